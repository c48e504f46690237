"""The in-memory connection of ``tests/inmemory.py``: a :class:`Pipe` joins the client
library's :class:`~txbroker.client.transport.Stream` (:class:`ClientSide`) to a broker
protocol's asyncio transport (:class:`BrokerSide`), and taps both directions into the
node's :class:`WireLog` with the real codec. See ``tests/inmemory.py`` for the theory
of operation."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from txbroker.errors import ErrorCode, ProtocolError
from txbroker.protocol.native import (
    HEADER_SIZE,
    Err,
    NativeConnection,
    Ok,
    Push,
    Request,
    Role,
)

if TYPE_CHECKING:
    from tests.inmemory import Node

#: The largest frame the wire tap decodes (it judges nothing: the edges do).
TAP_MAX_FRAME = 1 << 30
#: Where every in-memory client seems to connect from: loopback, which a broker without
#: users serves (``Operations.open``).
CLIENT_HOST = "127.0.0.1"
#: The errors a broker refuses a connection with (at open or in reply to ``hello``).
REFUSALS = frozenset({ErrorCode.STANDBY, ErrorCode.SHUTTING_DOWN,
                      ErrorCode.TOO_MANY_CONNECTIONS})

Reply = Ok | Err | Push


@dataclass
class WireLog:
    """What one node's connections carried, decoded: ``(pipe id, event)`` in order."""

    requests: list[tuple[int, Request]] = field(default_factory=list)
    replies: list[tuple[int, Reply]] = field(default_factory=list)

    def ops(self, *names: str) -> list[dict[str, Any]]:
        """The arguments of every request named one of ``names``, in arrival order."""
        return [request.args for _, request in self.requests if request.op in names]

    def names(self) -> list[str]:
        """Every request's op, in arrival order."""
        return [request.op for _, request in self.requests]

    def _matching(self, op: str, args: dict[str, Any]) -> list[tuple[int, Request]]:
        return [(pipe, request) for pipe, request in self.requests if request.op == op
                and all(request.args.get(key) == value for key, value in args.items())]

    def seen(self, op: str, **args: Any) -> bool:
        """True once the broker read a request ``op`` whose arguments include ``args``."""
        return bool(self._matching(op, args))

    def answered(self, op: str, **args: Any) -> bool:
        """True once the broker wrote its reply to such a request (even a held one)."""
        wanted = {(pipe, request.rid) for pipe, request in self._matching(op, args)}
        return any((pipe, reply.rid) in wanted for pipe, reply in self.replies
                   if isinstance(reply, Ok | Err))

    @property
    def refusals(self) -> int:
        """Connections the broker refused (``Standby``, ``TooManyConnections`` …)."""
        return sum(1 for _, reply in self.replies
                   if isinstance(reply, Err) and reply.code in REFUSALS)

    @property
    def hellos(self) -> list[dict[str, Any]]:
        """The ``hello`` arguments of every connection the broker accepted."""
        accepted = {(pipe, reply.rid) for pipe, reply in self.replies if isinstance(reply, Ok)}
        return [request.args for pipe, request in self.requests
                if request.op == "hello" and (pipe, request.rid) in accepted]


class BrokerSide(asyncio.Transport):
    """The transport the broker's protocol writes to: one end of a :class:`Pipe`."""

    def __init__(self, pipe: Pipe) -> None:
        super().__init__()
        self._pipe = pipe
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``peername``: the client's (loopback) address; nothing else is known."""
        return (CLIENT_HOST, self._pipe.id) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send bytes to the client (held while the node is stalled)."""
        if not self._closing:
            self._pipe.to_client(bytes(data))

    def is_closing(self) -> bool:
        """True once closed or aborted."""
        return self._closing

    def close(self) -> None:
        """Close after what was written: the client reads end of stream."""
        if not self._closing:
            self._closing = True
            self._pipe.broker_closed(reset=False)

    def abort(self) -> None:
        """Close at once: the client sees a reset."""
        if not self._closing:
            self._closing = True
            self._pipe.broker_closed(reset=True)

    def pause_reading(self) -> None:
        """Stop handing the client's bytes to the protocol (back-pressure)."""
        self._pipe.paused = True

    def resume_reading(self) -> None:
        """Hand over what arrived meanwhile, in a later loop turn."""
        self._pipe.resume()

    def is_reading(self) -> bool:
        """False while paused."""
        return not self._pipe.paused

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Nothing is buffered here."""

    def get_write_buffer_size(self) -> int:
        """Nothing is buffered here."""
        return 0


class ClientSide:
    """The client's :class:`~txbroker.client.transport.Stream`: the other end of a pipe."""

    def __init__(self, pipe: Pipe, loop: asyncio.AbstractEventLoop) -> None:
        self._pipe = pipe
        self._loop = loop
        self._buffer = bytearray()
        self._ended = False
        self._error: Exception | None = None
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None

    async def read(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes; ``b""`` at end of stream; ConnectionResetError."""
        while not self._buffer and not self._ended:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._buffer:
            chunk = bytes(self._buffer[:max_bytes])
            del self._buffer[:max_bytes]
            return chunk
        if self._error is not None:
            raise self._error
        return b""

    def write(self, data: bytes) -> None:
        """Queue bytes for the broker (dropped once the stream ended, as TCP's are)."""
        if not self._closed and not self._ended:
            self._pipe.to_broker(bytes(data))

    async def drain(self) -> None:
        """Nothing is buffered here."""

    def close(self) -> None:
        """Close our end: the broker sees the connection lost."""
        if not self._closed:
            self._closed = True
            self._pipe.client_closed()
            self.feed_end(None)

    # ---- called on the client's loop by the pipe
    def feed(self, data: bytes) -> None:
        """Bytes from the broker."""
        if not self._ended:
            self._buffer += data
            self._wake()

    def feed_end(self, error: Exception | None) -> None:
        """End of stream (``error``: a reset)."""
        if not self._ended:
            self._ended = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Pipe:
    """One in-memory connection between a client and a node (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, node: Node, protocol: asyncio.Protocol,
                 client_loop: asyncio.AbstractEventLoop) -> None:
        self.id = next(Pipe._ids)
        self.node = node
        self.protocol = protocol
        self.broker_loop = node.loop
        #: the life of the node's process this connection reached (see :meth:`connect`)
        self.incarnation = node.incarnation
        self.client_loop = client_loop
        self.stream = ClientSide(self, client_loop)
        self.transport = BrokerSide(self)
        #: False once the broker side is gone (closed, lost, or its process killed)
        self.broker_open = True
        self.paused = False
        self._unread: list[bytes] = []
        self._held: list[bytes] = []
        self._requests = NativeConnection(Role.SERVER, max_frame_size=TAP_MAX_FRAME)
        self._replies = NativeConnection(Role.CLIENT, max_frame_size=TAP_MAX_FRAME)
        self._out = bytearray()

    # ---- the broker's loop
    def connect(self) -> None:
        """``connection_made`` on the broker's side: the connection was accepted on the
        client's loop, and the process that accepted it may have died since."""
        if self.node.incarnation != self.incarnation:
            self.sever()
        elif self.broker_open:
            self.node.pipes.add(self)
            self.protocol.connection_made(self.transport)

    def _arrive(self, data: bytes) -> None:
        if not self.broker_open:
            return
        self._requests.receive_data(data)
        with contextlib.suppress(ProtocolError):  # garbage: the edge itself answers it
            while events := self._requests.drain():
                self.node.log.requests.extend((self.id, event) for event in events
                                              if isinstance(event, Request))
        if self.paused:
            self._unread.append(data)
        else:
            self.protocol.data_received(data)

    def resume(self) -> None:
        """Reading resumes: what arrived meanwhile goes in, in a later turn."""
        self.paused = False

        def hand_over() -> None:
            while self._unread and not self.paused and self.broker_open:
                self.protocol.data_received(self._unread.pop(0))

        self.broker_loop.call_soon(hand_over)

    def to_client(self, data: bytes) -> None:
        """Bytes the broker wrote: tapped frame by frame, held while the node stalls."""
        if not self.broker_open:  # written by a dead broker: nobody reads it
            return
        self._out += data
        while len(self._out) >= HEADER_SIZE:
            size = HEADER_SIZE + int.from_bytes(self._out[:HEADER_SIZE], "big")
            if len(self._out) < size:
                break
            frame = bytes(self._out[:size])
            del self._out[:size]
            self._replies.receive_data(frame)
            with contextlib.suppress(ProtocolError):  # garbage: the client itself judges it
                self.node.log.replies.extend((self.id, event) for event in self._replies.drain()
                                             if not isinstance(event, Request))
            if self.node.stalled:
                self._held.append(frame)
            else:
                self.client_loop.call_soon_threadsafe(self.stream.feed, frame)

    def release(self) -> None:
        """The stall is over: the held bytes go, in order."""
        held, self._held = self._held, []
        for frame in held:
            self.client_loop.call_soon_threadsafe(self.stream.feed, frame)

    def broker_closed(self, *, reset: bool) -> None:
        """The broker closed (or aborted) the connection."""
        if not reset:
            self.release()
        self.client_loop.call_soon_threadsafe(
            self.stream.feed_end, ConnectionResetError("reset by the broker") if reset else None)
        self.broker_loop.call_soon(self._lost, None)

    def _lost(self, exc: Exception | None) -> None:
        if self.broker_open:
            self.broker_open = False
            self.node.pipes.discard(self)
            self.protocol.connection_lost(exc)

    def cut(self) -> None:
        """A reset that both sides see (the broker lives on)."""
        self._held.clear()
        self.client_loop.call_soon_threadsafe(
            self.stream.feed_end, ConnectionResetError("connection reset"))
        self._lost(ConnectionResetError("connection reset"))

    def sever(self) -> None:
        """The broker's process died: the client sees a reset; the broker runs nothing."""
        self.broker_open = False
        self._held.clear()
        self.client_loop.call_soon_threadsafe(
            self.stream.feed_end, ConnectionResetError("the broker died"))

    # ---- the client's loop
    def to_broker(self, data: bytes) -> None:
        """Bytes the client wrote."""
        self.broker_loop.call_soon_threadsafe(self._arrive, data)

    def client_closed(self) -> None:
        """The client closed its end."""
        self.broker_loop.call_soon_threadsafe(self._lost, None)
