"""Sans-IO codec of the native protocol (``txb://``), see ``docs/protocol.md``.

Theory of operation
-------------------
A :class:`NativeConnection` is one side of one TCP connection, without the
TCP: the caller hands it the bytes it read (:meth:`~NativeConnection.receive_data`)
and gets back events (:meth:`~NativeConnection.next_event` or, faster,
:meth:`~NativeConnection.drain`); it hands it events to write
(:meth:`~NativeConnection.send`) and gets back bytes. No socket, loop, clock
or file is touched here, as in ``h11``.

Bytes on the wire::

    offset  size  field
    0       4     N, big-endian unsigned: length of the payload, 1 ≤ N ≤ max_frame_size
    4       N     msgpack (use_bin_type) of the array [type, rid, name, body]

    type 0 REQUEST  client → server  rid ≥ 0 (0 = no reply)  name = op   body = map
    type 1 OK       server → client  rid ≥ 1                 name = ""   body = any
    type 2 ERR      server → client  rid ≥ 0 (0 = unknown)   name = ""   body = {code, message}
    type 3 PUSH     server → client  rid = 0                 name = event body = map

Errors: a frame the *peer* got wrong (bad length, not a 4-array, bad types,
a type that may not travel in that direction) raises
:class:`~txbroker.errors.ProtocolError` (or its subclass
:class:`~txbroker.errors.FrameTooLarge`) and moves the receiving side to
:attr:`ConnectionState.ERROR`: every later ``next_event``/``drain`` raises
again. Sending is still allowed in that state, so that a server can write
the ``err`` frame (see :func:`encode_error`) before it closes. An event *we*
got wrong (wrong direction, wrong types, not msgpack-able, too large for the
peer) raises :class:`LocalProtocolError` and changes nothing.

Typical edge loop (a server)::

    codec.receive_data(data)
    try:
        while events := codec.drain():   # loop: an error after valid frames
            handle(events)               # is raised by the *next* drain()
    except ProtocolError as exc:
        transport.write(encode_error(0, exc.code, str(exc)))
        transport.close()

Speed: the receive buffer is one ``bytearray``; complete frames are decoded
straight out of a ``memoryview`` of it and the consumed prefix is deleted
once per :meth:`~NativeConnection.drain` call (CPython deletes a bytearray
prefix in O(1)), so there is no per-byte Python work.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from txbroker.errors import FrameTooLarge, ProtocolError, TxBrokerError

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_PORT",
    "HEADER_SIZE",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "ConnectionState",
    "Err",
    "Event",
    "FrameType",
    "LocalProtocolError",
    "NativeConnection",
    "NeedData",
    "Ok",
    "Push",
    "Request",
    "Role",
    "encode_error",
]

#: Default limit on a frame's payload (docs/protocol.md: "default 8 MiB").
DEFAULT_MAX_FRAME_SIZE: Final = 8 * 1024 * 1024
#: Default TCP port of the native protocol (docs/protocol.md title).
DEFAULT_PORT: Final = 5445
#: Version sent in and expected from ``hello``.
PROTOCOL_VERSION: Final = 1

_LENGTH: Final = struct.Struct(">I")
_pack_length: Final = _LENGTH.pack
#: Size of the length prefix of every frame.
HEADER_SIZE: Final = _LENGTH.size
assert HEADER_SIZE == 4
#: Largest length the 4-byte prefix can express.
_MAX_ENCODABLE: Final = 0xFFFFFFFF


class FrameType(enum.IntEnum):
    """First element of every frame's array."""

    REQUEST = 0
    OK = 1
    ERR = 2
    PUSH = 3


class Role(enum.Enum):
    """Which side of the connection this codec speaks for."""

    CLIENT = "client"
    SERVER = "server"


class ConnectionState(enum.Enum):
    """State of the receiving side."""

    OPEN = "open"
    #: The peer broke the protocol; nothing more can be received.
    ERROR = "error"


class NeedData:
    """Type of :data:`NEED_DATA`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


#: Returned by :meth:`NativeConnection.next_event` when no complete frame is buffered.
NEED_DATA: Final = NeedData()


class LocalProtocolError(TxBrokerError):
    """We tried to send something the protocol does not allow (our bug, not the peer's)."""


@dataclass(slots=True)
class Request:
    """A client's request: ``rid`` ≥ 1 wants a reply, 0 wants none."""

    rid: int
    op: str
    args: dict[str, Any]


@dataclass(slots=True)
class Ok:
    """The successful reply to request ``rid``."""

    rid: int
    result: Any


@dataclass(slots=True)
class Err:
    """The failed reply to request ``rid`` (0 if the request is unknown)."""

    rid: int
    code: int
    message: str


@dataclass(slots=True)
class Push:
    """A server-initiated event such as ``deliver``."""

    event: str
    data: dict[str, Any]


Event = Request | Ok | Err | Push

_REQUEST: Final = 0
_OK: Final = 1
_ERR: Final = 2
_PUSH: Final = 3


def _packer() -> msgpack.Packer:
    return msgpack.Packer(use_bin_type=True, autoreset=True)


_module_packer: Final = _packer()


def encode_error(rid: int, code: int, message: str) -> bytes:
    """Encode an ``ERR`` frame; rid 0 reports an error not tied to a request."""
    payload = _module_packer.pack([_ERR, rid, "", {"code": int(code), "message": message}])
    return _pack_length(len(payload)) + payload


class NativeConnection:
    """One side of a native-protocol connection, without I/O.

    ``max_frame_size`` bounds frames we *receive*; ``peer_max_frame_size``
    (set it from the ``hello`` reply) bounds frames we *send*.
    """

    __slots__ = (
        "_buffer",
        "_error",
        "_is_client",
        "_packer",
        "max_frame_size",
        "peer_max_frame_size",
        "role",
    )

    def __init__(
        self,
        role: Role,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        peer_max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        if not 1 <= max_frame_size <= _MAX_ENCODABLE:
            raise ValueError(f"max_frame_size must be in 1..{_MAX_ENCODABLE}")
        self.role = role
        self._is_client = role is Role.CLIENT
        self.max_frame_size = max_frame_size
        self.peer_max_frame_size = peer_max_frame_size
        self._buffer = bytearray()
        self._error: ProtocolError | None = None
        self._packer = _packer()

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> ConnectionState:
        """OPEN, or ERROR once the peer broke the protocol."""
        return ConnectionState.OPEN if self._error is None else ConnectionState.ERROR

    @property
    def buffered(self) -> int:
        """Bytes received but not yet turned into events (a partial frame at EOF)."""
        return len(self._buffer)

    # -------------------------------------------------------------- receiving

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes read from the peer. Ignored once in the ERROR state."""
        if self._error is None:
            self._buffer += data

    def next_event(self) -> Event | NeedData:
        """Return the next complete event, or :data:`NEED_DATA`."""
        events = self._parse(1)
        return events[0] if events else NEED_DATA

    def drain(self) -> list[Event]:
        """Return every complete event buffered (empty list = need more data).

        If a violation follows valid frames, the valid events are returned
        first and the error is raised by the next call: call ``drain`` until
        it returns an empty list (``while events := codec.drain(): ...``).
        """
        return self._parse(-1)

    def _fail(self, error: ProtocolError) -> ProtocolError:
        self._error = error
        self._buffer = bytearray()
        return error

    def _parse(self, limit: int) -> list[Event]:
        if self._error is not None:
            raise type(self._error)(f"connection is in ERROR state: {self._error}")
        buf = self._buffer
        size = len(buf)
        if size < HEADER_SIZE:
            return []
        events: list[Event] = []
        pos = 0
        unpack_length = _LENGTH.unpack_from
        unpackb = msgpack.unpackb
        is_server = self.role is Role.SERVER
        max_size = self.max_frame_size
        failure: ProtocolError | None = None
        view = memoryview(buf)
        try:
            while size - pos >= HEADER_SIZE and limit != 0:
                (length,) = unpack_length(buf, pos)
                if length > max_size:
                    failure = FrameTooLarge(
                        f"frame of {length} bytes exceeds the limit of {max_size}"
                    )
                    break
                if length == 0:
                    failure = ProtocolError("frame of length 0")
                    break
                end = pos + HEADER_SIZE + length
                if end > size:
                    break
                try:
                    obj = unpackb(view[pos + HEADER_SIZE : end], use_list=True, raw=False)
                except Exception as exc:  # msgpack raises many ValueError/TypeError kinds
                    failure = ProtocolError(f"undecodable frame: {exc.__class__.__name__}")
                    break
                event = _to_event(obj, is_server)
                if type(event) is str:
                    failure = ProtocolError(event)
                    break
                events.append(event)  # type: ignore[arg-type]
                pos = end
                limit -= 1
        finally:
            view.release()
        if pos:
            del buf[:pos]
        if failure is not None:
            self._fail(failure)
            if not events:
                raise failure
        return events

    # ---------------------------------------------------------------- sending

    def send(self, event: Event) -> bytes:
        """Encode one event as a frame; raises LocalProtocolError on misuse."""
        obj = self._as_list(event) if self._is_client else _reply_as_list(event)
        try:
            payload = self._packer.pack(obj)
        except (TypeError, ValueError, OverflowError) as exc:
            self._packer.reset()
            raise LocalProtocolError(f"cannot encode {type(event).__name__}: {exc}") from exc
        size = len(payload)
        if size > self.peer_max_frame_size:
            raise LocalProtocolError(
                f"frame of {size} bytes exceeds the peer's limit of {self.peer_max_frame_size}"
            )
        return _pack_length(size) + payload

    def send_many(self, events: list[Event]) -> bytes:
        """Encode several events into one bytes object (one write)."""
        return b"".join([self.send(event) for event in events])

    @staticmethod
    def _as_list(event: Event) -> list[Any]:
        if type(event) is not Request:
            raise LocalProtocolError(f"a client cannot send {type(event).__name__}")
        rid = event.rid
        if type(rid) is not int or rid < 0:
            raise LocalProtocolError(f"bad request id {rid!r}")
        if type(event.op) is not str or type(event.args) is not dict:
            raise LocalProtocolError("a request needs a str op and a dict of args")
        return [_REQUEST, rid, event.op, event.args]


def _reply_as_list(event: Event) -> list[Any]:
    """Validate an event a server sends; return the frame's array."""
    cls = type(event)
    if cls is Ok:
        ok: Ok = event  # type: ignore[assignment]
        if type(ok.rid) is not int or ok.rid < 1:
            raise LocalProtocolError(f"bad reply id {ok.rid!r}")
        return [_OK, ok.rid, "", ok.result]
    if cls is Push:
        push: Push = event  # type: ignore[assignment]
        if type(push.event) is not str or not push.event or type(push.data) is not dict:
            raise LocalProtocolError("a push needs a non-empty str event and a dict")
        return [_PUSH, 0, push.event, push.data]
    if cls is Err:
        err: Err = event  # type: ignore[assignment]
        if type(err.rid) is not int or err.rid < 0:
            raise LocalProtocolError(f"bad reply id {err.rid!r}")
        if type(err.message) is not str:
            raise LocalProtocolError("an error message must be a str")
        return [_ERR, err.rid, "", {"code": int(err.code), "message": err.message}]
    raise LocalProtocolError(f"a server cannot send {cls.__name__}")


def _to_event(obj: Any, is_server: bool) -> Event | str:
    """Validate a decoded frame; return the event or a reason string for the error."""
    if type(obj) is not list or len(obj) != 4:
        return "a frame must be an array of 4 elements"
    kind, rid, name, body = obj
    if type(kind) is not int or type(rid) is not int or type(name) is not str:
        return "a frame must be [int type, int rid, str name, body]"
    if rid < 0:
        return f"negative request id {rid}"
    if kind == _REQUEST:
        if not is_server:
            return "a client cannot receive a REQUEST"
        if type(body) is not dict:
            return "request arguments must be a map"
        return Request(rid, name, body)
    if kind in (_OK, _ERR, _PUSH) and is_server:
        return f"a server cannot receive a frame of type {kind}"
    if kind == _OK:
        if rid == 0:
            return "an OK reply needs a request id"
        return Ok(rid, body)
    if kind == _ERR:
        if type(body) is not dict:
            return "an ERR body must be a map"
        code = body.get("code")
        message = body.get("message", "")
        if type(code) is not int or type(message) is not str:
            return "an ERR body needs an int code and a str message"
        return Err(rid, code, message)
    if kind == _PUSH:
        if rid != 0 or not name or type(body) is not dict:
            return "a PUSH needs rid 0, an event name and a map"
        return Push(name, body)
    return f"unknown frame type {kind}"
