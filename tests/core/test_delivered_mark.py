"""The delivered mark (core/queue_index.py, "Delivered mark"): a message delivered and
not acked when the broker died comes back flagged redelivered (seed 004), and a
delivery never gets ahead of the durable mark."""

from __future__ import annotations

import msgpack

from tests.core.harness import Harness
from txbroker.core import LATER
from txbroker.core.queues import MARK_AHEAD
from txbroker.core.records import Kind


def marks(h: Harness, queue: str) -> list[int]:
    """The delivered marks in the durable log's QUEUE_PUT records of ``queue``."""
    found = []
    for kind, meta, _ in h.log:
        if kind == Kind.QUEUE_PUT:
            definition = msgpack.unpackb(meta)
            if definition["name"] == queue:
                found.append(definition["delivered_seq"])
    return found


def fill(h: Harness, sid: int, queue: str, count: int) -> None:
    for i in range(count):
        h.send(sid, 0, queue, b"m%d" % i)
    h.sync()


def test_delivered_then_crash_comes_back_flagged() -> None:
    h = Harness()
    s = h.session()
    fill(h, s, "q", 3)
    first = h.receive(s, 1, "q")
    assert (first.body, first.redelivered, first.delivery_count) == (b"m0", False, 1)
    assert marks(h, "q") == [MARK_AHEAD]  # written with the queue's first definition
    h = h.crash()
    s = h.session()
    got = [h.receive(s, 10 + i, "q") for i in range(3)]
    assert [(d.body, d.redelivered, d.delivery_count) for d in got] == [
        (b"m0", True, 2), (b"m1", True, 2), (b"m2", True, 2)]  # all three at or below


def test_beyond_the_mark_a_delivery_waits_for_the_next_mark() -> None:
    h = Harness()
    s = h.session()
    fill(h, s, "q", MARK_AHEAD + 2)
    for i in range(MARK_AHEAD // 2):  # well below the mark: no record
        d = h.receive(s, 1 + i, "q")
        h.call("ack", s, 0, [d.tag], h.now)
    h.sync()
    assert marks(h, "q") == [MARK_AHEAD]
    h.auto_sync = False
    d = h.receive(s, 5000, "q")  # half-way: the next mark goes out early, no waiting
    assert d.body == b"m%d" % (MARK_AHEAD // 2)
    h.sync()
    assert marks(h, "q") == [MARK_AHEAD, MARK_AHEAD // 2 + 1 + MARK_AHEAD]
    h.auto_sync = True


def test_held_delivery_is_sent_only_when_the_mark_is_durable() -> None:
    h = Harness()
    s = h.session()
    fill(h, s, "q", 3)
    h = h.crash()  # replay: the log's mark (MARK_AHEAD) covers seqs 1..3
    h.auto_sync = False
    s = h.session()
    fill_more = [h.send(s, 100 + i, "q", b"x") for i in range(2)]
    assert fill_more == [LATER, LATER]
    h.sync()
    q = h.broker.queues["q"]
    q.delivered_seq = 3  # as if the last mark covered exactly the old messages
    for i in range(3):
        d = h.receive(s, 200 + i, "q")
        h.call("ack", s, 0, [d.tag], h.now)
    assert h.receive(s, 300, "q") is LATER  # seq 4 > mark 3: held
    assert q.reserving == 1 + MARK_AHEAD  # written early, at seq 1 (half-way past 3)
    assert (s, 300) not in h.replies
    h.sync()  # the mark is durable: the delivery goes out
    assert h.replies[(s, 300)].body == b"x"
    assert q.delivered_seq == 1 + MARK_AHEAD and q.reserving == 0


def test_held_delivery_of_a_closed_session_is_dropped_and_the_message_returns() -> None:
    h = Harness()
    s = h.session()
    fill(h, s, "q", 1)
    h.broker.queues["q"].delivered_seq = 0
    h.auto_sync = False
    count = len(h.deliveries)
    assert h.receive(s, 1, "q") is LATER
    h.call("close_session", s, h.now)
    h.sync()
    assert len(h.deliveries) == count  # never sent to the closed session
    h.auto_sync = True
    s2 = h.session(2)
    d = h.receive(s2, 2, "q")
    assert (d.body, d.redelivered) == (b"m0", True)  # it may have left: flagged


def test_auto_ack_and_non_persistent_take_no_mark() -> None:
    h = Harness(auto_sync=False)
    s = h.session()
    h.send(s, 1, "q", b"p", persistent=False)
    h.sync()
    q = h.broker.queues["q"]
    q.delivered_seq = 0
    d = h.receive(s, 2, "q")
    assert d.body == b"p" and q.reserving == 0
