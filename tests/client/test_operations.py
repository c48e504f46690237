"""One definition per client operation: every face checks the same way and has the same
signature (issue 11: the transactional send skipped the size check the plain send did)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_sync_client import ServerThread
from tests.inmemory import InMemoryNetwork, Node, run

import txbroker.aio
from txbroker.client import sync
from txbroker.client.aio import AsyncConnection, AsyncMessage, AsyncSubscription
from txbroker.client.async_transaction import AsyncTransaction
from txbroker.client.operations import (
    BrokerLimits,
    batch_request,
    receive_request,
    send_request,
    settle_args,
)
from txbroker.client.xa import AsyncXAResource
from txbroker.core.limits import Limits
from txbroker.errors import BadRequest, MessageTooLarge

pytestmark = pytest.mark.timeout(30)

#: The brokers of these tests announce a max_message_size of 512 KiB.
LIMITS = Limits(max_message_size=512 * 1024)
TOO_LARGE = b"x" * (600 * 1024)

SEND_FACES: list[Callable[..., Any]] = [
    AsyncConnection.send,
    AsyncConnection.send_nowait,
    AsyncTransaction.send,
    sync.Connection.send,
    sync.Connection.send_nowait,
    sync.Transaction.send,
]
RECEIVE_FACES: list[Callable[..., Any]] = [
    AsyncConnection.receive,
    AsyncTransaction.receive,
    sync.Connection.receive,
    sync.Transaction.receive,
]
BATCH_FACES: list[Callable[..., Any]] = [AsyncConnection.send_batch, sync.Connection.send_batch]
#: (async class, sync class): the two faces of one object.
FACE_PAIRS: list[tuple[type, type]] = [
    (AsyncConnection, sync.Connection),
    (AsyncTransaction, sync.Transaction),
    (AsyncMessage, sync.Message),
    (AsyncSubscription, sync.Subscription),
    (AsyncXAResource, sync.XAResource),
]


def parameters(function: Callable[..., Any]) -> list[tuple[str, Any, Any, Any]]:
    """Name, kind, default and annotation of each parameter after ``self``."""
    found = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default, p.annotation) for p in found]


@pytest.mark.parametrize("faces", [SEND_FACES, RECEIVE_FACES, BATCH_FACES],
                         ids=["send", "receive", "send_batch"])
def test_every_face_of_an_operation_has_one_signature(faces: list[Callable[..., Any]]) -> None:
    first = parameters(faces[0])
    assert first, "no parameters found"
    for face in faces[1:]:
        assert parameters(face) == first, face.__qualname__


def test_the_send_signature_is_the_documented_one() -> None:
    shown = str(inspect.signature(sync.Connection.send)).split(" -> ")[0]
    assert shown.replace("'", "") == (
        "(self, /, dest: str, body: bytes, *, headers: dict[str, str] | None = None, "
        "message_id: str | None = None, persistent: bool = True, priority: int = 4, "
        "ttl: float | None = None, delay: float | None = None)"
    )
    for face in SEND_FACES:
        assert face.__doc__, face.__qualname__
    # the async faces stay coroutine functions (their checks run when awaited)
    assert inspect.iscoroutinefunction(AsyncConnection.send)
    assert inspect.iscoroutinefunction(AsyncTransaction.send)
    assert not inspect.iscoroutinefunction(AsyncConnection.send_nowait)


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        name: value
        for name, value in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


@pytest.mark.parametrize("pair", FACE_PAIRS, ids=lambda pair: pair[1].__name__)
def test_sync_and_async_faces_take_the_same_arguments(pair: tuple[type, type]) -> None:
    async_face, sync_face = (public_methods(cls) for cls in pair)
    shared = sorted(set(async_face) & set(sync_face))
    assert len(shared) >= 2
    for name in shared:
        wanted = [(n, k, d) for n, k, d, _ in parameters(async_face[name])]
        got = [(n, k, d) for n, k, d, _ in parameters(sync_face[name])]
        assert got == wanted, f"{pair[1].__name__}.{name}"


def wire_ops(server: Node) -> list[str]:
    return [op for op in server.log.names() if op != "hello"]


def test_async_transactional_send_checks_the_size_like_the_plain_send() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker(limits=LIMITS)
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            with pytest.raises(MessageTooLarge) as plain:
                await conn.send("q", TOO_LARGE)
            with pytest.raises(MessageTooLarge) as nowait:
                conn.send_nowait("q", TOO_LARGE)
            tx = conn.transaction()
            with pytest.raises(MessageTooLarge) as staged:
                await tx.send("q", TOO_LARGE)
            assert str(staged.value) == str(plain.value) == str(nowait.value)
            with pytest.raises(BadRequest):
                await tx.send("q", b"x", priority=10)
            with pytest.raises(TypeError):
                await tx.send("q", b"x", headers={"k": 1})  # type: ignore[dict-item]
            assert wire_ops(server) == []  # refused without a round trip (not even tx_begin)
            await tx.send("q", b"ok")
            await tx.commit()
            assert wire_ops(server) == ["tx_begin", "send", "tx_commit"]

    run(main)


@pytest.fixture
def servers() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.stop()


def test_sync_transactional_send_checks_the_size_like_the_plain_send(
    servers: ServerThread,
) -> None:
    server = servers.server(limits=LIMITS)
    with servers.connect(f"txb://{server.address}") as conn:
        with pytest.raises(MessageTooLarge) as plain:
            conn.send("q", TOO_LARGE)
        with pytest.raises(MessageTooLarge):
            conn.send_nowait("q", TOO_LARGE)
        tx = conn.transaction()
        with pytest.raises(MessageTooLarge) as staged:
            tx.send("q", TOO_LARGE)
        assert str(staged.value) == str(plain.value)
        with pytest.raises(MessageTooLarge):
            conn.send_batch("q", [b"small", TOO_LARGE])
        assert wire_ops(server) == []  # refused without a round trip (not even tx_begin)
        with pytest.raises(MessageTooLarge), conn.transaction() as begun:  # begins at once
            begun.send("q", TOO_LARGE)
        assert wire_ops(server) == ["tx_begin", "tx_rollback"]
        tx.send("q", b"ok")
        tx.commit()
        assert server.bodies("q") == [b"ok"]


def test_receive_and_batch_arguments_are_checked_before_any_request() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker(limits=LIMITS)
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            tx = conn.transaction()
            with pytest.raises(ValueError):
                await tx.receive("q", timeout=-1)
            with pytest.raises(TypeError):
                await conn.receive(b"q")  # type: ignore[arg-type]
            with pytest.raises(BadRequest):
                await conn.send_batch("q", [b"a", b"b"], message_ids=["one"])
            with pytest.raises(TypeError):
                await conn.send_batch("q", [b"a", "b"])  # type: ignore[list-item]
            assert wire_ops(server) == []

    run(main)


def test_requests_and_their_wire_arguments() -> None:
    plain = send_request("q", b"x")
    assert plain.wire_args() == {"dest": "q", "body": b"x"}  # defaults are left out
    assert not plain.resendable
    full = send_request("q", bytearray(b"xy"), headers={"k": "v"}, message_id="m",
                        persistent=False, priority=0, ttl=0.5, delay=0)
    assert full.wire_args(tx=7) == {
        "dest": "q", "body": bytearray(b"xy"), "headers": {"k": "v"}, "message_id": "m",
        "persistent": False, "priority": 0, "ttl_ms": 500, "delay_ms": 0, "tx": 7,
    }
    assert full.resendable
    assert send_request("q", memoryview(b"abc")).body_size == 3
    for bad in ({"dest": 1}, {"body": "text"}, {"headers": {"k": 1}}, {"headers": [("k", "v")]},
                {"message_id": 5}, {"persistent": 1}, {"priority": 4.0}, {"priority": True},
                {"ttl": "1"}):
        arguments: dict[str, Any] = {"dest": "q", "body": b"x", **bad}
        with pytest.raises(TypeError):
            send_request(arguments.pop("dest"), arguments.pop("body"), **arguments)
    with pytest.raises(ValueError):
        send_request("q", b"x", delay=-0.001)
    for priority in (-1, 10):
        with pytest.raises(BadRequest):
            send_request("q", b"x", priority=priority)

    limits = BrokerLimits.from_hello({"max_message_size": 3})
    send_request("q", b"abc").check(limits)
    with pytest.raises(MessageTooLarge, match="4 bytes is above max_message_size \\(3\\)"):
        send_request("q", b"abcd").check(limits)
    assert BrokerLimits.from_hello({"max_message_size": "3"}) == BrokerLimits(None)
    send_request("q", b"abcd").check(BrokerLimits.from_hello({}))  # no limit announced

    batch = batch_request("q", [b"a", b"bcde"], headers=[None, {"k": "v"}],
                          message_ids=["1", None], persistent=False)
    assert batch.wire_args() == {"dest": "q", "bodies": [b"a", b"bcde"],
                                 "headers": [None, {"k": "v"}], "message_ids": ["1", None],
                                 "persistent": False}
    with pytest.raises(MessageTooLarge, match="bodies\\[1\\] is 4 bytes"):
        batch.check(limits)
    with pytest.raises(TypeError, match="headers\\[0\\]"):
        batch_request("q", [b"a"], headers=["k=v"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="message_ids\\[0\\]"):
        batch_request("q", [b"a"], message_ids=[1])  # type: ignore[list-item]

    assert receive_request("q").wire_args() == {"queue": "q"}
    assert receive_request("q").reply_timeout(30.0) is None
    polled = receive_request("q", 0)
    assert (polled.wire_args(), polled.reply_timeout(30.0)) == ({"queue": "q", "timeout_ms": 0},
                                                                30.0)
    assert receive_request("q", 1.5).reply_timeout(None) is None
    assert settle_args([1, 2]) == {"tags": [1, 2]}
    assert settle_args([1], requeue=False, tx=3) == {"tags": [1], "requeue": False, "tx": 3}
