"""The store lock (``storage/store_lock.py``): one holder per data directory, across
processes and within one; freed by release and by the holder's death, kept by a
stopped holder (what makes shared-store HA safe)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from txbroker.errors import StoreLocked
from txbroker.storage.dirstore import DirStore
from txbroker.storage.journal import JournalStore
from txbroker.storage.store_lock import StoreLock, lock_holder

HOLDER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from txbroker.storage.store_lock import StoreLock\n"
    "lock = StoreLock.acquire(Path(sys.argv[1]), 'child')\n"
    "print('LOCKED', flush=True)\n"
    "time.sleep(600)\n"
)


def _hold_in_child(path: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "LOCKED"
    return child


def _wait_for_lock(path: Path, timeout: float = 10.0) -> StoreLock:
    """Poll until the lock is ours (the kernel frees it when the holder's files close)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lock = StoreLock.try_acquire(path)
        if lock is not None:
            return lock
        time.sleep(0.01)
    raise AssertionError(f"{path} still locked after {timeout} s")


def test_one_holder_per_directory_even_in_one_process(tmp_path: Path) -> None:
    path = tmp_path / "d" / "journal" / "lock"
    first = StoreLock.acquire(path, "first", directory=tmp_path / "d")
    assert first.held and first.created == [tmp_path / "d", tmp_path / "d" / "journal"]
    assert StoreLock.try_acquire(path) is None  # an OFD lock: per open, not per process
    with pytest.raises(StoreLocked) as info:
        StoreLock.acquire(path, directory=tmp_path / "d")
    text = str(info.value)
    assert text.startswith(f"data directory {tmp_path / 'd'} is in use: {path} is locked by "
                           f"pid {os.getpid()} on {socket.gethostname()} (first) since ")
    assert "cannot be shared" in text and "--ha shared-store" in text
    assert lock_holder(path).startswith(f"pid {os.getpid()} on ")
    first.release()
    first.release()  # idempotent
    assert not first.held
    second = StoreLock.acquire(path, "second")
    assert "(second)" in second.holder()
    second.release()


def test_a_killed_holder_frees_the_lock_a_stopped_one_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    child = _hold_in_child(path)
    try:
        assert StoreLock.try_acquire(path) is None
        assert lock_holder(path).startswith(f"pid {child.pid} on ")
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert StoreLock.try_acquire(path) is None  # stopped: still the holder
        os.kill(child.pid, signal.SIGCONT)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        lock = _wait_for_lock(path)
        assert lock_holder(path).startswith(f"pid {os.getpid()} on ")
        lock.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


@pytest.mark.parametrize("store_class", [JournalStore, DirStore])
def test_a_store_opens_under_a_lock_taken_first(tmp_path: Path,
                                                store_class: type[JournalStore | DirStore]) -> None:
    """The HA part takes the store's own lock, then opens the store under it: one lock."""
    path = store_class.lock_path(tmp_path)
    lock = StoreLock.acquire(path, "ha")
    store = store_class(tmp_path, lock=lock)
    list(store.recover())
    other = store_class(tmp_path)
    with pytest.raises(StoreLocked):
        list(other.recover())
    store.close()  # the store releases the lock it was given
    assert not lock.held
    again = store_class(tmp_path)
    list(again.recover())
    again.close()


def test_a_lock_of_another_directory_is_refused(tmp_path: Path) -> None:
    lock = StoreLock.acquire(tmp_path / "elsewhere" / "lock")
    store = JournalStore(tmp_path / "data", lock=lock)
    with pytest.raises(Exception, match="not a held lock of"):
        list(store.recover())
    lock.release()
