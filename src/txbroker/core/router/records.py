"""The router's journal records: the bodies of the ``$router`` queue's messages.

Theory of operation
-------------------
The router journals into the broker's own store (``log.py``): each record is the
body of one persistent message of the internal queue ``$router``, one msgpack
map (``use_bin_type``) whose ``"r"`` names its kind. One class per kind holds a
record's fields by name, as ``core/records`` does for the store's own kinds:
``encode()`` gives the exact bytes the router has always written, and
:func:`decode` (or a class's ``from_value``) takes them back, or raises
:class:`~txbroker.errors.MalformedRecord` (a ``ValueError``) naming the kind and
the field: a key missing or extra, a value of the wrong type. Every writer
builds one (:meth:`TxRecord.of`, :meth:`FacilityRecord.of`,
``Tombstone.to_record``) and hands it to :meth:`RouterLog.write
<txbroker.core.router.log.RouterLog.write>`; the restart reads them with
:func:`decode` (``journal.py``). Meaning is checked where it is used, not here:
which states come back (``journal.py``), the tombstone answers
(``tombstones.py``); a facility's partitions go through
:func:`~txbroker.core.router.model.parse_facility`, the one place that checks
them.

Byte format (map keys in this order, the order they are written in)::

    {"r": "facility", "name": str, "key_type": "int"|"str",
     "partitions": [{"name": str, "low": key, "high": key, "retry_count": int,
                     "vote_timeout_ms": int}…],
     ["shadowed": [partition…]]}
    {"r": "tx", "tid": str, "facility": str, "state": "VREQ"|"COMMITTING"|"ABORTING",
     "reason": str|nil, "exception": bool, "strikes": {partition: int},
     "messages": [[partition, key, body: bin, headers: map|nil]…], "created_ms": int,
     "decided_ms": int, "flagged_ms": int, "shadowed": [partition…]}
    {"r": "tomb", "tid": str, "facility": str|nil, "state": "UNKNOWN"|"ACCEPTED"|
     "REJECTED", "reason": str|nil, "until_ms": int}

``key`` is an int or a str (all keys of a facility of one type). A ``tx`` record's
``state`` is the seed's public name of the transaction's state
(:data:`~txbroker.core.router.states.PUBLIC`): an exception is an ``ABORTING``
record with ``"exception": true``; ``shadowed`` lists the partitions whose
shadow site takes part. A ``facility`` record's ``shadowed`` (optional: written
only when not empty) lists the partitions a shadow server ever registered for:
their transactions keep a participant for the secondary site, across restarts.
Versions: each kind has had this one shape since the router's first commit,
except the facility record's ``shadowed``, added later as an optional key (absent:
no partition shadowed), so that older records still decode; a field added later
is to be an optional key too (as ``core/records`` does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from txbroker.core.records.common import (
    check_dict,
    check_int,
    check_str,
    check_strs,
    malformed,
    pack,
    unpack_meta,
)
from txbroker.core.router.model import Facility, Key, Site, parse_facility
from txbroker.core.router.states import PUBLIC, Transaction
from txbroker.errors import BadRequest

#: The ``"r"`` of each kind.
FACILITY: Final = "facility"
TX: Final = "tx"
TOMB: Final = "tomb"

#: The keys of each kind's map, in the order they are written.
FACILITY_KEYS: Final = ("r", "name", "key_type", "partitions")
#: The facility record's optional key (written last, only when its list is not empty).
FACILITY_SHADOWED: Final = "shadowed"
PARTITION_KEYS: Final = ("name", "low", "high", "retry_count", "vote_timeout_ms")
TX_KEYS: Final = ("r", "tid", "facility", "state", "reason", "exception", "strikes",
                  "messages", "created_ms", "decided_ms", "flagged_ms", "shadowed")
TOMB_KEYS: Final = ("r", "tid", "facility", "state", "reason", "until_ms")
_KEY_SETS: Final[dict[tuple[str, ...], frozenset[str]]] = {keys: frozenset(keys)
                    for keys in (FACILITY_KEYS, PARTITION_KEYS, TX_KEYS, TOMB_KEYS)}
#: Fields of one message of a ``tx`` record: partition, key, body, headers.
TX_MESSAGE_FIELDS: Final = 4

#: One message of a transaction: partition, key, body, headers.
RouterMessage = tuple[str, Key, bytes, dict[str, str] | None]


def _check_keys(value: dict[Any, Any], name: str, keys: tuple[str, ...]) -> None:
    """``value`` has exactly ``keys`` (the field count of a map record)."""
    if value.keys() != _KEY_SETS[keys]:
        missing = sorted(key for key in keys if key not in value)
        extra = sorted(str(key) for key in value if key not in keys)
        malformed(name, f"keys missing {missing}, unknown {extra}")


def _check_optional_str(value: Any, name: str, field: str) -> str | None:
    if value is not None and type(value) is not str:
        malformed(name, f"{field} is {type(value).__name__}, not str or nil")
    return value


@dataclass(slots=True)
class FacilityRecord:
    """A facility's definition, and its partitions that have a shadow site (one live
    record per facility, replaced on change)."""

    facility: Facility
    #: partitions a shadow server ever registered for, sorted (durable: a restart
    #: keeps their transactions for the secondary site while it is down)
    shadowed: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """The record's ``"r"``."""
        return FACILITY

    @classmethod
    def of(cls, facility: Facility, shadowed: Iterable[str] = ()) -> FacilityRecord:
        """The record of ``facility`` and its shadowed partitions."""
        return cls(facility, sorted(shadowed))

    def encode(self) -> bytes:
        """The body bytes (without ``shadowed`` when no partition is: the bytes the
        record had before the field existed)."""
        facility = self.facility
        value: dict[str, Any] = {
            "r": FACILITY, "name": facility.name, "key_type": facility.key_type,
            "partitions": [{"name": p.name, "low": p.low, "high": p.high,
                            "retry_count": p.retry_count,
                            "vote_timeout_ms": p.vote_timeout_ms}
                           for p in facility.partitions]}
        if self.shadowed:
            value[FACILITY_SHADOWED] = self.shadowed
        return pack(value)

    @classmethod
    def from_value(cls, value: Any) -> FacilityRecord:
        """Decode an unpacked body (its partitions checked by ``parse_facility``; an
        older record without ``shadowed`` has no shadowed partition)."""
        name = "router facility"
        record = check_dict(value, name, "the record")
        shadowed: list[str] = []
        if FACILITY_SHADOWED in record:
            shadowed = check_strs(record[FACILITY_SHADOWED], name, FACILITY_SHADOWED)
            record = {key: item for key, item in record.items() if key != FACILITY_SHADOWED}
        _check_keys(record, name, FACILITY_KEYS)
        partitions = record["partitions"]
        if type(partitions) is not list:
            malformed(name, "partitions is not a list")
        for partition in partitions:
            _check_keys(check_dict(partition, name, "a partition"), name, PARTITION_KEYS)
        try:
            facility = parse_facility(record["name"], partitions)
        except BadRequest as exc:
            malformed(name, str(exc))
        if record["key_type"] != facility.key_type:
            malformed(name, f"key_type {record['key_type']!r}, but the keys are "
                            f"{facility.key_type}")
        names = {partition.name for partition in facility.partitions}
        unknown = sorted(set(shadowed) - names)
        if unknown or shadowed != sorted(set(shadowed)):
            malformed(name, f"shadowed {shadowed!r} is not a sorted list of its partitions")
        return cls(facility, shadowed)


@dataclass(slots=True)
class TxRecord:
    """A transaction the client accepted: its messages, state and strikes (one live
    record per transaction, replaced on every state change)."""

    tid: str
    facility: str
    state: str  #: the public name (``PUBLIC``): VREQ, COMMITTING or ABORTING
    reason: str | None
    exception: bool  #: an ABORTING record of an exception transaction
    strikes: dict[str, int]  #: partition -> presentations lost before a vote
    messages: list[RouterMessage]
    created_ms: int
    decided_ms: int
    flagged_ms: int
    shadowed: list[str]  #: partitions whose shadow site takes part

    @property
    def kind(self) -> str:
        """The record's ``"r"``."""
        return TX

    @classmethod
    def of(cls, tx: Transaction) -> TxRecord:
        """The record of ``tx`` as it is now (a partition's strikes: the most of its
        sites')."""
        strikes: dict[str, int] = {}
        shadowed: list[str] = []
        for (name, site), participant in tx.participants.items():
            strikes[name] = max(strikes.get(name, 0), participant.strikes)
            if site is Site.SECONDARY:
                shadowed.append(name)
        shadowed.sort()
        return cls(tx.tid, tx.facility, PUBLIC[tx.state], tx.reason, tx.exception, strikes,
                   list(tx.messages), tx.created_ms, tx.decided_ms, tx.flagged_ms, shadowed)

    def encode(self) -> bytes:
        """The body bytes (a message tuple packs as the array it was written as)."""
        return pack({"r": TX, "tid": self.tid, "facility": self.facility,
                     "state": self.state, "reason": self.reason, "exception": self.exception,
                     "strikes": self.strikes, "messages": self.messages,
                     "created_ms": self.created_ms, "decided_ms": self.decided_ms,
                     "flagged_ms": self.flagged_ms, "shadowed": self.shadowed})

    @classmethod
    def from_value(cls, value: Any) -> TxRecord:
        """Decode an unpacked body."""
        name = "router tx"
        record = check_dict(value, name, "the record")
        _check_keys(record, name, TX_KEYS)
        if type(record["exception"]) is not bool:
            malformed(name, "exception is not a bool")
        strikes = check_dict(record["strikes"], name, "strikes")
        for partition, count in strikes.items():
            check_str(partition, name, "a strikes partition")
            check_int(count, name, "a strike count")
        if type(record["messages"]) is not list:
            malformed(name, "messages is not a list")
        messages: list[RouterMessage] = []
        for message in record["messages"]:
            if type(message) is not list or len(message) != TX_MESSAGE_FIELDS:
                malformed(name, f"a message is not [partition, key, body, headers]: "
                                f"{message!r}")
            partition, key, body, headers = message
            if (type(partition) is not str or type(key) not in (int, str)
                    or type(body) is not bytes
                    or (headers is not None and type(headers) is not dict)):
                malformed(name, f"a message field has the wrong type: {message!r}")
            messages.append((partition, key, body, headers))
        return cls(check_str(record["tid"], name, "tid"),
                   check_str(record["facility"], name, "facility"),
                   check_str(record["state"], name, "state"),
                   _check_optional_str(record["reason"], name, "reason"),
                   record["exception"], strikes, messages,
                   check_int(record["created_ms"], name, "created_ms"),
                   check_int(record["decided_ms"], name, "decided_ms"),
                   check_int(record["flagged_ms"], name, "flagged_ms"),
                   check_strs(record["shadowed"], name, "shadowed"))


@dataclass(slots=True)
class TombRecord:
    """A tid that never begins again, and what the router answered for it
    (``tombstones.py``)."""

    tid: str
    facility: str | None
    state: str  #: UNKNOWN, ACCEPTED or REJECTED (``tombstones.STATES``)
    reason: str | None
    until_ms: int  #: kept until then

    @property
    def kind(self) -> str:
        """The record's ``"r"``."""
        return TOMB

    def encode(self) -> bytes:
        """The body bytes."""
        return pack({"r": TOMB, "tid": self.tid, "facility": self.facility,
                     "state": self.state, "reason": self.reason, "until_ms": self.until_ms})

    @classmethod
    def from_value(cls, value: Any) -> TombRecord:
        """Decode an unpacked body."""
        name = "router tomb"
        record = check_dict(value, name, "the record")
        _check_keys(record, name, TOMB_KEYS)
        return cls(check_str(record["tid"], name, "tid"),
                   _check_optional_str(record["facility"], name, "facility"),
                   check_str(record["state"], name, "state"),
                   _check_optional_str(record["reason"], name, "reason"),
                   check_int(record["until_ms"], name, "until_ms"))


#: Any router record.
RouterRecord = FacilityRecord | TxRecord | TombRecord


def from_value(value: Any) -> RouterRecord:
    """The router record of an unpacked body (``MalformedRecord`` if it is not one)."""
    kind = value.get("r") if type(value) is dict else None
    if kind == TX:
        return TxRecord.from_value(value)
    if kind == FACILITY:
        return FacilityRecord.from_value(value)
    if kind == TOMB:
        return TombRecord.from_value(value)
    malformed("router", f"not a router record (kind {kind!r})")


def decode(body: bytes) -> RouterRecord:
    """The router record in a ``$router`` message's body (``MalformedRecord`` if the
    bytes are not one)."""
    return from_value(unpack_meta(body, "router record"))


__all__ = ["FACILITY", "FACILITY_KEYS", "FACILITY_SHADOWED", "PARTITION_KEYS", "TOMB",
           "TOMB_KEYS", "TX", "TX_KEYS", "TX_MESSAGE_FIELDS", "FacilityRecord", "RouterMessage",
           "RouterRecord", "TombRecord", "TxRecord", "decode", "from_value"]
