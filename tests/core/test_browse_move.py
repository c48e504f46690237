"""Browse and move (a DLQ's re-drive) in the core: order, what stays, replay."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from txbroker.errors import BadRequest, NotFound


def test_browse_is_delivery_order_and_takes_nothing() -> None:
    h = Harness()
    s = h.session()
    h.send(s, 1, "q", b"p4-first")
    h.send(s, 2, "q", b"p9", priority=9)
    h.send(s, 3, "q", b"later", delay_ms=60_000)
    h.send(s, 4, "q", b"p4-second")
    browsed = h.broker.queue_browse("q", 10)
    assert [m.priority for m in browsed] == [9, 4, 4, 4]
    assert [m.deliver_at_ms > 0 for m in browsed] == [False, False, False, True]
    assert [m.id for m in h.broker.queue_browse("q", 2)] == [m.id for m in browsed[:2]]
    assert h.broker.queues["q"].ready_count == 3
    delivered = h.receive(s, 5, "q")
    assert delivered.body == b"p9"
    assert len(h.broker.queue_browse("q", 10)) == 3  # in flight: not browsed
    with pytest.raises(BadRequest):
        h.broker.queue_browse("q", 0)
    with pytest.raises(NotFound):
        h.broker.queue_browse("nope", 1)


def test_move_redrives_to_the_origin_and_survives_a_restart() -> None:
    h = Harness()
    s = h.session()
    h.call("queue_declare", s, 1, "work", h.now,
           settings={"max_deliveries": 1, "dead_letter_queue": "dlq"})
    h.call("queue_declare", s, 2, "dlq", h.now)
    for rid, body in ((3, b"a"), (4, b"b"), (5, b"c")):
        h.send(s, rid, "work", body)
    for rid in (6, 7):
        d = h.receive(s, rid, "work")
        h.call("nack", s, [d.tag], h.now)
    assert h.broker.queues["dlq"].messages == 2
    assert h.broker.queues["work"].dead_lettered == 2
    h.call("queue_move", s, 8, "dlq", None, 10, h.now)
    assert h.replies[(s, 8)] == {"moved": 2, "to": "work"}
    work = h.broker.queues["work"]
    assert (work.ready_count, h.broker.queues["dlq"].ready_count) == (3, 0)
    assert (work.enqueued, h.broker.queues["dlq"].enqueued) == (5, 2)
    h2 = h.crash()
    # live, moved messages queue behind "c"; replay rebuilds a queue in id order (as
    # for dead-lettered messages): the same messages, "a" and "b" first again
    assert [m.id for m in h.broker.queue_browse("work", 10)] == [3, 1, 2]
    assert [m.id for m in h2.broker.queue_browse("work", 10)] == [1, 2, 3]
    assert h2.broker.queues["dlq"].messages == 0
    h2.session()
    with pytest.raises(BadRequest, match="dead-lettering to 'work': none"):
        h2.call("queue_move", 1, 9, "work", None, 10, h2.now)
    with pytest.raises(BadRequest):
        h2.call("queue_move", 1, 10, "work", "work", 10, h2.now)
    with pytest.raises(BadRequest):
        h2.call("queue_move", 1, 11, "work", "dlq", 0, h2.now)
    with pytest.raises(NotFound):
        h2.call("queue_move", 1, 12, "work", "elsewhere", 10, h2.now)


def test_move_of_non_persistent_messages_answers_at_once() -> None:
    h = Harness()
    s = h.session()
    h.call("queue_declare", s, 1, "b", h.now)
    h.send(s, 2, "a", b"volatile", persistent=False)
    assert h.call("queue_move", s, 3, "a", "b", 10, h.now) == {"moved": 1, "to": "b"}
    assert h.receive(s, 4, "b").body == b"volatile"


def test_ambiguous_origin_is_refused() -> None:
    h = Harness()
    s = h.session()
    for rid, name in ((1, "x"), (2, "y")):
        h.call("queue_declare", s, rid, name, h.now, settings={"dead_letter_queue": "shared"})
    h.call("queue_declare", s, 3, "shared", h.now)
    with pytest.raises(BadRequest, match="x, y"):
        h.call("queue_move", s, 4, "shared", None, 10, h.now)
