"""The async client against the real broker (core, operation layer, native edge) in
memory (tests/inmemory.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.inmemory import InMemoryNetwork, Node, run

import txbroker.aio
from txbroker.client.aio import AsyncConnection
from txbroker.client.async_objects import AUTO_ACK_BUFFER
from txbroker.client.transport import Stream
from txbroker.core.limits import Limits
from txbroker.errors import (
    AlreadyExists,
    AuthenticationFailed,
    BadRequest,
    BrokerError,
    ConnectionLost,
    ErrorCode,
    IllegalState,
    MessageTooLarge,
    NotFound,
    QuotaExceeded,
    TransactionError,
    TransactionRolledBack,
)
from txbroker.protocol.native import NativeConnection, Ok, Request, Role
from txbroker.server.security.auth import hash_password

pytestmark = pytest.mark.timeout(30)


def connect(net: InMemoryNetwork, *nodes: Node, auth: str = "", **options: Any) -> Any:
    """``txbroker.aio.connect`` to ``nodes`` (a failover list) over the in-memory network."""
    return txbroker.aio.connect(net.url(*nodes, auth=auth), transport=net, **options)


def test_connect_hello_send_receive_ack() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server, auth="alice:s%40cret@", client_id="c1") as conn:
            assert isinstance(conn, AsyncConnection)
            assert conn.server_info["server"] == "txbroker"
            assert conn.host == server.address
            assert server.log.hellos == [
                {"version": 1, "user": "alice", "password": "s@cret", "client_id": "c1"}
            ]
            await conn.send("orders", b"\x00body", headers={"k": "v"}, message_id="m1", priority=7)
            message = await conn.receive("orders", timeout=1)
            assert message is not None
            assert message.body == b"\x00body"
            assert message.headers == {"k": "v"}
            assert message.message_id == "m1"
            assert message.priority == 7
            assert message.queue == "orders"
            assert message.redelivered is False
            assert message.delivery_count == 1
            assert message.seq >= 1 and message.timestamp > 1e9
            assert "orders" in repr(message)
            await message.ack(wait=True)
            with pytest.raises(IllegalState):
                await message.ack()
            assert server.info("orders")["in_flight"] == 0

    run(main)


def test_await_connect_and_send_options_on_the_wire() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker(limits=Limits(max_message_size=512 * 1024))
        conn = await connect(net, server)
        await conn.send("q", b"x", persistent=False, ttl=1.5, delay=0.25)
        await conn.send("q", b"y")
        sends = server.log.ops("send")
        assert sends[0] == {
            "dest": "q",
            "body": b"x",
            "persistent": False,
            "ttl_ms": 1500,
            "delay_ms": 250,
        }
        assert sends[1] == {"dest": "q", "body": b"y"}  # defaults are left out
        with pytest.raises(TypeError):
            await conn.send("q", "text")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await conn.send("q", b"x", ttl=-1)
        with pytest.raises(MessageTooLarge):
            await conn.send("q", b"x" * (600 * 1024))
        await conn.close()
        await conn.close()  # idempotent
        with pytest.raises(ConnectionLost):
            await conn.ping()

    run(main)


def test_receive_timeout_poll_and_priority_order() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            assert await conn.receive("empty", timeout=0) is None
            assert await conn.receive("empty", timeout=0.05) is None
            for priority in (1, 9, 4):
                await conn.send("p", str(priority).encode(), priority=priority)
            got = []
            for _ in range(3):
                message = await conn.receive("p", timeout=0)
                assert message is not None
                got.append(message.body)
                await message.ack()
            assert got == [b"9", b"4", b"1"]

    run(main)


def test_send_nowait_pipelines() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            futures = [conn.send_nowait("bulk", b"%d" % i) for i in range(2000)]
            assert all(isinstance(f, asyncio.Future) for f in futures)
            assert await asyncio.gather(*futures) == [None] * 2000
            assert server.info("bulk")["depth"] == 2000
            with pytest.raises(BadRequest):  # checked at once, as the broker would
                conn.send_nowait("bulk", b"x", priority=99)
            await conn.declare_queue("full", max_messages=1)
            await conn.send("full", b"1")
            refused = conn.send_nowait("full", b"2")  # the broker's refusal: in the future
            with pytest.raises(QuotaExceeded):
                await refused

    run(main)


def test_subscribe_client_ack_prefetch_and_nack() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            for i in range(5):
                await conn.send("s", b"%d" % i)
            sub = await conn.subscribe("s", prefetch=2)
            first = await sub.get(timeout=1)
            second = await sub.get(timeout=1)
            assert first is not None and second is not None
            assert await sub.get(timeout=0.05) is None  # prefetch 2, nothing acked
            await first.ack()
            third = await sub.get(timeout=1)
            assert third is not None and third.body == b"2"
            await second.nack()  # requeued: comes back redelivered
            bodies = []
            async for message in sub:
                bodies.append(message.body)
                if message.body == b"1":
                    assert message.redelivered and message.delivery_count == 2
                await message.ack()
                if len(bodies) == 3:
                    break
            assert sorted(bodies) == [b"1", b"3", b"4"]
            await third.nack(requeue=False, wait=True)
            await sub.close()
            await sub.close()
            assert await sub.get() is None
            assert server.info("s")["consumers"] == 0

    run(main)


def test_subscribe_auto_ack_and_context_manager() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            async with conn.subscribe("a", prefetch=10, ack="auto") as sub:
                for i in range(30):
                    conn.send_nowait("a", b"%d" % i)
                got = [m.body async for m in _take(sub, 30)]
                assert got == [b"%d" % i for i in range(30)]
                await got_message_ack_is_noop(sub, conn)
            assert server.info("a")["consumers"] == 0
            with pytest.raises(ValueError):
                conn.subscribe("a", ack="never")  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                conn.subscribe("a", prefetch=0)

    run(main)


async def _take(sub: Any, count: int) -> Any:
    for _ in range(count):
        message = await sub.get(timeout=2)
        assert message is not None
        yield message


async def got_message_ack_is_noop(sub: Any, conn: AsyncConnection) -> None:
    await conn.send("a", b"last")
    message = await sub.get(timeout=1)
    await message.ack()  # auto-acked already: no-op
    with pytest.raises(IllegalState):
        await message.nack()


def test_closing_subscription_returns_unacked_messages() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            await conn.send("c", b"1")
            sub = await conn.subscribe("c")
            message = await sub.get(timeout=1)
            assert message is not None
            await sub.close()
            again = await conn.receive("c", timeout=1)
            assert again is not None and again.redelivered
            # Acking the stale delivery: the broker refuses; the error comes with the next call.
            await message.ack()
            await asyncio.sleep(0.05)
            with pytest.raises(IllegalState):
                await conn.ping()
            await conn.ping()  # raised once only
            await again.ack(wait=True)

    run(main)


def test_cancelled_subscription_ends_iteration() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            await conn.declare_queue("doomed")
            sub = await conn.subscribe("doomed")
            assert await conn.delete_queue("doomed") == 0
            assert [m async for m in sub] == []
            assert sub.cancel_reason == "queue 'doomed' deleted"

    run(main)


def test_transaction_commit_rollback_and_exception() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            async with conn.transaction() as tx:
                await tx.send("t", b"1")
                await tx.send("t", b"2", message_id="x")
                assert server.bodies("t") == []  # staged only
            assert len(server.bodies("t")) == 2
            with pytest.raises(TransactionError):
                await tx.send("t", b"3")  # finished

            with pytest.raises(RuntimeError, match="boom"):
                async with conn.transaction() as tx:
                    message = await tx.receive("t", timeout=1)
                    assert message is not None and message.body == b"1"
                    await message.ack()  # part of the transaction: no-op
                    with pytest.raises(IllegalState):
                        await message.nack()
                    await tx.send("t", b"never")
                    raise RuntimeError("boom")
            assert sorted(server.bodies("t")) == [b"1", b"2"]

            tx = conn.transaction()
            message = await tx.receive("t", timeout=1)
            outside = await conn.receive("t", timeout=1)
            assert message is not None and outside is not None
            assert message.redelivered  # rolled back above
            await tx.ack(outside)
            await tx.ack(outside)  # already staged: no-op
            with pytest.raises(IllegalState):
                await tx.nack(outside)
            await tx.commit()
            assert server.bodies("t") == [] and server.info("t")["in_flight"] == 0
            await conn.transaction().commit()  # empty transaction: nothing sent
            await conn.transaction().rollback()

    run(main)


def test_transaction_nack_and_failed_commit() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            await conn.send("n", b"1")
            outside = await conn.receive("n", timeout=1)
            assert outside is not None
            tx = conn.transaction()
            await tx.begin()
            await tx.nack(outside)
            await tx.rollback()
            server.fail_store()  # the commit's record is never durable
            with pytest.raises(TransactionRolledBack):
                async with conn.transaction() as tx2:
                    await tx2.send("n", b"2")
            assert tx2.state.value == "rolled back"

    run(main)


def test_broker_errors_map_to_exception_classes() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            with pytest.raises(NotFound):
                await conn.queue_info("nope")
            with pytest.raises(BadRequest):
                await conn.send("q", b"x", priority=12)
            await conn.declare_queue("small", max_messages=1)
            await conn.send("small", b"1")
            with pytest.raises(QuotaExceeded):
                await conn.send("small", b"2")
            with pytest.raises(BrokerError) as info:
                await conn._engine.call("bogus", {}, timeout=1)
            assert info.value.code == ErrorCode.UNKNOWN_OP
            sub = await conn.subscribe("q")
            with pytest.raises(BadRequest, match="already in use"):
                await conn._engine.call("subscribe", sub.subscribe_args(), timeout=1)
            await conn.declare_topic("news")
            with pytest.raises(AlreadyExists):
                await conn.declare_queue("news")
            with pytest.raises(TransactionError):
                await conn._engine.call("tx_commit", {"tx": 999}, timeout=1)
            await conn.ping()  # the connection survives all of this

    run(main)


def test_authentication_failure() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker(users={"bob": hash_password("pw")})
        with pytest.raises(AuthenticationFailed):
            await connect(net, server, auth="bob:wrong@")
        conn = await connect(net, server, auth="bob:pw@")
        await conn.close()

    run(main)


def test_queue_admin() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server) as conn:
            info = await conn.declare_queue("adm", max_deliveries=3)
            assert info["name"] == "adm" and info["settings"]["max_deliveries"] == 3
            info = await conn.update_queue("adm", max_bytes=10)
            assert (info["settings"]["max_deliveries"], info["settings"]["max_bytes"]) == (3, 10)
            await conn.send("adm", b"x")
            assert (await conn.queue_info("adm"))["depth"] == 1
            assert [q["name"] for q in await conn.queues()] == ["adm"]
            assert await conn.purge_queue("adm") == 1
            await conn.declare_topic("news")
            sub_info = await conn.subscribe_topic("news", "a")
            assert sub_info["name"] == "news::a"
            await conn.subscribe_topic("news", "b", durable=False)
            await conn.send("news", b"hello")
            for name in ("news::a", "news::b"):
                message = await conn.receive(name, timeout=1)
                assert message is not None and message.body == b"hello"
            assert (await conn.stats())["connections"] == 1
            await conn.ping()
            assert await conn.delete_queue("adm") == 0
            with pytest.raises(NotFound):
                await conn.queue_info("adm")

    run(main)


def test_request_timeout_and_abandoned_receive() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with connect(net, server, timeout=0.2) as conn:
            server.stall()  # the broker answers, its bytes are held back
            with pytest.raises(TimeoutError):
                await conn.ping()
            server.unstall()  # the late reply to the abandoned ping is ignored
            # A receive cancelled on our side: the message that answers it later is given back.
            waiting = asyncio.ensure_future(conn.receive("late"))
            await asyncio.sleep(0.05)
            waiting.cancel()
            await asyncio.sleep(0.01)
            await conn.send("late", b"1")
            message = await conn.receive("late", timeout=1)
            assert message is not None and message.body == b"1" and message.redelivered

    run(main)


def test_connect_errors_and_options() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        dead = await net.broker()
        await dead.kill()
        with pytest.raises(ConnectionLost, match="no broker"):
            await connect(net, dead)
        # The first host is dead: the second one of the list is used.
        async with connect(net, dead, server) as conn:
            assert conn.host == server.address
        with pytest.raises(TypeError, match="unknown connect option"):
            connect(net, server, colour="red")
        with pytest.raises(ValueError):
            txbroker.aio.connect("http://x")
        with pytest.raises(ValueError):
            connect(net, server, timeout=0)
        # A host that never answers hello: the error names the timeout (it said nothing).
        silent = await net.broker()
        silent.stall()
        with pytest.raises(ConnectionLost, match=rf"{silent.address}: TimeoutError"):
            await connect(net, silent, timeout=0.05)
        assert silent.log.names() == ["hello"]  # it got the hello; its answer never came

    run(main)


class ScriptedTransport:
    """A test of the wire edge, not of a broker: a peer that answers hello, then answers
    any other request with garbage (no real broker sends an undecodable frame)."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int]] = []

    async def open(self, host: str, port: int) -> Stream:
        self.opened.append((host, port))
        return ScriptedStream()


class ScriptedStream:
    def __init__(self) -> None:
        self.codec = NativeConnection(Role.SERVER)
        self.incoming: asyncio.Queue[bytes] = asyncio.Queue()

    async def read(self, max_bytes: int) -> bytes:
        return await self.incoming.get()

    def write(self, data: bytes) -> None:
        self.codec.receive_data(data)
        for request in self.codec.drain():
            assert isinstance(request, Request)
            if request.op == "hello":
                self.incoming.put_nowait(self.codec.send(Ok(request.rid, {"version": 1})))
            else:
                self.incoming.put_nowait(b"\x00\x00\x00\x01\xc1")  # undecodable frame

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.incoming.put_nowait(b"")


def test_replaceable_transport_and_broker_protocol_violation() -> None:
    async def main(net: InMemoryNetwork) -> None:
        transport = ScriptedTransport()
        conn = await txbroker.aio.connect("txb://somewhere:1", transport=transport, reconnect=False)
        assert transport.opened == [("somewhere", 1)]
        with pytest.raises(ConnectionLost, match="undecodable"):
            await conn.ping()
        with pytest.raises(ConnectionLost):
            await conn.ping()
        await conn.close()

    run(main)


def test_auto_ack_subscription_stops_reading_when_the_application_lags() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with (
            connect(net, server) as producer,
            connect(net, server) as consumer,
        ):
            sub = await consumer.subscribe("flood", prefetch=10, ack="auto")
            body = b"x" * 2048
            await asyncio.gather(*[producer.send_nowait("flood", body) for _ in range(1600)])
            await asyncio.sleep(0.2)
            buffered = len(sub._buffer)
            assert AUTO_ACK_BUFFER <= buffered < 1600  # paused, not everything was read
            count = 0
            while await sub.get(timeout=2) is not None:
                count += 1
                if count == 1600:
                    break
            assert count == 1600
            await consumer.ping()  # reading resumed: replies flow again

    run(main)
