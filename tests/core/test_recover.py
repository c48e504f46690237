"""``Broker.recover`` (JMS ``Session.recover()``) in the core: every unacked delivery of
the session goes back, as a nack with requeue; nothing else moves (no I/O)."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from txbroker.core.xa import TMNOFLAGS, TMSUCCESS
from txbroker.errors import IllegalState
from txbroker.xid import Xid


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_recover_gives_back_every_unacked_delivery_in_order(h: Harness) -> None:
    s = h.session()
    for i in range(4):
        h.send(s, i + 1, "q", b"m%d" % i)
    h.call("subscribe", s, 7, "q", h.now, prefetch=10)
    first = [d for d in h.deliveries if d.sub == 7]
    assert [d.body for d in first] == [b"m0", b"m1", b"m2", b"m3"]
    h.call("ack", s, 10, [first[1].tag], h.now)  # acked: never comes back

    result = h.call("recover", s, h.now)

    assert result == {"recovered": 3, "next_tag": first[-1].tag + 1}
    again = [d for d in h.deliveries if d.sub == 7][4:]
    # redelivered to the same subscription, oldest first, flagged and counted
    assert [(d.body, d.redelivered, d.delivery_count) for d in again] == [
        (b"m0", True, 2), (b"m2", True, 2), (b"m3", True, 2)]
    assert all(d.tag >= result["next_tag"] for d in again)
    with pytest.raises(IllegalState):  # a given-back tag is not an unacked delivery
        h.call("ack", s, 11, [first[0].tag], h.now)
    h.call("ack", s, 12, [d.tag for d in again], h.now)
    assert h.broker.queues["q"].in_flight == 0
    assert h.broker.queues["q"].ready_count == 0


def test_recover_counts_receives_and_leaves_other_sessions_alone(h: Harness) -> None:
    a, b = h.session(1), h.session(2)
    for i in range(3):
        h.send(a, i + 1, "q", b"m%d" % i)
    mine = h.receive(a, 10, "q")
    theirs = h.receive(b, 10, "q")
    assert h.call("recover", a, h.now) == {"recovered": 1, "next_tag": mine.tag + 1}
    assert h.broker.queues["q"].in_flight == 1  # b's delivery stays out
    h.call("ack", b, 11, [theirs.tag], h.now)
    back = h.receive(b, 12, "q")
    assert (back.body, back.redelivered, back.delivery_count) == (b"m0", True, 2)
    assert h.call("recover", a, h.now)["recovered"] == 0  # nothing left: a no-op


def test_recover_leaves_messages_consumed_by_transactions(h: Harness) -> None:
    s = h.session()
    for i in range(3):
        h.send(s, i + 1, "q", b"m%d" % i)
    tx = h.call("tx_begin", s)["tx"]
    in_tx = h.receive(s, 10, "q")
    h.call("ack", s, 11, [in_tx.tag], h.now, tx=tx)
    xid = str(Xid(0, "recover", "b"))
    h.call("xa_start", s, xid, TMNOFLAGS, h.now)
    in_branch = h.receive(s, 12, "q")
    h.call("ack", s, 13, [in_branch.tag], h.now)  # staged in the branch
    h.call("xa_end", s, xid, TMSUCCESS, h.now)
    loose = h.receive(s, 14, "q")

    assert h.call("recover", s, h.now)["recovered"] == 1
    assert h.receive(s, 15, "q").body == loose.body
    h.call("tx_commit", s, 16, tx, h.now)
    h.call("xa_commit", s, 17, xid, True, h.now)
    assert h.receive(s, 18, "q") is None


def test_recover_dead_letters_at_max_deliveries_and_persists_the_count(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "w", h.now,
           settings={"max_deliveries": 2, "dead_letter_queue": "dlq"})
    h.send(s, 2, "w", b"poison")
    h.receive(s, 3, "w")
    h.call("recover", s, h.now)
    d = h.receive(s, 4, "w")
    assert d.delivery_count == 2
    h2 = h.crash()  # the count of the recovered delivery was written
    h2.session()
    again = h2.receive(1, 1, "w")
    assert again.redelivered and again.delivery_count >= 2  # (a crash may count one more)
    h2.call("recover", 1, h2.now)
    assert h2.receive(1, 2, "w") is None
    assert h2.receive(1, 3, "dlq").body == b"poison"
