"""Deliveries that stay with the session (AMQP's semantics, as RabbitMQ): a
subscription ended with ``keep_unacked`` and a transaction rolled back with
``keep_delivered`` leave their messages unacked deliveries of the session; the
defaults (native, STOMP) give them back to the queue."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from txbroker.core.messages import State
from txbroker.errors import IllegalState


def subscribed(h: Harness, count: int) -> tuple[int, list[int]]:
    """A session subscribed to "q" (sub 7) holding ``count`` unacked deliveries."""
    s = h.session()
    for i in range(count):
        h.send(s, 100 + i, "q", b"m%d" % i)
    h.call("subscribe", s, 7, "q", h.now, prefetch=count)
    tags = [d.tag for d in h.deliveries if d.sub == 7]
    assert len(tags) == count
    return s, tags


def test_unsubscribe_keeping_unacked_lets_them_be_acked_later() -> None:
    h = Harness()
    s, tags = subscribed(h, 5)
    h.call("unsubscribe", s, 7, h.now, keep_unacked=True)
    queue = h.broker.queues["q"]
    assert (queue.ready_count, queue.in_flight, len(queue.consumers)) == (0, 5, 0)
    h.call("ack", s, 0, tags[:3], h.now)
    assert (queue.messages, queue.in_flight) == (2, 2)
    h.call("close_session", s, h.now)  # the last two come back, redelivered
    assert queue.ready_count == 2
    s2 = h.session(2)
    again = [h.receive(s2, 1, "q"), h.receive(s2, 2, "q")]
    assert [d.body for d in again] == [b"m3", b"m4"]
    assert all(d.redelivered for d in again)


def test_unsubscribe_by_default_gives_them_back() -> None:
    h = Harness()
    s, tags = subscribed(h, 3)
    h.call("unsubscribe", s, 7, h.now)
    assert h.broker.queues["q"].ready_count == 3
    with pytest.raises(IllegalState):
        h.call("ack", s, 0, tags[:1], h.now)


def test_kept_deliveries_can_be_nacked_back() -> None:
    h = Harness()
    s, tags = subscribed(h, 2)
    h.call("unsubscribe", s, 7, h.now, keep_unacked=True)
    h.call("nack", s, tags, h.now, requeue=True)
    assert h.broker.queues["q"].ready_count == 2


def test_a_delivery_held_for_its_mark_goes_back_at_once() -> None:
    """A delivery waiting for the delivered mark was never sent: a kept
    unsubscribe gives it back rather than leave it with nobody to ack it."""
    h = Harness(auto_sync=False)
    s = h.session()
    h.send(s, 1, "q", b"first")
    h.sync()
    h.call("subscribe", s, 7, "q", h.now, prefetch=1)
    assert not h.deliveries  # held until the mark is durable
    h.call("unsubscribe", s, 7, h.now, keep_unacked=True)
    h.sync()
    queue = h.broker.queues["q"]
    assert (queue.ready_count, queue.in_flight, h.deliveries) == (1, 0, [])


def test_rollback_keeping_delivered_makes_acked_ones_unacked_again() -> None:
    h = Harness()
    s, tags = subscribed(h, 4)
    tx = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, tags[:2], h.now, tx=tx)
    h.call("nack", s, tags[2:3], h.now, requeue=False, tx=tx)
    queue = h.broker.queues["q"]
    assert queue.in_flight == 1
    h.call("tx_rollback", s, tx, h.now, keep_delivered=True)
    assert (queue.ready_count, queue.in_flight, queue.messages) == (0, 4, 4)
    assert all(h.broker.messages[d.message_id].state is State.DELIVERED
               for d in h.deliveries)
    tx2 = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, tags[:3], h.now, tx=tx2)  # the same tags again
    h.call("tx_commit", s, 9, tx2, h.now)
    assert (queue.messages, queue.in_flight) == (1, 1)
    h.call("ack", s, 0, tags[3:], h.now)
    assert queue.messages == 0
    assert h.crash().broker.queues["q"].messages == 0


def test_rollback_by_default_requeues_the_acked_ones() -> None:
    h = Harness()
    s, tags = subscribed(h, 2)
    h.call("unsubscribe", s, 7, h.now, keep_unacked=True)
    tx = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, tags, h.now, tx=tx)
    h.call("tx_rollback", s, tx, h.now)
    assert h.broker.queues["q"].ready_count == 2
    with pytest.raises(IllegalState):
        h.call("ack", s, 0, tags[:1], h.now)


def test_kept_deliveries_go_with_their_deleted_queue() -> None:
    """A kept delivery (and a receive's) of a queue that is deleted is gone with it:
    forgotten, its body released, and a recreated queue of that name never gets it."""
    h = Harness()
    s, tags = subscribed(h, 2)
    got = h.receive(s, 50, "q")  # none left to receive: the two are delivered
    assert got is None
    h.call("unsubscribe", s, 7, h.now, keep_unacked=True)
    refs = {h.broker.messages[d.message_id].ref for d in h.deliveries}
    h.call("queue_delete", s, 60, "q", h.now)
    assert refs <= h.released
    assert all(d.message_id not in h.broker.messages for d in h.deliveries)
    with pytest.raises(IllegalState):
        h.call("ack", s, 0, tags[:1], h.now)
    h.call("queue_declare", s, 61, "q", h.now)
    h.call("close_session", s, h.now)
    assert h.broker.queues["q"].messages == 0
