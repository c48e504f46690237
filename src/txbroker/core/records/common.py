"""What every record kind shares: the kinds, the msgpack codec, the ``msg`` tuple and
the field checks a decoder makes (``core/records/__init__.py`` describes the format).

Theory of operation
-------------------
A record class (``queue_records.py``, ``xa_records.py``) encodes itself with
:func:`pack` and decodes a meta value with checks from here. Each check takes
the value and the record's name, and raises :class:`MalformedRecord` — the one
error a malformed record gives — naming the record and the field; a decoder
never lets an ``IndexError`` or ``TypeError`` out. Values are checked with
``type(v) is int`` (msgpack gives exact types; a bool is not an id).

The ``msg`` tuple stays a list (replay keeps it as is, one list per message, and
appends the seq and the body ref: ``core/replay.py``); :func:`check_msg` asserts
its field count and types and :class:`~txbroker.core.messages.Message` encodes
(``to_record``) and decodes (``from_record``) it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final, NoReturn

import msgpack

from txbroker.errors import MalformedRecord

#: What the store hands back per body (an opaque int; ``storage/interface.py``).
BodyRef = int


class Kind(IntEnum):
    """Record kinds (the ``kind`` of a store entry)."""

    SNAPSHOT = 1
    QUEUE_PUT = 2
    QUEUE_DELETE = 3
    ADD = 4
    TX = 5
    ACK = 6
    DROP = 7
    MOVE = 8
    UPDATE = 9
    RELOCATE = 10
    XA_PREPARE = 11
    XA_COMMIT = 12
    XA_ROLLBACK = 13
    XA_HEURISTIC = 14
    XA_FORGET = 15
    SINK_COMMIT = 16
    RELOCATE_MANY = 17
    REPLICA_AT = 18


#: The kind of the entry a journal hands back *instead of* the log it covers: the
#: recovered state at the end of that log, written at a clean shutdown
#: (``core/checkpoint.py``). Never a record of a log, so not a :class:`Kind`.
CHECKPOINT_KIND: Final = 19


#: Positions in the ``msg`` tuple.
MSG_ID, MSG_QUEUE, MSG_MESSAGE_ID, MSG_HEADERS, MSG_PRIORITY = 0, 1, 2, 3, 4
MSG_TIMESTAMP, MSG_EXPIRES, MSG_DELIVER_AT, MSG_DELIVERY_COUNT = 5, 6, 7, 8
MSG_SEQ = 9
MSG_FIELDS = 9  #: the fewest fields a ``msg`` has (records written before seqs)
#: The most fields a ``msg`` has (with ``seq``).
MSG_FIELDS_MAX: Final = 10

_packer = msgpack.Packer(use_bin_type=True)


def pack(value: Any) -> bytes:
    """Encode a meta value."""
    return _packer.pack(value)


def unpack(meta: bytes) -> Any:
    """Decode a meta value (strings as ``str``, bodies never appear here)."""
    return msgpack.unpackb(meta, raw=False, strict_map_key=False, use_list=True)


def unpack_meta(meta: bytes, name: str) -> Any:
    """:func:`unpack`, with undecodable bytes as :class:`MalformedRecord`."""
    try:
        return unpack(meta)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedRecord(f"{name}: undecodable meta: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """One entry read back by a store's ``recover`` or ``entries_of``: what replay
    takes (``core/replay.py``)."""

    kind: int
    meta: bytes
    refs: tuple[BodyRef, ...]


# ---------------------------------------------------------------------- checks
def malformed(name: str, what: str) -> NoReturn:
    """Raise the one error of a malformed record."""
    raise MalformedRecord(f"malformed {name} record: {what}")


def check_fields(value: Any, name: str, least: int, most: int) -> list[Any]:
    """``value`` as a list of ``least``..``most`` fields."""
    if type(value) is not list:
        malformed(name, f"expected a list of fields, got {type(value).__name__}")
    count = len(value)
    if count < least or count > most:
        expected = str(least) if least == most else f"{least} to {most}"
        malformed(name, f"{count} fields, expected {expected}")
    return value


def check_int(value: Any, name: str, field: str) -> int:
    """An int field."""
    if type(value) is not int:
        malformed(name, f"{field} is {type(value).__name__}, not int")
    return value


def check_str(value: Any, name: str, field: str) -> str:
    """A text field."""
    if type(value) is not str:
        malformed(name, f"{field} is {type(value).__name__}, not str")
    return value


def check_ints(value: Any, name: str, field: str) -> list[int]:
    """A list of ints (message ids, seqs)."""
    if type(value) is not list:
        malformed(name, f"{field} is {type(value).__name__}, not a list")
    for item in value:
        if type(item) is not int:
            malformed(name, f"{field} holds a {type(item).__name__}, not int")
    return value


def check_strs(value: Any, name: str, field: str) -> list[str]:
    """A list of texts (xids)."""
    if type(value) is not list:
        malformed(name, f"{field} is {type(value).__name__}, not a list")
    for item in value:
        if type(item) is not str:
            malformed(name, f"{field} holds a {type(item).__name__}, not str")
    return value


def check_pairs(value: Any, name: str, field: str) -> list[list[int]]:
    """A list of ``[int, int]`` pairs (``[id, seq]``, ``[id, delivery count]``)."""
    if type(value) is not list:
        malformed(name, f"{field} is {type(value).__name__}, not a list")
    for pair in value:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int \
                or type(pair[1]) is not int:
            malformed(name, f"{field} holds {pair!r}, not an [int, int] pair")
    return value


def check_dict(value: Any, name: str, field: str) -> dict[Any, Any]:
    """A map field."""
    if type(value) is not dict:
        malformed(name, f"{field} is {type(value).__name__}, not a map")
    return value


def check_msg(value: Any, name: str) -> list[Any]:
    """One ``msg`` tuple: 9 fields (before seqs) or 10, each of its type (the hottest
    check of a restart: one per replayed message, so the common case is one test)."""
    if type(value) is list and len(value) == MSG_FIELDS_MAX:
        id_, queue, client_id, headers, priority, timestamp, expires, deliver_at, count, \
            seq = value
        if (type(id_) is int and type(queue) is str and type(priority) is int
                and type(timestamp) is int and type(expires) is int
                and type(deliver_at) is int and type(count) is int and type(seq) is int
                and (client_id is None or type(client_id) is str)
                and (headers is None or type(headers) is dict)):
            return value
    elif type(value) is list and len(value) == MSG_FIELDS:  # written before seqs
        check_msg([*value, 0], name)
        return value
    if type(value) is not list:
        malformed(name, f"a msg is {type(value).__name__}, not a list")
    if len(value) != MSG_FIELDS_MAX:
        malformed(name, f"a msg has {len(value)} fields, expected 9 or 10")
    malformed(name, f"a msg field has the wrong type: {value!r}")


def check_msgs(value: Any, name: str) -> list[list[Any]]:
    """A list of ``msg`` tuples (:func:`check_msg`'s common case inlined: this loop runs
    once per message of a restart)."""
    if type(value) is not list:
        malformed(name, f"the msgs are {type(value).__name__}, not a list")
    for msg in value:
        if type(msg) is list and len(msg) == MSG_FIELDS_MAX:
            id_, queue, client_id, headers, priority, timestamp, expires, deliver_at, \
                count, seq = msg
            if (type(id_) is int and type(queue) is str and type(priority) is int
                    and type(timestamp) is int and type(expires) is int
                    and type(deliver_at) is int and type(count) is int
                    and type(seq) is int and (client_id is None or type(client_id) is str)
                    and (headers is None or type(headers) is dict)):
                continue
        check_msg(msg, name)
    return value


def check_definition(value: Any, name: str) -> dict[str, Any]:
    """A queue or topic ``def``: a map with a ``name`` and a ``kind``."""
    if (type(value) is not dict or type(value.get("name")) is not str
            or value.get("kind") not in ("queue", "topic")):
        malformed(name, f"not a queue definition: {value!r}")
    return value


def optional(value: list[Any], index: int) -> Any:
    """``value[index]``, or None when an older record shape stops before it."""
    return value[index] if len(value) > index else None


__all__ = ["CHECKPOINT_KIND", "MSG_DELIVERY_COUNT", "MSG_DELIVER_AT", "MSG_EXPIRES", "MSG_FIELDS",
           "MSG_FIELDS_MAX", "MSG_HEADERS", "MSG_ID", "MSG_MESSAGE_ID", "MSG_PRIORITY",
           "MSG_QUEUE", "MSG_SEQ", "MSG_TIMESTAMP", "BodyRef", "Kind", "MalformedRecord",
           "StoredEntry", "check_definition", "check_dict", "check_fields", "check_int",
           "check_ints", "check_msg", "check_msgs", "check_pairs", "check_str",
           "check_strs", "malformed", "optional", "pack", "unpack", "unpack_meta"]
