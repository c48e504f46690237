"""The primary's catch-up buffer (``server/ha/replication.py``): what it keeps, and when a
backup's ``resume`` may be answered with the suffix rather than a dump. No broker,
no socket: the hub's numbering and buffer on their own (``begin`` with no backup
attached)."""

from __future__ import annotations

from typing import Any, cast

from txbroker.server.ha.replication import ReplicationHub


def hub(buffer: int) -> ReplicationHub:
    return ReplicationHub(cast(Any, None), "a", backup_timeout=1.0, catchup_bytes=buffer)


def append(h: ReplicationHub, count: int, body: bytes = b"x" * 100) -> None:
    for _ in range(count):
        h.begin(4, b"meta", [body], lambda error: None)


def test_the_buffer_keeps_the_newest_entries_within_its_bound() -> None:
    h = hub(1000)
    append(h, 30)
    held = [lsn for lsn, _ in h.suffix]
    assert held == list(range(h.lsn - len(held) + 1, h.lsn + 1))  # the newest, gapless
    assert h.suffix_held == sum(len(frame) for _, frame in h.suffix) <= 1000
    frame = len(h.suffix[0][1])  # every frame here has the same size
    assert h.suffix_held + frame > 1000  # one more would not fit: the oldest were dropped
    status = h.status()["catchup"]
    assert status["held_entries"] == len(held) and status["oldest_lsn"] == held[0]


def test_resume_needs_this_epoch_and_every_later_entry() -> None:
    h = hub(1000)
    append(h, 30)
    oldest = h.suffix[0][0]
    assert h.can_resume({"epoch": h.epoch, "lsn": h.lsn}) == h.lsn  # nothing missed
    assert h.can_resume({"epoch": h.epoch, "lsn": oldest - 1}) == oldest - 1  # all held
    assert h.can_resume({"epoch": h.epoch, "lsn": oldest - 2}) is None  # one is gone
    assert h.can_resume({"epoch": "another", "lsn": h.lsn}) is None
    assert h.can_resume({"epoch": h.epoch, "lsn": h.lsn + 1}) is None  # ahead of us?
    assert h.can_resume({"epoch": h.epoch, "lsn": -1}) is None
    assert h.can_resume({"epoch": h.epoch, "lsn": "7"}) is None
    assert h.can_resume(None) is None


def test_no_buffer_means_a_dump_unless_nothing_was_missed() -> None:
    h = hub(0)
    append(h, 5)
    assert not h.suffix and h.suffix_held == 0
    assert h.can_resume({"epoch": h.epoch, "lsn": h.lsn - 1}) is None
    assert h.can_resume({"epoch": h.epoch, "lsn": h.lsn}) == h.lsn


def test_an_entry_larger_than_the_buffer_is_not_kept() -> None:
    h = hub(500)
    append(h, 3)
    append(h, 1, b"y" * 2000)
    assert not h.suffix and h.suffix_held == 0
    assert h.can_resume({"epoch": h.epoch, "lsn": h.lsn - 1}) is None
