"""The memory store: the contract suite, plus its restart and crash helpers."""

from __future__ import annotations

import errno

import pytest

from txbroker.storage.interface import Dispatch, SnapshotProvider, Store
from txbroker.storage.memory import MemoryState, MemoryStore

from .contract import Damaged, StoreContractTests, StoreFactory, recover
from .support import Completions, Loop


class MemoryCrasher:
    """Crashes of a memory store: entries that never became durable."""

    def __init__(self, factory: MemoryFactory) -> None:
        self.factory = factory

    def tear_last_entry(self, how: str) -> None:
        self.truncate_log(1)

    def truncate_log(self, entries_back: int) -> None:
        del self.factory.state.entries[-entries_back:]

    def corrupt_old_entry(self) -> Damaged:
        raise NotImplementedError("memory is never corrupt")

    def truncate_old_segment(self) -> Damaged:
        raise NotImplementedError("memory has no segments")

    def fail_syncs(self, store: Store) -> None:
        assert isinstance(store, MemoryStore)

        def failing_sync() -> None:
            raise OSError(errno.EIO, "injected sync failure")

        store.sync_step = failing_sync


class MemoryFactory(StoreFactory):
    def __init__(self) -> None:
        self.count = 0
        self.crasher = MemoryCrasher(self)
        self.fresh()

    @property
    def location_name(self) -> str:
        return self.state.name

    def fresh(self) -> None:
        self.count += 1
        self.state = MemoryState(name=f"memory-{self.count}")

    def open(
        self,
        *,
        dispatch: Dispatch | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        repair: bool = False,
        small_segments: bool = False,
    ) -> Store:
        return MemoryStore(
            self.state, dispatch=dispatch, snapshot_provider=snapshot_provider, repair=repair
        )


class TestMemoryContract(StoreContractTests):
    @pytest.fixture
    def factory(self) -> MemoryFactory:
        return MemoryFactory()


def test_inline_dispatch_completes_inside_append() -> None:
    store = MemoryStore()
    recover(store)
    done = Completions()
    store.append(4, b"m", [b"body"], done.callback(0))
    assert done.calls == [(0, None)]
    assert store.stats().syncs == 1
    store.close()


def test_crash_loses_what_was_not_synced_and_reopen_recovers_the_rest() -> None:
    loop = Loop()
    store = MemoryStore(dispatch=loop.dispatch)
    recover(store)
    done = Completions()
    store.append(4, b"durable", [b"d"], done.callback(0))
    loop.run_until(lambda: len(done) == 1)
    [lost_ref] = store.append(4, b"lost", [b"l"], done.callback(1))
    store.crash()
    loop.run_pending()
    assert done.calls == [(0, None)]  # the crash came before the second sync
    again = store.reopen()
    entries = recover(again)
    assert [(e.meta, [again.read_body(r) for r in e.refs]) for e in entries] == [
        (b"durable", [b"d"])
    ]
    with pytest.raises(KeyError):
        again.read_body(lost_ref)
    again.close()


def test_maintain_reclaims_released_bodies() -> None:
    store = MemoryStore()
    recover(store)
    [[a], [b]] = [store.append(4, b"m", [bytes(1000)], lambda e: None) for _ in range(2)]
    before = store.stats().disk_bytes
    store.release(a)
    assert store.maintain() is None
    assert store.stats().disk_bytes == before - 1000
    assert store.body_size(a) == 1000  # sizes stay known for replay
    with pytest.raises(KeyError):
        store.read_body(a)
    assert store.read_body(b) == bytes(1000)
    store.close()


def _released_while_its_ack_is_unsynced() -> tuple[Loop, MemoryStore, Completions, int]:
    """A store with a synced message whose body was released while the entry that
    killed it (its ack) still waits for its sync."""
    loop = Loop()
    store = MemoryStore(dispatch=loop.dispatch)
    recover(store)
    done = Completions()
    [body] = store.append(4, b"message", [b"payload"], done.callback(0))
    loop.run_until(lambda: len(done) == 1)
    store.append(5, b"its ack", [], done.callback(1))  # not synced yet
    store.release(body)  # what replaying the ack found dead
    return loop, store, done, body


def test_a_body_released_while_entries_are_unsynced_survives_their_crash() -> None:
    """As the journal deletes a dead segment only after syncing what was queued before
    it: a body released while entries wait for their sync (a backup releases the
    bodies an applied entry killed before that entry is on its disk) is reclaimed only
    once they are synced. Before, ``maintain`` dropped it at once; a crash then lost the
    killing entry, replay brought the message back and its body was gone
    (``replicated-etcd-live`` seed 57870: "body ref 52 does not exist")."""
    _, store, _, body = _released_while_its_ack_is_unsynced()
    store.maintain()
    assert store.read_body(body) == b"payload"  # kept: the ack may never reach the disk
    store.crash()
    again = store.reopen()
    assert [e.meta for e in recover(again)] == [b"message"]
    assert again.read_body(body) == b"payload"  # the message is back, with its body
    again.release(body)  # nothing unsynced now: reclaimed at the next maintain
    again.maintain()
    with pytest.raises(KeyError):
        again.read_body(body)
    again.close()


def test_a_body_released_before_a_sync_is_reclaimed_after_it() -> None:
    loop, store, done, body = _released_while_its_ack_is_unsynced()
    loop.run_until(lambda: len(done) == 2)  # the ack is synced
    store.maintain()
    with pytest.raises(KeyError):
        store.read_body(body)
    store.close()


def test_a_checkpoint_then_the_log_after_it() -> None:
    """``checkpoints=True`` (the simulator's broker with ``recovery_checkpoint``): a
    checkpoint kept at a mark is handed back by the next recovery, then the entries
    after the mark, with the bodies live at the mark and after it; it serves one
    recovery; one whose mark lies past the log (a lying disk lost entries) is not used."""
    state = MemoryState()
    store = MemoryStore(state, checkpoints=True)
    recover(store)
    refs = [store.append(4, b"m%d" % n, [b"b%d" % n], lambda error: None) for n in range(4)]
    store.release(refs[0][0])
    store.flush()
    store.maintain()
    mark = store.checkpoint_mark(store.appends)
    assert mark is not None and store.checkpoint_mark(store.appends - 1) is None
    assert store.write_checkpoint(mark, 19, b"state")
    store.append(4, b"after", [b"a"], lambda error: None)
    store.release(refs[1][0])  # after the mark: the replay of "after" releases it again
    store.flush()
    store.crash()
    again = MemoryStore(state, checkpoints=True)
    assert [(e.kind, e.meta) for e in recover(again)] == [(19, b"state"), (4, b"after")]
    stats = again.stats()
    assert stats.recovered_from_checkpoint and stats.recovered_entries == 2
    assert stats.live_bodies == 3 + 1  # live at the mark, and the one after it
    again.crash()
    third = MemoryStore(state, checkpoints=True)  # it served one recovery
    assert len(recover(third)) == 5 and not third.stats().recovered_from_checkpoint
    third.write_checkpoint(mark, 19, b"state")
    del state.entries[2:]  # (a lying disk: the log is shorter than the mark)
    third.crash()
    fourth = MemoryStore(state, checkpoints=True)
    assert [e.meta for e in recover(fourth)] == [b"m0", b"m1"]
