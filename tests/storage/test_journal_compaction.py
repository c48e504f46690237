"""Journal compaction (issue 29): retention follows the live data, not the history.

One live message at the head of a queue used to pin every later segment: the
journal kept, and replayed, the whole history. These tests pin the policy
(which prefix of the journal pays to relocate), the journal's part of a
relocation, what recovery reports it read, and the crash points' parsing
(the kill -9 tests at those points are in ``test_compaction_process.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from txbroker.server.config import ServerConfig, load_config
from txbroker.storage.journal import JournalStore
from txbroker.storage.journal_faults import CrashPoints
from txbroker.storage.journal_format import SEGMENT_HEADER, unpack_ref
from txbroker.storage.journal_space import CompactionSettings, SegmentInfo, SegmentSpace

from .contract import append_all, recover
from .support import Loop

#: Tiny segments: a few entries of 1,000-byte bodies each.
SEGMENT = 16 * 1024
BODY = 1000


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "data"


def space(table: list[tuple[int, int]], fraction: float = 0.5) -> SegmentSpace:
    """A space over segments 1..n given as ``(size, live bodies)``; each body is 100
    bytes with 10 bytes of record overhead, and the segment has no snapshot."""
    segments = {
        n: SegmentInfo(size, live, 100 * live, bodies=max(live, 1), overhead=10 * max(live, 1))
        for n, (size, live) in enumerate(table, start=1)
    }
    return SegmentSpace(Path("/nonexistent"), segments, lambda segment: None,
                        CompactionSettings(live_fraction=fraction))


def test_a_fully_live_oldest_segment_pays_once_enough_dead_ones_follow() -> None:
    # segment 1: 10 live bodies, copy cost 10 * (100 + 10) = 1,100 bytes, size 1,100
    live = (1100, 10)
    dead = (1100, 0)
    # on its own it never pays: copying writes as much as deleting it frees
    assert space([live, (1100, 10), (1100, 10)]).paying_prefix(head=3, written=3) == 0
    # one dead segment after it: frees 2,200 for 1,100 copied — not less than half
    assert space([live, dead, (1100, 10)]).paying_prefix(head=3, written=3) == 0
    # two dead segments after it: frees 3,300 for 1,100: the oldest and both go
    assert space([live, dead, dead, (1100, 10)]).paying_prefix(head=4, written=4) == 3


def test_two_live_segments_pay_together_for_the_run_behind_them() -> None:
    live, dead = (1100, 10), (1100, 0)
    table = [live, live, dead, dead, dead, (1100, 10)]
    # k=1 frees 1,100 for 1,100; k=2 frees 2,200 + 3,300 for 2,200: pays
    assert space(table).paying_prefix(head=6, written=6) == 5
    assert space(table, fraction=0.4).paying_prefix(head=6, written=6) == 0  # 2,200 ≥ 2,200
    assert space(table, fraction=0.0).paying_prefix(head=6, written=6) == 0  # never
    # a segment the writer has not finished is never part of the prefix
    assert space(table).paying_prefix(head=6, written=1) == 0
    assert space(table).paying_prefix(head=6, written=2) == 0


def test_compaction_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="compact_live_fraction"):
        CompactionSettings(live_fraction=1.0)
    with pytest.raises(ValueError, match="compact_min_segments"):
        CompactionSettings(min_segments=1)
    with pytest.raises(ValueError, match="compact_live_fraction"):
        ServerConfig(compact_live_fraction=-0.1).validate()
    assert ServerConfig().compaction() == CompactionSettings()


def test_compaction_settings_come_from_the_server_table(tmp_path: Path) -> None:
    path = tmp_path / "broker.toml"
    path.write_text("[server]\ncompact_live_fraction = 0.3\ncompact_min_segments = 10\n"
                    "compact_idle_live_fraction = 0\n")
    settings = load_config(path).compaction()
    assert settings == CompactionSettings(live_fraction=0.3, min_segments=10,
                                          idle_live_fraction=0.0)
    assert CompactionSettings() == CompactionSettings(0.5, 2, 0.8)  # the documented defaults


def test_crash_points_parse_and_count() -> None:
    assert not CrashPoints().armed and not CrashPoints.from_env().armed
    points = CrashPoints("synced:17@3")
    assert (points.point, points.kind, points.armed) == ("synced:17", 17, True)
    points.passed("before_unlink")  # another point: nothing happens
    assert CrashPoints("before_unlink").kind == -1
    with pytest.raises(ValueError, match="unknown crash point"):
        CrashPoints("after_lunch")


def _relocate(store: JournalStore, loop: Loop, live: dict[int, int]) -> int:
    """The broker's part, as the server does it: copy every live body of each offered
    segment forward, release the old ref once the copy is durable; run until nothing
    is offered. Returns the number of segments offered."""
    offered = 0
    while (relocation := store.maintain()) is not None:
        offered += 1
        for entry in relocation.entries:
            for ref in entry.refs:
                if ref in live:
                    number = live.pop(ref)
                    [[copy]] = append_all(store, loop, [(17, b"%d" % number,
                                                         [store.read_body(ref)])])
                    live[copy] = number
                    store.release(ref)
    store.flush()
    return offered


def test_history_behind_a_fully_live_oldest_segment_goes(directory: Path) -> None:
    loop = Loop()
    store = JournalStore(directory, dispatch=loop.dispatch, segment_size=SEGMENT)
    recover(store)
    body_of = {n: bytes([n % 251]) * BODY for n in range(1000)}
    # 30 live messages first (two segments' worth), then 600 sent and consumed
    live_refs = append_all(store, loop, [(4, b"%d" % n, [body_of[n]]) for n in range(30)])
    churn = append_all(store, loop, [(4, b"%d" % n, [body_of[n]]) for n in range(30, 630)])
    for [ref] in churn:
        store.release(ref)
    history = store.stats()
    assert history.segments > 30
    live = {ref: n for n, [ref] in enumerate(live_refs)}
    assert {unpack_ref(ref)[0] for ref in live} == {1, 2}
    store.flush()
    assert _relocate(store, loop, live) == 2  # segments 1 and 2, each fully live
    stats = store.stats()
    live_bytes = 30 * BODY
    assert (stats.live_bodies, stats.live_body_bytes) == (30, live_bytes)
    # what is left: the copies (their records), their segments' snapshots-free
    # headers, and the head segment; not the history
    assert stats.segments <= 4
    assert stats.disk_bytes <= live_bytes * 1.2 + SEGMENT, stats
    assert stats.disk_bytes < history.disk_bytes / 10
    store.close()

    store = JournalStore(directory, segment_size=SEGMENT)
    entries = recover(store)
    after = store.stats()
    # recovery replayed exactly what was left on disk, and reports it
    assert after.recovered_bytes == stats.disk_bytes
    assert after.recovered_segments == stats.segments
    assert after.recovered_bytes == sum(p.stat().st_size for p in
                                        (directory / "journal").glob("*.seg"))
    last_copy = {int(e.meta): e.refs[0] for e in entries if e.refs}
    assert {n: store.read_body(last_copy[n]) for n in range(30)} == {
        n: body_of[n] for n in range(30)}
    store.close()


def test_a_live_journal_without_history_is_left_alone(directory: Path) -> None:
    loop = Loop()
    store = JournalStore(directory, dispatch=loop.dispatch, segment_size=SEGMENT)
    recover(store)
    append_all(store, loop, [(4, b"%d" % n, [bytes(BODY)]) for n in range(200)])
    for _ in range(3):
        assert store.maintain() is None  # everything lives: copying frees nothing
    stats = store.stats()
    store.close()
    store = JournalStore(directory, segment_size=SEGMENT)
    recover(store)
    assert store.stats().recovered_bytes == stats.disk_bytes > 200 * BODY
    assert store.stats().recovered_bytes > SEGMENT_HEADER.size
    store.close()


def test_a_quiet_journal_packs_at_the_idle_fraction() -> None:
    # segment 1 is 70 % live: not worth it while clients write (0.5), worth it when
    # nothing but compaction writes (0.8); a fully live one never is
    partly, full = (1100, 7), (1100, 10)
    table = space([partly, full, full, full])
    table.count_maintain_call(appends=5)
    assert not table.quiet and table.paying_prefix(head=4, written=4) == 0
    table.count_maintain_call(appends=9)  # appends in between: busy
    assert not table.quiet and table.paying_prefix(head=4, written=4) == 0
    table.count_maintain_call(appends=9)  # none since the last call: quiet
    assert table.quiet and table.paying_prefix(head=4, written=4) == 1
    assert space([full, full, full]).paying_prefix(head=3, written=3) == 0
    off = SegmentSpace(Path("/nonexistent"), dict(table.segments), lambda segment: None,
                       CompactionSettings(live_fraction=0.0))
    off.count_maintain_call(appends=1)
    off.count_maintain_call(appends=1)
    assert off.quiet and off.paying_prefix(head=4, written=4) == 0  # 0 = off, idle too
