"""AMQP 0-9-1, sans IO: the server's side of the framing (``codec.py``), and the
per-message frames read and written by hand (``hot.py``).

Compiled with mypyc like the other codecs (``txbroker._build.COMPILED``), over pamqp
for every frame but the per-message ones.
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
