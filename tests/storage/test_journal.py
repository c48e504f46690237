"""The journal store: the contract suite, plus what only a journal has
(byte format, segment files, the writer thread, repair details)."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txbroker.errors import CorruptStore, StorageFailed
from txbroker.storage.interface import Dispatch, SnapshotProvider, Store, SyncMode
from txbroker.storage.journal import JournalStore
from txbroker.storage.journal_format import (
    ENTRY_HEADER,
    SEGMENT_HEADER,
    encode_segment_header,
    pack_ref,
    unpack_ref,
)
from txbroker.storage.journal_scan import (
    entry_spans,
)
from txbroker.storage.journal_writer import PREALLOCATE_BYTES

from .contract import (
    CORRUPTION,
    PROCESS,
    SEGMENTS,
    SNAPSHOT,
    Damaged,
    StoreContractTests,
    StoreFactory,
    append_all,
    contents,
    recover,
    sample_entries,
)
from .support import Completions, Loop

EXAMPLES = itertools.count()
#: Small segments make rolls, deletions and relocation happen within a few
#: hundred test entries.
SMALL_SEGMENT = 16 * 1024


def segment_files(directory: Path) -> list[Path]:
    return sorted((directory / "journal").glob("*.seg"))


def flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x10]))


class JournalCrasher:
    """Damages a closed journal directory."""

    def __init__(self, factory: JournalFactory) -> None:
        self.factory = factory

    def _segments(self) -> list[Path]:
        return segment_files(self.factory.directory)

    def _spans(self, path: Path) -> list[tuple[int, int]]:
        return entry_spans(path.read_bytes())

    def _position(self, path: Path, index: int) -> int:
        """Position in the recovered log of entry ``index`` of segment file ``path``."""
        before = sum(len(self._spans(p)) for p in self._segments() if p < path)
        return before + index

    def tear_last_entry(self, how: str) -> None:
        path = self._segments()[-1]
        offset, length = self._spans(path)[-1]
        if how == "crc":
            flip_bit(path, offset + length - 10)
        else:
            cut = offset + 7 if how == "header" else offset + ENTRY_HEADER.size + length // 2
            os.truncate(path, cut)

    def truncate_log(self, entries_back: int) -> None:
        path = self._segments()[-1]
        offset, length = self._spans(path)[-entries_back]
        os.truncate(path, offset + length // 3)

    def corrupt_old_entry(self) -> Damaged:
        path = self._segments()[0]
        spans = self._spans(path)
        index = len(spans) // 2
        offset, length = spans[index]
        flip_bit(path, offset + length // 2)
        return Damaged(str(path), offset, (self._position(path, index),))

    def truncate_old_segment(self) -> Damaged:
        path = self._segments()[0]
        spans = self._spans(path)
        offset, length = spans[-1]
        os.truncate(path, offset + length - 5)
        return Damaged(str(path), offset, (self._position(path, len(spans) - 1),))

    def fail_syncs(self, store: Store) -> None:
        assert isinstance(store, JournalStore) and store.writer is not None

        def failing_sync(fd: int) -> None:
            raise OSError(errno.EIO, "injected fsync failure")

        store.writer.sync_file = failing_sync


class JournalFactory(StoreFactory):
    features = frozenset({SEGMENTS, SNAPSHOT, CORRUPTION, PROCESS})
    #: The head segment plus one sealed segment that is at least half live.
    reclaim_slack = 2 * SMALL_SEGMENT + 4096

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0
        self.crasher = JournalCrasher(self)
        self.fresh()

    @property
    def location_name(self) -> str:
        return str(self.directory)

    def fresh(self) -> None:
        self.count += 1
        self.directory = self.root / f"data{self.count}"

    def open(
        self,
        *,
        dispatch: Dispatch | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        repair: bool = False,
        small_segments: bool = False,
    ) -> Store:
        return JournalStore(
            self.directory,
            dispatch=dispatch,
            snapshot_provider=snapshot_provider,
            repair=repair,
            segment_size=SMALL_SEGMENT if small_segments else 1024 * 1024,
        )

    def child_spec(self) -> dict[str, Any]:
        return {
            "factory": "txbroker.storage.journal:JournalStore",
            "kwargs": {"directory": str(self.directory), "segment_size": 256 * 1024},
        }


class TestJournalContract(StoreContractTests):
    @pytest.fixture
    def factory(self, tmp_path: Path) -> JournalFactory:
        return JournalFactory(tmp_path)


# -- journal-only tests ----------------------------------------------------------


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "data"


def open_journal(directory: Path, **options: Any) -> tuple[JournalStore, Loop]:
    loop = Loop()
    store = JournalStore(directory, dispatch=loop.dispatch, **options)
    recover(store)
    return store, loop


def test_format_sizes_and_refs() -> None:
    assert SEGMENT_HEADER.size == 24 and ENTRY_HEADER.size == 16
    assert len(encode_segment_header(7)) == SEGMENT_HEADER.size
    ref = pack_ref(123456, 2**39 + 5, 2**32 - 1)
    assert unpack_ref(ref) == (123456, 2**39 + 5, 2**32 - 1)


def test_layout_on_disk(directory: Path) -> None:
    store, loop = open_journal(directory)
    [[ref]] = append_all(store, loop, [(9, b"meta", [b"body!"])])
    store.close()
    (path,) = segment_files(directory)
    assert path.name == "00000000000000000001.seg"
    data = path.read_bytes()
    assert data[:8] == b"TXBJRNL\n"
    # entry: magic, length 20 + 4 + 4 + 5 = 33, kind 9, 1 body, meta 4, body length 5
    assert data[24:44] == struct.pack("<4sIHHII", b"TXBE", 33, 9, 1, 4, 5)
    assert data[44:48] == b"meta" and data[48:53] == b"body!" and len(data) == 24 + 33
    assert unpack_ref(ref) == (1, 48, 5)
    assert store.body_size(ref) == 5


def test_each_new_segment_starts_with_the_snapshot(directory: Path) -> None:
    count = iter(range(1000))
    store, loop = open_journal(
        directory, segment_size=SMALL_SEGMENT, snapshot_provider=lambda: (1, b"S%d" % next(count))
    )
    append_all(store, loop, [(4, b"%d" % n, [bytes(1000)]) for n in range(100)])
    store.close()
    files = segment_files(directory)
    assert len(files) >= 5
    for number, path in enumerate(files[1:]):
        data = path.read_bytes()
        offset, length = entry_spans(data)[0]
        assert offset == SEGMENT_HEADER.size
        assert data[offset + 8 : offset + 10] == b"\x01\x00"  # kind 1
        assert data[offset + 16 : offset + length - 4] == b"S%d" % number


def test_entry_larger_than_a_segment_gets_its_own(directory: Path) -> None:
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    big = bytes(range(256)) * 200  # 51,200 bytes > 16 KiB
    entries = [(4, b"a", [b"x" * 100]), (4, b"big", [big]), (4, b"b", [b"y" * 100])]
    append_all(store, loop, entries)
    store.close()
    sizes = [len(entry_spans(p.read_bytes())) for p in segment_files(directory)]
    assert sizes == [1, 1, 1]
    store = JournalStore(directory)
    assert contents(store, recover(store)) == entries
    store.close()


def _snapshot_kinds(path: Path) -> list[int]:
    """The kind of each entry of a segment file."""
    data = path.read_bytes()
    return [struct.unpack_from("<H", data, offset + 8)[0] for offset, _ in entry_spans(data)]


def test_a_snapshot_bigger_than_a_segment_takes_at_most_half_of_one(directory: Path) -> None:
    # The broker's snapshot carries the duplicate-id windows (up to 20,000 ids a
    # queue): the kill -9 soak's grew past its 128 KiB segments, and from then on
    # every append rolled, writing a segment (and the whole snapshot) of its own.
    snapshot = (1, b"S" * (3 * SMALL_SEGMENT // 2))
    store, loop = open_journal(
        directory, segment_size=SMALL_SEGMENT, snapshot_provider=lambda: snapshot
    )
    entries = [(4, b"%d" % n, [bytes(100)]) for n in range(1000)]
    append_all(store, loop, entries)
    written = store.stats().bytes_written
    store.close()
    payload = sum(ENTRY_HEADER.size + 8 + len(meta) + 100 for _, meta, _ in entries)
    snapshot_entry = ENTRY_HEADER.size + 4 + len(snapshot[1])
    files = segment_files(directory)
    # a segment per append before: 1,000 files and 25 MB written
    assert len(files) <= payload // snapshot_entry + 2
    assert written <= 2 * payload + 2 * snapshot_entry
    for path in files[1:-1]:
        assert _snapshot_kinds(path)[0] == 1
        assert path.stat().st_size >= 2 * snapshot_entry - 200  # the snapshot is half of it
    store = JournalStore(directory)
    assert [e for e in contents(store, recover(store)) if e[0] != 1] == entries
    store.close()


def test_restarts_keep_the_head_segment_with_a_big_snapshot(directory: Path) -> None:
    # Each start of the soak appended a few entries and was killed: the recovered
    # head forgot where its snapshot ended and rolled at the first append.
    snapshot = (1, b"S" * (3 * SMALL_SEGMENT // 2))
    for start in range(30):
        store, loop = open_journal(
            directory, segment_size=SMALL_SEGMENT, snapshot_provider=lambda: snapshot
        )
        append_all(store, loop, [(4, b"%d-%d" % (start, n), [bytes(100)]) for n in range(10)])
        store.close()
    # 300 entries of ~130 bytes: 39 KB, one or two segments' worth (30+ before)
    assert len(segment_files(directory)) <= 3


def test_a_head_that_lost_its_snapshot_gets_one_before_older_segments_go(
    directory: Path,
) -> None:
    # A kill during a roll's first write tears the new head's snapshot: recovery
    # cuts it to an empty segment. Had the store deleted the older segments (their
    # bodies all dead), the log would start without a snapshot: queues and
    # duplicate-id windows forgotten at the next start.
    made: list[bytes] = []

    def snapshot() -> tuple[int, bytes]:
        made.append(b"snap-%d" % len(made))
        return 1, made[-1]

    options: dict[str, Any] = {"segment_size": SMALL_SEGMENT, "snapshot_provider": snapshot}
    store, loop = open_journal(directory, **options)
    append_all(store, loop, [(4, b"%d" % n, [bytes(1000)]) for n in range(40)])
    store.close()
    assert len(segment_files(directory)) >= 3
    head = segment_files(directory)[-1]
    os.truncate(head, SEGMENT_HEADER.size)  # the roll's snapshot (and what followed) torn

    store = JournalStore(directory, **options)
    for entry in recover(store):
        for ref in entry.refs:
            store.release(ref)  # every body dead: every segment but the head may go
    store.maintain()
    store.flush()
    assert len(segment_files(directory)) == 1
    store.close()
    store = JournalStore(directory, **options)
    assert [(e.kind, e.meta) for e in recover(store)] == [(1, made[-1])]
    store.close()

    # the same when an append comes first: it goes after a new snapshot
    store, loop = open_journal(directory, **options)
    append_all(store, loop, [(4, b"%d" % n, [bytes(1000)]) for n in range(40)])
    store.close()
    os.truncate(segment_files(directory)[-1], SEGMENT_HEADER.size)
    store, loop = open_journal(directory, **options)
    append_all(store, loop, [(4, b"after", [b"x"])])
    store.close()
    store = JournalStore(directory, **options)
    recovered = [(e.kind, e.meta) for e in recover(store)]
    assert recovered[-2:] == [(1, made[-1]), (4, b"after")]
    store.close()


@pytest.mark.parametrize("snapshot_size", [4, 3 * SMALL_SEGMENT // 2])
def test_segments_of_small_live_messages_are_not_relocated(
    directory: Path, snapshot_size: int
) -> None:
    # Relocation must pay: copying a segment's live messages must write less than
    # half of what deleting it frees. Counted in body bytes alone, a segment of
    # small messages (10-byte bodies, ~120-byte entries) always looked mostly dead,
    # and so did one whose snapshot is half of it: the live messages were copied
    # forward again and again (the soak rewrote ~700 KB of them several times a
    # second, ten times what its clients wrote).
    snapshot = (1, b"S" * snapshot_size)
    store, loop = open_journal(
        directory, segment_size=SMALL_SEGMENT, snapshot_provider=lambda: snapshot
    )
    refs = append_all(store, loop, [(4, b"m" * 80, [b"%010d" % n]) for n in range(1500)])
    assert store.stats().segments >= 5
    for _ in range(3):
        assert store.maintain() is None  # every message lives: nothing to gain
    oldest = [ref for [ref] in refs if unpack_ref(ref)[0] == 1]
    for ref in oldest[: len(oldest) * 3 // 4]:
        store.release(ref)  # three quarters consumed: moving the rest pays
    # ... but consumers ate from the oldest since the last call: it may die on its
    # own, so it is not copied yet (watched at every call, also while nothing paid)
    assert store.maintain() is None
    relocation = store.maintain()  # nothing eaten since: now it is offered
    assert relocation is not None and relocation.segment == 1
    store.close()


def test_dead_segments_are_deleted_from_the_oldest_end_only(directory: Path) -> None:
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    refs = append_all(store, loop, [(4, b"%d" % n, [bytes(1000)]) for n in range(80)])
    segments = {unpack_ref(r[0])[0] for r in refs}
    assert len(segments) >= 5
    keep = refs[20][0]  # lives in segment 2: 1 and everything after 2 die
    keep_segment = unpack_ref(keep)[0]
    for ref_list in refs:
        if ref_list[0] != keep:
            store.release(ref_list[0])
    assert store.maintain() is not None  # segment 2 is mostly dead: relocate it
    store.flush()
    names = [p.name for p in segment_files(directory)]
    assert names[0] == f"{keep_segment:020d}.seg"  # 1 deleted; 2 and later kept
    assert len(names) == len(segments) - (keep_segment - 1)
    store.release(keep)
    assert store.maintain() is None
    store.flush()
    assert len(segment_files(directory)) == 1  # only the head is left
    assert store.stats().segments == 1
    store.close()


def test_no_sync_or_unlink_on_the_caller_thread(directory: Path) -> None:
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    assert store.writer is not None
    threads: set[int] = set()
    real_sync, real_unlink = store.writer.sync_file, store.writer.unlink

    def sync(fd: int) -> None:
        threads.add(threading.get_ident())
        real_sync(fd)

    def unlink(path: Path) -> None:
        threads.add(threading.get_ident())
        real_unlink(path)

    store.writer.sync_file, store.writer.unlink, store.writer.sync_dir = sync, unlink, sync
    refs = append_all(store, loop, [(4, b"m", [bytes(2000)]) for _ in range(40)])
    for (ref,) in refs:
        store.release(ref)
    store.maintain()
    store.flush()
    assert threads and threading.get_ident() not in threads
    store.close()


def test_failure_fails_every_queued_entry(directory: Path) -> None:
    store, loop = open_journal(directory)
    assert store.writer is not None
    entered, release = threading.Event(), threading.Event()

    def stuck_then_failing_sync(fd: int) -> None:
        entered.set()
        release.wait(10)
        raise OSError(errno.EIO, "injected")

    store.writer.sync_file = stuck_then_failing_sync
    done = Completions()
    store.append(4, b"0", [b"a"], done.callback(0))
    assert entered.wait(10)
    for n in range(1, 50):  # queued while the writer is stuck in its sync
        store.append(4, b"%d" % n, [b"b"], done.callback(n))
    release.set()
    loop.run_until(lambda: len(done) == 50)
    assert [n for n, _ in done.calls] == list(range(50))
    assert all(isinstance(error, StorageFailed) for _, error in done.calls)
    with pytest.raises(StorageFailed):
        store.append(4, b"late", [], done.callback(99))
    with pytest.raises(StorageFailed):
        store.flush()
    assert store.maintain() is None
    store.close()


def test_failing_write_is_a_storage_failure(directory: Path) -> None:
    store, loop = open_journal(directory)
    assert store.writer is not None

    def full_disk(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "injected: no space left")

    store.writer.write_at = full_disk
    done = Completions()
    store.append(4, b"x", [b"y"], done.callback(0))
    loop.run_until(lambda: len(done) == 1)
    assert isinstance(done.result(0), StorageFailed) and "no space" in str(done.result(0))
    store.close()


def test_torn_tail_is_logged_and_truncated(directory: Path, caplog: Any) -> None:
    store, loop = open_journal(directory)
    append_all(store, loop, sample_entries(5))
    store.close()
    (path,) = segment_files(directory)
    size = path.stat().st_size
    offset, _length = entry_spans(path.read_bytes())[-1]
    os.truncate(path, size - 3)
    with caplog.at_level(logging.WARNING, logger="txbroker.journal"):
        store, _ = open_journal(directory)
    assert path.stat().st_size == offset
    assert any("torn tail" in r.message and str(path) in r.message for r in caplog.records)
    assert any(f"offset {offset}" in line for line in store.repair_report)
    store.close()


def test_damage_in_the_middle_of_the_last_segment(directory: Path) -> None:
    store, loop = open_journal(directory)
    entries = sample_entries(10)
    append_all(store, loop, entries)
    store.close()
    (path,) = segment_files(directory)
    offset, length = entry_spans(path.read_bytes())[4]
    flip_bit(path, offset + length - 6)
    with pytest.raises(CorruptStore, match="valid entries follow") as caught:
        recover(JournalStore(directory))
    assert (caught.value.path, caught.value.offset) == (str(path), offset)
    store, _ = open_journal(directory, repair=True)
    store.close()
    store = JournalStore(directory)
    assert contents(store, recover(store)) == entries[:4] + entries[5:]
    store.close()


def test_bad_header_of_an_old_segment(directory: Path) -> None:
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    entries = [(4, b"%d" % n, [bytes(900)]) for n in range(40)]
    append_all(store, loop, entries)
    store.close()
    first = segment_files(directory)[0]
    flip_bit(first, 3)
    with pytest.raises(CorruptStore, match="magic") as caught:
        recover(JournalStore(directory))
    assert (caught.value.path, caught.value.offset) == (str(first), 0)
    store, _ = open_journal(directory, repair=True)
    assert any("header rewritten" in line for line in store.repair_report)
    store.close()
    store = JournalStore(directory)
    assert contents(store, recover(store)) == entries
    store.close()


def test_missing_segment_is_corruption(directory: Path) -> None:
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    append_all(store, loop, [(4, b"%d" % n, [bytes(900)]) for n in range(60)])
    store.close()
    os.unlink(segment_files(directory)[1])
    with pytest.raises(CorruptStore, match="missing"):
        recover(JournalStore(directory))
    store, _ = open_journal(directory, repair=True)
    assert any("missing" in line for line in store.repair_report)
    store.close()
    store, _ = open_journal(directory)  # the gap is filled: no repair needed
    store.close()


def test_torn_segment_header_of_the_last_segment(directory: Path) -> None:
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    entries = [(4, b"%d" % n, [bytes(900)]) for n in range(40)]
    append_all(store, loop, entries)
    store.close()
    last = segment_files(directory)[-1]
    lost = len(entry_spans(last.read_bytes()))
    os.truncate(last, 10)
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    append_all(store, loop, [(4, b"new", [b"n"])])
    store.close()
    store = JournalStore(directory)
    assert contents(store, recover(store)) == [*entries[:-lost], (4, b"new", [b"n"])]
    store.close()


def test_lock_is_held_against_other_processes(directory: Path) -> None:
    store, _ = open_journal(directory)
    code = (
        "import sys\nfrom txbroker.storage.journal import JournalStore\n"
        "from txbroker.errors import StoreLocked\n"
        "try:\n    JournalStore(sys.argv[1]).recover()\nexcept StoreLocked as e:\n"
        "    print('LOCKED', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.startswith("LOCKED") and str(directory) in result.stdout, result
    assert f"pid {os.getpid()}" in result.stdout
    store.close()
    result = subprocess.run(
        [sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.stdout == "", result  # released by close()


def test_body_cache_is_bounded_and_reads_fall_back_to_disk(directory: Path) -> None:
    store, loop = open_journal(directory, body_cache_bytes=10_000)
    bodies = [bytes([n]) * 3000 for n in range(30)]
    refs = append_all(store, loop, [(4, b"m", [body]) for body in bodies])
    assert store._cache_bytes <= 10_000  # the bound itself
    assert store.stats().body_cache_bytes == store._cache_bytes == 9000  # the last three
    assert [store.read_body(r) for (r,) in refs] == bodies
    store.close()
    store, loop = open_journal(directory, body_cache_bytes=0)
    done = Completions()
    [ref] = store.append(4, b"m", [b"unwritten"], done.callback(0))
    assert store.read_body(ref) == b"unwritten"  # from the queue or the file
    loop.run_until(lambda: len(done) == 1)
    store.close()


@pytest.mark.parametrize("mode", SyncMode.ALL)
def test_sync_modes(directory: Path, mode: str) -> None:
    store, loop = open_journal(directory, sync=mode)
    append_all(store, loop, sample_entries(20))
    assert store.stats().syncs >= 1
    store.close()
    store = JournalStore(directory, sync=mode)
    assert len(recover(store)) == 20
    store.close()


def test_inline_dispatch_completes_on_the_writer_thread(directory: Path) -> None:
    store = JournalStore(directory)
    recover(store)
    seen: list[tuple[int, BaseException | None]] = []
    event = threading.Event()

    def on_durable(error: BaseException | None) -> None:
        seen.append((threading.get_ident(), error))
        event.set()

    store.append(4, b"m", [b"b"], on_durable)
    assert event.wait(10)
    assert seen[0][1] is None and seen[0][0] != threading.get_ident()
    store.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_tail_cut_recovers_a_prefix(tmp_path: Path, data: st.DataObject) -> None:
    directory = tmp_path / f"cut{next(EXAMPLES)}"
    entries = [(4, b"%d" % n, [bytes([n]) * data.draw(st.integers(0, 300))]) for n in range(8)]
    store, loop = open_journal(directory)
    append_all(store, loop, entries)
    store.close()
    (path,) = segment_files(directory)
    spans = entry_spans(path.read_bytes())
    cut = data.draw(st.integers(SEGMENT_HEADER.size, path.stat().st_size))
    os.truncate(path, cut)
    whole = sum(1 for offset, length in spans if offset + length <= cut)
    store = JournalStore(directory)
    assert contents(store, recover(store)) == entries[:whole]
    store.close()


# -- pre-allocated head segment (journal_writer.py) ------------------------------


def data_end(path: Path) -> int:
    offset, length = entry_spans(path.read_bytes())[-1]
    return offset + length


def test_head_segment_is_preallocated_with_zeros_and_cut_on_close(directory: Path) -> None:
    store, loop = open_journal(directory)
    append_all(store, loop, sample_entries(5))
    (path,) = segment_files(directory)
    end = data_end(path)
    data = path.read_bytes()
    assert end < len(data) <= end + PREALLOCATE_BYTES
    assert data[end:] == bytes(len(data) - end)
    assert store.stats().bytes_written == end  # the zeros are not counted as data
    store.close()
    assert path.stat().st_size == end


def test_crash_leaves_zeros_that_recovery_reads_as_free_space(
        directory: Path, tmp_path: Path, caplog: Any) -> None:
    store, loop = open_journal(directory)
    entries = sample_entries(7)
    append_all(store, loop, entries)
    crashed = tmp_path / "crashed"
    shutil.copytree(directory, crashed)  # the files as a kill -9 leaves them
    store.close()
    (path,) = segment_files(crashed)
    end = data_end(path)
    assert end < path.stat().st_size <= end + PREALLOCATE_BYTES
    with caplog.at_level(logging.DEBUG, logger="txbroker.journal"):
        store = JournalStore(crashed)
        assert contents(store, recover(store)) == entries
    assert store.repair_report == []
    assert not any("torn tail" in r.message for r in caplog.records)
    assert path.stat().st_size == end  # cut back: appends go on right after the data
    store.close()


def test_zeros_after_a_torn_write_are_a_torn_tail(directory: Path, tmp_path: Path,
                                                  caplog: Any) -> None:
    store, loop = open_journal(directory)
    append_all(store, loop, sample_entries(3))
    crashed = tmp_path / "crashed"
    shutil.copytree(directory, crashed)
    store.close()
    (path,) = segment_files(crashed)
    end = data_end(path)
    with open(path, "r+b") as file:  # half an entry header, then the zeros
        file.seek(end)
        file.write(b"TXBE\x40\x00")
    with caplog.at_level(logging.WARNING, logger="txbroker.journal"):
        store = JournalStore(crashed)
        assert contents(store, recover(store)) == sample_entries(3)
    assert any("torn tail" in r.message and f"offset {end}" in r.message
               for r in caplog.records)
    store.close()


def test_sealed_segments_carry_no_zeros(directory: Path) -> None:
    store, loop = open_journal(directory, segment_size=SMALL_SEGMENT)
    append_all(store, loop, sample_entries(200))
    *sealed, head = segment_files(directory)
    assert len(sealed) >= 2
    for path in sealed:
        assert path.stat().st_size == data_end(path) <= 2 * SMALL_SEGMENT
    assert data_end(head) < head.stat().st_size <= data_end(head) + PREALLOCATE_BYTES
    store.close()
    assert head.stat().st_size == data_end(head)


def test_no_preallocation_without_sync(directory: Path) -> None:
    store, loop = open_journal(directory, sync=SyncMode.NONE)
    append_all(store, loop, sample_entries(5))
    (path,) = segment_files(directory)
    assert path.stat().st_size == data_end(path)
    store.close()
