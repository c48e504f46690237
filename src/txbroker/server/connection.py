"""One native-protocol client connection: bytes in, core commands, bytes out.

The edge loop is thin: ``data_received`` hands bytes to the sans-IO codec,
each request goes to the broker core, and the server's effect runner writes
whatever comes back. Replies for one read are batched into one write. When a
client has too many requests waiting for durability, reading pauses
(back-pressure) until half of them are answered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, cast

from txbroker.core import LATER
from txbroker.core.streams import ReadResult
from txbroker.errors import (
    XAER_RMERR,
    BrokerError,
    ErrorCode,
    NotAuthenticated,
    ProtocolError,
    TxBrokerError,
    XAError,
)
from txbroker.protocol.native import (
    Err,
    NativeConnection,
    Ok,
    Push,
    Request,
    Role,
    encode_error,
)
from txbroker.server.handlers import HANDLERS

if TYPE_CHECKING:
    from txbroker.server.app import BrokerServer

log = logging.getLogger("txbroker.server")

PROTOCOL_VERSION = 1


class ClientConnection(asyncio.Protocol):
    """asyncio protocol for one client of the native protocol."""

    def __init__(self, server: BrokerServer, session_id: int) -> None:
        self.server = server
        self.session_id = session_id
        self.codec = NativeConnection(Role.SERVER, max_frame_size=server.config.max_frame_size)
        self.transport: asyncio.Transport | None = None
        self.authenticated = False
        self.user: str | None = None
        self.waiting = 0  #: requests answered later (LATER) not yet answered
        self.paused = False
        self.closed = False
        self._out: list[bytes] = []
        self.peer = ""

    # ------------------------------------------------------------- asyncio side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        if not self.server.admit(self):
            self.transport.write(encode_error(0, ErrorCode.TOO_MANY_CONNECTIONS,
                                              "too many connections (max_connections)"))
            self.transport.close()
            self.closed = True

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.codec.receive_data(data)
        now = self.server.now()
        try:
            # drain() returns the valid frames first and raises on a later call
            # when garbage follows them: loop until it has nothing more.
            while events := self.codec.drain():
                for event in events:
                    if not isinstance(event, Request):
                        raise ProtocolError("clients may only send requests")
                    self._handle(event, now)
        except ProtocolError as exc:
            self.server.run_effects()
            self._protocol_error(exc)
            return
        self.server.run_effects()
        self.flush()
        if self.waiting > self.server.config.max_pending_requests and not self.paused:
            self.paused = True
            if self.transport is not None:
                self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed and self.session_id not in self.server.connections:
            return
        self.closed = True
        self.server.forget(self)

    # ------------------------------------------------------------- requests
    def _handle(self, request: Request, now: int) -> None:
        rid = request.rid
        try:
            if request.op == "hello":
                self.reply(rid, self._hello(request.args))
                return
            if not self.authenticated:
                raise NotAuthenticated("the first request must be hello")
            if request.op == "stats":
                self.reply(rid, self.server.stats())
                return
            handler = HANDLERS.get(request.op)
            if request.op.startswith(("xa_", "sink_")) and not self.server.supports_xa:
                raise XAError(XAER_RMERR, "this broker's store (--store dir) does not support "
                              "XA yet: use the journal store")
            if handler is None:
                self.fail(rid, BrokerError(f"unknown op {request.op!r}", ErrorCode.UNKNOWN_OP))
                return
            result = handler(self.server.broker, self.session_id, rid, request.args, now)
        except BrokerError as exc:
            self.fail(rid, exc)
            return
        except TxBrokerError as exc:
            self.fail(rid, BrokerError(str(exc)))
            return
        if result is LATER:
            if rid:
                self.waiting += 1
            return
        if isinstance(result, ReadResult):
            result = self.server.read_result(result)
        self.reply(rid, result)

    def _hello(self, args: dict[str, Any]) -> dict[str, Any]:
        from txbroker.errors import AuthenticationFailed, BadRequest

        if self.authenticated:
            raise BadRequest("hello was already sent on this connection")
        if args.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            raise BadRequest(f"unsupported protocol version {args.get('version')!r}; "
                             f"this broker speaks {PROTOCOL_VERSION}")
        user, password = args.get("user"), args.get("password")
        if not self.server.auth.check(user, password):
            log.warning("authentication failed for user %r from %s", user, self.peer)
            raise AuthenticationFailed("wrong user or password")
        self.authenticated = True
        self.user = user if isinstance(user, str) else None
        self.server.broker.open_session(self.session_id, self.user)
        return {
            "server": "txbroker",
            "version": PROTOCOL_VERSION,
            "session": self.session_id,
            "max_frame_size": self.server.config.max_frame_size,
            "max_message_size": self.server.config.limits.max_message_size,
            "max_sink_branch_messages": self.server.config.limits.max_sink_branch_messages,
        }

    # ------------------------------------------------------------- output
    def reply(self, rid: int, result: Any) -> None:
        if rid:
            self._out.append(self.codec.send(Ok(rid, result)))

    def answer_later(self, rid: int, result: Any) -> None:
        self.waiting -= 1
        self.reply(rid, result)

    def fail(self, rid: int, error: BrokerError) -> None:
        if rid:
            self._out.append(self.codec.send(Err(rid, error.wire_code, error.message)))
        else:
            self.push("error", {"code": error.wire_code, "message": error.message})

    def fail_later(self, rid: int, error: BrokerError) -> None:
        self.waiting -= 1
        self.fail(rid, error)

    def push(self, event: str, data: dict[str, Any]) -> None:
        self._out.append(self.codec.send(Push(event, data)))

    def deliver(self, sub: int, data: dict[str, Any]) -> None:
        data["sub"] = sub
        self._out.append(self.codec.send(Push("deliver", data)))

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()

    def flush(self) -> None:
        """Write everything gathered in one call; resume reading if we may."""
        if self._out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self._out))
        self._out.clear()
        if self.paused and self.waiting <= self.server.config.max_pending_requests // 2:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.info("protocol error from %s: %s", self.peer, exc)
        self.flush()
        if self.transport is not None:
            self.transport.write(encode_error(0, int(exc.code), str(exc)))
            self.transport.close()
        self.closed = True
        self.server.forget(self)
