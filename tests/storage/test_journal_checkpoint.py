"""The journal's checkpoint file (``storage/journal_checkpoint.py``, issue 29): a clean
close or a running broker writes it, the next recovery hands back its one entry instead
of the log up to its mark, then the log after it — only while the segments it covers
are as it says — and deletes it whatever it reads."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from txbroker.server.config import ServerConfig
from txbroker.server.stores import open_store
from txbroker.storage.journal import JournalStore
from txbroker.storage.journal_checkpoint import CHECKPOINT_FILE, take_checkpoint_file
from txbroker.storage.journal_format import segment_name
from txbroker.storage.journal_recovery import list_segments

from .contract import append_all, contents, recover
from .support import Loop

KIND = 19
ENTRIES = [(4, b"meta%d" % number, [b"body%d" % number * 20]) for number in range(30)]


def _store(directory: Path, loop: Loop, *, checkpoints: bool = True,
           segment_size: int = 1024 * 1024) -> JournalStore:
    return JournalStore(directory, dispatch=loop.dispatch, checkpoints=checkpoints,
                        segment_size=segment_size)


def _written(directory: Path, segment_size: int = 1024 * 1024) -> tuple[Loop, list[list[int]]]:
    """A journal of ENTRIES, two bodies released, closed with a checkpoint."""
    loop = Loop()
    store = _store(directory, loop, segment_size=segment_size)
    recover(store)
    refs = append_all(store, loop, ENTRIES)
    store.release(refs[0][0])
    store.release(refs[1][0])
    store.close(checkpoint=(KIND, b"the state", store.appends))
    return loop, refs


def _checkpoint(directory: Path) -> Path:
    return directory / "journal" / CHECKPOINT_FILE


def test_a_clean_close_leaves_a_checkpoint_the_next_recovery_reads(tmp_path: Path) -> None:
    loop, refs = _written(tmp_path)
    assert _checkpoint(tmp_path).exists()
    store = _store(tmp_path, loop)
    entries = recover(store)
    assert [(e.kind, e.meta, e.refs) for e in entries] == [(KIND, b"the state", ())]
    assert store.stats().recovered_from_checkpoint
    assert not _checkpoint(tmp_path).exists()  # deleted before any append
    stats = store.stats()
    assert (stats.recovered_entries, stats.recovered_segments) == (1, 0)
    assert stats.live_bodies == len(ENTRIES) - 2  # the releases of the last run
    assert store.read_body(refs[5][0]) == ENTRIES[5][2][0]
    append_all(store, loop, [(4, b"after", [b"x"])])
    store.close()  # no checkpoint: the next start replays the whole log
    again = _store(tmp_path, loop)
    assert [e.meta for e in recover(again)] == [m for _, m, _ in ENTRIES] + [b"after"]
    assert not again.stats().recovered_from_checkpoint
    again.close()


def test_a_store_not_asked_to_use_it_deletes_it_and_replays(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    loop, _ = _written(tmp_path)
    store = _store(tmp_path, loop, checkpoints=False)
    with caplog.at_level(logging.INFO, logger="txbroker.journal"):
        assert contents(store, recover(store)) == ENTRIES
    assert "not used (not asked to)" in caplog.text
    assert not _checkpoint(tmp_path).exists()
    store.close()


def test_the_log_appended_after_a_checkpoint_follows_its_entry(tmp_path: Path) -> None:
    """An older version that ignored the file appended to the log (into the head and
    into new segments): the recovery hands back the checkpoint, then what follows it."""
    loop, _ = _written(tmp_path, segment_size=1024)  # many segments
    kept = tmp_path / "kept"
    shutil.copy(_checkpoint(tmp_path), kept)
    older = _store(tmp_path, loop, checkpoints=False, segment_size=1024)
    recover(older)
    after = [(4, b"after%d" % number, [b"y" * 400]) for number in range(4)]
    append_all(older, loop, after)
    older.close()
    shutil.copy(kept, _checkpoint(tmp_path))
    store = _store(tmp_path, loop, segment_size=1024)
    entries = recover(store)
    assert store.stats().recovered_from_checkpoint
    assert [(e.kind, e.meta) for e in entries[:1]] == [(KIND, b"the state")]
    assert contents(store, entries[1:]) == after
    stats = store.stats()
    assert stats.recovered_entries == 1 + len(after)
    assert stats.live_bodies == len(ENTRIES) - 2 + len(after)
    store.close()


@pytest.mark.parametrize("change", ["sealed segment grew", "head shrank", "middle gone"])
def test_a_checkpoint_of_other_segments_is_not_used(tmp_path: Path, change: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    _written(tmp_path, segment_size=1024)  # many segments
    segments = sorted((tmp_path / "journal").glob("*.seg"))
    assert len(segments) >= 4
    if change == "sealed segment grew":
        with segments[1].open("ab") as file:
            file.write(b"\0" * 16)
    elif change == "head shrank":
        with segments[-1].open("r+b") as file:
            file.truncate(segments[-1].stat().st_size - 1)
    else:
        segments[1].unlink()
    journal = tmp_path / "journal"
    with caplog.at_level(logging.WARNING, logger="txbroker.journal"):
        assert take_checkpoint_file(journal, list_segments(journal)) is None
    assert "is not used" in caplog.text
    assert ("holds" if change != "middle gone" else "it lists segments") in caplog.text
    assert not _checkpoint(tmp_path).exists()


def test_a_checkpoint_whose_oldest_segments_were_deleted_is_used(tmp_path: Path) -> None:
    _written(tmp_path, segment_size=1024)
    journal = tmp_path / "journal"
    segments = sorted(journal.glob("*.seg"))
    segments[0].unlink()
    segments[1].unlink()
    found = take_checkpoint_file(journal, list_segments(journal))
    assert found is not None and found.meta == b"the state"
    assert sorted(found.mark.resumed()) == sorted(found.mark.segments)


def test_a_checkpoint_taken_while_running_covers_the_log_up_to_its_mark(tmp_path: Path
                                                                         ) -> None:
    """A running broker's checkpoint (``checkpoint_mark`` and ``write_checkpoint``, the
    log synced up to the mark): the store goes on — appends into new segments, releases,
    the oldest segments deleted once dead — and is killed; the recovery hands back the
    checkpoint and exactly the entries appended after the mark, and counts live what was
    live at the mark (less the deleted segments) and everything appended after it."""
    loop = Loop()
    store = _store(tmp_path, loop, segment_size=1024)
    recover(store)
    before = [(4, b"before%d" % number, [b"b" * 300]) for number in range(12)]
    refs = append_all(store, loop, before)
    for ref in refs[:6]:  # the first segments die before the mark
        store.release(ref[0])
    mark = store.checkpoint_mark(store.appends)
    assert mark is not None
    assert store.checkpoint_mark(store.appends - 1) is None  # (a stale append count)
    after = [(4, b"after%d" % number, [b"a" * 300]) for number in range(9)]
    append_all(store, loop, after[:3])
    assert store.write_checkpoint(mark, KIND, b"state at the mark")
    append_all(store, loop, after[3:])
    store.maintain(relocate=False)  # deletes the dead oldest segments
    store.flush()
    assert not (tmp_path / "journal" / segment_name(1)).exists()
    for ref in refs[6:8]:  # released after the mark: the replay of "after" does it again
        store.release(ref[0])
    store.close()  # (no checkpoint given: the running one stays, as after a kill -9)
    again = _store(tmp_path, loop, segment_size=1024)
    entries = recover(again)
    assert again.stats().recovered_from_checkpoint
    assert [e.meta for e in entries] == [b"state at the mark"] + [m for _, m, _ in after]
    assert contents(again, entries[1:]) == after
    assert again.read_body(refs[11][0]) == before[11][2][0]
    # live at the mark: the last six (the two released after it are released again by
    # the replay of what follows); then everything appended after it
    assert again.stats().live_bodies == 6 + len(after)
    again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_damaged_checkpoint_is_not_used(tmp_path: Path, damage: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    loop, _ = _written(tmp_path)
    path = _checkpoint(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        del data[len(data) - 5:]
    elif damage == "garbage":
        data[:] = b"not a checkpoint at all"
    else:
        data.clear()
    path.write_bytes(bytes(data))
    store = _store(tmp_path, loop)
    with caplog.at_level(logging.WARNING, logger="txbroker.journal"):
        assert contents(store, recover(store)) == ENTRIES
    assert "is not used" in caplog.text
    assert not path.exists()
    store.close()


def test_no_checkpoint_is_written_when_the_log_moved_on_since_it_was_taken(tmp_path: Path
                                                                         ) -> None:
    loop = Loop()
    store = _store(tmp_path, loop)
    recover(store)
    append_all(store, loop, ENTRIES[:3])
    mark = store.appends
    append_all(store, loop, ENTRIES[3:4])
    store.close(checkpoint=(KIND, b"stale", mark))
    assert not _checkpoint(tmp_path).exists()


def test_a_store_that_keeps_none_writes_none(tmp_path: Path) -> None:
    loop = Loop()
    store = _store(tmp_path, loop, checkpoints=False)
    recover(store)
    append_all(store, loop, ENTRIES[:3])
    store.close(checkpoint=(KIND, b"state", store.appends))
    assert not _checkpoint(tmp_path).exists()


def test_a_torn_checkpoint_write_leaves_no_trace(tmp_path: Path) -> None:
    loop, _ = _written(tmp_path)
    torn = tmp_path / "journal" / (CHECKPOINT_FILE + ".tmp")
    torn.write_bytes(b"half")
    _checkpoint(tmp_path).unlink()
    store = _store(tmp_path, loop)
    assert contents(store, recover(store)) == ENTRIES
    assert not torn.exists()
    store.close()


@pytest.mark.parametrize(("ha", "asked", "keeps"), [("", True, True), ("", False, False),
                                                    ("shared-store", True, False),
                                                    ("replicated", True, True),
                                                    ("replicated", False, False)])
def test_a_server_keeps_checkpoints_but_with_shared_store_ha(tmp_path: Path, ha: str,
                                                             asked: bool, keeps: bool) -> None:
    """``recovery_checkpoint`` reaches the journal of a broker without HA and of a
    replicated node (a backup checkpoints its replay, whose snapshot carries the LSN its
    log counts to: ``server/ha/replica_checkpoints.py``), not a shared-store standby's,
    which resumes what it followed."""
    config = ServerConfig(data=tmp_path, recovery_checkpoint=asked, ha=ha)
    store = open_store(config, lambda completions: None, lambda: (1, b""))
    assert isinstance(store, JournalStore) and store.checkpoints is keeps


def test_a_flush_racing_a_close_returns(tmp_path: Path) -> None:
    """A checkpoint's flush runs in a thread while the store may be closing (a backup
    stopped in the middle of a checkpoint): once the writer is stopping, the flush
    returns — the close writes everything queued — instead of waiting for ever on a
    barrier that no writer will set."""
    loop = Loop()
    store = _store(tmp_path, loop)
    recover(store)
    append_all(store, loop, ENTRIES[:3])
    queue, writer = store._queue, store.writer
    assert writer is not None
    with queue.lock:  # what close() does first: the writer drains the queue and ends
        queue.stopping = True
        queue.wakeup.notify()
    writer._thread.join(10)
    assert not writer._thread.is_alive()
    store.flush(timeout=2)  # (before: TimeoutError, or for ever without a timeout)
    assert queue.put_barrier() is None
    store.close()
    again = _store(tmp_path, loop, checkpoints=False)
    assert contents(again, recover(again)) == ENTRIES[:3]
    again.close()
