"""Settling replayed messages ahead of the finish (``core/replay_settled.py``, the warm
standby's takeover, issue 29): whatever the moments a replay settles at, the finished
state is the one of a replay that never settled — every queue's counters, the order
and contents of every priority level (chunk by chunk), the index's objects, the
log order (ordinals, by rank), the XA branches and every body released exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from tests.core.harness import Harness
from txbroker.core.broker import Broker
from txbroker.core.effects import Release
from txbroker.core.messages import CHUNK_SIZE, Chunk, Message
from txbroker.core.records import Kind, StoredEntry
from txbroker.core.replay_settled import RUN_SIZE
from txbroker.core.xa import TMNOFLAGS, TMSUCCESS
from txbroker.xid import Xid

Log = list[tuple[int, bytes, list[int]]]


def send_work(h: Harness, s: int, rid: Iterator[int]) -> None:
    """30 messages to ``work``: some with a client id, headers, a priority, one with a
    TTL, one with a delay, the rest plain."""
    for number in range(30):
        kw: dict[str, Any] = {}
        if number % 5 == 1:
            kw["message_id"] = f"m{number}"
        if number % 7 == 2:
            kw["headers"] = {"h": "v"}
        if number % 4 == 3:
            kw["priority"] = 7
        if number == 9:
            kw["ttl_ms"] = 60_000
        if number == 11:
            kw["delay_ms"] = 5_000
        h.send(s, next(rid), "work", b"w%d" % number, **kw)


def _journal() -> tuple[Log, dict[int, bytes], int]:
    """A log with every kind of record that touches a replayed message: parked
    plain messages (relocated by compaction twice), consumed and acked ones, nacked
    (an UPDATE of the delivery count), moved ones, ones with a client id, headers, a
    priority, a TTL or a delay, a transaction (sends and acks), XA branches prepared
    (consuming and sending) and committed, a deleted queue."""
    h = Harness()
    s = h.session()
    rid = iter(range(1, 100_000))
    h.call("queue_declare", s, next(rid), "moved", h.now)
    for number in range(40):
        h.send(s, next(rid), "parked", b"p%d" % number)
    send_work(h, s, rid)
    for _ in range(6):  # consumed and acked
        got = h.receive(s, next(rid), "work")
        h.call("ack", s, next(rid), [got.tag], h.now)
    nacked = h.receive(s, next(rid), "work")
    h.call("nack", s, [nacked.tag], h.now)  # its delivery count: an UPDATE
    for number in range(5):
        h.send(s, next(rid), "plain", b"n%d" % number)
    h.call("queue_move", s, next(rid), "parked", "moved", 3, h.now)  # the head of parked
    tx = h.call("tx_begin", s)["tx"]
    h.send(s, next(rid), "work", b"in tx", tx=tx)
    in_tx = h.receive(s, next(rid), "work")
    h.call("ack", s, next(rid), [in_tx.tag], h.now, tx=tx)
    h.call("tx_commit", s, next(rid), tx, h.now)
    for name, commit in (("prepared", False), ("committed", True)):
        xid = str(Xid(0, name, "b"))
        h.call("xa_start", s, xid, TMNOFLAGS, h.now)
        consumed = h.receive(s, next(rid), "parked")
        h.call("ack", s, next(rid), [consumed.tag], h.now)
        h.send(s, next(rid), "parked", b"xa " + name.encode())
        h.call("xa_end", s, xid, TMSUCCESS, h.now)
        h.call("xa_prepare", s, next(rid), xid, h.now)
        if commit:
            h.call("xa_commit", s, next(rid), xid, False, h.now)
    for number in range(5):
        h.send(s, next(rid), "gone", b"g%d" % number)
    h.call("queue_delete", s, next(rid), "gone", h.now)
    for _ in range(2):  # compaction relocates what is live, twice
        entries = [StoredEntry(k, m, tuple(r)) for k, m, r in h.log]
        for message_id, ref in h.broker.live_refs(entries):
            h.call("relocate_many", [(message_id, ref)], [h.bodies[ref]])
    for _ in range(2):  # (of a message that settled, at times; after the relocations)
        nacked = h.receive(s, next(rid), "plain")
        h.call("nack", s, [nacked.tag], h.now)
    for number in range(10):  # later sends to the parked queue (after settled ones)
        h.send(s, next(rid), "parked", b"late%d" % number)
    h.call("queue_move", s, next(rid), "parked", "moved", 2, h.now)
    return h.log, h.bodies, h.now


def _replay(log: Log, bodies: dict[int, bytes], now: int, settle_every: int | None
            ) -> tuple[Broker, Counter[int]]:
    broker = Broker()
    broker.body_size_of = lambda ref: len(bodies[ref])
    released: Counter[int] = Counter()
    for number, (kind, meta, refs) in enumerate(log, 1):
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
        if settle_every and number % settle_every == 0:
            broker.settle_replay()
    broker.finish_recovery(now)
    for effect in broker.take_effects():
        if isinstance(effect, Release):
            released[effect.ref] += 1
    return broker, released


def _message(message: Message) -> tuple[Any, ...]:
    return (message.id, message.queue, message.size, message.message_id, message.headers,
            message.priority, message.timestamp_ms, message.expires_ms,
            message.deliver_at_ms, message.delivery_count, message.ref, message.seq,
            message.state)


def _state(broker: Broker) -> dict[str, Any]:
    """Everything the finish built, ordinals replaced by their rank."""
    home = broker.index.messages
    ords = sorted({*home.restored.values(),
                   *(o for chunk in home.chunks() for o in chunk.ords)})
    rank = {o: number for number, o in enumerate(ords)}
    queues: dict[str, Any] = {}
    for name, queue in broker.queues.items():
        levels = []
        for level in queue._ready:
            items: list[Any] = []
            for item in level:
                if isinstance(item, Chunk):
                    items.append(("chunk", list(item.ids), list(item.seqs), list(item.ref_hi),
                                  list(item.ref_lo), list(item.sizes), list(item.stamps),
                                  list(item.counts), [rank[o] for o in item.ords],
                                  bytes(item.marks), item.head, item.live))
                else:
                    items.append(("message", item.id))
            levels.append(items)
        queues[name] = (queue.messages, queue.bytes, queue.next_seq, queue.delivered_seq,
                        queue.expiring, queue.ready_count, queue.pending, queue.pending_bytes,
                        levels, queue.scheduled_count)
    return {"queue order": list(broker.queues), "queues": queues,
            "objects": {i: _message(m) for i, m in home.objects.items()},
            "object order": list(home.objects),
            "restored": {i: rank[o] for i, o in home.restored.items()},
            "compact": home.compact, "next id": broker.index.next_id,
            "branches": {str(x): (b.state, [_message(m) for m in b.work.sends],
                                  sorted(b.work.acks)) for x, b in broker.xa.branches.items()}}


@pytest.mark.parametrize("settle_every", [1, 2, 7, 25, 60])
def test_a_settled_replay_finishes_as_one_that_never_settled(settle_every: int) -> None:
    log, bodies, now = _journal()
    cold, cold_released = _replay(log, bodies, now, None)
    warm, warm_released = _replay(log, bodies, now, settle_every)
    assert _state(warm) == _state(cold)
    assert warm_released == cold_released
    assert set(warm_released.values()) == {1}  # each body released once
    # the scenario is what it says: the work the finish did is not trivial
    state = _state(cold)
    # 40, 3 moved, 1 consumed by the committed branch (the prepared one's is held, still
    # counted), 1 sent by the committed branch, 10 late, 2 moved
    assert state["queues"]["parked"][0] == 40 - 3 - 1 + 1 + 10 - 2
    assert state["queues"]["moved"][0] == 5
    assert state["objects"] == {} or all(o[1] != "plain" for o in state["objects"].values())
    assert state["queues"]["plain"][8][4][0][7][0] == 2  # (counted by the UPDATEs)
    assert "gone" not in state["queues"]
    assert len(state["branches"]) == 1
    assert state["compact"] > 40


def test_settling_takes_the_compact_messages_out_of_the_walk() -> None:
    log, bodies, now = _journal()
    broker = Broker()
    broker.body_size_of = lambda ref: len(bodies[ref])
    for kind, meta, refs in log:
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
    before = broker.replay_backlog()
    left = broker.settle_replay()
    assert left == broker.replay_backlog()
    # what stays: the messages of a level behind the first object in it (work's
    # levels: a client id, headers, a TTL or a delay) and the moved ones behind
    # nothing settled; parked's plain messages all settle
    assert before - left >= 40
    assert left < before / 2
    broker.finish_recovery(now)


def test_a_move_into_a_settled_level_brings_the_level_back_in_order() -> None:
    h = Harness()
    s = h.session()
    for number in range(6):
        h.send(s, number + 1, "a", b"a%d" % number)
    h.send(s, 10, "b", b"b-early")
    broker = Broker()
    broker.body_size_of = lambda ref: len(h.bodies[ref])
    for kind, meta, refs in h.log:
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
    assert broker.settle_replay() == 0
    mark = len(h.log)
    h.send(s, 11, "b", b"b-late")
    h.call("queue_move", s, 12, "a", "b", 2, h.now)  # older than b's settled ones
    for kind, meta, refs in h.log[mark:]:
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
    broker.finish_recovery(h.now)
    cold, _ = _replay(h.log, h.bodies, h.now, None)
    assert _state(broker) == _state(cold)
    ids = [i for chunk in broker.queues["b"]._ready[4] for i in chunk.ids]  # type: ignore[union-attr]
    assert ids == sorted(ids) and len(ids) == 4  # the moved ones first (log order)


def test_runs_are_cut_at_run_size() -> None:
    h = Harness()
    s = h.session()
    h.call("send_batch", s, 1, "q", [b"x"] * (RUN_SIZE + 10), h.now)
    broker = Broker()
    broker.body_size_of = lambda ref: len(h.bodies[ref])
    for kind, meta, refs in h.log:
        assert kind in (Kind.TX, Kind.ADD, Kind.QUEUE_PUT, Kind.SNAPSHOT)
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
    assert broker.settle_replay() == 0
    runs = broker.replay_part.settled.levels[("q", 4)]
    assert [len(run.ids) for run in runs] == [RUN_SIZE, 10]
    mark = len(h.log)
    for number in range(5):  # taken out of the first run: the chunks are cut elsewhere
        got = h.receive(s, 10 + number, "q")
        h.call("ack", s, 20 + number, [got.tag], h.now)
    for kind, meta, refs in h.log[mark:]:
        broker.replay(StoredEntry(kind, meta, tuple(refs)))
    broker.finish_recovery(h.now)
    cold, _ = _replay(h.log, h.bodies, h.now, None)
    assert _state(broker) == _state(cold)
    chunks = broker.queues["q"]._ready[4]
    assert [len(chunk.ids) for chunk in chunks] == [CHUNK_SIZE, RUN_SIZE + 5 - CHUNK_SIZE]  # type: ignore[union-attr]
    assert broker.queues["q"].messages == RUN_SIZE + 5
