"""The warm standby's journal follower (``storage/journal_follow.py``, issue 29):
it reads what another store appends, and a store that resumes from its point
replays only the suffix, with the rules of a cold recovery."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from txbroker.errors import CorruptStore
from txbroker.storage.interface import StoredEntry
from txbroker.storage.journal import JournalStore
from txbroker.storage.journal_follow import FollowerLost, JournalFollower
from txbroker.storage.journal_format import segment_name

SEGMENT = 4096


def _open(path: Path, **options: object) -> JournalStore:
    store = JournalStore(path, segment_size=SEGMENT, **options)  # type: ignore[arg-type]
    assert list(store.recover()) == []
    return store


def _append(store: JournalStore, first: int, count: int) -> list[StoredEntry]:
    """Append ``count`` entries (one body each) and wait until they are durable;
    the entries as recovery gives them back."""
    written = []
    for number in range(first, first + count):
        meta, body = f"m{number}".encode(), f"body {number}".encode() * 20
        refs = store.append(7, meta, [body], lambda _error: None)
        written.append(StoredEntry(7, meta, tuple(refs)))
    store.flush(5)
    return written


def _drain(follower: JournalFollower) -> list[StoredEntry]:
    entries: list[StoredEntry] = []
    while batch := follower.poll(limit=50):
        entries += batch
    return entries


def _entries(items: list[StoredEntry]) -> list[tuple[int, bytes, tuple[int, ...]]]:
    return [(entry.kind, bytes(entry.meta), tuple(entry.refs)) for entry in items]


def test_a_follower_reads_what_the_writer_appends_and_recovery_resumes_after_it(
        tmp_path: Path) -> None:
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    followed = _append(active, 0, 40)
    assert _entries(_drain(follower)) == _entries(followed)
    followed += _append(active, 40, 200)  # rolls over several segments
    assert _entries(_drain(follower)) == _entries(followed[40:])
    assert _drain(follower) == []
    stop = follower.segments[max(follower.segments)]
    suffix = _append(active, 240, 30)  # written after the follower's last poll
    active.close()  # the lock is free: the standby takes it
    sizes = {int(path.stem): path.stat().st_size for path in active.journal_dir.glob("*.seg")}
    assert len(sizes) > 10
    later = [size for segment_id, size in sizes.items() if segment_id > stop.segment_id]
    assert later  # the suffix rolled over into new segments

    resume = follower.resume_point()
    assert resume is not None and resume.entries_followed == 240
    store = JournalStore(tmp_path, segment_size=SEGMENT)
    store.resume_from(resume.segments)
    assert _entries(list(store.recover())) == _entries(suffix)
    stats = store.stats()
    assert stats.recovered_entries == 30
    # it read where the follower stopped to the end of that segment, and the later ones
    assert stats.recovered_bytes == sizes[stop.segment_id] - stop.end + sum(later)
    assert stats.recovered_segments == len(later) + (sizes[stop.segment_id] > stop.end)
    # the accounting is a cold recovery's: every body counted, appends continue
    assert stats.live_bodies == 270
    more = _append(store, 270, 5)
    store.close()
    cold = JournalStore(tmp_path, segment_size=SEGMENT)
    everything = list(cold.recover())
    assert _entries(everything) == _entries(followed + suffix + more)
    assert cold.stats().recovered_entries == 275
    cold.close()


def test_a_torn_tail_after_the_followed_point_is_cut_as_in_a_cold_recovery(
        tmp_path: Path) -> None:
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    followed = _append(active, 0, 20)
    assert len(_drain(follower)) == 20
    active.close()
    head = active.journal_dir / segment_name(max(follower.segments))
    with open(head, "ab") as file:
        file.write(b"TXJE\x00\x01\x00\x00garbage")  # a torn entry: the kill came mid-write
    resume = follower.resume_point()
    assert resume is not None
    store = JournalStore(tmp_path, segment_size=SEGMENT)
    store.resume_from(resume.segments)
    assert list(store.recover()) == []
    assert any("cut torn tail" in line for line in store.repair_report)
    store.close()
    cold = JournalStore(tmp_path, segment_size=SEGMENT)
    assert _entries(list(cold.recover())) == _entries(followed)
    cold.close()


def test_damage_in_the_suffix_still_stops_the_start(tmp_path: Path) -> None:
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    _append(active, 0, 20)
    assert len(_drain(follower)) == 20
    suffix = _append(active, 20, 200)
    active.close()
    # flip a byte of the first entry after the followed point, in a sealed segment
    first = min(follower.segments)
    stop = follower.segments[max(follower.segments)]
    path = active.journal_dir / segment_name(stop.segment_id)
    data = bytearray(path.read_bytes())
    data[stop.end + 30] ^= 0xFF
    path.write_bytes(bytes(data))
    assert suffix and first
    resume = follower.resume_point()
    assert resume is not None
    store = JournalStore(tmp_path, segment_size=SEGMENT)
    store.resume_from(resume.segments)
    with pytest.raises(CorruptStore) as caught:
        list(store.recover())
    assert caught.value.offset == stop.end


def test_compaction_deleting_old_segments_is_followed(tmp_path: Path) -> None:
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    _append(active, 0, 200)
    assert len(_drain(follower)) == 200
    oldest = min(follower.segments)
    os.unlink(active.journal_dir / segment_name(oldest))  # as maintain() deletes it
    follower.release(oldest << 72 | 24 << 32 | 10)
    assert _drain(follower) == []
    assert oldest not in follower.segments
    active.close()
    resume = follower.resume_point()
    assert resume is not None and oldest not in resume.segments
    assert follower._released == {}  # its releases went with it


def test_a_replaced_segment_makes_the_follower_lost(tmp_path: Path) -> None:
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    _append(active, 0, 100)
    _drain(follower)
    active.close()
    path = active.journal_dir / segment_name(min(follower.segments))
    copy = path.with_suffix(".copy")
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # another file in its place (a copy, not the one followed)
    assert follower.resume_point() is None


def test_a_segment_replaced_while_it_is_read_makes_the_follower_lost(tmp_path: Path) -> None:
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    _append(active, 0, 5)
    _drain(follower)
    active.close()
    path = active.journal_dir / segment_name(max(follower.segments))
    copy = path.with_suffix(".copy")
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)
    with pytest.raises(FollowerLost, match="was replaced"):
        follower.poll()


def test_a_rewritten_last_entry_is_noticed_at_the_takeover(tmp_path: Path) -> None:
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    _append(active, 0, 10)
    _drain(follower)
    active.close()
    last = follower.segments[max(follower.segments)]
    path = active.journal_dir / segment_name(last.segment_id)
    with open(path, "r+b") as file:
        file.seek(last.end - 6)
        file.write(b"XX")
    assert follower.resume_point() is None


def test_an_entry_longer_than_a_read_is_read_whole_and_zeros_are_not_read_again(
        tmp_path: Path) -> None:
    store = JournalStore(tmp_path, segment_size=4 * 1024 * 1024)
    assert list(store.recover()) == []
    follower = JournalFollower(store.journal_dir)
    big = os.urandom(300 * 1024)  # more than FOLLOW_FIRST_READ, and than its doubling
    refs = store.append(9, b"big", [b"small", big], lambda _error: None)
    store.flush(5)
    entries = _drain(follower)
    assert _entries(entries) == [(9, b"big", tuple(refs))]
    assert store.read_body(entries[0].refs[1]) == big
    before = follower.bytes_read
    assert follower.poll() == []  # at the end of what is written: one short read
    assert follower.bytes_read - before <= 64 * 1024
    store.close()


def test_a_segment_deleted_before_it_was_read_to_its_end_makes_the_follower_lost(
        tmp_path: Path) -> None:
    """Its unread entries (say the acks of messages the follower holds) are gone:
    the follower must start again, never go on from the next segment."""
    active = _open(tmp_path)
    follower = JournalFollower(active.journal_dir)
    _append(active, 0, 5)
    _drain(follower)  # in segment 1, not sealed
    _append(active, 5, 200)  # rolls on
    first = min(follower.segments)
    assert not follower.segments[first].sealed
    os.unlink(active.journal_dir / segment_name(first))
    with pytest.raises(FollowerLost, match="before it was read to its end"):
        follower.poll()
    active.close()
    assert follower.resume_point() is None
