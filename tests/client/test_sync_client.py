"""The sync wrapper, against real brokers in memory (tests/inmemory.py) whose loop runs
on a background thread (the sync client runs its own)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from tests.inmemory import LoopThread, Node

import txbroker.client
from txbroker.client.sync import Connection, Message, Subscription, Transaction
from txbroker.client.sync import connect as sync_connect
from txbroker.errors import (
    BadRequest,
    ConnectionLost,
    IllegalState,
    NotFound,
    QuotaExceeded,
    TransactionError,
    TransactionRolledBack,
)

pytestmark = pytest.mark.timeout(30)


class ServerThread(LoopThread):
    """Real brokers on a loop thread; each :meth:`server` is one more address."""

    def server(self, state: Any = None, **config: Any) -> Node:
        """A running broker (``state``: another node's, for a shared store)."""
        return self.broker(state, **config)

    def standby(self, state: Any) -> Node:
        """A standby on ``state`` (refuses ``hello`` until it takes over)."""

        async def standby() -> Node:
            return self.network.node(state).standby()

        return self.call(standby())

    def fail_over(self, active: Node, standby: Node) -> None:
        """The active dies; the standby takes over its store."""

        async def fail_over() -> None:
            await standby.take_over(active)

        self.call(fail_over())

    def connect(self, url: str, **options: Any) -> Connection:
        """``txbroker.connect`` over the in-memory network."""
        return sync_connect(url, transport=self.network, **options)


@pytest.fixture
def servers() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.stop()


def test_sync_send_receive_subscribe(servers: ServerThread) -> None:
    server = servers.server()
    with servers.connect(f"txb://u:p@{server.address}", client_id="sync") as conn:
        assert isinstance(conn, Connection)
        assert conn.host == server.address
        assert conn.url.user == "u"
        assert conn.server_info["version"] == 1
        conn.send("q", b"one", headers={"h": "1"}, message_id="m1")
        message = conn.receive("q", timeout=1)
        assert isinstance(message, Message)
        assert (message.body, message.headers, message.message_id) == (b"one", {"h": "1"}, "m1")
        message.ack(wait=True)
        with pytest.raises(IllegalState):
            message.ack()
        assert conn.receive("q", timeout=0) is None

        futures = [conn.send_nowait("q", b"%d" % i) for i in range(300)]
        assert all(isinstance(f, concurrent.futures.Future) for f in futures)
        assert [f.result(5) for f in futures] == [None] * 300
        with pytest.raises(BadRequest):  # checked at once, as the broker would
            conn.send_nowait("q", b"x", priority=42)
        with pytest.raises(TypeError):
            conn.send_nowait("q", "str")  # type: ignore[arg-type]
        conn.declare_queue("full", max_messages=1)
        conn.send("full", b"1")
        refused = conn.send_nowait("full", b"2")  # the broker's refusal: in the future
        with pytest.raises(QuotaExceeded):
            refused.result(5)

        with conn.subscribe("q", prefetch=50) as sub:
            assert isinstance(sub, Subscription)
            assert (sub.queue, sub.prefetch, sub.ack_mode) == ("q", 50, "client")
            got = []
            for message in sub:
                got.append(message.body)
                message.ack()
                if len(got) == 300:
                    break
            assert got == [b"%d" % i for i in range(300)]
            assert sub.get(timeout=0.05) is None
            assert sub.cancel_reason is None
        conn.send("q", b"nack me")
        message = conn.receive("q", timeout=1)
        assert message is not None
        message.nack()
        again = conn.receive("q", timeout=1)
        assert again is not None and again.redelivered
        again.nack(requeue=False, wait=True)


def test_sync_transactions(servers: ServerThread) -> None:
    server = servers.server()
    with servers.connect(f"txb://{server.address}") as conn:
        with conn.transaction() as tx:
            assert isinstance(tx, Transaction)
            tx.send("t", b"1")
            tx.send("t", b"2", priority=5, ttl=10)
            assert tx.tx_id is not None
        with pytest.raises(ZeroDivisionError), conn.transaction() as tx:
            message = tx.receive("t", timeout=1)
            assert message is not None and message.body == b"2"  # priority 5 first
            tx.send("t", b"never")
            _ = 1 / 0
        tx = conn.transaction()
        tx.begin()
        first = tx.receive("t", timeout=1)
        outside = conn.receive("t", timeout=1)
        assert first is not None and first.redelivered and outside is not None
        tx.ack(outside)
        tx.commit()
        with pytest.raises(TransactionError):
            tx.receive("t", timeout=0)  # finished
    with servers.connect(f"txb://{server.address}") as conn:
        conn.send("n", b"x")
        outside = conn.receive("n", timeout=1)
        assert outside is not None
        tx = conn.transaction()
        tx.nack(outside)
        tx.rollback()
        assert server.bodies("t") == []
        server.fail_store()  # the commit's record is never durable
        with pytest.raises(TransactionRolledBack), conn.transaction() as tx:
            tx.send("n", b"y")


def test_sync_admin_and_errors(servers: ServerThread) -> None:
    server = servers.server()
    conn = txbroker.client.connect(f"txb://{server.address}", timeout=5,
                                   transport=servers.network)
    try:
        assert conn.declare_queue("a", max_messages=10)["settings"]["max_messages"] == 10
        assert conn.update_queue("a", max_bytes=1)["settings"]["max_bytes"] == 1
        conn.declare_topic("t")
        assert conn.subscribe_topic("t", "s", durable=False)["name"] == "t::s"
        conn.send("a", b"1")
        assert conn.queue_info("a")["depth"] == 1
        assert {q["name"] for q in conn.queues()} == {"a", "t", "t::s"}
        assert conn.purge_queue("a") == 1
        assert conn.delete_queue("a") == 0
        assert conn.stats()["connections"] == 1
        conn.ping()
        with pytest.raises(NotFound):
            conn.queue_info("a")
        assert conn.async_connection.host == server.address
    finally:
        conn.close()
    conn.close()
    with pytest.raises(ConnectionLost):
        conn.ping()
    with pytest.raises(ConnectionLost):
        conn.send_nowait("q", b"x")


def test_sync_connect_errors(servers: ServerThread) -> None:
    with pytest.raises(ValueError):
        sync_connect("nope://x")
    with pytest.raises(TypeError):
        sync_connect("txb://127.0.0.1:1", bogus=1)
    dead = servers.server()
    servers.call(dead.kill())
    before = threading.active_count()
    with pytest.raises(ConnectionLost):
        servers.connect(f"txb://{dead.address}", timeout=1)
    assert threading.active_count() == before  # the loop thread was stopped


def test_sync_failover_and_callback_thread(servers: ServerThread) -> None:
    a = servers.server()
    b = servers.standby(a.state)  # the other broker of a shared-store pair
    moves: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    holder: list[Connection] = []

    def on_failover(old: str, new: str) -> None:
        moves.append((old, new))
        try:
            holder[0].ping()  # would deadlock: refused
        except RuntimeError as exc:
            errors.append(exc)

    with servers.connect(f"txb://{a.address},{b.address}", on_failover=on_failover) as conn:
        holder.append(conn)
        sub = conn.subscribe("f", ack="client")
        conn.send("f", b"1")
        first = sub.get(timeout=1)
        assert first is not None
        tx = conn.transaction()
        tx.send("f", b"tx")
        servers.fail_over(a, b)
        conn.send("f", b"2", message_id="two")  # waits for the failover
        assert moves == [(a.address, b.address)]
        assert len(errors) == 1 and "deadlock" in str(errors[0])
        first.ack()  # seed 004: one receiver, so the ack (by the message's id) succeeds
        with pytest.raises(IllegalState):
            first.ack()  # (once)
        with pytest.raises(TransactionRolledBack):
            tx.commit()
        got = sub.get(timeout=2)
        assert got is not None and got.body == b"2"  # "1" was acked: its copy is dropped
        assert sub.get(timeout=0.2) is None
        sub.close()


def test_sync_no_host_left(servers: ServerThread) -> None:
    server = servers.server()
    conn = servers.connect(f"txb://{server.address}", failover_timeout=0.2)
    sub = conn.subscribe("x")
    servers.call(server.kill())
    with pytest.raises(ConnectionLost):
        sub.get(timeout=5)
    with pytest.raises(ConnectionLost):
        conn.receive("x")
    conn.close()
