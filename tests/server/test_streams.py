"""Offset reading and the Spark sink's commits against a real broker process
(core/streams.py), including kill -9 between steps. The cases on the ``broker``
fixture run on the journal and on the dir store (issue 17); the two about segment
rolls, deletion and compaction are the journal's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import txbroker
from tests.support import STORES, BrokerProcess, durability_barrier
from txbroker.client.xa import TMNOFLAGS, TMSUCCESS, XA_OK
from txbroker.errors import XAER_NOTA, IllegalState, MessageTooLarge, NotFound, XAError
from txbroker.xid import sink_xid


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """The journal, and the dir store with FDATASYNC,DSYNC (issue 17)."""
    return str(request.param)



def read_all(conn: txbroker.Connection, queue: str, start: int, end: int,
             page: int = 3) -> list[tuple[int, bytes]]:
    found: list[tuple[int, bytes]] = []
    while start < end:
        chunk = conn.stream_read(queue, start, end, max_messages=page)
        found += list(zip(chunk.seqs, chunk.bodies, strict=True))
        if chunk.next == start:  # nothing readable beyond: next is the readable limit
            assert not chunk.seqs and start == conn.stream_info(queue).next
            break
        start = chunk.next
    return found


def test_every_committed_message_gets_a_gap_free_seq(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.send("s", b"a")
        with conn.transaction() as tx:
            tx.send("s", b"b")
            tx.send("s", b"c")
        assert conn.send_batch("s", [b"d", b"e", b"f"], headers=[{"key": "k"}, None, None]) == 3
        tx = conn.transaction()
        tx.send("s", b"rolled back")
        tx.rollback()
        conn.send("s", b"g")
        info = conn.stream_open("s", "reader")
        assert (info.first, info.next) == (1, 8)
        expected = [(1, b"a"), (2, b"b"), (3, b"c"), (4, b"d"), (5, b"e"), (6, b"f"), (7, b"g")]
        assert read_all(conn, "s", 1, 8) == expected
        assert read_all(conn, "s", 1, 8, page=100) == expected  # repeatable
        chunk = conn.stream_read("s", 4, 5)
        assert chunk.headers == [{"key": "k"}] and chunk.delivery_counts == [0]
        assert read_all(conn, "s", 3, 5) == expected[2:4]
    broker.kill()  # kill -9: seqs come back from the records
    broker.start()
    with txbroker.connect(broker.url) as conn:
        assert conn.stream_info("s").first == 1 and conn.stream_info("s").next == 8
        assert read_all(conn, "s", 1, 8) == expected
        conn.send("s", b"h")
        assert read_all(conn, "s", 8, 9) == [(8, b"h")]


def test_a_stream_reader_owns_the_queue_and_releases_below_an_offset(
        broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as reader, txbroker.connect(broker.url) as other:
        reader.send_batch("q", [b"%d" % i for i in range(10)])
        reader.stream_open("q", "spark-1")
        with pytest.raises(IllegalState, match="owned by stream reader 'spark-1'"):
            other.receive("q", timeout=0)
        with pytest.raises(IllegalState, match="owned by stream reader"):
            other.stream_open("q", "somebody-else")
        assert reader.stream_commit("q", "spark-1", 6) == 5
        assert reader.stream_commit("q", "spark-1", 6) == 0  # idempotent
        assert reader.stream_commit("q", "spark-1", 3) == 0  # below: nothing left
        assert reader.stream_info("q").first == 6
        assert read_all(reader, "q", 1, 11) == [(i + 1, b"%d" % i) for i in range(5, 10)]
        # the same name from another connection takes over (a restarted driver)
        assert other.stream_open("q", "spark-1").first == 6
        with pytest.raises(IllegalState):
            reader.stream_commit("q", "spark-2", 8)
        other.stream_close("q", "spark-1")
        got = reader.receive("q", timeout=5)
        assert got is not None and got.body == b"5"
        got.ack(wait=True)
    broker.kill()
    broker.start()
    with txbroker.connect(broker.url) as conn:
        info = conn.stream_open("q", "spark-1")
        assert (info.first, info.next) == (7, 11)  # released and consumed stay gone
        assert conn.stream_commit("q", "spark-1", 11) == 4
        conn.stream_close("q", "spark-1")
        conn.send("q", b"after")
        assert conn.stream_info("q").next == 12  # seqs continue after all were consumed
    broker.kill()
    broker.start()
    with txbroker.connect(broker.url) as conn:
        assert conn.stream_info("q").first == 11 and conn.stream_info("q").next == 12


def test_bad_stream_and_batch_requests_get_clear_errors(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        with pytest.raises(NotFound, match="no queue 'nope'"):
            conn.stream_open("nope", "r")
        with pytest.raises(NotFound):
            conn.stream_read("nope", 1, 10)
        conn.declare_queue("big")
        with pytest.raises(MessageTooLarge, match="bodies\\[1\\]"):
            conn.send_batch("big", [b"ok", b"x" * (5 * 1024 * 1024)])
        assert conn.queue_info("big")["messages"] == 0  # nothing half-sent


def _prepare(conn: txbroker.Connection, sink: str, batch: int, part: int, attempt: int,
             bodies: list[bytes]) -> str:
    xid = sink_xid(sink, batch, part, attempt)
    xa = conn.xa_resource()
    xa.start(xid, TMNOFLAGS)
    conn.send_batch("out", bodies)
    xa.end(xid, TMSUCCESS)
    assert xa.prepare(xid) == XA_OK
    return str(xid)


def test_sink_commit_is_atomic_idempotent_and_survives_kill9(broker: BrokerProcess) -> None:
    bodies = [b"row-%d" % i for i in range(600)]  # above XA's 256 per branch
    with txbroker.connect(broker.url) as conn:
        assert conn.sink_status("s1") == -1
        good = [_prepare(conn, "s1", 0, 0, 0, bodies[:300]),
                _prepare(conn, "s1", 0, 1, 1, bodies[300:])]
        failed_attempt = _prepare(conn, "s1", 0, 1, 0, [b"dup"])  # a retried task's first try
        with pytest.raises(XAError) as info:
            conn.sink_commit("s1", 0, [*good, str(sink_xid("s1", 0, 9, 0))])
        assert info.value.errcode == XAER_NOTA
        assert conn.queue_info("out")["messages"] == 0  # nothing committed by the failure
        result = conn.sink_commit("s1", 0, good)
        assert result == {"committed": True, "last": 0, "branches": 2, "rolled_back": 1}
        assert failed_attempt not in [str(x) for x in conn.xa_resource().recover()]
        # a replay of batch 0 (driver died before Spark's commit log): rolled back
        replayed = _prepare(conn, "s1", 0, 0, 0, bodies[:300])
        assert conn.sink_commit("s1", 0, [replayed])["committed"] is False
        assert conn.sink_abort("s1", 0) == {"rolled_back": 0, "last": 0}  # never undoes
        assert conn.xa_resource().recover() == []
        _prepare(conn, "s1", 1, 0, 0, [b"batch-1"])
        assert conn.sink_abort("s1", 1) == {"rolled_back": 1, "last": 0}
    broker.kill()
    broker.start()
    with txbroker.connect(broker.url) as conn:
        assert conn.sink_status("s1") == 0
        assert conn.xa_resource().recover() == []
        info = conn.stream_info("out")
        assert (info.first, info.next) == (1, 601)
        assert [b for _, b in read_all(conn, "out", 1, 601, page=1000)] == bodies


def test_a_segment_roll_with_a_prepared_branch_keeps_the_branch(tmp_path: Path) -> None:
    """Regression: the snapshot that starts a segment carries prepared branches' body
    refs, which are wider than msgpack ints (the broker crashed on the roll)."""
    config = tmp_path / "broker.toml"
    config.write_text("[server]\nsegment_size = 65536\n")
    proc = BrokerProcess(tmp_path / "data", "--config", str(config)).start()
    try:
        with txbroker.connect(proc.url) as conn:
            xid = _prepare(conn, "s2", 0, 0, 0, [b"prepared-%d" % i for i in range(100)])
            conn.send_batch("filler", [b"x" * 1000] * 200)  # rolls several segments
        proc.kill()
        proc.start()
        with txbroker.connect(proc.url) as conn:
            assert [str(x) for x in conn.xa_resource().recover()] == [xid]
            assert conn.sink_commit("s2", 0, [xid])["committed"] is True
            assert conn.queue_info("out")["messages"] == 100
            assert read_all(conn, "out", 1, 101, page=500)[-1] == (100, b"prepared-99")
    finally:
        proc.kill()


def test_prepared_sink_branches_keep_their_segment_through_deletion_and_compaction(
        tmp_path: Path) -> None:
    """The snapshot leaves out branches that send stored messages (their XA_PREPARE's
    bodies keep its segment): with small segments, churn that kills old segments and
    fast maintenance (deletion and compaction), the branches survive kill -9."""
    config = tmp_path / "broker.toml"
    config.write_text("[server]\nsegment_size = 65536\nmaintain_interval = 0.05\n")
    proc = BrokerProcess(tmp_path / "data", "--config", str(config)).start()
    try:
        with txbroker.connect(proc.url) as conn:

            def churn(rounds: int) -> None:  # a segment written and consumed per round
                for _ in range(rounds):
                    conn.send_batch("churn", [b"x" * 1000] * 60)
                    while (m := conn.receive("churn", timeout=0)) is not None:
                        m.ack()

            conn.send_batch("early", [b"e%d" % i for i in range(40)])  # compaction moves it
            churn(20)
            xids = [_prepare(conn, "s3", 0, part, 0, [b"p%d-%d" % (part, i) for i in range(50)])
                    for part in range(4)]
            churn(20)
            deadline = time.monotonic() + 20
            while conn.stats()["store"]["segments"] > 25 and time.monotonic() < deadline:
                time.sleep(0.1)  # the segments before the branches' one go
            store = conn.stats()["store"]
            assert store["segments"] <= 25 and store["disk_bytes"] < store["bytes_written"] / 1.5
        proc.kill()
        proc.start()
        with txbroker.connect(proc.url) as conn:
            assert sorted(str(x) for x in conn.xa_resource().recover()) == sorted(xids)
            assert conn.sink_commit("s3", 0, xids[:3])["committed"] is True  # 4th: rolled back
            got = read_all(conn, "out", 1, 151, page=500)
            assert [body for _, body in got] == [
                b"p%d-%d" % (part, i) for part in range(3) for i in range(50)]
            assert conn.xa_resource().recover() == []
            early = [conn.receive("early", timeout=5) for _ in range(40)]
            assert [m.body for m in early if m is not None] == [b"e%d" % i for i in range(40)]
    finally:
        proc.kill()


def test_seqs_of_moved_messages_survive_kill9(broker: BrokerProcess) -> None:
    """A dead-lettered message gets its seq in the dead-letter queue; on the dir store
    a moved message is recovered as ADD + MOVE (docs/dirstore.md)."""
    proc = broker
    try:
        with txbroker.connect(proc.url) as conn:
            conn.declare_queue("src", max_deliveries=1, dead_letter_queue="dlq")
            conn.send("dlq", b"first")
            conn.send_batch("src", [b"a", b"b"])
            with conn.transaction() as tx:
                tx.send("src", b"c")
            got = conn.receive("src", timeout=5)
            assert got is not None
            got.nack(requeue=False)  # "a" moves to dlq and gets its seq 2 there
            # nack is answered before its MOVE record is durable: a kill right after it
            # could undo the move ("a" back in src). Wait until it is durable first.
            durability_barrier(conn)
            # dlq's readable limit passes a seq only once its record is durable
            assert (conn.stream_info("dlq").first, conn.stream_info("dlq").next) == (1, 3)
            assert conn.stream_info("src").first == 2
        proc.kill()
        proc.start()
        with txbroker.connect(proc.url) as conn:
            assert read_all(conn, "src", 1, 10) == [(2, b"b"), (3, b"c")]
            assert read_all(conn, "dlq", 1, 10) == [(1, b"first"), (2, b"a")]
            assert conn.sink_status("s") == -1  # no sink committed anything
    finally:
        proc.kill()
