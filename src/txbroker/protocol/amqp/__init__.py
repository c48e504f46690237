"""AMQP 0-9-1, sans IO: the server's side of the framing (``codec.py``).

This package sits beside the compiled codecs of ``txbroker.protocol`` but is not
one of them (``txbroker._build.COMPILED`` globs ``protocol/*.py`` only): it is
pure Python over pamqp.
"""

from txbroker.protocol.amqp.codec import (
    DEFAULT_FRAME_MAX,
    DEFAULT_MAX_BODY_SIZE,
    FRAME_END,
    FRAME_MIN_SIZE,
    PROTOCOL_HEADER,
    TRANSITIONS,
    AmqpConnection,
    AmqpProtocolError,
    CodecState,
    ContentReceived,
    Event,
    HeartbeatReceived,
    MethodReceived,
    ProtocolHeaderMismatch,
    ProtocolHeaderReceived,
    ReplyCode,
)

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
