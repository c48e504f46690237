"""The store's single-writer lock, which is also the shared-store HA lock.

Theory of operation
-------------------
A data directory has one lock file (``DIR/journal/lock`` for the journal
store, ``DIR/lock`` for the directory store). Whoever holds an exclusive
``fcntl`` record lock on it owns the directory: a store opens only under it,
and with ``--ha shared-store`` (``server/ha/shared_store.py``) it is what makes a broker the
active one. There is exactly one lock, never a second one beside it.

The lock is an *open file description* lock (``F_OFD_SETLK``, Linux ≥ 3.15)
where the platform has it, else a classic POSIX record lock (``F_SETLK``).
Both are record locks, which NFSv4 carries to the server (its own locking in
the protocol, with leases) and NFSv3 only through the separate NLM/lockd
service; ``flock`` is not used because it is not a record lock. OFD locks
belong to the open file (like ``flock``), so one process that opens a
directory twice is refused the second time, as a second process is; a POSIX
record lock belongs to the process and would let it in.

The kernel (or the NFS server, when the client's lease expires) drops the lock
when the holder's process dies, however it dies. A stopped (SIGSTOP) process
keeps it. The holder writes one line into the file (pid, host, what it is) so
that others can say who holds the lock; the line is informative, never trusted
for the decision.

Who takes the lock and reads its line is a :class:`LockOpener`: :data:`FILE_LOCKS` (the
file's ``fcntl`` lock) in production; the simulator passes a model of it
(``sim/live_shared_store.py``: one holder, released when its process is killed).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import time
from pathlib import Path
from typing import Final, Protocol

from txbroker.errors import StoreLocked

__all__ = ["FILE_LOCKS", "LockOpener", "StoreLock", "lock_holder"]

#: ``struct flock`` on Linux: l_type, l_whence (short), l_start, l_len (off_t), l_pid.
_FLOCK: Final = struct.Struct("hhqqi4x")
#: Open-file-description lock commands (Linux); absent elsewhere.
_OFD_SETLK: Final = getattr(fcntl, "F_OFD_SETLK", None)
#: Errors a refused non-blocking lock attempt gives.
_BUSY: Final = (errno.EAGAIN, errno.EACCES)


def _try_lock(fd: int) -> bool:
    """Take an exclusive record lock on the whole file without waiting; False if held."""
    try:
        if _OFD_SETLK is not None:
            fcntl.fcntl(fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        else:  # pragma: no cover - not Linux
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


def lock_holder(path: Path) -> str:
    """The line the current holder wrote into the lock file ("" if none or unreadable)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(512).decode(errors="replace").strip()
    except OSError:
        return ""


class StoreLock:
    """An exclusive lock on one data directory's lock file (see the module docstring).

    :meth:`try_acquire` returns ``None`` when another process (or another open
    of the directory in this process) holds it; :meth:`acquire` raises
    :class:`~txbroker.errors.StoreLocked` then. :meth:`release` (or the
    holder's death) frees it.
    """

    def __init__(self, path: Path, fd: int, created: list[Path]) -> None:
        self.path = path
        self._fd = fd
        #: directories made to hold the lock file (their parents need an fsync)
        self.created = created
        self.acquired_at = time.time()

    @classmethod
    def try_acquire(cls, path: Path, role: str = "store") -> StoreLock | None:
        """Lock ``path`` (created with its parents if missing) or return None at once."""
        created: list[Path] = []
        missing: list[Path] = []
        parent = path.parent
        while not parent.is_dir():
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            directory.mkdir(exist_ok=True)
            created.append(directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not _try_lock(fd):
                os.close(fd)
                return None
            os.ftruncate(fd, 0)
            line = f"pid {os.getpid()} on {socket.gethostname()} ({role}) since " \
                   f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
            os.pwrite(fd, line.encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, created)

    @classmethod
    def acquire(cls, path: Path, role: str = "store", directory: Path | None = None
                ) -> StoreLock:
        """Lock ``path`` or raise :class:`StoreLocked` naming the data ``directory``
        and the holder."""
        lock = cls.try_acquire(path, role)
        if lock is None:
            holder = lock_holder(path) or "an unknown process"
            raise StoreLocked(
                f"data directory {directory or path.parent} is in use: {path} is locked by "
                f"{holder}; a data directory cannot be shared, stop that broker first "
                "(two brokers share one only as an HA pair: --ha shared-store)")
        return lock

    @property
    def held(self) -> bool:
        """True until :meth:`release`."""
        return self._fd >= 0

    def holder(self) -> str:
        """The line this holder wrote."""
        return lock_holder(self.path)

    def release(self) -> None:
        """Unlock (closing the file releases the lock). Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LockOpener(Protocol):
    """Takes a data directory's lock and reads the line its holder wrote: the lock
    file's ``fcntl`` lock (:data:`FILE_LOCKS`), or the simulator's model of it."""

    def try_acquire(self, path: Path, role: str) -> StoreLock | None:
        """Lock ``path`` for ``role`` or return None at once (another holder)."""
        ...

    def holder(self, path: Path) -> str:
        """The line the current (or last) holder wrote ("" if none)."""
        ...


class _FileLocks:
    """:class:`LockOpener` of the lock files themselves."""

    def try_acquire(self, path: Path, role: str) -> StoreLock | None:
        return StoreLock.try_acquire(path, role)

    def holder(self, path: Path) -> str:
        return lock_holder(path)


#: The lock files' own ``fcntl`` locks (what production uses).
FILE_LOCKS: Final[LockOpener] = _FileLocks()
