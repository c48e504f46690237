"""The frames of AMQP 0-9-1's per-message path, read and written by hand (issue 31).

Theory of operation
-------------------
pamqp reads and writes any frame generically: one Python object per frame, its
arguments walked by name and type. That costs several times what the message
itself costs the broker. The few frames that arrive or leave once per message
are therefore done here with ``struct`` at fixed offsets; pamqp stays for every
other frame, and for these too whenever a frame is not exactly the well-formed
shape read here, so that the outcome (the value, or the error) is pamqp's.

Read (a frame's payload, after the codec checked its framing):

* ``basic.publish`` (class 60, method 40)::

      index:4 ticket:2 exchange:shortstr routing-key:shortstr bits:1
      (bits: mandatory 0x01, immediate 0x02)

* ``basic.ack`` from a consumer (class 60, method 80)::

      index:4 delivery-tag:8 bits:1      (bits: multiple 0x01)

* a content header (frame type 2): ``class:2 weight:2 body-size:8`` then the
  property flags and list, decoded by pamqp once per distinct byte string and
  kept (:class:`PropertiesCache`): consecutive messages of one producer usually
  carry the same properties (``delivery_mode`` 2, a content type).

A method read here is pamqp's own command object (made without running its
constructor, as pamqp's decoder makes it), so that the edge sees no difference.
pamqp ignores bytes after a method's last argument and reads a short string
shorter than its length octet says; this reader takes only the exact shape and
leaves anything else to pamqp.

Written (byte for byte what ``pamqp.frame.marshal`` writes, checked by
``tests/amqp/test_codec_hot.py``): ``basic.ack`` (publisher confirms), and
``basic.deliver`` with its content header and body frames. :func:`method_payload`
writes any method as pamqp does but without its name checks (the codec's fallback
for names pamqp refuses).
"""

from __future__ import annotations

import struct
from typing import Any, Final

from pamqp import commands, constants, encode

__all__ = [
    "ACK_INDEX",
    "PROPERTIES_CACHE_SIZE",
    "PUBLISH_INDEX",
    "PropertiesCache",
    "ack_frame",
    "content_frames",
    "deliver_frame",
    "header_body_size",
    "method_payload",
    "read_ack",
    "read_publish",
]

#: pamqp's method index (class << 16 | method) of basic.publish and basic.ack.
PUBLISH_INDEX: Final = 0x003C0028
ACK_INDEX: Final = 0x003C0050
_DELIVER_INDEX: Final = 0x003C003C
#: Distinct property byte strings kept decoded (a few producers' worth; a full cache
#: starts again empty, so that one producer of unique properties costs no more than
#: pamqp would).
PROPERTIES_CACHE_SIZE: Final = 256

_FRAME_END: Final = b"\xce"
_HEAD: Final = struct.Struct(">BHI")
#: type 1, channel, size 13, index, delivery tag, bits, frame end. (pamqp reads and
#: writes a long-long, a delivery tag, as signed: so do we.)
_ACK: Final = struct.Struct(">BHIIqBB")
_INDEX: Final = struct.Struct(">I")
_TAG_BITS: Final = struct.Struct(">qB")
_SHORT: Final = struct.Struct(">H")
_QUAD: Final = struct.Struct(">Q")
#: class 60 (basic), weight 0, body size.
_CONTENT_HEAD: Final = struct.Struct(">HHQ")
_BASIC_CLASS: Final = 60
_ACK_PAYLOAD_SIZE: Final = 13
assert _ACK.size == 7 + _ACK_PAYLOAD_SIZE + 1
#: pamqp's check of an exchange name (``Basic.Deliver.validate``).
_EXCHANGE_NAME: Final = constants.DOMAIN_REGEX["exchange-name"]
_EXCHANGE_MAX: Final = 127
_SHORTSTR_MAX: Final = 255


def read_publish(payload: bytes) -> Any | None:
    """``basic.publish``'s command object from a method frame's payload (its index
    first), or None when the payload is not exactly that shape (pamqp decides)."""
    size = len(payload)
    if size < 9:
        return None
    exchange_end = 7 + payload[6]
    if exchange_end + 2 > size:
        return None
    key_end = exchange_end + 1 + payload[exchange_end]
    if key_end + 1 != size:
        return None
    try:
        exchange = payload[7:exchange_end].decode()
        routing_key = payload[exchange_end + 1:key_end].decode()
    except UnicodeDecodeError:
        return None
    bits = payload[key_end]
    method = commands.Basic.Publish.__new__(commands.Basic.Publish)
    method.ticket = _SHORT.unpack_from(payload, 4)[0]
    method.exchange = exchange
    method.routing_key = routing_key
    method.mandatory = bool(bits & 1)
    method.immediate = bool(bits & 2)
    return method


def read_ack(payload: bytes) -> Any | None:
    """``basic.ack``'s command object from a method frame's payload (its index
    first), or None when the payload is not exactly that shape."""
    if len(payload) != _ACK_PAYLOAD_SIZE:
        return None
    tag, bits = _TAG_BITS.unpack_from(payload, 4)
    method = commands.Basic.Ack.__new__(commands.Basic.Ack)
    method.delivery_tag = tag
    method.multiple = bool(bits & 1)
    return method


class PropertiesCache:
    """Decoded ``basic`` properties by their bytes (flags and list) on the wire.

    The objects handed out are shared by every message that carried the same
    bytes: treat them as read-only (copy before changing one)."""

    def __init__(self, size: int = PROPERTIES_CACHE_SIZE) -> None:
        self.size = size
        self._decoded: dict[bytes, commands.Basic.Properties] = {}

    def get(self, raw: bytes) -> commands.Basic.Properties | None:
        """The properties decoded earlier from ``raw``, if kept."""
        return self._decoded.get(raw)

    def put(self, raw: bytes, properties: commands.Basic.Properties) -> None:
        """Keep ``properties``, decoded from ``raw``."""
        if len(self._decoded) >= self.size:
            self._decoded.clear()
        self._decoded[raw] = properties


def ack_frame(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """A ``basic.ack`` method frame (a publisher confirm)."""
    return _ACK.pack(1, channel, _ACK_PAYLOAD_SIZE, ACK_INDEX, delivery_tag,
                     1 if multiple else 0, 0xCE)


def deliver_frame(channel: int, consumer_tag: str, delivery_tag: int, redelivered: bool,
                  exchange: str, routing_key: str) -> bytes | None:
    """A ``basic.deliver`` method frame, or None when pamqp must write it (a name
    longer than a short string, or an exchange name pamqp refuses)."""
    if exchange and (len(exchange) > _EXCHANGE_MAX or not _EXCHANGE_NAME.fullmatch(exchange)):
        return None
    tag = consumer_tag.encode()
    exchange_bytes = exchange.encode()
    key = routing_key.encode()
    if len(tag) > _SHORTSTR_MAX or len(exchange_bytes) > _SHORTSTR_MAX \
            or len(key) > _SHORTSTR_MAX:
        return None
    payload = b"".join((_INDEX.pack(_DELIVER_INDEX), bytes((len(tag),)), tag,
                        _TAG_BITS.pack(delivery_tag, 1 if redelivered else 0),
                        bytes((len(exchange_bytes),)), exchange_bytes,
                        bytes((len(key),)), key))
    return b"".join((_HEAD.pack(1, channel, len(payload)), payload, _FRAME_END))


def content_frames(channel: int, properties: bytes, body: bytes, frame_max: int) -> bytes:
    """A content header (``properties``: the flags and list as pamqp marshals them)
    and the body in frames of at most ``frame_max`` bytes."""
    header = _CONTENT_HEAD.pack(_BASIC_CLASS, 0, len(body))
    parts = [_HEAD.pack(2, channel, len(header) + len(properties)), header, properties,
             _FRAME_END]
    step = frame_max - 8
    size = len(body)
    if size <= step:
        if size:
            parts += (_HEAD.pack(3, channel, size), body, _FRAME_END)
    else:
        for start in range(0, size, step):
            chunk = body[start:start + step]
            parts += (_HEAD.pack(3, channel, len(chunk)), chunk, _FRAME_END)
    return b"".join(parts)


def header_body_size(payload: bytes) -> int:
    """A content header payload's body size (the payload has at least 12 bytes)."""
    return int(_QUAD.unpack_from(payload, 4)[0])


def method_payload(method: Any) -> bytes:
    """A method's payload (its index, then its arguments) as pamqp's
    ``Frame.marshal`` encodes it, without its ``validate()``: consecutive bits
    share octets (spec 4.2.5.2)."""
    output = [struct.pack(">I", method.index)]
    bits = -1
    offset = 0
    for argument in method.__slots__:
        kind = method.amqp_type(argument)
        value = getattr(method, argument, 0)
        if kind == "bit":
            if bits < 0 or offset == 8:
                if bits >= 0:
                    output.append(encode.octet(bits))
                bits, offset = 0, 0
            bits = encode.bit(value, bits, offset)
            offset += 1
            continue
        if bits >= 0:
            output.append(encode.octet(bits))
            bits = -1
        output.append(encode.by_type(value, kind))
    if bits >= 0:
        output.append(encode.octet(bits))
    return b"".join(output)
