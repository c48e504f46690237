"""The directory store: the contract suite, plus what only a dir store has
(the seed's file flow, sync flags, crash injection between steps, power loss
without directory syncs, quarantine of foreign and torn files)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.ledger import check
from tests.server import test_kill9 as kill9
from txbroker.core import queue_settings as core_queue_settings
from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.errors import CorruptStore, StorageFailed
from txbroker.storage import dirstore
from txbroker.storage.dirstore import DirStore
from txbroker.storage.dirstore_format import (
    ACTIVE,
    BLOCK_HEADER,
    COMMITTED,
    FLAG_LOCAL,
    FLAGS_FOR_SYNC_MODE,
    METADATA_FILE,
    PREPARED,
    BlockType,
    SyncFlags,
    block_name,
    block_size,
    decode_block,
    encode_block,
    message_name,
    parse_block_name,
    parse_flags,
    parse_message_name,
)
from txbroker.storage.dirstore_model import DEFAULT_DUP_WINDOW
from txbroker.storage.interface import Dispatch, SnapshotProvider, Store, StoredEntry, SyncMode
from txbroker.storage.journal import JournalStore

from .contract import (
    PROCESS,
    RECORDS,
    BrokerState,
    Damaged,
    Entry,
    StoreContractTests,
    StoreFactory,
    add_entry,
    append_all,
    assert_same_state,
    broker_entries,
    broker_state,
    expected_state,
    msg_record,
    queue_put,
    recover,
    tx_entry,
)
from .support import Completions, Loop


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


class DirCrasher:
    """Damages a closed dir store the way a crash would have left it."""

    def __init__(self, factory: DirFactory) -> None:
        self.factory = factory

    def tear_last_entry(self, how: str) -> None:
        """Put the newest message back into ``active/`` as a torn block: its
        transaction never got past the write step."""
        committed = self.factory.directory / COMMITTED
        blocks = []
        for path in committed.iterdir():
            block = decode_block(path.read_bytes())
            assert not isinstance(block, str)
            blocks.append(((block.tid, block.sequence), path, block))
        (tid, sequence), path, block = max(blocks, key=lambda item: item[0])
        torn = self.factory.directory / ACTIVE / block_name(tid, sequence)
        os.rename(path, torn)
        if how == "crc":
            flip_bit(torn, torn.stat().st_size - 10)
        elif how == "header":
            os.truncate(torn, 7)
        else:
            os.truncate(torn, BLOCK_HEADER.size + len(block.info) + len(block.body) // 2)

    def truncate_log(self, entries_back: int) -> None:
        raise NotImplementedError("a dir store has no log to cut")

    def corrupt_old_entry(self) -> Damaged:
        raise NotImplementedError("a dir store quarantines damage instead of stopping")

    def truncate_old_segment(self) -> Damaged:
        raise NotImplementedError("a dir store has no segments")

    def fail_syncs(self, store: Store) -> None:
        assert isinstance(store, DirStore)

        def failing_sync(target: Any) -> None:
            raise OSError(errno.EIO, "injected fsync failure")

        store.ops.sync_file = failing_sync
        store.ops.sync_dir = failing_sync


class DirFactory(StoreFactory):
    features = frozenset({PROCESS, RECORDS})

    def __init__(self, root: Path, flags: str = "") -> None:
        self.root = root
        self.flags = flags
        self.count = 0
        self.crasher = DirCrasher(self)
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
        return DirStore(
            self.directory, flags=self.flags, dispatch=dispatch,
            snapshot_provider=snapshot_provider,
        )

    def child_spec(self) -> dict[str, Any]:
        return {
            "factory": "dirstore_payload:open_records_store",
            "kwargs": {"directory": str(self.directory), "flags": self.flags},
        }


class TestDirContract(StoreContractTests):
    @pytest.fixture(params=["", "FDATASYNC,DSYNC"])
    def factory(self, tmp_path: Path, request: pytest.FixtureRequest) -> DirFactory:
        return DirFactory(tmp_path, request.param)



# -- helpers for the dir-only tests ----------------------------------------------------


def kind_entry(kind: Kind, meta: Any) -> Entry:
    return int(kind), records.pack(meta), []


#: Durable before each crash case: two queues and four messages.
SETUP: list[Entry] = [
    queue_put("q0"),
    queue_put("dlq"),
    add_entry(1, b"one", client_id="c1"),
    add_entry(2, b"two"),
    add_entry(3, b"three", client_id="c3"),
    add_entry(4, b"four"),
]
#: Appended at once while a step is "killed": a transaction of three sends and
#: two acks (the seed's weak spot), an update, a move, an ack, a queue created,
#: used and deleted, and a read-only transaction (a DUMMY block).
VICTIMS: list[Entry] = [
    tx_entry([(10, b"t10"), (11, b"t11" * 100), (12, b"")], [1, 2]),
    kind_entry(Kind.UPDATE, [3, 2, 0]),
    kind_entry(Kind.MOVE, [[4], "dlq", "rejected"]),
    kind_entry(Kind.ACK, [3]),
    queue_put("q9"),
    add_entry(13, b"x", queue="q9", client_id="c13"),
    kind_entry(Kind.QUEUE_DELETE, "q9"),
    tx_entry([], []),
]
STEPS = ("write_file", "sync_file", "rename", "sync_dir", "unlink")


def open_store(directory: Path, **options: Any) -> tuple[DirStore, Loop, list[StoredEntry]]:
    loop = Loop()
    store = DirStore(directory, dispatch=loop.dispatch, **options)
    return store, loop, recover(store)


def append_and_wait(
    store: DirStore, loop: Loop, entries: list[Entry]
) -> list[BaseException | None]:
    """Append ``entries`` at once; the outcome of each (None: durable). A store that
    failed under the appends (a kill in its writer thread) refuses the later ones at
    once, raising StorageFailed: that is their outcome (whether the writer fails
    before or after the last append depends on the threads' timing)."""
    done = Completions()
    for n, (kind, meta, bodies) in enumerate(entries):
        try:
            store.append(kind, meta, bodies, done.callback(n))
        except StorageFailed as error:
            done.callback(n)(error)
    loop.run_until(lambda: len(done) == len(entries))
    return [error for _, error in sorted(done.calls, key=lambda call: call[0])]


def state_of(store: DirStore, recovered: list[StoredEntry]) -> BrokerState:
    return broker_state(recovered, store.read_body, store.body_size, dups=False)


def matching_prefix(state: BrokerState, entries: list[Entry]) -> int:
    """The length of the prefix of ``entries`` whose state ``state`` is (-1: none)."""
    for length in range(len(entries), -1, -1):
        want = expected_state(entries[:length], dups=False)
        if (state.queues, state.topics, state.messages, state.branches, state.sinks) == (
                want.queues, want.topics, want.messages, want.branches, want.sinks):
            return length
    return -1


def kill_at(store: DirStore, step: str, call: int) -> None:
    """Make call number ``call`` (0-based) of ``store.ops.<step>`` a kill: it
    raises instead of running, and the store does nothing more (poisoned)."""
    real = getattr(store.ops, step)
    calls = [0]

    def killed_step(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == call + 1:
            raise OSError(errno.EIO, f"simulated kill at {step} #{call}")
        return real(*args)

    setattr(store.ops, step, killed_step)


def count_steps(store: DirStore) -> dict[str, int]:
    """Count the calls of each step from now on."""
    counts = dict.fromkeys(STEPS, 0)
    for step in STEPS:
        real = getattr(store.ops, step)

        def counted(*args: Any, _step: str = step, _real: Any = real) -> Any:
            counts[_step] += 1
            return _real(*args)

        setattr(store.ops, step, counted)
    return counts


def files(directory: Path, sub: str) -> list[str]:
    return sorted(os.listdir(directory / sub))


# -- format ----------------------------------------------------------------------------


def test_format_sizes_and_names() -> None:
    assert BLOCK_HEADER.size == 48
    assert block_name(0x2A, 0) == "000000000000002a-000"
    assert block_name(0x2A, 1234) == "000000000000002a-1234"
    assert parse_block_name("000000000000002a-1234") == (0x2A, 1234)
    assert parse_block_name("000000000000002a-12") is None
    assert parse_block_name("x00000000000002a-123") is None
    assert message_name(42) == "00000000000000000042"
    assert parse_message_name("00000000000000000042") == 42
    assert parse_message_name("42") is None
    parts = encode_block(BlockType.NEW, sequence=1, count=2, tid=7, message_id=9, info=b"inf",
                         body=b"body")
    data = b"".join(parts)
    assert len(data) == block_size(3, 4) == 52 + 3 + 4
    block = decode_block(data)
    assert not isinstance(block, str)
    assert (block.type, block.sequence, block.count, block.tid, block.message_id, block.info,
            block.body, block.flags) == (BlockType.NEW, 1, 2, 7, 9, b"inf", b"body", FLAG_LOCAL)
    assert decode_block(data[:-1]) == (
        f"length {len(data) - 1} but the header says {len(data)} (torn or padded)")
    assert decode_block(data[:30]) == "too short for a block (30 bytes)"
    damaged = bytearray(data)
    damaged[50] ^= 1
    assert decode_block(bytes(damaged)) == "CRC mismatch"
    assert decode_block(b"X" * 60) == "bad magic (not a txbroker block)"


def test_sync_flags_parse() -> None:
    assert str(parse_flags("")) == "" and parse_flags("") == SyncFlags("", False)
    assert parse_flags("fsync;DSYNC") == SyncFlags("FSYNC", True)
    assert parse_flags("FDATASYNC, DSYNC") == SyncFlags("FDATASYNC", True)
    assert parse_flags("DSYNC") == SyncFlags("", True)
    assert str(parse_flags("FSYNC|DSYNC")) == "FSYNC,DSYNC"
    with pytest.raises(ValueError, match="exclude"):
        parse_flags("FSYNC,FDATASYNC")
    with pytest.raises(ValueError, match="NOSYNC"):
        parse_flags("NOSYNC")
    for mode, flags in FLAGS_FOR_SYNC_MODE.items():
        assert mode in SyncMode.ALL
        parse_flags(flags)
    with pytest.raises(ValueError):
        DirStore("/nonexistent", flags="bogus")


def test_default_dup_window_is_the_cores() -> None:
    assert DEFAULT_DUP_WINDOW == core_queue_settings.DEFAULT_DUP_WINDOW


# -- the seed's file flow ----------------------------------------------------------------


def test_layout_on_disk(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, [queue_put("q0"), add_entry(7, b"body!", client_id="c7")])
    assert files(tmp_path, ACTIVE) == files(tmp_path, PREPARED) == []
    assert files(tmp_path, COMMITTED) == ["00000000000000000007"]
    block = decode_block((tmp_path / COMMITTED / "00000000000000000007").read_bytes())
    assert not isinstance(block, str)
    assert block.type is BlockType.NEW and block.body == b"body!"
    assert block.message_id == 7 and records.unpack(block.info) == msg_record(7, client_id="c7")
    metadata = decode_block((tmp_path / METADATA_FILE).read_bytes())
    assert not isinstance(metadata, str) and metadata.type is BlockType.METADATA
    meta = records.unpack(metadata.info)
    assert meta["queues"]["q0"]["name"] == "q0" and meta["dups"] == {"q0": ["c7"]}
    assert meta["next_id"] > 7
    assert store.body_size(7) == 5 and store.stats().segments == 1
    store.close()
    assert (tmp_path / "lock").exists()


def record_steps(store: DirStore) -> list[tuple[str, str]]:
    """Log each step as (step, what it touched: "dir/name", "dir/name->dir/name")."""
    log: list[tuple[str, str]] = []

    def short(path: Path) -> str:
        return f"{path.parent.name}/{path.name}"

    ops = store.ops
    write_file, rename, unlink, sync_dir = ops.write_file, ops.rename, ops.unlink, ops.sync_dir

    def logged_write(path: Path, parts: Any) -> int:
        log.append(("create", short(path)))
        return write_file(path, parts)

    def logged_rename(source: Path, target: Path) -> None:
        log.append(("rename", f"{short(source)}->{short(target)}"))
        rename(source, target)

    def logged_unlink(path: Path) -> None:
        log.append(("unlink", short(path)))
        unlink(path)

    def logged_sync_dir(path: Path) -> None:
        log.append(("dsync", path.name))
        sync_dir(path)

    ops.write_file, ops.rename, ops.unlink, ops.sync_dir = (
        logged_write, logged_rename, logged_unlink, logged_sync_dir)
    return log


def test_enqueue_and_dequeue_follow_the_seed(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path, flags="FDATASYNC,DSYNC")
    append_all(store, loop, [queue_put("q0"), add_entry(1, b"first")])  # metadata written
    log = record_steps(store)
    append_all(store, loop, [add_entry(2, b"second")])
    tid = f"{store._index.next_tid - 1:016x}"
    # enqueue: new block in active/, prepare: into prepared/, commit: into committed/ as the id
    assert log == [
        ("create", f"active/{tid}-000"),
        ("rename", f"active/{tid}-000->prepared/{tid}-000"),
        ("dsync", "active"), ("dsync", "prepared"),
        ("rename", f"prepared/{tid}-000->committed/00000000000000000002"),
        ("dsync", "committed"),
    ]
    log.clear()
    append_all(store, loop, [kind_entry(Kind.ACK, [1])])
    tid = f"{store._index.next_tid - 1:016x}"
    # dequeue: delete block in active/, prepared/; commit removes the message file, then the block
    assert log == [
        ("create", f"active/{tid}-000"),
        ("rename", f"active/{tid}-000->prepared/{tid}-000"),
        ("dsync", "active"), ("dsync", "prepared"),
        ("unlink", "committed/00000000000000000001"),
        ("dsync", "committed"),
        ("unlink", f"prepared/{tid}-000"),
    ]
    log.clear()
    append_all(store, loop, [tx_entry([], [])])  # read-only: the dummy block
    tid = f"{store._index.next_tid - 1:016x}"
    assert [step for step, _ in log] == ["create", "rename", "dsync", "dsync", "dsync", "unlink"]
    assert log[-1] == ("unlink", f"prepared/{tid}-000")
    store.close()


def test_a_transaction_is_one_file_per_block(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, [queue_put("q0"), add_entry(1, b"a"), add_entry(2, b"b")])
    log = record_steps(store)
    append_all(store, loop, [tx_entry([(3, b"c"), (4, b"d")], [1, 2])])
    tid = f"{store._index.next_tid - 1:016x}"
    created = [what for step, what in log if step == "create"]
    assert created == [f"active/{tid}-{n:03d}" for n in range(4)]  # 2 NEW + 2 DELETE
    assert files(tmp_path, COMMITTED) == ["00000000000000000003", "00000000000000000004"]
    store.close()


def test_sync_flags_choose_the_syscalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def fsync(fd: int) -> None:
        calls.append("dir-fsync" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync")
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        calls.append("fdatasync")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    expected = {
        "": set(),
        "FDATASYNC": {"fdatasync"},
        "FSYNC": {"fsync"},
        "DSYNC": {"dir-fsync"},
        "FDATASYNC,DSYNC": {"fdatasync", "dir-fsync"},
        "FSYNC;DSYNC": {"fsync", "dir-fsync"},
    }
    for number, (flags, kinds) in enumerate(expected.items()):
        store, loop, _ = open_store(tmp_path / f"d{number}", flags=flags)
        calls.clear()
        append_all(store, loop, [add_entry(1, b"x"), add_entry(2, b"y")])
        assert set(calls) == kinds, flags
        stats = store.ops
        assert (stats.file_syncs > 0) == bool(kinds & {"fsync", "fdatasync"})
        assert (stats.dir_syncs > 0) == ("dir-fsync" in kinds)
        store.close()


def test_no_file_work_on_the_callers_thread(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path, flags="FDATASYNC,DSYNC")
    threads: set[int] = set()
    for step in STEPS:
        real = getattr(store.ops, step)

        def noted(*args: Any, _real: Any = real) -> Any:
            threads.add(threading.get_ident())
            return _real(*args)

        setattr(store.ops, step, noted)
    append_all(store, loop, [queue_put("q0"), *[add_entry(n, bytes(100)) for n in range(1, 50)]])
    append_all(store, loop, [kind_entry(Kind.ACK, list(range(1, 50)))])
    assert threads and threading.get_ident() not in threads
    store.close()


def test_entries_the_store_cannot_take_are_refused(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, [add_entry(1, b"a")])
    bad: list[tuple[int, bytes, list[bytes]]] = [
        (99, records.pack(1), []),  # unknown kind
        (int(Kind.RELOCATE), records.pack(msg_record(1)), [b"a"]),  # never asked for
        (int(Kind.ADD), b"\xc1", [b"x"]),  # not msgpack
        (int(Kind.ADD), records.pack(msg_record(2)), [b"x", b"y"]),  # two bodies
        (int(Kind.ADD), records.pack([2, "q0"]), [b"x"]),  # short msg
        (int(Kind.ADD), records.pack(msg_record(1)), [b"x"]),  # id already stored
        (int(Kind.TX), records.pack([[msg_record(5)], []]), []),  # body missing
        (int(Kind.ACK), records.pack([1]), [b"x"]),  # body on an ack
        (int(Kind.QUEUE_PUT), records.pack({"name": 3}), []),
    ]
    for kind, meta, bodies in bad:
        with pytest.raises(ValueError):
            store.append(kind, meta, bodies, lambda error: None)
    assert store.stats().appends == 1
    store.close()
    store, _, recovered = open_store(tmp_path)
    assert_same_state(store, recovered, [add_entry(1, b"a")])
    store.close()


def test_reads_fall_back_to_the_queue_and_the_file(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path, body_cache_bytes=0)
    done = Completions()
    [ref] = store.append(*add_entry(1, b"unwritten")[:2], [b"unwritten"], done.callback(0))
    assert store.read_body(ref) == b"unwritten"  # from the writer's queue or the file
    loop.run_until(lambda: len(done) == 1)
    assert store.read_body(ref) == b"unwritten"
    store.close()
    bodies = [bytes([n]) * 3000 for n in range(2, 12)]
    store, loop, _ = open_store(tmp_path, body_cache_bytes=10_000)
    refs = append_all(store, loop, [add_entry(n, body) for n, body in enumerate(bodies, 2)])
    assert store._cache_bytes <= 10_000
    assert store.stats().body_cache_bytes == store._cache_bytes == 9000  # the last three
    assert [store.read_body(r) for (r,) in refs] == bodies
    flip_bit(tmp_path / COMMITTED / message_name(2), 60)
    store._cache.clear()
    with pytest.raises(CorruptStore, match="CRC mismatch"):
        store.read_body(2)
    with pytest.raises(KeyError):
        store.read_body(999)
    store.close()


def test_failure_fails_every_queued_entry(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    entered, release = threading.Event(), threading.Event()

    def stuck_then_failing(path: Path, parts: Any) -> int:
        entered.set()
        release.wait(10)
        raise OSError(errno.ENOSPC, "injected: no space left")

    store.ops.write_file = stuck_then_failing
    done = Completions()
    store.append(*add_entry(1, b"a")[:2], [b"a"], done.callback(0))
    assert entered.wait(10)
    for n in range(1, 30):  # queued while the writer is stuck
        store.append(*add_entry(n + 1, b"b")[:2], [b"b"], done.callback(n))
    release.set()
    loop.run_until(lambda: len(done) == 30)
    assert [n for n, _ in done.calls] == list(range(30))
    assert all(isinstance(error, StorageFailed) and "no space" in str(error)
               for _, error in done.calls)
    with pytest.raises(StorageFailed):
        store.append(*add_entry(99, b"late")[:2], [b"late"], done.callback(99))
    with pytest.raises(StorageFailed):
        store.flush()
    assert store.maintain() is None
    store.close()


# -- crash injection: a kill between any two steps --------------------------------------


def crash_case(directory: Path, step: str, call: int, flags: str) -> tuple[DirStore, int]:
    """Set up, kill ``step`` at call ``call`` while VICTIMS are written; return the
    reopened store's state as the length of the VICTIMS prefix it matches."""
    store, loop, _ = open_store(directory, flags=flags)
    append_all(store, loop, SETUP)
    kill_at(store, step, call)
    outcomes = append_and_wait(store, loop, VICTIMS)
    acknowledged = outcomes.index(next((o for o in outcomes if o is not None), None)) \
        if any(outcomes) else len(outcomes)
    store.close()
    return store, acknowledged


@pytest.mark.parametrize("flags", ["", "FDATASYNC,DSYNC"])
def test_kill_between_any_two_steps_is_all_or_nothing(tmp_path: Path, flags: str) -> None:
    store, loop, _ = open_store(tmp_path / "count", flags=flags)
    append_all(store, loop, SETUP)
    counts = count_steps(store)
    append_all(store, loop, VICTIMS)
    store.close()
    mid_commit_seen = 0
    cases = 0
    for step in STEPS:
        for call in range(counts[step]):
            cases += 1
            directory = tmp_path / f"{step}-{call}"
            _, acknowledged = crash_case(directory, step, call, flags)
            tx_prepared = [n for n in files(directory, PREPARED)]
            in_commit = (directory / COMMITTED / message_name(10)).exists() and not (
                directory / COMMITTED / message_name(12)).exists()
            if in_commit and tx_prepared:
                mid_commit_seen += 1
            store, _, recovered = open_store(directory, flags=flags)
            length = matching_prefix(state_of(store, recovered), SETUP + VICTIMS)
            assert length >= len(SETUP) + acknowledged, (step, call, length)
            assert files(directory, ACTIVE) == files(directory, PREPARED) == []
            assert not store.report, store.report
            store.close()
    assert cases >= 40 and mid_commit_seen >= 1


def test_a_crash_mid_commit_is_rolled_forward(tmp_path: Path) -> None:
    """The seed's weak spot: killed after the first message of the transaction
    reached committed/: recovery finishes the commit (all of it is there)."""
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, SETUP)
    counts = count_steps(store)
    append_all(store, loop, VICTIMS[:1])  # the transaction alone
    renames = counts["rename"]
    store.close()
    # renames: 5 into prepared/, then message 10 into committed/, then 11 …: kill at 11
    assert renames == 5 + 3
    store, loop, _ = open_store(tmp_path / "crash")
    append_all(store, loop, SETUP)
    kill_at(store, "rename", 6)
    assert isinstance(append_and_wait(store, loop, VICTIMS[:1])[0], StorageFailed)
    store.close()
    directory = tmp_path / "crash"
    assert files(directory, COMMITTED) == [message_name(n) for n in (1, 2, 3, 4, 10)]
    assert len(files(directory, PREPARED)) == 4  # 11, 12 and the two deletes
    # Recovery itself is killed while rolling forward: the next start finishes it.
    store = DirStore(directory)
    kill_at(store, "unlink", 0)
    with pytest.raises(OSError, match="simulated kill"):
        recover(store)
    store.close()
    store, _, recovered = open_store(directory)
    assert matching_prefix(state_of(store, recovered), SETUP + VICTIMS[:1]) == len(SETUP) + 1
    assert files(directory, COMMITTED) == [message_name(n) for n in (3, 4, 10, 11, 12)]
    assert files(directory, PREPARED) == []
    store.close()


def test_a_torn_block_in_active_is_rolled_back_and_quarantined(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, SETUP)
    real_write = store.ops.write_file
    calls = [0]

    def torn_write(path: Path, parts: Any) -> int:
        calls[0] += 1
        if calls[0] < 3:
            return real_write(path, parts)
        data = b"".join(parts)
        fd = real_write(path, [data[: len(data) // 2]])
        os.close(fd)
        raise OSError(errno.EIO, "simulated kill in the middle of a write")

    store.ops.write_file = torn_write
    outcomes = append_and_wait(store, loop, VICTIMS)
    assert all(isinstance(error, StorageFailed) for error in outcomes)
    store.close()
    torn = sorted(os.listdir(tmp_path / ACTIVE))[-1]
    store, _, recovered = open_store(tmp_path)
    assert matching_prefix(state_of(store, recovered), SETUP + VICTIMS) == len(SETUP)
    assert len(store.report) == 1 and str(tmp_path / ACTIVE / torn) in store.report[0]
    assert "half-written" in store.report[0]
    assert files(tmp_path, "quarantine") == [f"active.{torn}"]
    assert files(tmp_path, ACTIVE) == files(tmp_path, PREPARED) == []
    store.close()


class PowerCut:
    """Simulates losing what no directory fsync made durable.

    Wraps the create/rename/unlink steps and remembers how to undo each until
    an fsync of the directory it changed (for a rename: the target's). ``cut``
    undoes everything not synced, newest first — the worst case of a power
    loss. File contents are assumed durable (what FSYNC/FDATASYNC ensure).
    """

    def __init__(self, store: DirStore) -> None:
        self.pending: list[tuple[Path, Any]] = []  # (directory, undo)
        ops = store.ops
        write_file, rename, unlink, sync_dir = ops.write_file, ops.rename, ops.unlink, ops.sync_dir

        def create(path: Path, parts: Any) -> int:
            fd = write_file(path, parts)
            self.pending.append((path.parent, lambda: path.unlink(missing_ok=True)))
            return fd

        def moved(source: Path, target: Path) -> None:
            replaced = target.read_bytes() if target.exists() else None
            rename(source, target)

            def undo() -> None:
                if target.exists():
                    os.rename(target, source)
                if replaced is not None:
                    target.write_bytes(replaced)

            self.pending.append((target.parent, undo))

        def removed(path: Path) -> None:
            content = path.read_bytes() if path.exists() else None
            unlink(path)
            if content is not None:
                self.pending.append((path.parent, lambda: path.write_bytes(content)))

        def synced(path: Path) -> None:
            sync_dir(path)  # called with or without DSYNC: a no-op without
            if store.flags.dir_sync:
                self.pending = [(d, undo) for d, undo in self.pending if d != path]

        ops.write_file, ops.rename, ops.unlink, ops.sync_dir = create, moved, removed, synced

    def cut(self) -> int:
        """Undo what no directory fsync covered; return how many changes that was."""
        undone = len(self.pending)
        for _directory, undo in reversed(self.pending):
            undo()
        self.pending.clear()
        return undone


def power_cut_case(directory: Path, flags: str, call: int, setup: list[Entry] = SETUP,
                   victims: list[Entry] = VICTIMS) -> tuple[int, int, int]:
    """Power fails at step ``call`` of writing ``victims`` (one at a time, after
    ``setup``): the acknowledged count, the prefix recovery finds (-1: none), the
    changes lost."""
    store, loop, _ = open_store(directory, flags=flags)
    append_all(store, loop, setup)
    cut = PowerCut(store)
    counter = [0]
    for step in ("write_file", "rename", "unlink"):
        real = getattr(store.ops, step)

        def maybe_fail(*args: Any, _real: Any = real) -> Any:
            counter[0] += 1
            if counter[0] == call:
                raise OSError(errno.EIO, "power cut")
            return _real(*args)

        setattr(store.ops, step, maybe_fail)
    acknowledged = 0
    for entry in victims:  # one at a time: each acknowledged before the next
        if append_and_wait(store, loop, [entry])[0] is not None:
            break
        acknowledged += 1
    store.close()
    undone = cut.cut()
    store, _, recovered = open_store(directory, flags=flags)
    length = matching_prefix(state_of(store, recovered), setup + victims)
    store.close()
    return acknowledged, length, undone


def test_power_cut_with_dsync_keeps_every_acknowledged_entry(tmp_path: Path) -> None:
    lost_changes = 0
    for call in range(1, 80):
        acknowledged, length, undone = power_cut_case(tmp_path / f"d{call}", "FDATASYNC,DSYNC",
                                                      call)
        assert length >= len(SETUP) + acknowledged, (call, acknowledged, length)
        lost_changes += undone
        if acknowledged == len(VICTIMS):
            break
    else:
        raise AssertionError("the victims never all got through")
    assert lost_changes > 0  # the cuts did undo unsynced creates, renames and unlinks


def test_power_cut_without_dsync_can_lose_acknowledged_entries(tmp_path: Path) -> None:
    """What the default (no flags, as the seed's default) risks: renames and
    unlinks that never reached the disk. The directory is consistent after
    recovery (a state of some prefix, or a mix the journal would not allow),
    but acknowledged entries can be gone."""
    losses = 0
    for call in range(5, 60, 6):
        acknowledged, length, _ = power_cut_case(tmp_path / f"d{call}", "", call)
        losses += length < len(SETUP) + acknowledged
    assert losses > 0


# -- bad input: foreign, torn and damaged files ------------------------------------------


def test_foreign_and_damaged_files_are_quarantined(tmp_path: Path, caplog: Any) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, SETUP)
    store.close()
    committed = tmp_path / COMMITTED
    (tmp_path / ACTIVE / "notes.txt").write_text("hello")
    (tmp_path / PREPARED / "core").write_bytes(b"\x7fELF")
    (tmp_path / PREPARED / block_name(0x999, 0)).write_bytes(b"torn")
    (committed / "README").write_text("not a message")
    (committed / "subdir").mkdir()
    (committed / message_name(50)).write_bytes(os.urandom(100))  # looks like a message
    os.truncate(committed / message_name(2), 60)  # torn message file
    (committed / (message_name(3) + ".tmp")).write_bytes(b"half an update")
    wrong = decode_block((committed / message_name(4)).read_bytes())
    assert not isinstance(wrong, str)
    (committed / message_name(77)).write_bytes(b"".join(encode_block(
        BlockType.NEW, sequence=0, count=1, tid=1, message_id=4, info=wrong.info,
        body=wrong.body)))  # its header names another message
    (committed / message_name(78)).write_bytes(b"".join(encode_block(
        BlockType.DELETE, sequence=0, count=1, tid=1, message_id=78, info=b"\xc0")))
    with caplog.at_level(logging.WARNING, logger="txbroker.dirstore"):
        store, _, recovered = open_store(tmp_path)
    quarantined = [
        tmp_path / ACTIVE / "notes.txt", tmp_path / PREPARED / "core",
        tmp_path / PREPARED / block_name(0x999, 0), committed / "README", committed / "subdir",
        committed / message_name(50), committed / message_name(2),
        committed / (message_name(3) + ".tmp"), committed / message_name(77),
        committed / message_name(78),
    ]
    assert len(store.report) == len(quarantined), store.report
    for path in quarantined:
        assert any(line.startswith(f"{path}: ") for line in store.report), path
        assert any(str(path) in record.message for record in caplog.records), path
        assert not path.exists()
    assert len(os.listdir(tmp_path / "quarantine")) == len(quarantined)
    # Never loaded: the state is the setup without message 2 (its file was torn).
    want = [e for e in SETUP if e[:2] != add_entry(2, b"two")[:2]]
    assert_same_state(store, recovered, want)
    store.close()
    store, _, _ = open_store(tmp_path)  # moved aside for good
    assert store.report == []
    store.close()


def test_damaged_metadata_is_quarantined(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, SETUP)
    store.close()
    flip_bit(tmp_path / METADATA_FILE, 20)
    store, _, recovered = open_store(tmp_path)
    assert len(store.report) == 1 and "metadata" in store.report[0]
    assert [e.kind for e in recovered] == [Kind.ADD] * 4  # the messages are all there
    store.close()


def test_lock_is_held_against_other_processes(tmp_path: Path) -> None:
    store, _, _ = open_store(tmp_path)
    code = (
        "import sys\nfrom txbroker.storage.dirstore import DirStore\n"
        "from txbroker.errors import StoreLocked\n"
        "try:\n    DirStore(sys.argv[1]).recover()\nexcept StoreLocked as e:\n"
        "    print('LOCKED', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.startswith("LOCKED") and str(tmp_path) in result.stdout, result
    assert f"pid {os.getpid()}" in result.stdout and "cannot be shared" in result.stdout
    store.close()


# -- metadata: duplicate ids and message ids across restarts -------------------------------


def test_duplicate_ids_of_consumed_messages_survive(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, [queue_put("q0"), add_entry(1, b"a", client_id="gone-soon")])
    append_all(store, loop, [kind_entry(Kind.ACK, [1])])
    saved = records.unpack(decode_block((tmp_path / METADATA_FILE).read_bytes()).info)  # type: ignore[union-attr]
    assert saved["dups"] == {"q0": ["gone-soon"]}  # written with the first message
    append_all(store, loop, [add_entry(2, b"b", client_id="later"), kind_entry(Kind.ACK, [2])])
    monkeypatch.setattr(dirstore, "METADATA_REFRESH_SECONDS", 0.0)
    assert store.maintain() is None
    store.flush()
    saved = records.unpack(decode_block((tmp_path / METADATA_FILE).read_bytes()).info)  # type: ignore[union-attr]
    assert saved["dups"] == {"q0": ["gone-soon", "later"]}
    store.close()
    store, _, recovered = open_store(tmp_path)
    state = broker_state(recovered, store.read_body, store.body_size)
    assert state.queues["q0"][2] == ["gone-soon", "later"] and state.messages == []
    assert state.next_id > 2
    store.close()


def test_message_ids_are_never_reused_after_a_crash(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, [add_entry(n, b"x") for n in range(1, 6)])
    append_all(store, loop, [kind_entry(Kind.ACK, [1, 2, 3, 4, 5])])
    kill_at(store, "write_file", 0)  # nothing more reaches the disk
    store.close()
    store, _, recovered = open_store(tmp_path)
    assert broker_state(recovered, store.read_body, store.body_size).next_id > 5
    store.close()


def test_same_broker_state_as_the_journal(tmp_path: Path) -> None:
    entries = broker_entries(300, seed=11)
    states = []
    for store in (JournalStore(tmp_path / "journal", sync="none"), DirStore(tmp_path / "dir")):
        loop = Loop()
        store._dispatch = loop.dispatch  # type: ignore[attr-defined]
        recover(store)
        append_all(store, loop, entries)
        store.close()
        again = type(store)(store.directory)  # type: ignore[attr-defined]
        recovered = recover(again)
        states.append(broker_state(recovered, again.read_body, again.body_size))
        again.close()
    journal, dir_store = states
    assert (dir_store.queues, dir_store.topics, dir_store.messages) == (
        journal.queues, journal.topics, journal.messages)
    assert dir_store.next_id >= journal.next_id


# -- end to end: the broker on the dir store, killed with SIGKILL --------------------------


def test_broker_on_the_dir_store_survives_kill_9(tmp_path: Path) -> None:
    """tests/server/test_kill9.py's load (sends, transactions, consumers, movers),
    killed with SIGKILL between cycles, against a broker on the dir store."""
    report = kill9.run_cycles(tmp_path, cycles=4, seed=20261123, store="dir")
    check(report)
    # A kill in the middle of a write leaves a torn block in active/ (moved
    # aside when its transaction is rolled back); nothing else is ever damaged.
    quarantined = [path.name for path in (tmp_path / "data").glob("quarantine/*")]
    assert all(name.startswith(f"{ACTIVE}.") for name in quarantined), quarantined


def test_removed_files_are_kept_as_spares_and_written_again(tmp_path: Path) -> None:
    """A removed message file and DELETE block go to DIR/spare/ (not unlinked); a new
    block is written into a spare (same inode), cut to its own length, and only
    then gets its name; the spares mean nothing to recovery."""
    store, loop, _ = open_store(tmp_path, flags="FDATASYNC,DSYNC")
    append_all(store, loop, [queue_put("q0"), add_entry(1, b"a long body" * 50)])
    inode = (tmp_path / COMMITTED / message_name(1)).stat().st_ino
    append_all(store, loop, [kind_entry(Kind.ACK, [1])])
    spares = {(tmp_path / "spare" / n).stat().st_ino for n in os.listdir(tmp_path / "spare")}
    assert len(spares) >= 2 and inode in spares
    append_all(store, loop, [add_entry(2, b"short")])
    assert (tmp_path / COMMITTED / message_name(2)).stat().st_ino in spares
    store.close()
    (tmp_path / "spare" / "not-a-spare-name").write_bytes(b"junk")
    store, _, recovered = open_store(tmp_path)
    assert not store.report
    assert state_of(store, recovered).messages[0][-1] == b"short"  # its length was cut
    store.close()
