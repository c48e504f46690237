"""The operation layer decides once for every protocol: the native and the STOMP
edge of one in-process broker get the same decision (code and message) for the
same request, each written as its protocol writes it.

Connections run on in-memory transports (bytes in, bytes out, a chosen peer
address), so the exact frames are checked, and a peer that is not on loopback
can be tried.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from txbroker.core.limits import Limits
from txbroker.errors import ErrorCode
from txbroker.protocol.native import Err, NativeConnection, Ok, Push, Request
from txbroker.protocol.native import Role as NativeRole
from txbroker.protocol.stomp import Frame, StompConnection
from txbroker.protocol.stomp import Role as StompRole
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.edges.native.connection import ClientConnection
from txbroker.server.edges.stomp.connection import StompServerConnection
from txbroker.server.ops import Session, is_loopback, unknown_delivery
from txbroker.server.security.auth import hash_password

LOOPBACK = ("127.0.0.1", 40000)
ELSEWHERE = ("10.1.2.3", 40000)
#: A small message size limit, so that a message over it is cheap to build.
MAX_MESSAGE = 1024


class Wire(asyncio.Transport):
    """An in-memory transport: what the server writes, whether it closed."""

    def __init__(self, peer: tuple[str, int]) -> None:
        super().__init__()
        self.peer = peer
        self.written = bytearray()
        self.closed = False
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peer if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def take(self) -> bytes:
        data = bytes(self.written)
        self.written.clear()
        return data


class NativePeer:
    """A native-protocol client of the server, through the client codec."""

    def __init__(self, server: BrokerServer, peer: tuple[str, int] = LOOPBACK) -> None:
        self.connection = ClientConnection(server.ops)
        self.wire = Wire(peer)
        self.codec = NativeConnection(NativeRole.CLIENT)
        self.connection.connection_made(self.wire)

    def events(self) -> list[Any]:
        self.codec.receive_data(self.wire.take())
        found: list[Any] = []
        while batch := self.codec.drain():
            found += batch
        return found

    def request(self, rid: int, op: str, **args: Any) -> list[Any]:
        self.connection.data_received(self.codec.send(Request(rid, op, args)))
        return self.events()

    def hello(self, **args: Any) -> None:
        assert isinstance(self.request(1, "hello", version=1, **args)[0], Ok)


class StompPeer:
    """A STOMP client of the server, through the client codec."""

    def __init__(self, server: BrokerServer, peer: tuple[str, int] = LOOPBACK) -> None:
        self.connection = StompServerConnection(server.ops)
        self.wire = Wire(peer)
        self.codec = StompConnection(StompRole.CLIENT)
        self.connection.connection_made(self.wire)

    def frames(self) -> list[Frame]:
        self.codec.receive_data(self.wire.take())
        found: list[Frame] = []
        while batch := self.codec.drain():
            found += batch
        return found

    def send(self, command: str, body: bytes = b"", **headers: str) -> list[Frame]:
        self.connection.data_received(self.codec.send(Frame(command, headers, body)))
        return self.frames()

    def connect(self, **headers: str) -> None:
        assert self.send("CONNECT", **{"accept-version": "1.2", **headers})[0].command == \
            "CONNECTED"


def with_server(tmp_path: Path, test: Callable[[BrokerServer], Any], **config: Any) -> None:
    """Run ``test`` (a function, or a coroutine function) against a started
    in-process broker (no listeners)."""
    settings = ServerConfig(data=tmp_path / "data", port=0, stomp_port=0, amqp_port=0,
                            limits=Limits(max_message_size=MAX_MESSAGE))

    async def main() -> None:
        server = BrokerServer(replace(settings, **config))
        await server.start()
        try:
            outcome = test(server)
            if inspect.isawaitable(outcome):
                await outcome
        finally:
            await server.stop()

    asyncio.run(main())


def assert_refused(error: Frame, code: ErrorCode, message: str,
                   receipt: str | None = None) -> None:
    """A STOMP refusal: ERROR with the message, the receipt, the code in the body."""
    assert error.command == "ERROR"
    assert error.headers["message"] == message
    assert error.headers.get("receipt-id") == receipt
    assert error.body == f"{code.name}: {message}\n".encode()


# ---------------------------------------------------------------- ack of an unknown id
def test_ack_of_an_unknown_id_is_refused_alike(tmp_path: Path) -> None:
    expected = "delivery tag 999 is not an unacked delivery of this connection"

    def test(server: BrokerServer) -> None:
        native = NativePeer(server)
        native.hello()
        (err,) = native.request(2, "ack", tags=[999])
        assert err == Err(2, ErrorCode.ILLEGAL_STATE, expected)
        assert isinstance(native.request(3, "ping")[0], Ok)  # native: the connection stays

        stomp = StompPeer(server)
        stomp.connect()
        (error,) = stomp.send("ACK", id="999", receipt="r")
        assert_refused(error, ErrorCode.ILLEGAL_STATE, expected, "r")
        assert stomp.wire.closed  # STOMP: every ERROR closes

    with_server(tmp_path, test)


def test_ack_of_an_acked_delivery_is_refused_alike(tmp_path: Path) -> None:
    """The same tag acked twice (in two requests, or twice in one) is unknown the
    second time, for both edges."""
    expected = "delivery tag 1 is not an unacked delivery of this connection"

    def test(server: BrokerServer) -> None:
        native = NativePeer(server)
        native.hello()
        native.request(2, "send", dest="ops-n", body=b"x", persistent=False)
        pushes = native.request(3, "subscribe", sub=1, queue="ops-n")
        (deliver,) = [e for e in pushes if isinstance(e, Push) and e.event == "deliver"]
        tag = deliver.data["tag"]
        assert tag == 1
        assert native.request(4, "ack", tags=[tag, tag]) == [
            Err(4, ErrorCode.ILLEGAL_STATE, expected)]  # named twice: refused, nothing acked
        assert native.request(5, "ack", tags=[tag]) == [Ok(5, {})]
        assert native.request(6, "ack", tags=[tag]) == [
            Err(6, ErrorCode.ILLEGAL_STATE, expected)]

        stomp = StompPeer(server)
        stomp.connect()
        stomp.send("SEND", b"x", destination="/queue/ops-s")
        frames = stomp.send("SUBSCRIBE", destination="/queue/ops-s", id="s",
                            ack="client-individual")
        (message,) = [f for f in frames if f.command == "MESSAGE"]
        ack_id = message.headers["ack"]  # the connection's prefix, then the tag
        assert ack_id.endswith("-1")
        assert stomp.send("ACK", id=ack_id, receipt="first")[0].headers["receipt-id"] == "first"
        (error,) = stomp.send("ACK", id=ack_id, receipt="again")
        assert_refused(error, ErrorCode.ILLEGAL_STATE, expected, "again")

    with_server(tmp_path, test)


@pytest.mark.parametrize(("version", "header", "ack_id"), [
    ("1.2", "id", "not-a-tag"),  # no tag stands for it
    ("1.1", "message-id", "12345"),  # no MESSAGE of this connection had that id
    ("1.0", "message-id", "12345"),
])
def test_stomp_ids_that_name_no_tag_get_the_same_rule(tmp_path: Path, version: str,
                                                      header: str, ack_id: str) -> None:
    def test(server: BrokerServer) -> None:
        stomp = StompPeer(server)
        stomp.connect(**{"accept-version": version})
        headers = {header: ack_id, "receipt": "r"}
        if version == "1.1":
            headers["subscription"] = "s"
        (error,) = stomp.send("NACK", **headers)
        assert_refused(error, ErrorCode.ILLEGAL_STATE, unknown_delivery(ack_id).message, "r")
        assert stomp.wire.closed

    with_server(tmp_path, test)


# ---------------------------------------------------------------- authentication
def test_auth_failure_is_refused_alike(tmp_path: Path) -> None:
    users = {"alice": hash_password("secret")}
    expected = "wrong user or password"

    def test(server: BrokerServer) -> None:
        native = NativePeer(server)
        assert native.request(1, "hello", version=1, user="alice", password="nope") == [
            Err(1, ErrorCode.AUTHENTICATION_FAILED, expected)]
        assert native.request(2, "ping") == [
            Err(2, ErrorCode.NOT_AUTHENTICATED, "the first request must be hello")]

        stomp = StompPeer(server)
        (error,) = stomp.send("CONNECT", **{"accept-version": "1.2", "login": "alice",
                                            "passcode": "nope"})
        assert_refused(error, ErrorCode.AUTHENTICATION_FAILED, expected)
        assert stomp.wire.closed

        good_native, good_stomp = NativePeer(server), StompPeer(server)
        good_native.hello(user="alice", password="secret")
        good_stomp.connect(login="alice", passcode="secret")

    with_server(tmp_path, test, users=users)


# ---------------------------------------------------------------- loopback only
def test_open_broker_refuses_a_peer_off_loopback_alike(tmp_path: Path) -> None:
    expected = "the broker has no users configured and serves loopback clients only"

    def test(server: BrokerServer) -> None:
        native = NativePeer(server, ELSEWHERE)
        assert native.events() == [Err(0, ErrorCode.AUTHENTICATION_FAILED, expected)]
        assert native.wire.closed

        stomp = StompPeer(server, ELSEWHERE)
        (error,) = stomp.frames()
        assert_refused(error, ErrorCode.AUTHENTICATION_FAILED, expected)
        assert stomp.wire.closed
        assert server.ops.sessions == {}

    with_server(tmp_path, test)


def test_open_broker_refuses_to_listen_off_loopback_alike(tmp_path: Path) -> None:
    expected = ("no users are configured: the broker runs open and only on loopback; "
                "refusing to listen on 0.0.0.0")

    async def test(server: BrokerServer) -> None:
        for listen in (server.listen_native, server.listen_stomp):
            with pytest.raises(ValueError) as refused:
                await listen("0.0.0.0", 0)
            assert str(refused.value) == expected

    with_server(tmp_path, test)

    async def start_elsewhere() -> None:
        await BrokerServer(ServerConfig(data=tmp_path / "d2", host="0.0.0.0", port=0,
                                        stomp_port=0, amqp_port=0)).start()

    with pytest.raises(ValueError, match=re.escape(expected)):
        asyncio.run(start_elsewhere())


def test_a_broker_with_users_serves_any_peer(tmp_path: Path) -> None:
    def test(server: BrokerServer) -> None:
        NativePeer(server, ELSEWHERE).hello(user="alice", password="secret")
        StompPeer(server, ELSEWHERE).connect(login="alice", passcode="secret")

    with_server(tmp_path, test, users={"alice": hash_password("secret")})


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("10.1.2.3", False), ("::ffff:10.1.2.3", False), ("0.0.0.0", False),
    ("example.org", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# ---------------------------------------------------------------- admission
def test_too_many_connections_are_refused_alike(tmp_path: Path) -> None:
    expected = "too many connections (max_connections)"

    def test(server: BrokerServer) -> None:
        NativePeer(server).hello()
        native = NativePeer(server)
        assert native.events() == [Err(0, ErrorCode.TOO_MANY_CONNECTIONS, expected)]
        (error,) = StompPeer(server).frames()
        assert_refused(error, ErrorCode.TOO_MANY_CONNECTIONS, expected)

    with_server(tmp_path, test, max_connections=1)


# ---------------------------------------------------------------- message size
def test_message_over_the_size_limit_is_refused_alike(tmp_path: Path) -> None:
    body = b"x" * (MAX_MESSAGE + 1)
    expected = f"message of {len(body)} bytes is above max_message_size ({MAX_MESSAGE})"

    def test(server: BrokerServer) -> None:
        native = NativePeer(server)
        native.hello()
        assert native.request(2, "send", dest="big", body=body) == [
            Err(2, ErrorCode.MESSAGE_TOO_LARGE, expected)]

        stomp = StompPeer(server)
        stomp.connect()
        (error,) = stomp.send("SEND", body, destination="/queue/big", receipt="r")
        assert_refused(error, ErrorCode.MESSAGE_TOO_LARGE, expected, "r")
        assert "big" not in server.broker.queues  # nothing was sent

    with_server(tmp_path, test)


# ---------------------------------------------------------------- back-pressure
def test_back_pressure_pauses_and_resumes_at_the_same_marks(tmp_path: Path) -> None:
    """Reading pauses above max_pending_requests waiting answers and resumes at half."""

    def test(server: BrokerServer) -> None:
        for peer in (NativePeer(server), StompPeer(server)):
            session = peer.connection.session
            assert isinstance(session, Session)
            session.waiting = 5
            assert not session.should_pause()
            session.waiting = 6
            assert session.should_pause() and not session.should_pause()  # once
            session.waiting = 3
            assert not session.should_resume()
            session.waiting = 2  # max_pending_requests // 2
            assert session.should_resume() and not session.reading_paused

    with_server(tmp_path, test, max_pending_requests=5)
