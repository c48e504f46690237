"""AMQP message properties <-> txbroker message headers, and queue arguments ->
queue settings.

A message published over AMQP keeps its ``basic`` properties exactly: they are
stored, encoded as on the wire (pamqp's content header, base64), in the header
:data:`PROPERTIES_HEADER`, with the exchange and routing key it was published
with beside them; the plain values of its ``headers`` table are copied as text
headers too, for native and STOMP consumers. A message sent by another protocol (native, STOMP) gets
properties made from what it has: its headers as the ``headers`` table, its
message id, its persistence as ``delivery_mode``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from typing import Any, Final

from pamqp import commands, header

from txbroker.core.messages import Message
from txbroker.protocol.amqp import ReplyCode
from txbroker.protocol.amqp.hot import PROPERTIES_CACHE_SIZE
from txbroker.server.edges.amqp.model import ChannelError

#: txbroker headers that carry an AMQP message's publish-time facts.
PROPERTIES_HEADER: Final = "amqp-properties"
EXCHANGE_HEADER: Final = "amqp-exchange"
ROUTING_KEY_HEADER: Final = "amqp-routing-key"
AMQP_HEADERS: Final = frozenset({PROPERTIES_HEADER, EXCHANGE_HEADER, ROUTING_KEY_HEADER})
#: txbroker's priority when the queue has no ``x-max-priority`` (core default 4:
#: every message the same, so FIFO as in RabbitMQ).
DEFAULT_PRIORITY: Final = 4
#: AMQP's delivery_mode for persistent messages.
PERSISTENT: Final = 2
#: Queue arguments we understand (docs/amqp.md has the table).
QUEUE_ARGUMENTS: Final = frozenset({
    "x-message-ttl", "x-max-length", "x-max-length-bytes", "x-max-priority", "x-overflow",
    "x-queue-type", "x-dead-letter-exchange", "x-dead-letter-routing-key", "x-queue-mode",
    # done by the edge (server/edges/amqp/state.py): unused that long, the queue is deleted
    "x-expires",
})


#: The internal dead-letter queues' prefix (AMQP clients cannot name ``$amqp…``).
DEAD_LETTER_PREFIX: Final = "$amqp.dlx."


def internal_queues(queue: str) -> tuple[str, str, str]:
    """(rejected, expired, maxlen): the internal queues of ``queue``'s dead letters
    (``server/edges/amqp/deadletters.py``), one per ``x-death`` reason."""
    prefix = f"{DEAD_LETTER_PREFIX}{hashlib.sha256(queue.encode()).hexdigest()[:32]}"
    return f"{prefix}.rejected", f"{prefix}.expired", f"{prefix}.maxlen"


def dead_letter_settings(queue: str) -> dict[str, str]:
    """The core settings of a queue with a dead-letter exchange: its rejected,
    expired and (``drop-head``) dropped messages go to its internal queues."""
    rejected, expired, maxlen = internal_queues(queue)
    return {"dead_letter_queue": rejected, "expiry_queue": expired, "overflow_queue": maxlen}


def encode_properties(properties: commands.Basic.Properties) -> str:
    """The properties as the value of :data:`PROPERTIES_HEADER`."""
    return base64.b64encode(header.ContentHeader(0, 0, properties).marshal()).decode()


def decode_properties(text: str) -> commands.Basic.Properties:
    """The properties :func:`encode_properties` stored."""
    content = header.ContentHeader()
    content.unmarshal(base64.b64decode(text))
    return content.properties


class PropertyTexts:
    """The two conversions of ``basic`` properties each message needs, kept for the
    byte strings and texts seen last (consecutive messages of a producer usually
    carry the same properties): the properties as they came on the wire -> the
    stored text (:func:`encode_properties`), and the stored text -> the properties
    marshalled for a content header. Each is exactly what the conversion gives."""

    def __init__(self, size: int = PROPERTIES_CACHE_SIZE) -> None:
        self.size = size
        self._texts: dict[bytes, str] = {}
        self._marshalled: dict[str, bytes | None] = {}

    def text(self, raw: bytes, properties: commands.Basic.Properties) -> str:
        """:func:`encode_properties` of ``properties``, decoded from ``raw``."""
        text = self._texts.get(raw)
        if text is None:
            text = encode_properties(properties)
            if len(self._texts) >= self.size:
                self._texts.clear()
            self._texts[raw] = text
        return text

    def marshalled(self, text: str) -> bytes | None:
        """The property flags and list a content header carries for a stored
        :data:`PROPERTIES_HEADER` value; None if ``text`` is not one we could have
        written (another protocol's header of that name)."""
        if text in self._marshalled:
            return self._marshalled[text]
        try:
            marshalled: bytes | None = decode_properties(text).marshal()
        except (ValueError, binascii.Error, TypeError, struct.error):
            marshalled = None
        if len(self._marshalled) >= self.size:
            self._marshalled.clear()
        self._marshalled[text] = marshalled
        return marshalled


def delivery_wire(message: Message, texts: PropertyTexts) -> tuple[bytes, str, str] | None:
    """(properties marshalled, exchange, routing key) of a message published over AMQP
    (None: :func:`delivery_facts` makes its properties)."""
    headers = message.headers
    if not headers:
        return None
    text = headers.get(PROPERTIES_HEADER)
    if text is None:
        return None
    marshalled = texts.marshalled(text)
    if marshalled is None:
        return None
    return (marshalled, headers.get(EXCHANGE_HEADER, ""),
            headers.get(ROUTING_KEY_HEADER, message.queue))


def message_headers(exchange: str, routing_key: str,
                    properties: commands.Basic.Properties,
                    text: str | None = None) -> dict[str, str]:
    """The txbroker headers of a message published with these facts: the exact
    properties for AMQP consumers (``text``: their :func:`encode_properties`, when
    known), and the ``headers`` table's plain values (text, numbers, booleans) as
    text for consumers of the other protocols."""
    headers: dict[str, str] = {}
    for key, value in (properties.headers or {}).items():
        if isinstance(value, bool):
            headers[key] = "true" if value else "false"
        elif isinstance(value, str | int | float):
            headers[key] = str(value)
        elif isinstance(value, bytes):
            try:
                headers[key] = value.decode()
            except UnicodeDecodeError:
                continue
    headers.update({PROPERTIES_HEADER: encode_properties(properties) if text is None else text,
                    EXCHANGE_HEADER: exchange, ROUTING_KEY_HEADER: routing_key})
    return headers


def delivery_facts(message: Message) -> tuple[commands.Basic.Properties, str, str]:
    """(properties, exchange, routing key) of a stored message."""
    headers = message.headers or {}
    text = headers.get(PROPERTIES_HEADER)
    if text is not None:
        try:
            return (decode_properties(text), headers.get(EXCHANGE_HEADER, ""),
                    headers.get(ROUTING_KEY_HEADER, message.queue))
        except (ValueError, binascii.Error, TypeError):
            pass  # a header of that name another protocol set: treat as theirs
    table: dict[str, Any] = {k: v for k, v in headers.items() if k not in AMQP_HEADERS}
    properties = commands.Basic.Properties(
        headers=table or None, message_id=message.message_id or None,
        delivery_mode=PERSISTENT if message.persistent else 1)
    return properties, "", message.queue


def ttl_of(properties: commands.Basic.Properties) -> int:
    """A message's ``expiration`` (milliseconds as text) as a TTL (0: none)."""
    text = properties.expiration
    if text is None or text == "":
        return 0
    if not (isinstance(text, str) and text.isdigit() and text.isascii()):
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           f"PRECONDITION_FAILED - invalid expiration '{text}'")
    return max(int(text), 1)


def queue_settings(name: str, arguments: dict[str, Any] | None
                   ) -> tuple[dict[str, Any], int]:
    """(core queue settings, x-max-priority or 0) of queue ``name``'s declare
    arguments; 406 for an argument we cannot honour. A dead-letter exchange makes the
    queue's dead-letter and expiry queues its internal ones (``amqp_deadletters.py``)."""
    settings: dict[str, Any] = {}
    args = arguments or {}
    for key in args:
        if key.startswith("x-") and key not in QUEUE_ARGUMENTS:
            raise _unsupported(key, "is not a queue argument txbroker knows")
    ttl = _count(args, "x-message-ttl")
    if ttl is not None:
        settings["default_ttl_ms"] = max(ttl, 1)
    length = _count(args, "x-max-length")
    if length is not None:
        settings["max_messages"] = length
    size = _count(args, "x-max-length-bytes")
    if size is not None:
        settings["max_bytes"] = size
    overflow = args.get("x-overflow")
    if overflow in (None, "drop-head", b"drop-head"):  # RabbitMQ's default
        settings["overflow"] = "drop_head"
    elif overflow in ("reject-publish", b"reject-publish"):
        settings["overflow"] = "reject"
    else:
        raise _unsupported("x-overflow", f"{overflow!r} is not supported (drop-head, the "
                           "default, and reject-publish are)")
    kind = args.get("x-queue-type")
    if kind not in (None, "classic", "quorum", b"classic", b"quorum"):
        raise _unsupported("x-queue-type", f"{kind!r} is not supported (classic and quorum "
                           "are: every txbroker queue is durable and replicated)")
    exchange = args.get("x-dead-letter-exchange")
    if exchange is not None:
        if not isinstance(exchange, str | bytes):
            raise _unsupported("x-dead-letter-exchange", "must be an exchange name")
        settings.update(dead_letter_settings(name))
    elif "x-dead-letter-routing-key" in args:
        raise _unsupported("x-dead-letter-routing-key", "needs x-dead-letter-exchange")
    if _count(args, "x-expires") == 0:
        raise _unsupported("x-expires", "must be a positive number of milliseconds")
    priority = _count(args, "x-max-priority") or 0
    if priority > 255:
        raise _unsupported("x-max-priority", "must be 0 to 255")
    return settings, priority


def _count(args: dict[str, Any], key: str) -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           f"PRECONDITION_FAILED - invalid arg '{key}' for queue: "
                           f"{value!r} is not a non-negative integer")
    return value


def _unsupported(key: str, why: str) -> ChannelError:
    return ChannelError(ReplyCode.PRECONDITION_FAILED,
                        f"PRECONDITION_FAILED - queue argument '{key}' {why} "
                        "(docs/amqp.md)")
