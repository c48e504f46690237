"""A real broker process, the real clients, over loopback."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import txbroker
from tests.support import ROOT, BrokerProcess, RawClient
from txbroker.errors import (
    AuthenticationFailed,
    IllegalState,
    MessageTooLarge,
    NotFound,
    QuotaExceeded,
)


def test_send_receive_ack_and_restart(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        for i in range(10):
            conn.send("orders", b"order-%d" % i, headers={"n": str(i)})
        msg = conn.receive("orders", timeout=5)
        assert msg is not None
        assert (msg.body, msg.headers, msg.redelivered, msg.delivery_count) == (
            b"order-0", {"n": "0"}, False, 1)
        msg.ack(wait=True)
        info = conn.queue_info("orders")
        assert (info["depth"], info["in_flight"]) == (9, 0)
    assert broker.stop() == 0  # SIGTERM: clean shutdown
    broker.start()
    with txbroker.connect(broker.url) as conn:
        bodies = []
        while (msg := conn.receive("orders", timeout=0)) is not None:
            bodies.append(msg.body)
            msg.ack()
        assert bodies == [b"order-%d" % i for i in range(1, 10)]


def test_unacked_message_is_redelivered_after_disconnect(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.send("q", b"once")
        msg = conn.receive("q", timeout=5)
        assert msg is not None and not msg.redelivered
    with txbroker.connect(broker.url) as conn:
        again = conn.receive("q", timeout=5)
        assert again is not None
        assert (again.body, again.redelivered, again.delivery_count) == (b"once", True, 2)
        again.ack(wait=True)
        assert conn.receive("q", timeout=0) is None


def test_subscribe_with_prefetch_and_competing_consumers(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as producer:
        for i in range(200):
            producer.send_nowait("work", b"%d" % i)
        producer.send("work", b"last")
    seen: list[bytes] = []
    lock = threading.Lock()

    def consume() -> None:
        with txbroker.connect(broker.url) as conn:
            sub = conn.subscribe("work", prefetch=10)
            while True:
                with lock:
                    if len(seen) >= 201:
                        break
                msg = sub.get(timeout=0.2)
                if msg is None:
                    continue
                with lock:
                    seen.append(msg.body)
                msg.ack()
            sub.close()

    threads = [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(seen) == sorted([b"%d" % i for i in range(200)] + [b"last"])


def test_transaction_commit_and_rollback(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.send("in", b"request")
        with conn.transaction() as tx:
            req = tx.receive("in", timeout=5)
            assert req is not None
            tx.send("out", b"reply to " + req.body)
        assert conn.queue_info("in")["depth"] == 0
        assert conn.queue_info("out")["depth"] == 1
        conn.send("in", b"second")
        with pytest.raises(RuntimeError), conn.transaction() as tx:
            req = tx.receive("in", timeout=5)
            tx.send("out", b"never")
            raise RuntimeError("application failure")
        assert conn.queue_info("out")["depth"] == 1
        again = conn.receive("in", timeout=5)
        assert again is not None and again.body == b"second" and again.redelivered


def test_admin_errors_and_limits(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.declare_queue("small", max_messages=1)
        conn.send("small", b"1")
        with pytest.raises(QuotaExceeded):
            conn.send("small", b"2")
        with pytest.raises(NotFound):
            conn.purge_queue("nope")
        with pytest.raises(MessageTooLarge):
            conn.send("small", b"x" * (4 * 1024 * 1024 + 1))
        msg = conn.receive("small", timeout=5)
        assert msg is not None
        msg.ack(wait=True)
        with pytest.raises(IllegalState):
            msg.ack(wait=True)
        assert conn.purge_queue("small") == 0
        names = [q["name"] for q in conn.queues()]
        assert "small" in names


def test_async_client_same_api(broker: BrokerProcess) -> None:
    async def main() -> None:
        conn = await txbroker.aio.connect(broker.url)
        try:
            await asyncio.gather(*(conn.send("aq", b"%d" % i) for i in range(50)))
            got = []
            for _ in range(50):
                msg = await conn.receive("aq", timeout=5)
                assert msg is not None
                got.append(msg.body)
                await msg.ack()
            assert sorted(got) == sorted(b"%d" % i for i in range(50))
        finally:
            await conn.close()

    asyncio.run(main())


def test_bad_frames_get_an_error_and_harm_no_one(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as good:
        good.send("safe", b"stored")
        # garbage that is not msgpack
        raw = RawClient(broker.port)
        raw.send_raw(b"\x00\x00\x00\x03\xc1\xc1\xc1")
        frame = raw.read_frame()
        assert frame is not None and frame[0] == 2 and frame[3]["code"] == 2
        assert raw.read_frame() is None  # closed
        # oversized declared length
        raw = RawClient(broker.port)
        raw.send_raw(b"\xff\xff\xff\xff")
        frame = raw.read_frame()
        assert frame is not None and frame[3]["code"] == 3
        # unknown op and bad arguments keep the connection
        raw = RawClient(broker.port)
        assert raw.call(1, "hello", version=1)[0] == 1
        assert raw.call(2, "frobnicate")[3]["code"] == 4
        assert raw.call(3, "send", dest=7, body=b"x")[3]["code"] == 5
        assert raw.call(4, "ping")[0] == 1
        # truncated frame, then the client vanishes
        raw2 = RawClient(broker.port)
        raw2.send_raw(b"\x00\x00\x01\x00\x94")
        raw2.close()
        raw.close()
        msg = good.receive("safe", timeout=5)
        assert msg is not None and msg.body == b"stored"


def test_requests_before_hello_are_refused(broker: BrokerProcess) -> None:
    raw = RawClient(broker.port)
    reply = raw.call(1, "send", dest="q", body=b"x")
    assert reply[0] == 2 and reply[3]["code"] == 17
    raw.close()


def test_authentication(tmp_path: Path) -> None:
    from txbroker.server.security.auth import hash_password

    config = tmp_path / "broker.toml"
    config.write_text(f'[users]\nalice = "{hash_password("s3cret")}"\n')
    with BrokerProcess(tmp_path / "data", "--config", str(config)) as proc:
        with txbroker.connect(f"txb://alice:s3cret@127.0.0.1:{proc.port}") as conn:
            conn.send("q", b"ok")
        with pytest.raises(AuthenticationFailed):
            txbroker.connect(f"txb://alice:wrong@127.0.0.1:{proc.port}", reconnect=False)
        with pytest.raises(AuthenticationFailed):
            txbroker.connect(f"txb://127.0.0.1:{proc.port}", reconnect=False)


def test_failover_list_moves_to_next_broker(tmp_path: Path) -> None:
    first = BrokerProcess(tmp_path / "a").start()
    second = BrokerProcess(tmp_path / "b").start()
    moved: list[tuple[str, str]] = []
    try:
        url = f"txb://127.0.0.1:{first.port},127.0.0.1:{second.port}"
        with txbroker.connect(url, on_failover=lambda a, b: moved.append((a, b)),
                              failover_timeout=20) as conn:
            conn.send("q", b"to-first")
            first.kill(signal.SIGKILL)
            deadline = time.monotonic() + 20
            while True:
                try:
                    conn.send("q", b"to-second")
                    break
                except txbroker.ConnectionLost:
                    assert time.monotonic() < deadline
            assert moved and moved[-1][1].endswith(str(second.port))
        with txbroker.connect(second.url) as conn:
            msg = conn.receive("q", timeout=5)
            assert msg is not None and msg.body == b"to-second"
    finally:
        first.kill()
        second.kill()


def test_a_program_exiting_with_open_connections_exits_quietly(broker: BrokerProcess) -> None:
    """Spark never calls a stream reader's stop(): its process exits with the
    connection open. The client stops its loop at exit instead of leaving the
    interpreter to tear down its tasks (which printed a failover warning)."""
    code = (f"import txbroker\nc = txbroker.connect({broker.url!r})\n"
            "c.declare_queue('left-open')\nc.stream_open('left-open', 'r')\nprint('done')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert (run.returncode, run.stdout, run.stderr) == (0, "done\n", "")
