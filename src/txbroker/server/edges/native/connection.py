"""One native-protocol client connection: bytes in, operations, bytes out.

The edge loop is thin: ``data_received`` hands bytes to the sans-IO codec
(``protocol/native.py``), each request goes through the handler table
(``handlers.py``) to the session's operations (``ops.py``), and the server's
effect runner hands back what the core answers later. Replies of one read are
written in one ``write``. Every decision about the request — admission,
authentication, back-pressure, acks — is the operation layer's; this module
only turns its outcomes into ``ok``/``err``/``push`` frames.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from txbroker.core import LATER
from txbroker.core.streams import ReadResult
from txbroker.errors import BadRequest, BrokerError, ErrorCode, ProtocolError, TxBrokerError
from txbroker.protocol.columns import encode_page
from txbroker.protocol.native import (
    PROTOCOL_VERSION,
    Err,
    NativeConnection,
    Ok,
    Push,
    Request,
    Role,
    encode_error,
)
from txbroker.server.edges.native.handlers import HANDLERS
from txbroker.server.ops import Delivery, Operations, Session, as_refusal
from txbroker.server.ops.seams import abort_transport, hold_reading

log = logging.getLogger("txbroker.server")


def delivery_map(delivery: Delivery) -> dict[str, Any]:
    """The message map of docs/protocol.md ("Pushes") for one delivery."""
    message = delivery.message
    return {
        "tag": delivery.tag,
        "queue": message.queue,
        "body": delivery.body,
        "headers": message.headers or {},
        "message_id": message.message_id,
        "redelivered": delivery.redelivered,
        "delivery_count": message.delivery_count,
        "priority": message.priority,
        "timestamp_ms": message.timestamp_ms,
        "seq": message.id,
    }


class ClientConnection(asyncio.Protocol):
    """asyncio protocol for one client of the native protocol; a ``SessionSink``."""

    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self.codec = NativeConnection(Role.SERVER, max_frame_size=ops.config.max_frame_size)
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.closed = False
        self._out: list[bytes] = []
        self.peer = ""

    # ------------------------------------------------------------- asyncio side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection, or write the refusal and close."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        try:
            self.session = self.ops.open(self, peer[0] if peer else None, protocol="native",
                                         address=self.peer)
        except BrokerError as exc:
            self.transport.write(encode_error(0, exc.wire_code, exc.message))
            self.transport.close()
            self.closed = True

    def data_received(self, data: bytes) -> None:
        """Parse what arrived, run each request, write the replies."""
        session = self.session
        if self.closed or session is None:
            return
        self.codec.receive_data(data)
        now = self.ops.now()
        try:
            # drain() returns the valid frames first and raises on a later call
            # when garbage follows them: loop until it has nothing more.
            while events := self.codec.drain():
                for event in events:
                    if not isinstance(event, Request):
                        raise ProtocolError("clients may only send requests")
                    self._handle(session, event, now)
        except ProtocolError as exc:
            self.ops.run_effects()
            self._protocol_error(exc)
            return
        self.ops.run_effects()
        self.flush()
        if session.should_pause() and self.transport is not None:
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone: the session ends (the core rolls back, redelivers)."""
        self.closed = True
        if self.session is not None:
            self.session.end()

    # ------------------------------------------------------------- requests
    def _handle(self, session: Session, request: Request, now: int) -> None:
        rid = request.rid
        op = request.op
        try:
            if op == "hello":
                result: Any = self._hello(session, request.args)
            else:
                if not session.authenticated:
                    session.require_authenticated("hello")
                handler = HANDLERS.get(op)
                if handler is None:
                    raise BrokerError(f"unknown op {op!r}", ErrorCode.UNKNOWN_OP)
                result = handler(session, rid, request.args, now)
        except TxBrokerError as exc:
            self.fail(rid, as_refusal(exc))
            return
        if result is LATER:  # answered later: counted for back-pressure
            session.started(rid, result)
            return
        if isinstance(result, ReadResult):
            result = self._page(result)
        self.reply(rid, result)

    def _hello(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        if session.authenticated:
            raise BadRequest("hello was already sent on this connection")
        version = args.get("version", PROTOCOL_VERSION)
        if type(version) is not int or version != PROTOCOL_VERSION:  # (True == 1 == 1.0)
            raise BadRequest(f"unsupported protocol version {args.get('version')!r}; "
                             f"this broker speaks {PROTOCOL_VERSION}")
        session.authenticate(args.get("user"), args.get("password"))
        config = self.ops.config
        return {
            "server": "txbroker",
            "version": PROTOCOL_VERSION,
            "session": session.id,
            "max_frame_size": config.max_frame_size,
            "max_message_size": config.limits.max_message_size,
            "max_sink_branch_messages": config.limits.max_sink_branch_messages,
        }

    def _page(self, result: ReadResult) -> dict[str, Any]:
        """A ``stream_read`` reply: a page of packed columns (``protocol/columns.py``)."""
        messages = result.messages
        packed = self.ops.server.bodies(messages)
        return encode_page(
            result.queue, result.next,
            seqs=[m.seq for m in messages],
            timestamps=[m.timestamp_ms for m in messages],
            delivery_counts=[m.delivery_count for m in messages],
            message_ids=[m.message_id for m in messages],
            headers=[m.headers for m in messages],
            body_data=packed.data, body_lengths=packed.lengths)

    # ------------------------------------------------------------- output
    def reply(self, rid: int, result: Any) -> None:
        """An ``ok`` frame (nothing for rid 0)."""
        if rid:
            self._out.append(self.codec.send(Ok(rid, result)))

    def fail(self, rid: int, error: BrokerError) -> None:
        """An ``err`` frame, or an ``error`` push for rid 0."""
        if rid:
            self._out.append(self.codec.send(Err(rid, error.wire_code, error.message)))
        else:
            self.push("error", {"code": error.wire_code, "message": error.message})

    def push(self, event: str, data: dict[str, Any]) -> None:
        """A ``push`` frame."""
        self._out.append(self.codec.send(Push(event, data)))

    # ------------------------------------------------------------- SessionSink
    def answer(self, rid: int, result: Any) -> None:
        """The reply the core gave later."""
        self.reply(rid, result)

    def refuse(self, rid: int, error: BrokerError) -> None:
        """The refusal the core gave later."""
        self.fail(rid, error)

    def deliver(self, delivery: Delivery) -> None:
        """A ``deliver`` push, or the reply to a ``receive``."""
        data = delivery_map(delivery)
        if delivery.sub == 0:
            self.reply(delivery.rid, data)
        else:
            data["sub"] = delivery.sub
            self._out.append(self.codec.send(Push("deliver", data)))

    def cancelled(self, sub: int, reason: str) -> None:
        """A ``cancelled`` push."""
        self.push("cancelled", {"sub": sub, "reason": reason})

    def hold_input(self, held: bool) -> None:
        """Stop (``held``) or go on reading this client (``SessionSink``: a replication
        dump is being described, ``server/ha/joining.py``; a recovery checkpoint is
        taken, ``server/recovery.py``); a client paused for its pending requests stays
        paused until they are answered."""
        session = self.session
        hold_reading(self.transport, held or (session is not None and session.reading_paused))

    def abort(self) -> None:
        """Cut the connection at once, nothing more written (``SessionSink``: a fenced
        primary)."""
        abort_transport(self.transport)

    def close(self) -> None:
        """Shutdown: write what is gathered, then close."""
        self.flush()
        if self.transport is not None:
            self.transport.close()

    def flush(self) -> None:
        """Write everything gathered in one call; resume reading if we may."""
        if self._out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self._out))
        self._out.clear()
        session = self.session
        if session is not None and session.should_resume() and self.transport is not None \
                and not self.closed:
            self.transport.resume_reading()

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.info("protocol error from %s: %s", self.peer, exc)
        self.flush()
        if self.transport is not None:
            self.transport.write(encode_error(0, int(exc.code), str(exc)))
            self.transport.close()
        self.closed = True
        if self.session is not None:
            self.session.end()


__all__ = ["ClientConnection", "delivery_map"]
