"""The transaction router's definitions: facilities, partitions, keys, roles, events.

Theory of operation
-------------------
A **facility** is a named set of **partitions**; each partition owns a key range
``low <= key <= high`` (both bounds included, as RTR's partition key ranges).
Keys are ints or strings, one type per facility, and the ranges of a facility
never overlap, so a key names at most one partition (:meth:`Facility.route`).

Servers register on a partition with a **role** (seed 000): ``primary`` and
``concurrent`` servers are the partition's active servers at the primary site
(concurrent ones share the load); ``standby`` servers get work only while no
active one is registered; ``shadow`` servers are the secondary site: they get
the same transactions as a second participant, and become the primary site
when no other server of the partition is left.

**Events** are numbered. User events are 0-255; router events (status the
router reports) are 256-511 (:class:`RouterEvent`). A controller subscribes to
ranges of numbers. A *named* event carries a recipient specifier with the
wildcards ``*`` (any run of characters) and ``%`` (exactly one); it reaches
only controllers that registered a recipient name matching it. An *unnamed*
event reaches every subscriber of its number: "no recipient" is not ``*``
(:func:`event_matches`).

Everything here is pure data and checks; the engine is ``core/router/engine.py``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import pairwise
from typing import Any, Final

from txbroker.errors import BadRequest, NotFound

#: The most user events a facility may number (RTR's user event range, 0-255).
USER_EVENT_MAX: Final = 255
#: Router events are numbered from here (``RTR_EVTNUM_RTRBASE``)...
ROUTER_EVENT_MIN: Final = 256
#: ... to here (``RTR_EVTNUM_RTRMAX``).
ROUTER_EVENT_MAX: Final = 511
#: Longest facility, partition, tid or recipient name (the queue name limit).
MAX_NAME: Final = 200
#: Longest transaction id the client may choose (a uuid4 hex is 32).
MAX_TID: Final = 64
#: Default presentations lost before a vote that a transaction survives (seed 000:
#: "If no recovery retry count is specified, RTR retries replay three times").
DEFAULT_RETRY_COUNT: Final = 3
#: Default time a client-accepted transaction waits for its votes before it is
#: rejected with reason TIMEOUT (a server that never answers harms nobody else).
DEFAULT_VOTE_TIMEOUT_MS: Final = 30_000
#: How long a decided transaction whose client is gone keeps its outcome for a
#: client that reconnects and asks (``rtr_outcome``).
OUTCOME_RETENTION_MS: Final = 600_000

Key = int | str


class Role(enum.Enum):
    """A server's role in its partition (seed 000)."""

    PRIMARY = "primary"
    STANDBY = "standby"
    CONCURRENT = "concurrent"
    SHADOW = "shadow"


class Site(enum.Enum):
    """Which copy of a partition's work a participant is: the primary site's or
    the shadow (secondary) site's."""

    PRIMARY = "primary"
    SECONDARY = "secondary"


class RouterEvent(enum.IntEnum):
    """Router events (numbers in ``ROUTER_EVENT_MIN..ROUTER_EVENT_MAX``)."""

    SERVER_UP = 256  #: a server registered on a partition
    SERVER_DOWN = 257  #: a server left (unregistered or its connection died)
    PARTITION_UP = 258  #: the partition got its first server
    PARTITION_DOWN = 259  #: the partition has no server left
    PRIMARY = 260  #: (to shadow servers) your site is now the primary one
    SECONDARY = 261  #: (to shadow servers) your site is the secondary one
    EXCEPTION = 262  #: a transaction was flagged an exception (three strikes)


#: Reasons of a rejection the router decides itself.
SRVDIED: Final = "SRVDIED"  #: lost before a vote more often than the retry count
TIMEOUT: Final = "TIMEOUT"  #: the votes did not come within vote_timeout_ms
CLIENT: Final = "CLIENT"  #: the client rejected (or left before accepting)
#: The client lost its connection while it was still sending (asked about after).
LOST: Final = "LOST"
#: Told to a server only, never an outcome: its participant makes way for an older
#: transaction that waits for this server in a wait cycle (core/router/deadlock.py);
#: the server rolls back, acknowledges, and gets the transaction again later (MSG1).
PREEMPTED: Final = "PREEMPTED"
DISCARDED: Final = "DISCARDED"  #: an operator discarded the exception transaction


@dataclass(frozen=True, slots=True)
class Partition:
    """One key range of a facility, with its recovery settings."""

    name: str
    low: Key
    high: Key
    retry_count: int = DEFAULT_RETRY_COUNT
    vote_timeout_ms: int = DEFAULT_VOTE_TIMEOUT_MS

    def owns(self, key: Key) -> bool:
        """Is ``key`` in this partition's range?"""
        return self.low <= key <= self.high  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        """The definition as the wire and the log carry it."""
        return {"name": self.name, "low": self.low, "high": self.high,
                "retry_count": self.retry_count, "vote_timeout_ms": self.vote_timeout_ms}

    def with_settings(self, retry_count: int | None, vote_timeout_ms: int | None) -> Partition:
        """A copy with new recovery settings (``None`` keeps one)."""
        if retry_count is not None:
            _check_count(retry_count, "retry_count")
        if vote_timeout_ms is not None:
            _check_count(vote_timeout_ms, "vote_timeout_ms")
        return replace(
            self,
            retry_count=self.retry_count if retry_count is None else retry_count,
            vote_timeout_ms=self.vote_timeout_ms if vote_timeout_ms is None else vote_timeout_ms)


@dataclass(slots=True)
class Facility:
    """A facility: its partitions, sorted by their low bound."""

    name: str
    partitions: list[Partition] = field(default_factory=list)

    @property
    def key_type(self) -> str:
        """``"int"`` or ``"str"``: the type of every key of the facility."""
        return "str" if self.partitions and isinstance(self.partitions[0].low, str) else "int"

    def partition(self, name: str) -> Partition:
        """The partition called ``name`` (NotFound otherwise)."""
        for partition in self.partitions:
            if partition.name == name:
                return partition
        raise NotFound(f"facility {self.name!r} has no partition {name!r}")

    def find(self, spec: Any) -> Partition:
        """The partition a server names: by name, or by its exact ``[low, high]``."""
        if isinstance(spec, str):
            return self.partition(spec)
        if isinstance(spec, list | tuple) and len(spec) == 2:
            for partition in self.partitions:
                if [partition.low, partition.high] == list(spec):
                    return partition
            raise NotFound(f"facility {self.name!r} has no partition with the key range "
                           f"{list(spec)!r}")
        raise BadRequest("argument 'partition' must be a partition name or [low, high]")

    def route(self, key: Any) -> Partition:
        """The partition that owns ``key`` (BadRequest for a key outside every range)."""
        expected = str if self.key_type == "str" else int
        if type(key) is not expected:
            raise BadRequest(f"key {key!r} must be of type {expected.__name__} "
                             f"(facility {self.name!r} has {self.key_type} keys)")
        for partition in self.partitions:
            if partition.owns(key):
                return partition
        raise BadRequest(f"key {key!r} is outside every partition of facility {self.name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The definition as the wire and the log carry it."""
        return {"name": self.name, "key_type": self.key_type,
                "partitions": [p.to_dict() for p in self.partitions]}


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise BadRequest(f"{what} must be a string of 1 to {MAX_NAME} characters")
    if any(ord(ch) < 32 for ch in value):
        raise BadRequest(f"{what} must not contain control characters")
    return value


def _check_count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise BadRequest(f"{what} must be an integer >= 0")
    return int(value)


def check_size(body: bytes, limit: int) -> None:
    """A router message's body is at most ``max_message_size`` (``limit``) bytes, as any
    message's: a router message is journaled like one (BadRequest)."""
    if len(body) > limit:
        raise BadRequest(f"a router message of {len(body)} bytes is above max_message_size "
                         f"({limit})")


def check_tid(tid: Any) -> str:
    """A transaction id as the client gives it (BadRequest otherwise)."""
    if not isinstance(tid, str) or not tid or len(tid) > MAX_TID:
        raise BadRequest(f"tid must be a string of 1 to {MAX_TID} characters")
    return tid


def parse_facility(name: Any, partitions: Any) -> Facility:
    """A facility from its wire (or log, or config) form: every check in one place."""
    _check_name(name, "facility name")
    if not isinstance(partitions, list) or not partitions:
        raise BadRequest("a facility needs a list of one or more partitions")
    parsed: list[Partition] = []
    for item in partitions:
        if not isinstance(item, dict):
            raise BadRequest("each partition must be a map {name, low, high}")
        low, high = item.get("low"), item.get("high")
        if type(low) not in (int, str) or type(low) is not type(high):
            raise BadRequest(f"partition {item.get('name')!r}: low and high must both be "
                             "ints or both strings")
        if low > high:  # type: ignore[operator]
            raise BadRequest(f"partition {item.get('name')!r}: low {low!r} is above high "
                             f"{high!r}")
        parsed.append(Partition(
            _check_name(item.get("name"), "partition name"), low, high,  # type: ignore[arg-type]
            _check_count(item.get("retry_count", DEFAULT_RETRY_COUNT), "retry_count"),
            _check_count(item.get("vote_timeout_ms", DEFAULT_VOTE_TIMEOUT_MS),
                         "vote_timeout_ms")))
    if len({type(p.low) for p in parsed}) != 1:
        raise BadRequest(f"facility {name!r}: every key range must be of one type")
    if len({p.name for p in parsed}) != len(parsed):
        raise BadRequest(f"facility {name!r}: partition names must be unique")
    parsed.sort(key=lambda p: p.low)
    for before, after in pairwise(parsed):
        if after.low <= before.high:  # type: ignore[operator]
            raise BadRequest(f"facility {name!r}: partitions {before.name!r} and "
                             f"{after.name!r} overlap")
    return Facility(name, parsed)


def parse_events(value: Any) -> tuple[tuple[int, int], ...]:
    """Event subscriptions: a list of numbers or ``[low, high]`` ranges."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadRequest("argument 'events' must be a list of numbers or [low, high] ranges")
    ranges: list[tuple[int, int]] = []
    for item in value:
        if type(item) is int:
            low = high = item
        elif (isinstance(item, list | tuple) and len(item) == 2
              and all(type(bound) is int for bound in item)):
            low, high = item
        else:
            raise BadRequest("argument 'events' must be a list of numbers or [low, high] ranges")
        if not 0 <= low <= high <= ROUTER_EVENT_MAX:
            raise BadRequest(f"event range {[low, high]} must be within 0..{ROUTER_EVENT_MAX}")
        ranges.append((low, high))
    return tuple(ranges)


def parse_recipient(value: Any) -> str | None:
    """A recipient name or specifier (``None``: unnamed)."""
    if value is None:
        return None
    return _check_name(value, "recipient")


@lru_cache(maxsize=1024)
def _pattern(spec: str) -> re.Pattern[str]:
    parts = [".*" if ch == "*" else "." if ch == "%" else re.escape(ch) for ch in spec]
    return re.compile("".join(parts), re.DOTALL)


def recipient_matches(spec: str, name: str) -> bool:
    """Does the recipient specifier ``spec`` (``*`` any run, ``%`` one character)
    match the whole of ``name``?"""
    return _pattern(spec).fullmatch(name) is not None


def event_matches(number: int, spec: str | None, events: tuple[tuple[int, int], ...],
                  name: str | None) -> bool:
    """Does an event (``number``, recipient ``spec``) reach a controller subscribed to
    ``events`` under the recipient ``name``? (Module docstring: named vs unnamed.)"""
    if not any(low <= number <= high for low, high in events):
        return False
    if spec is None:
        return True
    return name is not None and recipient_matches(spec, name)


__all__ = [
    "CLIENT",
    "DEFAULT_RETRY_COUNT",
    "DEFAULT_VOTE_TIMEOUT_MS",
    "DISCARDED",
    "LOST",
    "MAX_TID",
    "OUTCOME_RETENTION_MS",
    "PREEMPTED",
    "ROUTER_EVENT_MAX",
    "ROUTER_EVENT_MIN",
    "SRVDIED",
    "TIMEOUT",
    "USER_EVENT_MAX",
    "Facility",
    "Key",
    "Partition",
    "Role",
    "RouterEvent",
    "Site",
    "check_size",
    "check_tid",
    "event_matches",
    "parse_events",
    "parse_facility",
    "parse_recipient",
    "recipient_matches",
]
