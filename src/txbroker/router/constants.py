"""The router's names: message types, roles, event numbers, reasons, the message class,
and the partition map a registration returns (the local key check).

These are the wire values of the router protocol (docs/router.md, the ``rtr_*``
operations): a message type is the ``type`` of an ``rtr`` push, a role the
``role`` of ``rtr_register``, a reason the ``reason`` of an outcome.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from txbroker.errors import BadRequest, ProtocolError

__all__ = [
    "ALL_ROUTER_EVENTS",
    "ALL_USER_EVENTS",
    "EXCEPTION",
    "PARTITION_DOWN",
    "PARTITION_UP",
    "PRIMARY",
    "REASON_CLIENT",
    "REASON_LOST",
    "REASON_PREEMPTED",
    "REASON_SRVDIED",
    "REASON_TIMEOUT",
    "REASON_UNKNOWN",
    "ROUTER_EVENT_MAX",
    "ROUTER_EVENT_MIN",
    "SECONDARY",
    "SERVER_DOWN",
    "SERVER_UP",
    "USER_EVENT_MAX",
    "USER_EVENT_MIN",
    "EventRanges",
    "Key",
    "MessageType",
    "PartitionMap",
    "Role",
    "RouterMessage",
    "event_ranges",
]

#: A partition key: every bound of one facility is of one of these types.
Key = int | str


class MessageType(StrEnum):
    """What a :class:`RouterMessage` is (the seed's ``rtr_mt_*``)."""

    #: the first message of a transaction presented to this server
    MSG1 = "MSG1"
    #: a further message of the transaction
    MSG = "MSG"
    #: explicit prepare: the client accepted, this server must vote now
    PREPARE = "PREPARE"
    #: the outcome: every participant accepted (commit)
    ACCEPTED = "ACCEPTED"
    #: the outcome: some participant rejected (roll back); see :attr:`RouterMessage.reason`
    REJECTED = "REJECTED"
    #: replaces MSG1 on a replay after this server may have voted: check your TID table
    UNCERTAIN = "UNCERTAIN"
    #: a user broadcast event (number 0..255)
    USER_EVENT = "USER_EVENT"
    #: a router status event (number 256..511)
    ROUTER_EVENT = "ROUTER_EVENT"


class Role(StrEnum):
    """A server's role in its partition (``rtr_register``'s ``role``)."""

    #: an active server of the primary site (transactions go round robin to the free ones)
    PRIMARY = "primary"
    #: gets transactions only while no primary or concurrent server is registered
    STANDBY = "standby"
    #: like PRIMARY: concurrent servers share the partition's load
    CONCURRENT = "concurrent"
    #: secondary site: also gets every transaction of the partition, and votes too
    SHADOW = "shadow"


#: User event numbers: 0..255.
USER_EVENT_MIN: Final = 0
USER_EVENT_MAX: Final = 255
#: Router event numbers: 256..511 (the seed's RTR_EVTNUM_RTRBASE / RTRMAX).
ROUTER_EVENT_MIN: Final = 256
ROUTER_EVENT_MAX: Final = 511
#: A server of the facility registered.
SERVER_UP: Final = 256
#: A server of the facility went away.
SERVER_DOWN: Final = 257
#: A partition got its first server.
PARTITION_UP: Final = 258
#: A partition has no server left.
PARTITION_DOWN: Final = 259
#: This shadow's site is now the primary site.
PRIMARY: Final = 260
#: This site is secondary again.
SECONDARY: Final = 261
#: A transaction was flagged an exception (three strikes).
EXCEPTION: Final = 262
#: ``events=`` ranges for every user event, every router event.
ALL_USER_EVENTS: Final = (USER_EVENT_MIN, USER_EVENT_MAX)
ALL_ROUTER_EVENTS: Final = (ROUTER_EVENT_MIN, ROUTER_EVENT_MAX)

#: Outcome reasons. Servers may give their own strings too.
#: Three strikes: the transaction crashed its servers more than the retry count.
REASON_SRVDIED: Final = "SRVDIED"
#: A vote did not come within the partition's vote timeout, or the server
#: inactivity timeout of this library rejected a partly received transaction.
REASON_TIMEOUT: Final = "TIMEOUT"
#: The client rejected it.
REASON_CLIENT: Final = "CLIENT"
#: Server side: the connection to the broker was lost before the outcome; roll back.
REASON_LOST: Final = "LOST"
#: Server side, never an outcome: make way for an older transaction in a wait cycle —
#: roll back and acknowledge; the transaction comes again later (MSG1).
REASON_PREEMPTED: Final = "PREEMPTED"
#: Client side, after a lost connection: the router has no record of it — it was
#: never durably accepted, so it was never applied anywhere.
REASON_UNKNOWN: Final = "UNKNOWN"

#: ``events=`` of a registration: numbers or inclusive ``(low, high)`` ranges.
EventRanges = Iterable[int | tuple[int, int]]


def event_ranges(events: EventRanges) -> list[list[int]]:
    """The wire form ``[[lo, hi], ...]`` of ``events``; ValueError when out of 0..511."""
    ranges: list[list[int]] = []
    for item in events:
        low, high = (item, item) if isinstance(item, int) else item
        if type(low) is not int or type(high) is not int:
            raise TypeError(f"an event number must be an int, not {item!r}")
        if not USER_EVENT_MIN <= low <= high <= ROUTER_EVENT_MAX:
            raise ValueError(f"event range {item!r} is not within {USER_EVENT_MIN}.."
                             f"{ROUTER_EVENT_MAX} (low <= high)")
        ranges.append([low, high])
    return ranges


@dataclass(slots=True)
class RouterMessage:
    """What ``receive()`` returns: a message of a transaction, an outcome or an event.

    ``tid`` is the transaction's id (None for events); ``body``, ``key``, ``index``
    (0-based number of the message for this server), ``headers`` and ``replay``
    (presentations so far) belong to MSG1/MSG/UNCERTAIN; ``reason`` to REJECTED;
    ``number``, ``recipient`` to events; ``facility``, ``partition``, ``key_range``
    (the partition's ``(low, high)``) and ``detail`` to router events (``partition``
    also names the partition of a server's messages).
    """

    type: MessageType
    tid: str | None = None
    body: bytes = b""
    key: Key | None = None
    index: int = 0
    reason: str | None = None
    number: int | None = None
    recipient: str | None = None
    partition: str | None = None
    replay: int = 0
    headers: dict[str, Any] = field(default_factory=dict)
    facility: str | None = None
    detail: Any = None
    key_range: tuple[Key, Key] | None = None
    #: (MSG1/UNCERTAIN/MSG) the transaction is already decided ACCEPTED — a replay, or
    #: the first presentation to a site that returned after the others decided: the
    #: server votes accept and keeps its work whatever its checks say now (a reject
    #: vote changes nothing); it applies the work on the ACCEPTED that follows once the
    #: decision is durable, and rolls it back if a restart aborts a decision it lost.
    decided: bool = False

    @property
    def is_outcome(self) -> bool:
        """True for ACCEPTED and REJECTED."""
        return self.type in (MessageType.ACCEPTED, MessageType.REJECTED)

    @property
    def is_event(self) -> bool:
        """True for USER_EVENT and ROUTER_EVENT."""
        return self.type in (MessageType.USER_EVENT, MessageType.ROUTER_EVENT)

    @classmethod
    def from_push(cls, data: Mapping[str, Any], partition: str | None = None) -> RouterMessage:
        """Decode the body of an ``rtr`` push (ProtocolError when malformed)."""
        try:
            kind = MessageType(data["type"])
            body = data.get("body") or b""
            return cls(
                type=kind,
                tid=data.get("tid"),
                body=bytes(body),
                key=data.get("key"),
                index=int(data.get("index") or 0),
                reason=data.get("reason"),
                number=data.get("number"),
                recipient=data.get("recipient"),
                partition=data.get("partition", partition),
                replay=int(data.get("replay") or 0),
                headers=dict(data.get("headers") or {}),
                facility=data.get("facility"),
                detail=data.get("detail"),
                key_range=_key_range(data.get("key_range")),
                decided=data.get("decided") is True,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed rtr push: {exc!r}") from exc


def _key_range(value: Any) -> tuple[Key, Key] | None:
    if value is None:
        return None
    low, high = value  # a pair, or the push is malformed (ValueError, TypeError)
    return (low, high)


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of the map: it owns ``low <= key <= high``."""

    name: str
    low: Key
    high: Key


@dataclass(frozen=True, slots=True)
class PartitionMap:
    """The facility's partitions as ``rtr_register`` returned them: keys are checked
    against it before anything is sent."""

    facility: str
    key_type: str
    partitions: tuple[Partition, ...]

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> PartitionMap:
        """From the ``rtr_register`` reply (ProtocolError when malformed)."""
        try:
            parts = tuple(Partition(str(p["name"]), p["low"], p["high"])
                          for p in reply.get("partitions") or ())
            return cls(str(reply["facility"]), str(reply.get("key_type", "int")), parts)
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed rtr_register reply: {exc!r}") from exc

    def partition_of(self, key: Key) -> str:
        """The name of the partition owning ``key``; BadRequest (the broker's words)
        when it is of the wrong type or outside every range."""
        wanted = int if self.key_type == "int" else str
        if type(key) is not wanted:
            raise BadRequest(f"key {key!r} is not of the facility's key type "
                             f"{self.key_type!r} (facility {self.facility!r})")
        for part in self.partitions:
            if part.low <= key <= part.high:  # type: ignore[operator]
                return part.name
        raise BadRequest(f"key {key!r} is outside every partition of facility "
                         f"{self.facility!r}")


def key_range_arg(key_range: str | Sequence[Key]) -> str | list[Key]:
    """``rtr_register``'s ``partition``: a partition name or ``[low, high]``."""
    if isinstance(key_range, str):
        return key_range
    if len(key_range) != 2:
        raise ValueError(f"a key range is (low, high), not {key_range!r}")
    return [key_range[0], key_range[1]]
