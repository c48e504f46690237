"""The recovery checkpoint of a clean shutdown (``core/checkpoint.py``, issue 29): a
restart that replays the checkpoint alone finishes in the state a replay of the whole
log finishes in — every queue's counters, the order and contents of every priority
level, the index's objects, the duplicate windows, the next id — and no checkpoint is
taken while the state holds what one cannot."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.core.harness import Harness, StoreOpener
from tests.core.test_replay_settled import _replay, _state, send_work
from txbroker.core.broker import Broker
from txbroker.core.checkpoint import LAYOUT, REPLAY, REPLAY_LAYOUT, read_checkpoint
from txbroker.core.effects import Release
from txbroker.core.records import (
    CHECKPOINT_KIND,
    Kind,
    MalformedRecord,
    ReplicaAt,
    StoredEntry,
    pack,
    unpack,
)
from txbroker.core.replay_settled import RAW_ORD, RUN_SIZE
from txbroker.core.xa import TMNOFLAGS, TMSUCCESS
from txbroker.errors import CorruptStore
from txbroker.storage.interface import Store
from txbroker.storage.journal import JournalStore
from txbroker.xid import Xid


def _workload(store: StoreOpener | None = None) -> Harness:
    """Every way a message can be alive at a shutdown: plain ones parked (relocated by
    compaction), more than a run of them partly consumed, ones with a client id,
    headers, a priority, a TTL or a delay; out to a consumer unacked, nacked (an
    UPDATE), moved, acked inside a transaction still open, a committed transaction's,
    a committed XA branch's; a purged queue and a deleted one."""
    h = Harness(store=store)
    s = h.session()
    rid = iter(range(1, 1_000_000))
    h.call("queue_declare", s, next(rid), "moved", h.now)
    for number in range(40):
        h.send(s, next(rid), "parked", b"p%d" % number)
    h.call("send_batch", s, next(rid), "big", [b"b"] * (RUN_SIZE + 100), h.now)
    for _ in range(30):  # the first chunk's head moves on
        got = h.receive(s, next(rid), "big")
        h.call("ack", s, next(rid), [got.tag], h.now)
    send_work(h, s, rid)
    for _ in range(4):
        got = h.receive(s, next(rid), "work")
        h.call("ack", s, next(rid), [got.tag], h.now)
    nacked = h.receive(s, next(rid), "work")
    h.call("nack", s, [nacked.tag], h.now)
    h.receive(s, next(rid), "parked")  # out to a consumer, never acked
    h.call("queue_move", s, next(rid), "parked", "moved", 3, h.now)
    tx = h.call("tx_begin", s)["tx"]
    h.send(s, next(rid), "work", b"in tx", tx=tx)
    in_tx = h.receive(s, next(rid), "work")
    h.call("ack", s, next(rid), [in_tx.tag], h.now, tx=tx)
    h.call("tx_commit", s, next(rid), tx, h.now)
    open_tx = h.call("tx_begin", s)["tx"]
    held = h.receive(s, next(rid), "parked")
    h.call("ack", s, next(rid), [held.tag], h.now, tx=open_tx)  # HELD: not in the log
    xid = str(Xid(0, "committed", "b"))
    h.call("xa_start", s, xid, TMNOFLAGS, h.now)
    consumed = h.receive(s, next(rid), "parked")
    h.call("ack", s, next(rid), [consumed.tag], h.now)
    h.send(s, next(rid), "parked", b"xa")
    h.call("xa_end", s, xid, TMSUCCESS, h.now)
    h.call("xa_prepare", s, next(rid), xid, h.now)
    h.call("xa_commit", s, next(rid), xid, False, h.now)
    for number in range(5):
        h.send(s, next(rid), "gone", b"g%d" % number)
        h.send(s, next(rid), "purged", b"u%d" % number)
    h.call("queue_delete", s, next(rid), "gone", h.now)
    h.call("queue_purge", s, next(rid), "purged", h.now)
    entries = [StoredEntry(k, m, tuple(r)) for k, m, r in h.log]
    for message_id, ref in h.broker.live_refs(entries):
        h.call("relocate_many", [(message_id, ref)], [h.read_body(ref)])
    for number in range(10):  # after the relocations
        h.send(s, next(rid), "parked", b"late%d" % number)
    h.sync()
    return h


def _from_checkpoint(h: Harness, meta: bytes) -> Broker:
    broker = Broker()
    broker.body_size_of = lambda ref: len(h.bodies[ref])
    broker.replay(StoredEntry(CHECKPOINT_KIND, meta, ()))
    broker.finish_recovery(h.now)
    return broker


def _dups(broker: Broker) -> dict[str, list[str]]:
    return {name: sorted(queue.dups) for name, queue in broker.queues.items()}


def _comparable(broker: Broker) -> dict[str, Any]:
    """``_state`` but the log order across queues (ordinals: a checkpoint numbers its
    messages level by level, a replay in log order; within a level both are the queue
    order, which the levels' ids show) and ``next_seq`` (:func:`_next_seqs`)."""
    state = _state(broker)
    del state["restored"], state["object order"]
    for name, (messages, size, _, *rest) in list(state["queues"].items()):
        levels = [[item[:8] + item[9:] if item[0] == "chunk" else item for item in level]
                  for level in rest[5]]
        state["queues"][name] = (messages, size, *rest[:5], levels, *rest[6:])
    return state


def _next_seqs(broker: Broker) -> dict[str, int]:
    return {name: queue.next_seq for name, queue in broker.queues.items()}


def test_a_checkpoint_finishes_as_the_replay_of_its_log() -> None:
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None and taken[0] == CHECKPOINT_KIND
    warm = _from_checkpoint(h, taken[1])
    cold, _ = _replay(h.log, h.bodies, h.now, None)
    assert _comparable(warm) == _comparable(cold)
    assert _dups(warm) == _dups(cold)
    # the live next seqs: a replay finds them in the snapshots of the journal's rolls
    # (none in this log) or after the last message (the purged queue has none left)
    assert _next_seqs(warm) == _next_seqs(h.broker)
    assert _next_seqs(cold) == {**_next_seqs(h.broker), "purged": 1}
    assert warm.take_effects() == []  # nothing released: the log's releases are done
    # the scenario is what it says
    state = _state(cold)
    assert state["queues"]["big"][0] == RUN_SIZE + 100 - 30
    assert "gone" not in state["queues"] and state["queues"]["purged"][0] == 0
    assert state["queues"]["moved"][0] == 3
    assert state["compact"] > RUN_SIZE


class _Journal(StoreOpener):
    """The journal, keeping checkpoints or not."""

    def __init__(self, directory: Path, checkpoints: bool) -> None:
        super().__init__("journal", directory)
        self.checkpoints = checkpoints

    def __call__(self) -> Store:
        store = JournalStore(self.directory, checkpoints=self.checkpoints)
        self.opened.append(store)
        return store


def test_a_journal_closed_with_its_checkpoint_restarts_as_its_replay(tmp_path: Path) -> None:
    """Over a real journal (its refs are wider than 64 bits): close with the checkpoint,
    restart from it; a copy without it replays the log — the same state."""
    opener = _Journal(tmp_path / "data", checkpoints=True)
    cold_opener = _Journal(tmp_path / "copy", checkpoints=True)
    try:
        h = _workload(opener)
        taken = h.broker.checkpoint()
        assert taken is not None and h.durable_store is not None
        store = h.durable_store
        assert isinstance(store, JournalStore)
        store.close(checkpoint=(*taken, store.appends))
        shutil.copytree(tmp_path / "data", tmp_path / "copy")
        (tmp_path / "copy" / "journal" / "checkpoint").unlink()
        warm = Harness(store=opener)
        assert isinstance(warm.durable_store, JournalStore)
        assert warm.durable_store.stats().recovered_from_checkpoint
        warm.broker.finish_recovery(h.now)
        cold = Harness(store=cold_opener)
        cold.broker.finish_recovery(h.now)
        assert warm.broker.queues["big"].messages == RUN_SIZE + 100 - 30
        assert _comparable(warm.broker) == _comparable(cold.broker)
        assert _dups(warm.broker) == _dups(cold.broker)
    finally:
        opener.close()
        cold_opener.close()


def test_the_runs_hold_the_plain_messages_and_the_lists_the_rest() -> None:
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None
    _, runs, msgs = read_checkpoint(unpack(taken[1]))
    settled = sum(len(run.ids) for run in runs)
    assert settled >= RUN_SIZE + 100 - 30 + 3
    assert len(runs) >= 2  # big's messages span two chunks, one run each
    # work's level 4 has objects (a client id first): its later plain ones are lists
    assert {msg[1] for msg in msgs} >= {"work"}
    assert settled + len(msgs) == len(_replay(h.log, h.bodies, h.now, None)[0].messages)


def test_a_restart_from_a_checkpoint_goes_on_as_the_replayed_one() -> None:
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None
    warm = _from_checkpoint(h, taken[1])
    cold, _ = _replay(h.log, h.bodies, h.now, None)
    for broker in (warm, cold):
        broker.set_now(h.now + 10_000)  # the delay is over, the TTL not
        broker.tick(h.now + 10_000)
    assert _comparable(warm) == _comparable(cold)


@pytest.mark.parametrize("case", ["prepared branch", "deleting", "not durable", "replaying"])
def test_no_checkpoint_while_the_state_holds_what_one_cannot(case: str) -> None:
    h = Harness(auto_sync=case != "not durable", auto_continue=case != "deleting")
    s = h.session()
    h.call("send_batch", s, 1, "q", [b"x"] * 20_000, h.now)
    if case == "not durable":
        h.auto_sync = False
        h.send(s, 2, "q", b"pending")
    elif case == "deleting":
        h.sync()
        h.call("queue_delete", s, 2, "q", h.now)  # dropped a slice per turn: not done
    elif case == "prepared branch":
        xid = str(Xid(0, "g", "b"))
        h.call("xa_start", s, xid, TMNOFLAGS, h.now)
        h.send(s, 2, "q", b"xa")
        h.call("xa_end", s, xid, TMSUCCESS, h.now)
        h.call("xa_prepare", s, 3, xid, h.now)
    broker = h.broker
    if case == "replaying":
        broker = Broker()
        broker.body_size_of = lambda ref: len(h.bodies[ref])
        for kind, meta, refs in h.log:
            broker.replay(StoredEntry(kind, meta, tuple(refs)))
    assert broker.checkpoint() is None
    if case == "replaying":
        broker.finish_recovery(h.now)
        assert broker.checkpoint() is not None  # finished: it can


def test_a_checkpoint_after_other_entries_is_corrupt() -> None:
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None
    broker = Broker()
    broker.body_size_of = lambda ref: len(h.bodies[ref])
    for kind, meta, refs in h.log[:5]:
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
    with pytest.raises(CorruptStore, match="follows other entries"):
        broker.replay(StoredEntry(CHECKPOINT_KIND, taken[1], ()))


@pytest.mark.parametrize("edit", [
    lambda v: v.update(v=2), lambda v: v.update(runs={}),
    lambda v: v["runs"][0].pop(), lambda v: v["runs"][0].__setitem__(3, b"\x01"),
    lambda v: v.update(layout="x8"), lambda v: v["msgs"].append([1, "q"]),
    lambda v: v["msgs"].append([*v["msgs"][0][:10], "ref"]), lambda v: v.pop("snapshot"),
])
def test_a_malformed_checkpoint_is_refused(edit: Any) -> None:
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None
    value = unpack(taken[1])
    edit(value)
    with pytest.raises(MalformedRecord):
        read_checkpoint(value)


def test_a_checkpoint_of_another_layout_is_converted() -> None:
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None
    value = unpack(taken[1])
    order = "big" if LAYOUT[0] == "l" else "little"
    sizes = [int(size) for size in LAYOUT[1:]]
    signed = [True, True, False, False, False, True, False]
    for run in value["runs"]:
        for at in range(7):
            data, size = run[2 + at], sizes[at]
            numbers = [int.from_bytes(data[i:i + size], "little" if order == "big" else "big",
                                      signed=signed[at]) for i in range(0, len(data), size)]
            run[2 + at] = b"".join(n.to_bytes(size, order, signed=signed[at]) for n in numbers)
    value["layout"] = order[0] + LAYOUT[1:]
    warm = _from_checkpoint(h, pack(value))
    assert _state(warm) == _state(_from_checkpoint(h, taken[1]))
    assert warm.queues["big"].messages == RUN_SIZE + 100 - 30


def test_a_checkpoint_with_wider_columns_is_converted() -> None:
    """A checkpoint written before the ``ref_lo`` and ``sizes`` columns were 4 bytes
    (8-byte ``L`` columns on Linux) loads into the same state."""
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None
    value = unpack(taken[1])
    order: Literal["big", "little"] = "little" if LAYOUT[0] == "l" else "big"
    sizes = [int(size) for size in LAYOUT[1:]]
    assert sizes[3] == sizes[4] == 4
    for run in value["runs"]:
        for at in (3, 4):
            data = run[2 + at]
            numbers = [int.from_bytes(data[i:i + 4], order) for i in range(0, len(data), 4)]
            run[2 + at] = b"".join(number.to_bytes(8, order) for number in numbers)
    value["layout"] = LAYOUT[0] + "".join("8" if at in (3, 4) else str(size)
                                          for at, size in enumerate(sizes))
    warm = _from_checkpoint(h, pack(value))
    assert _state(warm) == _state(_from_checkpoint(h, taken[1]))
    assert warm.queues["big"].messages == RUN_SIZE + 100 - 30


def _after_the_checkpoint(h: Harness) -> None:
    """What a running broker does after a checkpoint: acks of messages it holds (in a
    run, as objects, the one out to a consumer), a nack, the open transaction committed
    (its HELD ack), new sends and a new queue, a move, a relocation of bodies it names,
    a purge, a queue deleted, an XA branch left prepared."""
    s = 2
    h.session(s)
    rid = iter(range(2_000_000, 3_000_000))
    for _ in range(10):
        got = h.receive(s, next(rid), "big")
        h.call("ack", s, next(rid), [got.tag], h.now)
    for _ in range(3):
        got = h.receive(s, next(rid), "work")
        h.call("ack", s, next(rid), [got.tag], h.now)
    nacked = h.receive(s, next(rid), "work")
    h.call("nack", s, [nacked.tag], h.now)
    h.call("send_batch", s, next(rid), "big", [b"n"] * 50, h.now)
    for number in range(5):
        h.send(s, next(rid), "fresh", b"f%d" % number, message_id=f"f{number}")
    h.call("queue_move", s, next(rid), "moved", "fresh", 1, h.now)
    tx = h.call("tx_begin", s)["tx"]
    in_tx = h.receive(s, next(rid), "big")
    h.call("ack", s, next(rid), [in_tx.tag], h.now, tx=tx)
    h.send(s, next(rid), "parked", b"tx after", tx=tx)
    h.call("tx_commit", s, next(rid), tx, h.now)
    xid = str(Xid(0, "after", "b"))
    h.call("xa_start", s, xid, TMNOFLAGS, h.now)
    consumed = h.receive(s, next(rid), "parked")
    h.call("ack", s, next(rid), [consumed.tag], h.now)
    h.send(s, next(rid), "fresh", b"xa after")
    h.call("xa_end", s, xid, TMSUCCESS, h.now)
    h.call("xa_prepare", s, next(rid), xid, h.now)
    entries = [StoredEntry(k, m, tuple(r)) for k, m, r in h.log]
    for message_id, ref in h.broker.live_refs(entries)[:40]:
        h.call("relocate_many", [(message_id, ref)], [h.read_body(ref)])
    for number in range(5):
        h.send(s, next(rid), "doomed", b"d%d" % number)
    h.call("queue_delete", s, next(rid), "doomed", h.now)
    h.call("queue_purge", s, next(rid), "purged", h.now)
    h.sync()


def _released(log: list[Any], bodies: dict[int, bytes], now: int, checkpoint: bytes | None
              ) -> tuple[Broker, Counter[int]]:
    """A restart from ``checkpoint`` (then ``log``) or from ``log`` alone; the refs it
    released."""
    broker = Broker()
    broker.body_size_of = lambda ref: len(bodies[ref])
    if checkpoint is not None:
        broker.replay(StoredEntry(CHECKPOINT_KIND, checkpoint, ()))
    for kind, meta, refs in log:
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
    broker.finish_recovery(now)
    released = Counter(effect.ref for effect in broker.take_effects()
                       if isinstance(effect, Release))
    return broker, released


def test_a_running_checkpoint_and_the_log_after_it_finish_as_the_whole_log() -> None:
    """A checkpoint taken while the broker runs (everything synced and completed, as
    ``server/recovery.py`` takes it), then more work: a restart from the checkpoint
    and the log after it builds the state a replay of the whole log builds, and
    releases exactly the bodies that died after the checkpoint (the journal's
    accounting at the checkpoint holds the releases before it)."""
    h = _workload()
    taken = h.broker.checkpoint()
    assert taken is not None
    mark = len(h.log)
    _after_the_checkpoint(h)
    assert len(h.log) > mark + 20
    warm, released_after = _released(h.log[mark:], h.bodies, h.now, taken[1])
    cold, released_all = _released(h.log, h.bodies, h.now, None)
    _, released_before = _released(h.log[:mark], h.bodies, h.now, None)
    assert _comparable(warm) == _comparable(cold)
    assert _dups(warm) == _dups(cold)
    assert set(warm.branches) == set(cold.branches) != set()
    assert released_after == released_all - released_before
    assert released_after  # (bodies did die after it: the acks, the drops, the moves)
    state = _state(cold)
    assert state["queues"]["big"][0] == RUN_SIZE + 100 - 30 - 10 - 1 + 50
    assert "doomed" not in state["queues"] and state["queues"]["purged"][0] == 0
    assert state["queues"]["fresh"][0] == 6  # 5 sent and 1 moved (the branch's: held)


def _replaying(log: list[Any], bodies: dict[int, bytes], checkpoint: bytes | None = None,
               settle_every: int = 0) -> tuple[Broker, Counter[int]]:
    """A replay not finished (a replicated backup's) of ``log``, after ``checkpoint``;
    the refs it released (a backup releases after every entry)."""
    broker = Broker()
    broker.body_size_of = lambda ref: len(bodies[ref])
    if checkpoint is not None:
        broker.replay(StoredEntry(CHECKPOINT_KIND, checkpoint, ()))
    for number, (kind, meta, refs) in enumerate(log, 1):
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
        if settle_every and number % settle_every == 0:
            broker.settle_replay()
    released = Counter(effect.ref for effect in broker.take_effects()
                       if isinstance(effect, Release))
    return broker, released


def _backup_log() -> tuple[Harness, list[Any]]:
    """A replicated backup's log: the count of the primary's LSNs, then every entry."""
    h = _workload()
    _after_the_checkpoint(h)
    at = ReplicaAt("epoch-1", 100)
    return h, [(at.kind, at.encode(), []), *h.log]


@pytest.mark.parametrize("settle_every", [0, 7])
def test_a_replay_checkpoint_and_the_log_after_it_replay_as_the_whole_log(
        settle_every: int) -> None:
    """A backup's checkpoint (``take_replay_checkpoint``) at every point of its log where
    one can be taken: the replay it restores goes on, over the log after it, as the
    replay of the whole log — the same LSN counted, and once finished (promoted) the
    same state, ordinals included; it releases exactly the bodies that died after it
    (the journal's accounting at the mark holds the releases before it). Where one
    cannot be taken, a prepared XA branch lives."""
    h, log = _backup_log()
    whole, released_all = _replaying(log, h.bodies)
    lsn = whole.replica_at
    assert lsn is not None and lsn.lsn == 100 + sum(
        1 for kind, _, _ in log[1:] if kind != Kind.SNAPSHOT)
    whole.finish_recovery(h.now)
    expected = _state(whole)
    # the workload's own entries, a sample of its relocations (one per message), the
    # work after its checkpoint
    total = len(log)
    cuts = {*range(1, 140, 3), *range(140, total - 80, 211), *range(total - 80, total + 1)}
    before = Broker()  # the backup, replaying on; a checkpoint at every cut
    before.body_size_of = lambda ref: len(h.bodies[ref])
    released_before: Counter[int] = Counter()
    taken_at = []
    for cut, (kind, meta, refs) in enumerate(log, 1):
        before.replay(StoredEntry(kind, meta, tuple(refs)))
        released_before.update(effect.ref for effect in before.take_effects()
                               if isinstance(effect, Release))
        if settle_every and cut % settle_every == 0:
            before.settle_replay()
        if cut not in cuts:
            continue
        taken = before.replay_checkpoint()
        if taken is None:
            assert before.branches
            continue
        taken_at.append(cut)
        after, released_after = _replaying(log[cut:], h.bodies, taken[1])
        assert after.replica_at == lsn, cut
        after.finish_recovery(h.now)
        assert _state(after) == expected, cut
        assert _dups(after) == _dups(whole)
        assert set(after.branches) == set(whole.branches) != set()
        assert released_after == released_all - released_before, cut
    assert 100 <= len(taken_at) < len(cuts)  # (a prepared branch lives in the last ones)


def test_a_replay_checkpoint_keeps_the_replay_it_holds() -> None:
    """What the form holds: the settled runs with their ordinals, the messages left in
    ``raw`` with theirs, the ordinal, the Xids completed, the LSN (in its snapshot)."""
    h, log = _backup_log()
    broker, _ = _replaying(log[:len(log) // 2], h.bodies, settle_every=5)
    part = broker.replay_part
    taken = broker.replay_checkpoint()
    assert taken is not None
    value = unpack(taken[1])
    assert value["form"] == REPLAY and value["layout"] == REPLAY_LAYOUT
    _, runs, msgs = read_checkpoint(value)
    assert sum(len(run.ids) for run in runs) == len(part.settled.at) > RUN_SIZE
    assert [msg[0] for msg in msgs] == list(part.raw) != []
    assert [msg[RAW_ORD] for msg in msgs] == [msg[RAW_ORD] for msg in part.raw.values()]
    assert value["ordinal"] == part.ordinal
    assert value["completed"] == [str(Xid(0, "committed", "b"))]
    restored, _ = _replaying([], h.bodies, taken[1])
    assert restored.replica_at == broker.replica_at is not None
    assert restored.replay_part.completed == part.completed


@pytest.mark.parametrize("edit", [
    lambda v: v.update(form="other"), lambda v: v.pop("ordinal"),
    lambda v: v.update(completed=[1]), lambda v: v["runs"][0].pop(),
    lambda v: v["msgs"][0].pop(), lambda v: v["msgs"][0].__setitem__(11, "ord"),
    lambda v: v.update(ordinal=1),
])
def test_a_malformed_replay_checkpoint_is_refused(edit: Any) -> None:
    h, log = _backup_log()
    broker, _ = _replaying(log[:len(log) // 2], h.bodies, settle_every=5)
    taken = broker.replay_checkpoint()
    assert taken is not None
    value = unpack(taken[1])
    edit(value)
    with pytest.raises(CorruptStore):
        _replaying([], h.bodies, pack(value))
