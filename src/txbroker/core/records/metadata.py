"""The metadata records: SNAPSHOT (1), QUEUE_PUT (2), QUEUE_DELETE (3) and a backup's
REPLICA_AT (18).

Theory of operation
-------------------
Each class holds one record's fields by name; ``encode()`` gives the exact meta
bytes the broker has always written (``core/records/__init__.py``), and
``decode(meta)`` / ``from_value(value)`` take any historical shape back, or raise
:class:`~txbroker.errors.MalformedRecord`. The classes are treated as immutable
(plain slotted dataclasses, not frozen ones: a frozen dataclass costs three times
as much to build in pure Python, and writers build one per record).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from txbroker.core.records.common import (
    Kind,
    check_definition,
    check_dict,
    check_fields,
    check_int,
    check_ints,
    check_msgs,
    check_pairs,
    check_str,
    malformed,
    pack,
    unpack_meta,
)

_SNAPSHOT: Final = int(Kind.SNAPSHOT)
_QUEUE_PUT: Final = int(Kind.QUEUE_PUT)
_QUEUE_DELETE: Final = int(Kind.QUEUE_DELETE)
_REPLICA_AT: Final = int(Kind.REPLICA_AT)

#: Fields of one branch of a SNAPSHOT's ``"xa"`` map.
SNAPSHOT_BRANCH_FIELDS = 6


@dataclass(slots=True)
class SnapshotBranch:
    """One XA branch of a SNAPSHOT's ``"xa"`` map: ``[state, [msg…], [ref…], [[consumed
    id, delivery count]…], [discard id…], created_ms]`` (refs as big-endian bytes)."""

    state: str  #: the ``BranchState`` value
    sends: list[list[Any]]  #: ``msg`` tuples
    refs: list[bytes | None]  #: the sends' body refs (``core/replay.pack_ref``)
    consumed: list[list[int]]  #: ``[id, delivery count]``
    discards: list[int]
    created_ms: int

    def to_value(self) -> list[Any]:
        """The branch as the snapshot's map holds it."""
        return [self.state, self.sends, self.refs, self.consumed, self.discards,
                self.created_ms]

    @classmethod
    def from_value(cls, value: Any) -> SnapshotBranch:
        """Decode one branch of the ``"xa"`` map."""
        name = "SNAPSHOT xa branch"
        state, sends, refs, consumed, discards, created = check_fields(
            value, name, SNAPSHOT_BRANCH_FIELDS, SNAPSHOT_BRANCH_FIELDS)
        check_msgs(sends, name)
        if type(refs) is not list or len(refs) != len(sends) or not all(
                ref is None or type(ref) is bytes or type(ref) is int for ref in refs):
            malformed(name, "refs are one bytes (or nil) per send")
        return cls(check_str(state, name, "state"), sends, refs,
                   check_pairs(consumed, name, "consumed"),
                   check_ints(discards, name, "discards"),
                   check_int(created, name, "created_ms"))


@dataclass(slots=True)
class Snapshot:
    """SNAPSHOT: the whole metadata state; replaces it on replay."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.SNAPSHOT``."""
        return _SNAPSHOT

    next_id: int
    queues: dict[str, dict[str, Any]]  #: name -> ``def``
    dups: dict[str, list[str]]  #: queue -> the client message ids of its window
    #: Durable XA branches no body keeps (None: the key is absent)
    xa: dict[str, SnapshotBranch] | None = None
    sinks: dict[str, int] | None = None  #: sink -> last batch id (None: absent)
    #: A backup's log: the primary's epoch and the LSN of the last entry before this
    #: snapshot (:class:`ReplicaAt`; None: the key is absent)
    replica: ReplicaAt | None = None

    def to_value(self) -> dict[str, Any]:
        """The meta value (keys in the order they have always been written)."""
        meta: dict[str, Any] = {"next_id": self.next_id, "queues": self.queues,
                                "dups": self.dups}
        if self.xa is not None:
            meta["xa"] = {xid: branch.to_value() for xid, branch in self.xa.items()}
        if self.sinks is not None:
            meta["sinks"] = self.sinks
        if self.replica is not None:
            meta["replica"] = self.replica.to_value()
        return meta

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.to_value())

    @classmethod
    def from_value(cls, value: Any) -> Snapshot:
        """Decode an unpacked meta value."""
        name = "SNAPSHOT"
        meta = check_dict(value, name, "the snapshot")
        next_id = check_int(meta.get("next_id"), name, "next_id")
        queues = check_dict(meta.get("queues"), name, "queues")
        for definition in queues.values():
            check_definition(definition, name)
        dups = check_dict(meta.get("dups", {}), name, "dups")
        for ids in dups.values():
            if type(ids) is not list:
                malformed(name, "a duplicate window is not a list")
        xa: dict[str, SnapshotBranch] | None = None
        if "xa" in meta:
            xa = {check_str(xid, name, "an xid"): SnapshotBranch.from_value(branch)
                  for xid, branch in check_dict(meta["xa"], name, "xa").items()}
        sinks: dict[str, int] | None = None
        if "sinks" in meta:
            sinks = check_dict(meta["sinks"], name, "sinks")
            for sink, last in sinks.items():
                check_str(sink, name, "a sink id")
                check_int(last, name, "a sink's last batch")
        replica = ReplicaAt.from_value(meta["replica"]) if "replica" in meta else None
        unknown = set(meta) - {"next_id", "queues", "dups", "xa", "sinks", "replica"}
        if unknown:
            malformed(name, f"unknown keys {sorted(map(str, unknown))}")
        return cls(next_id, queues, dups, xa, sinks, replica)

    @classmethod
    def decode(cls, meta: bytes) -> Snapshot:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "SNAPSHOT"))


@dataclass(slots=True)
class QueuePut:
    """QUEUE_PUT: the ``def`` of one queue or topic (declare / update)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.QUEUE_PUT``."""
        return _QUEUE_PUT

    definition: dict[str, Any]  #: ``{"name", "kind", "topic", "settings", …}``

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.definition)

    @classmethod
    def from_value(cls, value: Any) -> QueuePut:
        """Decode an unpacked meta value."""
        return cls(check_definition(value, "QUEUE_PUT"))

    @classmethod
    def decode(cls, meta: bytes) -> QueuePut:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "QUEUE_PUT"))


@dataclass(slots=True)
class QueueDelete:
    """QUEUE_DELETE: a queue or topic deleted (its messages go with it)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.QUEUE_DELETE``."""
        return _QUEUE_DELETE

    name: str

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.name)

    @classmethod
    def from_value(cls, value: Any) -> QueueDelete:
        """Decode an unpacked meta value."""
        return cls(check_str(value, "QUEUE_DELETE", "the name"))

    @classmethod
    def decode(cls, meta: bytes) -> QueueDelete:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "QUEUE_DELETE"))


@dataclass(slots=True)
class ReplicaAt:
    """REPLICA_AT: in a backup's own log, where its copy of the primary stands — every
    entry after this one is the primary's entry of the next LSN, in order
    (``server/ha/replica.py``, "Resuming from the disk"). An empty ``epoch`` says that
    no position holds from here (the node was promoted: its entries are its own)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.REPLICA_AT``."""
        return _REPLICA_AT

    epoch: str  #: the primary's epoch ("" : none)
    lsn: int  #: the LSN of the primary's entry just before the next one in this log

    def to_value(self) -> list[Any]:
        """``[epoch, lsn]``."""
        return [self.epoch, self.lsn]

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.to_value())

    @classmethod
    def from_value(cls, value: Any) -> ReplicaAt:
        """Decode an unpacked meta value."""
        epoch, lsn = check_fields(value, "REPLICA_AT", 2, 2)
        lsn = check_int(lsn, "REPLICA_AT", "lsn")
        if lsn < 0:
            malformed("REPLICA_AT", "a negative LSN")
        return cls(check_str(epoch, "REPLICA_AT", "epoch"), lsn)

    @classmethod
    def decode(cls, meta: bytes) -> ReplicaAt:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "REPLICA_AT"))


__all__ = ["SNAPSHOT_BRANCH_FIELDS", "QueueDelete", "QueuePut", "ReplicaAt", "Snapshot",
           "SnapshotBranch"]
