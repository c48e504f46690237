"""Offset reading in the pure core: seqs, the readable limit, stream readers, the
sink's commits, and all of it across a replay (core/streams.py)."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from txbroker.core import LATER
from txbroker.core.xa import TMNOFLAGS, TMSUCCESS
from txbroker.errors import IllegalState, QuotaExceeded
from txbroker.xid import sink_xid


def seqs(h: Harness, queue: str, start: int = 1, end: int = 1 << 40) -> list[tuple[int, bytes]]:
    result = h.broker.stream_read(1, queue, start, end)
    refs = [m.body if m.body is not None else h.bodies[m.ref]  # type: ignore[index]
            for m in result.messages]
    return [(m.seq, body) for m, body in zip(result.messages, refs, strict=True)]


def test_seqs_are_gap_free_in_commit_order_and_survive_replay() -> None:
    h = Harness()
    h.session(1)
    h.send(1, 1, "q", b"a")
    tx = h.call("tx_begin", 1)["tx"]
    h.call("send", 1, 0, "q", b"tx-1", h.now, tx=tx)
    h.send(1, 2, "q", b"b")  # sent after the tx's send, committed before it
    h.call("tx_commit", 1, 3, tx, h.now)
    h.call("send_batch", 1, 4, "q", [b"c", b"d"], h.now)
    h.send(1, 5, "q", b"volatile", persistent=False)  # no seq: not stored
    expected = [(1, b"a"), (2, b"b"), (3, b"tx-1"), (4, b"c"), (5, b"d")]
    assert seqs(h, "q") == expected
    h = h.crash()
    h.session(1)
    assert seqs(h, "q") == expected
    h.send(1, 6, "q", b"e")
    assert seqs(h, "q", 5) == [(5, b"d"), (6, b"e")]


def test_a_seq_is_readable_only_once_its_record_is_durable() -> None:
    h = Harness(auto_sync=False)
    h.session(1)
    h.send(1, 1, "q", b"a")
    h.sync()
    h.send(1, 2, "q", b"b")  # appended, not yet durable
    queue = h.broker.queues["q"]
    assert (queue.next_seq, queue.readable_seq) == (3, 2)
    assert h.broker.stream_info(1, "q") == {"queue": "q", "first": 1, "next": 2, "reader": None}
    h.sync()
    assert h.broker.stream_info(1, "q")["next"] == 3
    h.send(1, 3, "q", b"lost")
    h = h.crash()  # the unsynced send is gone; its seq is given again
    h.session(1)
    h.send(1, 4, "q", b"c")
    h.sync()
    assert seqs(h, "q") == [(1, b"a"), (2, b"b"), (3, b"c")]


def test_dead_lettering_gives_a_new_seq_in_the_target_queue() -> None:
    h = Harness()
    h.session(1)
    h.call("queue_declare", 1, 0, "in", h.now, settings={"dead_letter_queue": "dlq"})
    h.send(1, 1, "dlq", b"older")
    h.send(1, 2, "in", b"bad")
    got = h.receive(1, 3, "in")
    h.call("nack", 1, [got.tag], h.now, requeue=False)
    assert seqs(h, "dlq") == [(1, b"older"), (2, b"bad")]
    assert seqs(h, "in") == []
    h = h.crash()
    h.session(1)
    assert seqs(h, "dlq") == [(1, b"older"), (2, b"bad")]


def test_a_stream_reader_owns_its_queue_and_releases_below_an_offset() -> None:
    h = Harness()
    h.session(1)
    h.session(2)
    h.call("send_batch", 1, 1, "q", [b"%d" % i for i in range(6)], h.now)
    assert h.call("stream_open", 1, "q", "r") == {"queue": "q", "first": 1, "next": 7,
                                                   "reader": "r"}
    with pytest.raises(IllegalState, match="owned by stream reader 'r'"):
        h.call("subscribe", 2, 1, "q", h.now)
    assert h.receive(2, 9, "q.other") is None  # other queues are not affected
    assert h.call("stream_commit", 1, 2, "q", "r", 4) is LATER
    assert h.replies[(1, 2)] == {"released": 3}
    assert h.call("stream_commit", 1, 3, "q", "r", 4) == {"released": 0}  # idempotent
    h.broker.close_session(1, h.now)  # the reader's connection ends: the queue is free
    got = h.receive(2, 4, "q")
    assert got.body == b"3"
    h = h.crash()
    h.session(1)
    assert [s for s, _ in seqs(h, "q")] == [4, 5, 6]  # released ones stay gone


def test_a_batch_over_the_quota_sends_nothing() -> None:
    h = Harness()
    h.session(1)
    h.call("queue_declare", 1, 0, "small", h.now, settings={"max_messages": 3})
    with pytest.raises(QuotaExceeded, match="nothing was sent"):
        h.call("send_batch", 1, 1, "small", [b"1", b"2", b"3", b"4"], h.now)
    assert h.broker.queues["small"].messages == 0


def test_sink_commit_applies_atomically_and_replays() -> None:
    h = Harness()
    h.session(1)
    branches = []
    for part in range(2):
        xid = str(sink_xid("s", 7, part, 0))
        h.call("xa_start", 1, xid, TMNOFLAGS, h.now)
        h.call("send_batch", 1, 0, "out", [b"p%d-%d" % (part, i) for i in range(3)], h.now)
        h.call("xa_end", 1, xid, TMSUCCESS, h.now)
        h.call("xa_prepare", 1, 10 + part, xid, h.now)
        branches.append(xid)
    assert h.call("sink_commit", 1, 20, "s", 7, branches, h.now) is LATER
    assert h.replies[(1, 20)] == {"committed": True, "last": 7, "branches": 2,
                                  "rolled_back": 0}
    assert [s for s, _ in seqs(h, "out")] == [1, 2, 3, 4, 5, 6]
    h = h.crash()
    h.session(1)
    assert h.broker.sinks == {"s": 7}
    assert [b for _, b in seqs(h, "out")] == [b"p0-0", b"p0-1", b"p0-2", b"p1-0", b"p1-1",
                                              b"p1-2"]
    assert h.call("sink_commit", 1, 21, "s", 6, [], h.now)["committed"] is False


def test_unsettled_runs_settle_in_and_out_of_order() -> None:
    from txbroker.core.messages import Message
    from txbroker.core.queues import Queue

    queue = Queue("q")
    first = [Message(i, "q", 1) for i in range(3)]
    second = [Message(i, "q", 1) for i in range(3, 5)]
    queue.assign_seqs(first)
    queue.assign_seqs(second)  # joins the run: [1, 6)
    assert [m.seq for m in first + second] == [1, 2, 3, 4, 5]
    assert list(queue.unsettled) == [[1, 6]] and queue.readable_seq == 1
    queue.settle(4)  # out of order (a failed record): the run splits
    assert list(queue.unsettled) == [[1, 4], [5, 6]]
    queue.settle(1, 3)
    assert queue.readable_seq == 5
    queue.settle(5)
    assert not queue.unsettled and queue.readable_seq == 6 == queue.next_seq
