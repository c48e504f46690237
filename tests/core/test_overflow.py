"""Queue overflow policies (core/overflow.py): ``reject`` refuses a send to a full
queue, ``drop_head`` takes it and drops (or moves) the oldest ready messages, in the
same record as the send when no overflow queue is set."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from txbroker.core import LATER
from txbroker.core.records import Kind
from txbroker.errors import BadRequest, QuotaExceeded


def bodies(h: Harness, queue: str) -> list[bytes]:
    """The ready messages' bodies of ``queue``, in delivery order (not taken)."""
    return [m.body if m.body is not None else h.read_body(m.ref)  # type: ignore[arg-type]
            for m in h.broker.queues[queue].browse(100)]


def declare(h: Harness, s: int, name: str, **settings: object) -> None:
    h.call("queue_declare", s, 1, name, h.now, settings=settings)


def test_reject_is_the_default_and_refuses_a_send_to_a_full_queue() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_messages=2)
    assert h.broker.queues["q"].settings.overflow == "reject"
    h.send(s, 2, "q", b"1")
    h.send(s, 3, "q", b"2")
    with pytest.raises(QuotaExceeded):
        h.send(s, 4, "q", b"3")
    assert bodies(h, "q") == [b"1", b"2"]


def test_drop_head_keeps_the_newest_and_is_one_record_with_the_send() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_messages=3, overflow="drop_head")
    for i in range(3):
        h.send(s, 10 + i, "q", b"m%d" % i)
    before = len(h.log)
    assert h.send(s, 20, "q", b"m3") == {"duplicate": False}
    # one TX record: the new message and the ack of the dropped head
    assert [k for k, _, _ in h.log[before:]] == [int(Kind.TX)]
    for i in range(4, 7):
        h.send(s, 10 + i, "q", b"m%d" % i)
    queue = h.broker.queues["q"]
    assert bodies(h, "q") == [b"m4", b"m5", b"m6"]
    assert (queue.messages, queue.ready_count, queue.dead_lettered) == (3, 3, 4)
    again = h.crash()  # the drops are durable with their sends
    assert bodies(again, "q") == [b"m4", b"m5", b"m6"]
    assert again.broker.queues["q"].settings.overflow == "drop_head"


def test_drop_head_counts_ready_messages_not_delivered_ones() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_messages=2, overflow="drop_head")
    h.send(s, 2, "q", b"a")
    h.send(s, 3, "q", b"b")
    taken = h.receive(s, 4, "q")  # "a" is delivered, unacked: it does not count
    assert taken.body == b"a"
    h.send(s, 5, "q", b"c")
    assert bodies(h, "q") == [b"b", b"c"]
    h.send(s, 6, "q", b"d")
    assert bodies(h, "q") == [b"c", b"d"]
    h.call("ack", s, 0, [taken.tag], h.now)
    assert h.broker.queues["q"].messages == 2


def test_drop_head_by_bytes() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_bytes=6, overflow="drop_head")
    for body in (b"aa", b"bb", b"cc"):
        h.send(s, 2, "q", body)
    h.send(s, 3, "q", b"dddd")
    assert bodies(h, "q") == [b"cc", b"dddd"]


def test_drop_head_moves_to_the_overflow_queue_with_reason_maxlen() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_messages=1, overflow="drop_head", overflow_queue="q.maxlen")
    h.send(s, 2, "q", b"old")
    before = len(h.log)
    h.send(s, 3, "q", b"new")
    kinds = [k for k, _, _ in h.log[before:] if k != int(Kind.QUEUE_PUT)]  # (q.maxlen made)
    assert kinds == [int(Kind.MOVE), int(Kind.ADD)]  # the move first, then the send
    move = next(meta for k, meta, _ in h.log[before:] if k == int(Kind.MOVE))
    assert b"maxlen" in move
    assert bodies(h, "q") == [b"new"]
    assert bodies(h, "q.maxlen") == [b"old"]
    again = h.crash()
    assert bodies(again, "q") == [b"new"] and bodies(again, "q.maxlen") == [b"old"]


def test_pipelined_sends_are_trimmed_when_they_become_visible() -> None:
    """Sends on their way at once each see the ready messages only: the queue is
    trimmed to its limit when they become visible, keeping the newest."""
    h = Harness(auto_sync=False)
    s = h.session()
    declare(h, s, "q", max_messages=2, overflow="drop_head")
    h.sync()
    for i in range(5):
        assert h.send(s, 10 + i, "q", b"p%d" % i) is LATER
    h.sync()
    assert bodies(h, "q") == [b"p3", b"p4"]
    assert all(h.replies[(s, 10 + i)] == {"duplicate": False} for i in range(5))
    h.sync()  # the trim's acks
    assert bodies(h.crash(), "q") == [b"p3", b"p4"]


def test_a_transaction_is_not_refused_and_trims_at_commit() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_messages=2, overflow="drop_head")
    h.send(s, 2, "q", b"old")
    tx = h.call("tx_begin", s)["tx"]
    for i in range(3):
        h.send(s, 3 + i, "q", b"t%d" % i, tx=tx)
    assert bodies(h, "q") == [b"old"]  # nothing dropped for staged sends
    h.call("tx_commit", s, 9, tx, h.now)
    assert bodies(h, "q") == [b"t1", b"t2"]
    assert bodies(h.crash(), "q") == [b"t1", b"t2"]


def test_a_rolled_back_transaction_drops_nothing() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_messages=1, overflow="drop_head")
    h.send(s, 2, "q", b"kept")
    tx = h.call("tx_begin", s)["tx"]
    h.send(s, 3, "q", b"staged", tx=tx)
    h.call("tx_rollback", s, tx, h.now)
    assert bodies(h, "q") == [b"kept"]


def test_overflow_setting_is_checked_and_updatable() -> None:
    h = Harness()
    s = h.session()
    with pytest.raises(BadRequest):
        declare(h, s, "q", overflow="drop-tail")
    declare(h, s, "q", max_messages=1)
    h.send(s, 2, "q", b"a")
    with pytest.raises(QuotaExceeded):
        h.send(s, 3, "q", b"b")
    h.call("queue_update", s, 4, "q", {"overflow": "drop_head"}, h.now)
    h.send(s, 5, "q", b"c")
    assert bodies(h, "q") == [b"c"]
    assert h.crash().broker.queues["q"].settings.overflow == "drop_head"


def test_a_transient_send_drops_a_persistent_head_in_a_record() -> None:
    h = Harness()
    s = h.session()
    declare(h, s, "q", max_messages=1, overflow="drop_head")
    h.send(s, 2, "q", b"stored")
    h.send(s, 3, "q", b"transient", persistent=False)
    assert bodies(h, "q") == [b"transient"]
    again = h.crash()  # the stored one's drop is durable; the transient one is gone
    assert again.broker.queues["q"].messages == 0
