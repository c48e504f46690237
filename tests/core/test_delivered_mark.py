"""The delivered mark (core/delivered_mark.py): a message delivered and
not acked when the broker died comes back flagged redelivered (seed 004), a delivery
never gets ahead of the durable mark, and a steady stream does not wait for marks."""

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


def test_nothing_delivered_nothing_flagged() -> None:
    h = Harness()
    s = h.session()
    fill(h, s, "q", 5)
    assert marks(h, "q") == [0]  # the definition written when the queue was made
    h = h.crash()
    s = h.session()
    got = [h.receive(s, 10 + i, "q") for i in range(5)]
    assert [(d.redelivered, d.delivery_count) for d in got] == [(False, 1)] * 5


def test_delivered_then_crash_comes_back_flagged() -> None:
    h = Harness()
    s = h.session()
    fill(h, s, "q", 3)
    first = h.receive(s, 1, "q")
    assert (first.body, first.redelivered, first.delivery_count) == (b"m0", False, 1)
    assert marks(h, "q") == [0, 1 + MARK_AHEAD]  # one-shot receive: no free credit
    h = h.crash()
    s = h.session()
    got = [h.receive(s, 10 + i, "q") for i in range(3)]
    assert [(d.body, d.redelivered, d.delivery_count) for d in got] == [
        (b"m0", True, 2), (b"m1", True, 2), (b"m2", True, 2)]  # all three at or below


def test_the_first_delivery_waits_for_its_mark_later_ones_do_not() -> None:
    h = Harness(auto_sync=False)
    s = h.session()
    fill(h, s, "q", MARK_AHEAD + 2)
    assert h.receive(s, 1, "q") is LATER  # held: no durable mark yet
    assert (s, 1) not in h.replies
    h.sync()
    assert h.replies[(s, 1)].body == b"m0"
    assert marks(h, "q")[-1] == 1 + MARK_AHEAD
    h.call("ack", s, 0, [h.replies[(s, 1)].tag], h.now)
    for i in range(2, MARK_AHEAD // 2 + 2):  # seqs 2..mark-half: no record yet
        d = h.receive(s, i, "q")
        assert d is not LATER, i
        h.call("ack", s, 0, [d.tag], h.now)
    h.sync()
    assert marks(h, "q")[-1] == 1 + MARK_AHEAD
    seq = MARK_AHEAD // 2 + 2  # the first seq past the early point
    d = h.receive(s, 9000, "q")  # half-way: the next mark goes out early, no waiting
    assert d.body == b"m%d" % (seq - 1)
    h.sync()
    assert marks(h, "q")[-1] == seq + MARK_AHEAD


def test_a_burst_reaches_past_the_free_credit() -> None:
    """A subscription's prefetch window fills in one dispatch: the first mark covers it."""
    h = Harness(auto_sync=False)
    s = h.session()
    fill(h, s, "q", 600)
    h.call("subscribe", s, 1, "q", h.now, prefetch=500)
    h.sync()
    assert len(h.deliveries) == 500  # all of the window, after one sync
    assert marks(h, "q")[-1] >= 500


def test_held_delivery_of_a_closed_session_is_dropped_and_the_message_returns() -> None:
    h = Harness()
    s = h.session()
    fill(h, s, "q", 1)
    h.auto_sync = False
    count = len(h.deliveries)
    assert h.receive(s, 1, "q") is LATER
    h.call("close_session", s, h.now)
    h.sync()
    assert len(h.deliveries) == count  # never sent to the closed session
    assert (s, 1) not in h.replies
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
    d = h.receive(s, 2, "q")
    assert d.body == b"p" and q.reserving == 0 and q.delivered_seq == 0
