"""The message records: ADD (4), TX (5), ACK (6), DROP (7), MOVE (8), UPDATE (9),
RELOCATE (10) and RELOCATE_MANY (17).

Theory of operation
-------------------
As in ``metadata.py``: one slotted dataclass per kind, ``encode()`` to the exact
historical bytes, ``decode``/``from_value`` accepting every older shape (TX without
``committed_ms``, MOVE without seqs, ``msg`` without ``seq``) and raising
:class:`~txbroker.errors.MalformedRecord` otherwise. An optional trailing field is
None when absent, and ``encode()`` leaves it out, so a decoded record encodes back
to its own bytes. Messages stay ``msg`` lists (``common.check_msg``): replay keeps
them as they come, with no object per message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from txbroker.core.records.common import (
    Kind,
    check_fields,
    check_int,
    check_ints,
    check_msg,
    check_msgs,
    check_str,
    malformed,
    pack,
    unpack_meta,
)

_ADD: Final = int(Kind.ADD)
_RELOCATE: Final = int(Kind.RELOCATE)
_RELOCATE_MANY: Final = int(Kind.RELOCATE_MANY)
_TX: Final = int(Kind.TX)
_ACK: Final = int(Kind.ACK)
_DROP: Final = int(Kind.DROP)
_MOVE: Final = int(Kind.MOVE)
_UPDATE: Final = int(Kind.UPDATE)


@dataclass(slots=True)
class Add:
    """ADD: one plain persistent message (one body)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.ADD``."""
        return _ADD

    msg: list[Any]

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.msg)

    @classmethod
    def from_value(cls, value: Any) -> Add:
        """Decode an unpacked meta value."""
        return cls(check_msg(value, "ADD"))

    @classmethod
    def decode(cls, meta: bytes) -> Add:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "ADD"))


@dataclass(slots=True)
class Relocate:
    """RELOCATE: a fresh copy of a live message written by compaction (one body);
    replayed like ADD."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.RELOCATE``."""
        return _RELOCATE

    msg: list[Any]

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.msg)

    @classmethod
    def from_value(cls, value: Any) -> Relocate:
        """Decode an unpacked meta value."""
        return cls(check_msg(value, "RELOCATE"))

    @classmethod
    def decode(cls, meta: bytes) -> Relocate:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "RELOCATE"))


@dataclass(slots=True)
class RelocateMany:
    """RELOCATE_MANY: fresh copies of many live messages (bodies in ``msg`` order)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.RELOCATE_MANY``."""
        return _RELOCATE_MANY

    msgs: list[list[Any]]

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.msgs)

    @classmethod
    def from_value(cls, value: Any) -> RelocateMany:
        """Decode an unpacked meta value."""
        return cls(check_msgs(value, "RELOCATE_MANY"))

    @classmethod
    def decode(cls, meta: bytes) -> RelocateMany:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "RELOCATE_MANY"))


@dataclass(slots=True)
class Tx:
    """TX: one local transaction (or one record group of plain sends and acks),
    atomic; one body per added message."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.TX``."""
        return _TX

    adds: list[list[Any]]  #: ``msg`` tuples
    acks: list[int]  #: ids of the messages consumed
    #: when a local transaction committed; None for a record group (two fields)
    committed_ms: int | None = None

    def encode(self) -> bytes:
        """The meta bytes."""
        if self.committed_ms is None:
            return pack([self.adds, self.acks])
        return pack([self.adds, self.acks, self.committed_ms])

    @classmethod
    def from_value(cls, value: Any) -> Tx:
        """Decode an unpacked meta value."""
        name = "TX"
        fields = check_fields(value, name, 2, 3)
        committed = None if len(fields) == 2 else check_int(fields[2], name, "committed_ms")
        return cls(check_msgs(fields[0], name), check_ints(fields[1], name, "acks"), committed)

    @classmethod
    def decode(cls, meta: bytes) -> Tx:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "TX"))


@dataclass(slots=True)
class Ack:
    """ACK: messages consumed (gone)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.ACK``."""
        return _ACK

    ids: list[int]

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.ids)

    @classmethod
    def from_value(cls, value: Any) -> Ack:
        """Decode an unpacked meta value."""
        return cls(check_ints(value, "ACK", "ids"))

    @classmethod
    def decode(cls, meta: bytes) -> Ack:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "ACK"))


@dataclass(slots=True)
class Drop:
    """DROP: messages purged, expired or deleted, and why."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.DROP``."""
        return _DROP

    ids: list[int]
    reason: str

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack([self.ids, self.reason])

    @classmethod
    def from_value(cls, value: Any) -> Drop:
        """Decode an unpacked meta value."""
        name = "DROP"
        ids, reason = check_fields(value, name, 2, 2)
        return cls(check_ints(ids, name, "ids"), check_str(reason, name, "reason"))

    @classmethod
    def decode(cls, meta: bytes) -> Drop:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "DROP"))


@dataclass(slots=True)
class Move:
    """MOVE: messages dead-lettered, expired or moved to another queue (same id and
    body)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.MOVE``."""
        return _MOVE

    ids: list[int]
    queue: str  #: the target queue
    reason: str
    #: the moved messages' seqs in the target queue, one per id (None: written before
    #: seqs, the 3-field shape)
    seqs: list[int] | None = None

    def encode(self) -> bytes:
        """The meta bytes."""
        if self.seqs is None:
            return pack([self.ids, self.queue, self.reason])
        return pack([self.ids, self.queue, self.reason, self.seqs])

    @classmethod
    def from_value(cls, value: Any) -> Move:
        """Decode an unpacked meta value."""
        name = "MOVE"
        fields = check_fields(value, name, 3, 4)
        ids = check_ints(fields[0], name, "ids")
        seqs = None
        if len(fields) == 4:
            seqs = check_ints(fields[3], name, "seqs")
            if len(seqs) != len(ids):
                malformed(name, f"{len(ids)} ids but {len(seqs)} seqs")
        return cls(ids, check_str(fields[1], name, "queue"),
                   check_str(fields[2], name, "reason"), seqs)

    @classmethod
    def decode(cls, meta: bytes) -> Move:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "MOVE"))


@dataclass(slots=True)
class Update:
    """UPDATE: a message's delivery count and delivery time changed."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.UPDATE``."""
        return _UPDATE

    id: int
    delivery_count: int
    deliver_at_ms: int

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack([self.id, self.delivery_count, self.deliver_at_ms])

    @classmethod
    def from_value(cls, value: Any) -> Update:
        """Decode an unpacked meta value."""
        name = "UPDATE"
        message_id, count, deliver_at = check_fields(value, name, 3, 3)
        return cls(check_int(message_id, name, "id"),
                   check_int(count, name, "delivery_count"),
                   check_int(deliver_at, name, "deliver_at_ms"))

    @classmethod
    def decode(cls, meta: bytes) -> Update:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "UPDATE"))


__all__ = ["Ack", "Add", "Drop", "Move", "Relocate", "RelocateMany", "Tx", "Update"]
