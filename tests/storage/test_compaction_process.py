"""Compaction in a real ``txbroker serve``: kill -9 at each of its steps, and a
restart that reads the live data, not the history (issue 29).

A template data directory is made once: 150 live 1,000-byte messages in queue
``live`` (the oldest segments), then 1,500 sent and consumed through ``churn``,
with compaction off (``compact_live_fraction = 0``), so the live messages pin
the whole history. Each case copies it, starts the broker with compaction on
and one crash point armed (``TXBROKER_JOURNAL_FAULT``, storage/journal_faults.py):
with no client connected, the broker's own compaction reaches the point and the
process SIGKILLs itself there. Then it starts again without the fault, lets
compaction finish, is killed with -9 once more, and must come back with:

* exactly the 150 live messages, each once, bodies intact, in their order, and
  nothing in ``churn`` (no relocated copy duplicates or revives a message);
* a journal bounded by the live data, and a recovery that reports it read only
  that much (``stats()["store"]["recovered_bytes"]``) — not the history.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import txbroker
from tests.support import ROOT, BrokerProcess
from txbroker.storage.journal_faults import FAULT_ENV

LIVE = 150
CHURN = 1500
BODY = 1000
SEGMENT = 64 * 1024
#: Kind 17 is RELOCATE_MANY (core/records.py): ``synced:17`` = the copies are durable,
#: the old refs not yet released; ``@N`` = the N-th time the point is passed.
POINTS = ["relocation_offered", "synced:17", "synced:17@3", "before_unlink",
          "after_unlink", "before_unlink@6"]


def body(number: int) -> bytes:
    return b"%06d|" % number + bytes([number % 251]) * (BODY - 7)


def config(path: Path, live_fraction: float, index: bool = False) -> Path:
    path.write_text(f"[server]\nsegment_size = {SEGMENT}\nmaintain_interval = 0.1\n"
                    f"compact_live_fraction = {live_fraction}\n"
                    f"recovery_index = {'true' if index else 'false'}\n"
                    # (these restarts measure what replaying the log reads)
                    "recovery_checkpoint = false\n")
    return path


def store_stats(url: str) -> dict[str, Any]:
    with txbroker.connect(url, reconnect=False, timeout=10) as conn:
        stats: dict[str, Any] = conn.stats()["store"]
        return stats


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A data directory: LIVE messages, then CHURN sent and consumed, no compaction."""
    base = tmp_path_factory.mktemp("history")
    proc = BrokerProcess(base / "data", "--config", str(config(base / "off.toml", 0))).start()
    try:
        with txbroker.connect(proc.url, reconnect=False, timeout=10) as conn:
            for number in range(LIVE):
                conn.send("live", body(number))
        churn = subprocess.run(
            [sys.executable, "-m", "txbroker.cli", "bench", "--url", proc.url, "--queue",
             "churn", "--count", str(CHURN), "--size", str(BODY), "--phase", "both",
             "--producers", "1", "--consumers", "1"],
            capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert churn.returncode == 0, churn.stderr[-2000:]
        stats = store_stats(proc.url)
        assert stats["live_bodies"] == LIVE and stats["disk_bytes"] > 10 * LIVE * BODY, stats
    finally:
        assert proc.stop() == 0  # a clean shutdown: everything written and synced
    yield base / "data"


def wait_for_compaction(url: str, limit: int, data: Path | None = None) -> dict[str, Any]:
    """The store's stats once its journal is within ``limit`` bytes (a minute at most)
    and, with ``data``, once the segment files on disk are the ones the stats count:
    the store counts a segment gone when its delete is queued, the writer thread
    unlinks the file a moment later, and a kill -9 in between leaves it to recovery."""
    deadline = time.monotonic() + 60
    while True:
        stats = store_stats(url)
        on_disk = None if data is None else len(list((data / "journal").glob("*.seg")))
        if ((stats["disk_bytes"] <= limit and on_disk in (None, stats["segments"]))
                or time.monotonic() > deadline):
            return stats
        time.sleep(0.2)


#: The journal once compaction is done: the live messages' records (body + a record
#: of ~40 bytes) and a segment header and snapshot per segment; measured 155,836
#: bytes for 150,000 live (1.04x). The aim (issue 29) is 1.5x; the history is 1.7 MB.
COMPACTED_LIMIT = int(1.5 * LIVE * BODY)


def check_live(url: str) -> None:
    """Exactly the LIVE messages, each once, in order; nothing in ``churn``."""
    with txbroker.connect(url, reconnect=False, timeout=10) as conn:
        got = []
        while (message := conn.receive("live", timeout=0.5)) is not None:
            got.append(message.body)
            message.ack()
        assert conn.queue_info("churn")["messages"] == 0
    assert len(got) == LIVE
    assert got == [body(number) for number in range(LIVE)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", POINTS)
def test_kill9_at_a_compaction_step_loses_and_duplicates_nothing(
        history: Path, tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kill_at(history, tmp_path, point, monkeypatch, index=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["synced:17@2", "before_unlink@2", "after_unlink"])
def test_kill9_at_a_compaction_step_with_the_recovery_index(
        history: Path, tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the segments the copies fill get recovery indexes; restarts read them
    kill_at(history, tmp_path, point, monkeypatch, index=True)


def kill_at(history: Path, tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch,
            *, index: bool) -> None:
    """Kill the broker at ``point`` of its compaction, restart, check (module doc)."""
    data = tmp_path / "data"
    shutil.copytree(history, data)
    on = config(tmp_path / "on.toml", 0.5, index)
    proc = BrokerProcess(data, "--config", str(on))
    monkeypatch.setenv(FAULT_ENV, point)
    try:
        with contextlib.suppress(RuntimeError):
            proc.start()  # it may reach the point before its ready line: checked below
        assert proc.proc is not None
        assert proc.proc.wait(timeout=120) == -signal.SIGKILL  # killed at the point
        monkeypatch.delenv(FAULT_ENV)
        proc.start()
        stats = wait_for_compaction(proc.url, COMPACTED_LIMIT, data)
        assert stats["live_bodies"] == LIVE
        assert stats["disk_bytes"] <= COMPACTED_LIMIT, stats
        assert len(list((data / "journal").glob("*.seg"))) == stats["segments"], stats
        proc.kill(signal.SIGKILL)
        proc.start()
        assert f"recovered {LIVE} messages" in proc.ready_line
        after = store_stats(proc.url)
        # recovery read what compaction left, not the ~1.9 MB of history
        assert after["recovered_bytes"] <= COMPACTED_LIMIT, after
        check_live(proc.url)
    finally:
        proc.kill()


def test_restart_after_churn_reads_only_live_data(history: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(history, data)
    proc = BrokerProcess(data, "--config", str(config(tmp_path / "off.toml", 0))).start()
    try:
        before = store_stats(proc.url)
        # without compaction the restart replays the whole history
        assert before["recovered_bytes"] == before["disk_bytes"] > 10 * LIVE * BODY
        proc.stop()
        config(tmp_path / "off.toml", 0.5)  # compaction on (the default)
        proc.start()
        stats = wait_for_compaction(proc.url, COMPACTED_LIMIT)
        assert stats["disk_bytes"] <= COMPACTED_LIMIT, stats
        assert proc.stop() == 0
        # the data directory itself: a clean stop cuts the head's pre-allocated zeros
        on_disk = sum(path.stat().st_size for path in data.rglob("*") if path.is_file())
        assert on_disk <= COMPACTED_LIMIT
        proc.start()
        after = store_stats(proc.url)
        assert after["recovered_bytes"] <= COMPACTED_LIMIT
        assert after["recovered_bytes"] * 5 < before["recovered_bytes"]
        check_live(proc.url)
    finally:
        proc.kill()
