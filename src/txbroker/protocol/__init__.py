"""Sans-IO protocol codecs: bytes in, events out; events in, bytes out."""

from txbroker.protocol.native import (
    DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA,
    Err,
    Event,
    LocalProtocolError,
    NativeConnection,
    Ok,
    Push,
    Request,
    Role,
    encode_error,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "NEED_DATA",
    "Err",
    "Event",
    "LocalProtocolError",
    "NativeConnection",
    "Ok",
    "Push",
    "Request",
    "Role",
    "encode_error",
]
