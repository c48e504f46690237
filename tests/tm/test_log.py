"""The decision log: durability, torn tails, corruption, group commit, compaction."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from txbroker.errors import CorruptStore
from txbroker.tm.log import DecisionLog


def test_decisions_survive_reopen_and_forget_removes_them(tmp_path: Path) -> None:
    path = tmp_path / "tm.log"
    log = DecisionLog(path)
    log.decide(b"a")
    log.decide(b"b")
    log.forget(b"a")
    log.close()
    assert DecisionLog(path).open_decisions == {b"b"}


def test_torn_tail_is_cut_and_corruption_elsewhere_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "tm.log"
    log = DecisionLog(path)
    log.decide(b"a")
    log.close()
    with open(path, "ab") as f:
        f.write(b"1234abcd C 62")  # a torn write: no newline, bad checksum
    assert DecisionLog(path).open_decisions == {b"a"}
    assert path.read_bytes().count(b"\n") == 1
    path.write_bytes(b"garbage\n" + path.read_bytes())
    with pytest.raises(CorruptStore):
        DecisionLog(path)


def test_group_commit_shares_syncs(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "tm.log")
    barrier = threading.Barrier(16)

    def decide(i: int) -> None:
        barrier.wait()
        for j in range(20):
            log.decide(b"%d-%d" % (i, j))

    threads = [threading.Thread(target=decide, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(log.open_decisions) == 320
    assert log.syncs < 320  # many decisions per fsync
    log.close()
    assert len(DecisionLog(tmp_path / "tm.log").open_decisions) == 320


def test_compaction_keeps_open_decisions_only(tmp_path: Path) -> None:
    path = tmp_path / "tm.log"
    log = DecisionLog(path, compact_bytes=2_000)
    for i in range(200):
        log.decide(b"g%d" % i)
        if i != 7:
            log.forget(b"g%d" % i)
    log.close()
    assert path.stat().st_size < 2_500
    assert DecisionLog(path).open_decisions == {b"g7"}
