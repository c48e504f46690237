"""Sans-IO codec of AMQP 0-9-1 (the server's side), over pamqp's frame marshalling.

Theory of operation
-------------------
An :class:`AmqpConnection` is the server's side of one AMQP 0-9-1 connection
without the TCP, like ``protocol/stomp.py``: the edge hands it the bytes it read
(:meth:`~AmqpConnection.receive_data`) and takes events
(:meth:`~AmqpConnection.next_event` or :meth:`~AmqpConnection.drain`); it asks
for bytes to write (:meth:`~AmqpConnection.send_method`,
:meth:`~AmqpConnection.send_content`, :meth:`~AmqpConnection.send_heartbeat`).
pamqp (the library aiormq and aio-pika use) encodes and decodes each frame's
payload; what is ours is framing, limits, content assembly and the errors.

The bytes on the wire (AMQP 0-9-1, section 4.2.3)::

    "AMQP" 0 0 9 1                   the client's protocol header, once, first
    type:1 channel:2 size:4 payload:size 0xCE     every frame after it

    type 1 method, 2 content header, 3 content body, 8 heartbeat

A content-bearing method (``basic.publish`` from a client) is followed on its
channel by one content header frame and as many body frames as its body size
needs; the codec assembles them into one :class:`ContentReceived` event.
Frames of other channels may come in between (spec 4.2.6); a method frame
on a channel whose content is incomplete may not.

Which frame may arrive when is one table, :data:`TRANSITIONS` (below).

Errors: anything the peer got wrong raises :class:`AmqpProtocolError` with the
AMQP reply code the connection must be closed with (501 FRAME_ERROR for bad
framing or a frame above ``frame_max``, 502 SYNTAX_ERROR for a payload pamqp
cannot decode, 505 UNEXPECTED_FRAME for a frame out of order, 540
NOT_IMPLEMENTED for a method a client may not send) and moves the codec to
:attr:`CodecState.ERROR`: later ``next_event`` calls raise the same error. A
wrong protocol header raises :class:`ProtocolHeaderMismatch`: the spec says to
answer with our own header (:data:`PROTOCOL_HEADER`) and close. Sending stays
allowed in every state, so that the edge can write ``connection.close``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Final

from pamqp import body as pamqp_body
from pamqp import commands, exceptions, frame, header, heartbeat

from txbroker.errors import ProtocolError
from txbroker.protocol.amqp.hot import (
    ACK_INDEX,
    PUBLISH_INDEX,
    PropertiesCache,
    ack_frame,
    content_frames,
    deliver_frame,
    header_body_size,
    method_payload,
    read_ack,
    read_publish,
)
from txbroker.protocol.native import NEED_DATA, LocalProtocolError, NeedData

__all__ = [
    "DEFAULT_FRAME_MAX",
    "DEFAULT_MAX_BODY_SIZE",
    "FRAME_END",
    "FRAME_MIN_SIZE",
    "PROTOCOL_HEADER",
    "TRANSITIONS",
    "AmqpConnection",
    "AmqpProtocolError",
    "CodecState",
    "ContentReceived",
    "Event",
    "HeartbeatReceived",
    "MethodReceived",
    "ProtocolHeaderMismatch",
    "ProtocolHeaderReceived",
    "ReplyCode",
]

#: The client's first 8 bytes: "AMQP", 0, then the version 0-9-1 (spec 4.2.2).
PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
#: Every frame ends with this octet (spec 4.2.3).
FRAME_END: Final = 0xCE
#: type (1) + channel (2) + payload size (4).
FRAME_HEADER_SIZE: Final = 7
#: A frame's header and end octet: its size is payload + 8.
FRAME_OVERHEAD: Final = FRAME_HEADER_SIZE + 1
#: The smallest frame_max a peer may agree to (spec 4.2.1, ``frame-min-size``).
FRAME_MIN_SIZE: Final = 4096
#: The frame_max we offer in connection.tune: RabbitMQ's default (128 KiB).
DEFAULT_FRAME_MAX: Final = 131072
#: The largest message body a client may publish (the broker's own limit on a
#: message is ``[limits] max_message_size``; this bounds what the codec buffers).
DEFAULT_MAX_BODY_SIZE: Final = 8 * 1024 * 1024

_METHOD, _HEADER, _BODY, _HEARTBEAT = 1, 2, 3, 8
_FRAME_TYPES: Final = frozenset({_METHOD, _HEADER, _BODY, _HEARTBEAT})
_HEAD: Final = struct.Struct(">BHI")
assert _HEAD.size == FRAME_HEADER_SIZE
_INDEX: Final = struct.Struct(">I")
#: A content header's class, weight and body size, before its property flags.
_CONTENT_HEAD_SIZE: Final = 12


class ReplyCode(enum.IntEnum):
    """AMQP 0-9-1 reply codes (spec 1.9, "Constants"), as RabbitMQ uses them."""

    REPLY_SUCCESS = 200
    CONTENT_TOO_LARGE = 311
    NO_ROUTE = 312
    NO_CONSUMERS = 313
    CONNECTION_FORCED = 320
    INVALID_PATH = 402
    ACCESS_REFUSED = 403
    NOT_FOUND = 404
    RESOURCE_LOCKED = 405
    PRECONDITION_FAILED = 406
    FRAME_ERROR = 501
    SYNTAX_ERROR = 502
    COMMAND_INVALID = 503
    CHANNEL_ERROR = 504
    UNEXPECTED_FRAME = 505
    RESOURCE_ERROR = 506
    NOT_ALLOWED = 530
    NOT_IMPLEMENTED = 540
    INTERNAL_ERROR = 541


class AmqpProtocolError(ProtocolError):
    """The peer broke AMQP: close the connection with ``reply_code`` and ``text``
    (``channel``, ``class_id`` and ``method_id`` name the offending frame, 0 if none)."""

    def __init__(self, reply_code: ReplyCode, text: str, *, channel: int = 0,
                 class_id: int = 0, method_id: int = 0) -> None:
        super().__init__(text)
        self.reply_code = reply_code
        self.text = text
        self.channel = channel
        self.class_id = class_id
        self.method_id = method_id


class ProtocolHeaderMismatch(AmqpProtocolError):
    """The first bytes are not AMQP 0-9-1's header: answer :data:`PROTOCOL_HEADER`, close."""


class CodecState(enum.Enum):
    """The receiving side's state (see :data:`TRANSITIONS`)."""

    #: Nothing read yet: the protocol header must come first.
    AWAIT_HEADER = "await-header"
    #: Frames flow.
    FRAMES = "frames"
    #: The peer broke the protocol: nothing more is read.
    ERROR = "error"


class _In(enum.Enum):
    """What arrived, as the table sees it."""

    PROTOCOL_HEADER = "protocol header"
    FRAME = "frame"


#: (state, input) -> next state; anything missing is a protocol error.
TRANSITIONS: Final[dict[tuple[CodecState, _In], CodecState]] = {
    # Rule 1: the connection begins with the protocol header, once.
    (CodecState.AWAIT_HEADER, _In.PROTOCOL_HEADER): CodecState.FRAMES,
    # Rule 2: after it, frames (which frame on which channel is checked per
    # channel: content frames only after a content-bearing method).
    (CodecState.FRAMES, _In.FRAME): CodecState.FRAMES,
}


@dataclass(frozen=True, slots=True)
class ProtocolHeaderReceived:
    """The client sent AMQP 0-9-1's protocol header."""


@dataclass(frozen=True, slots=True)
class MethodReceived:
    """A method frame (without content) on ``channel``: a pamqp command object."""

    channel: int
    method: Any


@dataclass(frozen=True, slots=True)
class ContentReceived:
    """A content-bearing method (``basic.publish``) with its properties and whole body."""

    channel: int
    method: Any
    properties: commands.Basic.Properties
    body: bytes
    #: the property flags and list as they came (b"": not known); ``properties`` may be
    #: shared by the messages that carried the same bytes: read-only
    raw_properties: bytes = b""


@dataclass(frozen=True, slots=True)
class HeartbeatReceived:
    """A heartbeat frame (channel 0)."""


Event = ProtocolHeaderReceived | MethodReceived | ContentReceived | HeartbeatReceived

#: Methods a client sends with content after them.
_CONTENT_METHODS: Final = frozenset({"Basic.Publish"})
#: Methods only a server sends: a client sending one is 503 COMMAND_INVALID.
_SERVER_ONLY: Final = frozenset({
    "Connection.Start", "Connection.Secure", "Connection.Tune", "Connection.OpenOk",
    "Channel.OpenOk", "Exchange.DeclareOk", "Exchange.DeleteOk", "Exchange.BindOk",
    "Exchange.UnbindOk", "Queue.DeclareOk", "Queue.BindOk", "Queue.UnbindOk",
    "Queue.PurgeOk", "Queue.DeleteOk", "Basic.QosOk", "Basic.ConsumeOk", "Basic.Return",
    "Basic.Deliver", "Basic.GetOk", "Basic.GetEmpty", "Basic.RecoverOk", "Tx.SelectOk",
    "Tx.CommitOk", "Tx.RollbackOk", "Confirm.SelectOk",
})


@dataclass(slots=True)
class _Content:
    """A content-bearing method whose header and body frames are still arriving."""

    method: Any
    properties: commands.Basic.Properties | None = None
    raw_properties: bytes = b""
    size: int = -1
    chunks: list[bytes] | None = None
    received: int = 0


class AmqpConnection:
    """The server's side of one AMQP 0-9-1 connection, sans IO (module docstring)."""

    def __init__(self, *, frame_max: int = DEFAULT_FRAME_MAX,
                 max_body_size: int = DEFAULT_MAX_BODY_SIZE) -> None:
        if frame_max < FRAME_MIN_SIZE:
            raise LocalProtocolError(f"frame_max must be at least {FRAME_MIN_SIZE}")
        self.frame_max = frame_max
        self.max_body_size = max_body_size
        self.state = CodecState.AWAIT_HEADER
        self._buffer = bytearray()
        self._error: AmqpProtocolError | None = None
        self._content: dict[int, _Content] = {}
        self._properties = PropertiesCache()

    # ------------------------------------------------------------------ receiving
    def receive_data(self, data: bytes) -> None:
        """Buffer bytes read from the socket."""
        self._buffer += data

    def set_frame_max(self, frame_max: int) -> None:
        """The frame_max agreed in ``connection.tune-ok`` (0: ours stays)."""
        if frame_max:
            if frame_max < FRAME_MIN_SIZE:
                raise LocalProtocolError(f"frame_max must be at least {FRAME_MIN_SIZE}")
            self.frame_max = frame_max

    def drain(self) -> list[Event]:
        """Every complete event buffered so far (an error after valid events is
        raised by the next call)."""
        events: list[Event] = []
        while True:
            try:
                event = self.next_event()
            except AmqpProtocolError:
                if events:
                    return events
                raise
            if isinstance(event, NeedData):
                return events
            events.append(event)

    def next_event(self) -> Event | NeedData:
        """The next event, or NEED_DATA; raises AmqpProtocolError on bad input."""
        if self._error is not None:
            raise self._error
        try:
            while True:
                if self.state is CodecState.AWAIT_HEADER:
                    return self._protocol_header()
                event = self._frame()
                if event is not None:
                    return event
        except AmqpProtocolError as exc:
            self.state = CodecState.ERROR
            self._error = exc
            self._buffer.clear()
            raise

    def _protocol_header(self) -> Event | NeedData:
        buffer = self._buffer
        have = bytes(buffer[:len(PROTOCOL_HEADER)])
        if not PROTOCOL_HEADER.startswith(have):
            raise ProtocolHeaderMismatch(
                ReplyCode.FRAME_ERROR,
                f"expected the AMQP 0-9-1 protocol header, got {have!r}")
        if len(have) < len(PROTOCOL_HEADER):
            return NEED_DATA
        del buffer[:len(PROTOCOL_HEADER)]
        self.state = TRANSITIONS[(self.state, _In.PROTOCOL_HEADER)]
        return ProtocolHeaderReceived()

    def _frame(self) -> Event | NeedData | None:
        """One frame's event; None for a frame that makes no event yet (part of a
        content); NEED_DATA when the frame is incomplete."""
        buffer = self._buffer
        if buffer and buffer[0] not in _FRAME_TYPES:
            start = bytes(buffer[:4])
            if start == PROTOCOL_HEADER[:4]:
                raise AmqpProtocolError(ReplyCode.UNEXPECTED_FRAME, "a second protocol header")
            if not PROTOCOL_HEADER.startswith(start):
                self._bad_type(buffer[0])
            return NEED_DATA
        if len(buffer) < FRAME_HEADER_SIZE:
            return NEED_DATA
        kind, channel, size = _HEAD.unpack_from(buffer)
        if size + FRAME_OVERHEAD > self.frame_max:
            raise AmqpProtocolError(
                ReplyCode.FRAME_ERROR,
                f"frame of {size + FRAME_OVERHEAD} bytes exceeds frame_max {self.frame_max}",
                channel=channel)
        end = FRAME_HEADER_SIZE + size
        if len(buffer) < end + 1:
            return NEED_DATA
        if buffer[end] != FRAME_END:
            raise AmqpProtocolError(ReplyCode.FRAME_ERROR,
                                    f"frame end octet is {buffer[end]:#04x}, not 0xce",
                                    channel=channel)
        payload = bytes(buffer[FRAME_HEADER_SIZE:end])
        if kind == _BODY:
            del buffer[:end + 1]
            return self._body(channel, payload)
        if kind == _HEARTBEAT:
            del buffer[:end + 1]
            if channel != 0:
                raise AmqpProtocolError(ReplyCode.COMMAND_INVALID,
                                        f"heartbeat frame on channel {channel}, not 0")
            return HeartbeatReceived()
        if kind == _HEADER:
            raw = payload[_CONTENT_HEAD_SIZE:]
            properties = self._properties.get(raw) if len(raw) >= 2 else None
            if properties is not None:  # (hot.py: the same bytes decoded before)
                del buffer[:end + 1]
                return self._header(channel, header_body_size(payload), properties, raw)
            value = self._decode(bytes(buffer[:end + 1]), channel)
            del buffer[:end + 1]
            assert isinstance(value, header.ContentHeader)
            self._properties.put(raw, value.properties)
            return self._header(channel, int(value.body_size), value.properties, raw)
        method = None
        if size >= 4:  # the per-message methods by hand (hot.py), the others by pamqp
            index = _INDEX.unpack_from(payload)[0]
            if index == PUBLISH_INDEX:
                method = read_publish(payload)
            elif index == ACK_INDEX:
                method = read_ack(payload)
        if method is None:
            method = self._decode(bytes(buffer[:end + 1]), channel)
        del buffer[:end + 1]
        return self._method(channel, method)

    @staticmethod
    def _bad_type(kind: int) -> None:
        raise AmqpProtocolError(ReplyCode.FRAME_ERROR, f"unknown frame type {kind}")

    @staticmethod
    def _decode(whole: bytes, channel: int) -> Any:
        """pamqp's decoding of one whole frame; its errors as 502 SYNTAX_ERROR."""
        try:
            _, _, value = frame.unmarshal(whole)
        except (exceptions.PAMQPException, ValueError, TypeError, KeyError, IndexError,
                UnicodeDecodeError, struct.error, AttributeError, OverflowError) as exc:
            raise AmqpProtocolError(ReplyCode.SYNTAX_ERROR,
                                    f"malformed frame: {exc or type(exc).__name__}",
                                    channel=channel) from None
        return value

    def _method(self, channel: int, method: Any) -> Event | None:
        name = method.name
        if channel in self._content:
            raise AmqpProtocolError(
                ReplyCode.UNEXPECTED_FRAME,
                f"method {name} on channel {channel} while its content was still arriving",
                channel=channel, class_id=method.index >> 16,
                method_id=method.index & 0xFFFF)
        if name in _SERVER_ONLY:
            raise AmqpProtocolError(
                ReplyCode.COMMAND_INVALID, f"{name} is a method only a server sends",
                channel=channel, class_id=method.index >> 16,
                method_id=method.index & 0xFFFF)
        if name in _CONTENT_METHODS:
            self._content[channel] = _Content(method)
            return None
        return MethodReceived(channel, method)

    def _header(self, channel: int, size: int, properties: commands.Basic.Properties,
                raw: bytes) -> Event | None:
        content = self._content.get(channel)
        if content is None or content.size >= 0:
            raise AmqpProtocolError(
                ReplyCode.UNEXPECTED_FRAME,
                f"content header on channel {channel} without a content-bearing method "
                "before it", channel=channel)
        if size > self.max_body_size:
            raise AmqpProtocolError(
                ReplyCode.FRAME_ERROR,
                f"message body of {size} bytes exceeds the limit of {self.max_body_size}",
                channel=channel)
        content.properties = properties
        content.raw_properties = raw
        content.size = size
        content.chunks = []
        return self._finish(channel, content) if size == 0 else None

    def _body(self, channel: int, payload: bytes) -> Event | None:
        content = self._content.get(channel)
        if content is None or content.chunks is None:
            raise AmqpProtocolError(
                ReplyCode.UNEXPECTED_FRAME,
                f"content body on channel {channel} without a content header before it",
                channel=channel)
        content.received += len(payload)
        if content.received > content.size:
            raise AmqpProtocolError(
                ReplyCode.FRAME_ERROR,
                f"content body on channel {channel} is longer than the {content.size} "
                "bytes its header announced", channel=channel)
        content.chunks.append(payload)
        return self._finish(channel, content) if content.received == content.size else None

    def _finish(self, channel: int, content: _Content) -> ContentReceived:
        del self._content[channel]
        assert content.properties is not None and content.chunks is not None
        body = content.chunks[0] if len(content.chunks) == 1 else b"".join(content.chunks)
        return ContentReceived(channel, content.method, content.properties, body,
                               content.raw_properties)

    def forget_channel(self, channel: int) -> None:
        """The channel was closed: drop a content half received on it."""
        self._content.pop(channel, None)

    # ------------------------------------------------------------------ sending
    def send_method(self, channel: int, method: Any) -> bytes:
        """The bytes of one method frame."""
        try:
            return frame.marshal(method, channel)
        except ValueError:
            # pamqp checks names against the spec's pattern (letters, digits, "-_.:"
            # and a few more, 127 at most); a queue named otherwise (by another
            # protocol, or by a client RabbitMQ would accept) is written as it is
            payload = method_payload(method)
            return _HEAD.pack(_METHOD, channel, len(payload)) + payload + bytes([FRAME_END])

    def send_content(self, channel: int, method: Any, properties: commands.Basic.Properties,
                     body: bytes) -> bytes:
        """A content-bearing method (deliver, get-ok, return), its header and its body
        in frames of at most ``frame_max`` bytes."""
        parts = [self.send_method(channel, method),
                 frame.marshal(header.ContentHeader(0, len(body), properties), channel)]
        step = self.frame_max - FRAME_OVERHEAD
        for start in range(0, len(body), step):
            parts.append(frame.marshal(pamqp_body.ContentBody(body[start:start + step]),
                                       channel))
        return b"".join(parts)

    @staticmethod
    def send_ack(channel: int, delivery_tag: int, multiple: bool = False) -> bytes:
        """A ``basic.ack`` frame (a publisher confirm), as ``send_method`` writes it."""
        return ack_frame(channel, delivery_tag, multiple)

    def send_deliver(self, channel: int, consumer_tag: str, delivery_tag: int,
                     redelivered: bool, exchange: str, routing_key: str,
                     properties: bytes, body: bytes) -> bytes | None:
        """``basic.deliver``, its content header (``properties``: the property flags
        and list, marshalled) and its body, as ``send_content`` writes them; None
        when only pamqp can write the method (``send_content`` then)."""
        method = deliver_frame(channel, consumer_tag, delivery_tag, redelivered, exchange,
                               routing_key)
        if method is None:
            return None
        return method + content_frames(channel, properties, body, self.frame_max)

    @staticmethod
    def send_heartbeat() -> bytes:
        """A heartbeat frame."""
        return frame.marshal(heartbeat.Heartbeat(), 0)

