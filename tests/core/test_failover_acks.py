"""Seed 004 in the core: acknowledgements after a failover, and topic subscriptions
named by a client that lost them (issue 28 §5). A failover is modelled as the harness's
crash (a new broker replays the store) or as the client's session ending: either way
the delivery went back to its queue.

- ``ack_by_id`` acknowledges a message a client was delivered on an earlier session,
  named by its queue and id (the client's ``Message.seq``). Seed 004: IllegalState "only
  occurs" when the message "has already been sent to another queue receiver"; with one
  receiver the ack succeeds.
- Naming ``topic::name`` (subscribe, receive, send) never creates a plain queue: a
  topic's subscription queue is made by ``topic_subscribe`` only.
"""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from txbroker.core import LATER
from txbroker.errors import IllegalState, NotFound


@pytest.fixture
def h() -> Harness:
    return Harness()


def delivered(h: Harness, sid: int, rid: int, queue: str) -> tuple[int, int]:
    """Receive one message: its ``(tag, id)``."""
    d = h.receive(sid, rid, queue)
    assert d is not None and d is not LATER, f"nothing in {queue}"
    return d.tag, d.message_id


def ack_by_id(h: Harness, sid: int, rid: int, queue: str, message_id: int) -> object:
    result = h.call("ack_by_id", sid, rid, queue, message_id, h.now)
    return h.replies.get((sid, rid), result) if result is LATER else result


def depth(h: Harness, queue: str) -> int:
    return h.broker.queues[queue].messages


# ---------------------------------------------------------------- acks after a failover
def test_one_receiver_acks_a_message_delivered_before_the_failover(h: Harness) -> None:
    h.session(1)
    h.send(1, 1, "q", b"m1")
    h.send(1, 2, "q", b"m2")
    _, first = delivered(h, 1, 3, "q")
    h2 = h.crash()  # the failover: the delivery is back in the queue, redelivered later
    h2.session(7)
    assert ack_by_id(h2, 7, 1, "q", first) == {}
    assert depth(h2, "q") == 1
    d = h2.receive(7, 2, "q")
    assert d.body == b"m2"  # m1 was acknowledged: never delivered again
    h3 = h2.crash()
    h3.session(8)
    assert [h3.receive(8, 1, "q").body, h3.receive(8, 2, "q")] == [b"m2", None]


def test_ack_of_the_message_redelivered_to_the_same_connection(h: Harness) -> None:
    """The client restored its subscription first: the message was delivered again to
    this connection. That delivery is the one acknowledged (still one receiver)."""
    h.session(1)
    h.send(1, 1, "q", b"m1")
    h.call("subscribe", 1, 5, "q", h.now)
    first = h.deliveries[-1].message_id
    h2 = h.crash()
    h2.session(7)
    h2.call("subscribe", 7, 5, "q", h2.now)
    again = h2.deliveries[-1]
    assert (again.message_id, again.redelivered) == (first, True)
    assert ack_by_id(h2, 7, 1, "q", first) == {}
    assert depth(h2, "q") == 0
    with pytest.raises(IllegalState):  # that delivery is acknowledged now
        h2.call("ack", 7, 2, [again.tag], h2.now)


def test_ack_of_a_message_sent_to_another_receiver_is_illegal_state(h: Harness) -> None:
    h.session(1)
    h.send(1, 1, "q", b"m1")
    _, first = delivered(h, 1, 2, "q")
    h2 = h.crash()
    h2.session(7)
    h2.session(8)
    tag, again = delivered(h2, 8, 1, "q")  # the other receiver got it after the failover
    assert again == first
    with pytest.raises(IllegalState, match="another receiver"):
        h2.call("ack_by_id", 7, 1, "q", first, h2.now)
    h2.call("ack", 8, 2, [tag], h2.now)  # the other receiver's ack stands
    assert depth(h2, "q") == 0


def test_ack_of_a_message_no_longer_in_the_queue_is_illegal_state(h: Harness) -> None:
    h.session(1)
    h.send(1, 1, "q", b"m1")
    _, first = delivered(h, 1, 2, "q")
    h2 = h.crash()
    h2.session(8)
    tag, _ = delivered(h2, 8, 1, "q")
    h2.call("ack", 8, 2, [tag], h2.now)  # consumed by another receiver meanwhile
    h2.session(7)
    with pytest.raises(IllegalState):
        h2.call("ack_by_id", 7, 1, "q", first, h2.now)
    with pytest.raises(IllegalState):  # the wrong queue is no match either
        h2.call("ack_by_id", 7, 2, "other", first, h2.now)


def test_ack_by_id_after_the_session_ended_without_a_crash(h: Harness) -> None:
    """A client that reconnected to the same broker (its connection broke): the same."""
    h.session(1)
    h.send(1, 1, "q", b"m1")
    _, first = delivered(h, 1, 2, "q")
    h.call("close_session", 1, h.now)
    h.session(2)
    assert ack_by_id(h, 2, 1, "q", first) == {}
    assert depth(h, "q") == 0


# ---------------------------------------------------------------- topic subscriptions
@pytest.mark.parametrize("how", ["subscribe", "receive", "send"])
def test_naming_a_missing_subscription_never_creates_a_queue(h: Harness, how: str) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "ev", h.now, kind="topic")
    h.call("topic_subscribe", s, 2, "ev", "mine", h.now, durable=False)
    h.call("close_session", s, h.now)  # the non-durable subscription goes with it
    s = h.session(2)
    with pytest.raises(NotFound, match="topic_subscribe"):
        if how == "subscribe":
            h.call("subscribe", s, 1, "ev::mine", h.now)
        elif how == "receive":
            h.call("receive", s, 3, "ev::mine", h.now, 0)
        else:
            h.call("send", s, 4, "ev::mine", b"x", h.now)
    assert "ev::mine" not in h.broker.queues
    h.call("topic_subscribe", s, 5, "ev", "mine", h.now, durable=False)
    h.call("subscribe", s, 1, "ev::mine", h.now)
    h.send(s, 6, "ev", b"after")
    assert h.deliveries[-1].body == b"after"


def test_a_reconnected_client_takes_its_non_durable_subscription_over(h: Harness) -> None:
    """A client whose connection broke makes its non-durable subscription again
    (``topic_subscribe``) and may do so before the broker noticed the old connection
    ended: the subscription passes to the new session, so the old one's end does
    not delete it under the new subscriber."""
    old = h.session(1)
    h.call("queue_declare", old, 1, "ev", h.now, kind="topic")
    h.call("topic_subscribe", old, 2, "ev", "mine", h.now, durable=False)
    new = h.session(2)
    h.call("topic_subscribe", new, 1, "ev", "mine", h.now, durable=False)
    h.call("subscribe", new, 1, "ev::mine", h.now)
    h.call("close_session", old, h.now)  # the broker notices the old connection now
    assert "ev::mine" in h.broker.queues
    h.send(new, 2, "ev", b"still")
    assert h.deliveries[-1].body == b"still"
    h.call("close_session", new, h.now)
    assert "ev::mine" not in h.broker.queues
