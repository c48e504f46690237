"""The XA records: XA_PREPARE (11), XA_COMMIT (12), XA_ROLLBACK (13), XA_HEURISTIC (14),
XA_FORGET (15), and the Spark sink's SINK_COMMIT (16).

Theory of operation
-------------------
As in ``metadata.py``: one slotted dataclass per kind, ``encode()`` to the exact
historical bytes, ``decode``/``from_value`` accepting every older shape and
raising :class:`~txbroker.errors.MalformedRecord` otherwise. A branch is named by
its Xid's text form; readers parse it (``xid.Xid.parse``).

**XA_PREPARE's sixth field** is ``prepared_ms``: when the branch's XA_PREPARE was
written. Three writers fill it — a prepare (``core/xa_branches.py``), a voted
local or one-phase commit (``core/local_tx.py``, ``core/xa_branches.py``: the
internal branch is created and prepared at once, so it equals ``created_ms``),
and a backup's dump (``core/replica.py``), which writes the branch's own
``Branch.prepared_ms``. Before this vocabulary the dump wrote ``created_ms``
there (a branch did not keep its prepare time), so in a backup's journal the
field may be the creation time: both are decodable and a reader cannot tell
them apart; it is never earlier than ``created_ms``. Records written before the
field existed have five fields: ``prepared_ms`` is None and readers take
``created_ms`` (:attr:`XaPrepare.prepared_or_created`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from txbroker.core.records.common import (
    Kind,
    check_fields,
    check_int,
    check_ints,
    check_msgs,
    check_pairs,
    check_str,
    check_strs,
    malformed,
    optional,
    pack,
    unpack_meta,
)

_XA_PREPARE: Final = int(Kind.XA_PREPARE)
_XA_COMMIT: Final = int(Kind.XA_COMMIT)
_XA_ROLLBACK: Final = int(Kind.XA_ROLLBACK)
_XA_HEURISTIC: Final = int(Kind.XA_HEURISTIC)
_XA_FORGET: Final = int(Kind.XA_FORGET)
_SINK_COMMIT: Final = int(Kind.SINK_COMMIT)

#: The outcomes an XA_HEURISTIC names.
HEURISTIC_OUTCOMES: Final = ("commit", "rollback")


@dataclass(slots=True)
class XaPrepare:
    """XA_PREPARE: a prepared branch's whole content, atomic (bodies: the sends')."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.XA_PREPARE``."""
        return _XA_PREPARE

    xid: str
    sends: list[list[Any]]  #: ``msg`` tuples
    consumed: list[list[int]]  #: ``[id, delivery count]``
    discards: list[int]
    created_ms: int
    prepared_ms: int | None = None  #: see the module docstring (None: five fields)

    @property
    def prepared_or_created(self) -> int:
        """``prepared_ms``, or ``created_ms`` for a record written before it."""
        return self.created_ms if self.prepared_ms is None else self.prepared_ms

    def encode(self) -> bytes:
        """The meta bytes."""
        if self.prepared_ms is None:
            return pack([self.xid, self.sends, self.consumed, self.discards,
                         self.created_ms])
        return pack([self.xid, self.sends, self.consumed, self.discards, self.created_ms,
                     self.prepared_ms])

    @classmethod
    def from_value(cls, value: Any) -> XaPrepare:
        """Decode an unpacked meta value."""
        name = "XA_PREPARE"
        fields = check_fields(value, name, 5, 6)
        prepared = None if len(fields) == 5 else check_int(fields[5], name, "prepared_ms")
        return cls(check_str(fields[0], name, "xid"), check_msgs(fields[1], name),
                   check_pairs(fields[2], name, "consumed"),
                   check_ints(fields[3], name, "discards"),
                   check_int(fields[4], name, "created_ms"), prepared)

    @classmethod
    def decode(cls, meta: bytes) -> XaPrepare:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "XA_PREPARE"))


@dataclass(slots=True)
class XaCommit:
    """XA_COMMIT: two-phase commit of a prepared branch."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.XA_COMMIT``."""
        return _XA_COMMIT

    xid: str
    discards: list[int]  #: sends not added
    seqs: list[list[int]] | None = None  #: ``[id, seq]`` of the added sends (None: absent)
    committed_ms: int | None = None  #: (None: absent; needs ``seqs``)

    def encode(self) -> bytes:
        """The meta bytes."""
        if self.committed_ms is not None:
            return pack([self.xid, self.discards, self.seqs or [], self.committed_ms])
        if self.seqs is not None:
            return pack([self.xid, self.discards, self.seqs])
        return pack([self.xid, self.discards])

    @classmethod
    def from_value(cls, value: Any) -> XaCommit:
        """Decode an unpacked meta value."""
        name = "XA_COMMIT"
        fields = check_fields(value, name, 2, 4)
        seqs = None if len(fields) < 3 else check_pairs(fields[2], name, "seqs")
        at = None if len(fields) < 4 else check_int(fields[3], name, "committed_ms")
        return cls(check_str(fields[0], name, "xid"), check_ints(fields[1], name, "discards"),
                   seqs, at)

    @classmethod
    def decode(cls, meta: bytes) -> XaCommit:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "XA_COMMIT"))


@dataclass(slots=True)
class XaRollback:
    """XA_ROLLBACK: a prepared branch rolled back (``[xid, rolled_back_ms]``; formerly
    the bare xid)."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.XA_ROLLBACK``."""
        return _XA_ROLLBACK

    xid: str
    rolled_back_ms: int | None = None  #: None: the old bare-xid shape

    def encode(self) -> bytes:
        """The meta bytes."""
        if self.rolled_back_ms is None:
            return pack(self.xid)
        return pack([self.xid, self.rolled_back_ms])

    @classmethod
    def from_value(cls, value: Any) -> XaRollback:
        """Decode an unpacked meta value."""
        name = "XA_ROLLBACK"
        if type(value) is str:
            return cls(value)
        xid, at = check_fields(value, name, 2, 2)
        return cls(check_str(xid, name, "xid"), check_int(at, name, "rolled_back_ms"))

    @classmethod
    def decode(cls, meta: bytes) -> XaRollback:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "XA_ROLLBACK"))


@dataclass(slots=True)
class XaHeuristic:
    """XA_HEURISTIC: an operator completed a prepared branch."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.XA_HEURISTIC``."""
        return _XA_HEURISTIC

    xid: str
    outcome: str  #: ``"commit"`` or ``"rollback"``
    discards: list[int]
    seqs: list[list[int]] | None = None  #: ``[id, seq]`` (None: absent)
    at_ms: int | None = None  #: (None: absent; needs ``seqs``)

    @property
    def commit(self) -> bool:
        """Did the operator commit it?"""
        return self.outcome == "commit"

    def encode(self) -> bytes:
        """The meta bytes."""
        if self.at_ms is not None:
            return pack([self.xid, self.outcome, self.discards, self.seqs or [], self.at_ms])
        if self.seqs is not None:
            return pack([self.xid, self.outcome, self.discards, self.seqs])
        return pack([self.xid, self.outcome, self.discards])

    @classmethod
    def from_value(cls, value: Any) -> XaHeuristic:
        """Decode an unpacked meta value."""
        name = "XA_HEURISTIC"
        fields = check_fields(value, name, 3, 5)
        outcome = check_str(fields[1], name, "outcome")
        if outcome not in HEURISTIC_OUTCOMES:
            malformed(name, f"outcome {outcome!r} is not commit or rollback")
        seqs = None if len(fields) < 4 else check_pairs(fields[3], name, "seqs")
        at = None if len(fields) < 5 else check_int(fields[4], name, "at_ms")
        return cls(check_str(fields[0], name, "xid"), outcome,
                   check_ints(fields[2], name, "discards"), seqs, at)

    @classmethod
    def decode(cls, meta: bytes) -> XaHeuristic:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "XA_HEURISTIC"))


@dataclass(slots=True)
class XaForget:
    """XA_FORGET: a heuristically completed branch removed."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.XA_FORGET``."""
        return _XA_FORGET

    xid: str

    def encode(self) -> bytes:
        """The meta bytes."""
        return pack(self.xid)

    @classmethod
    def from_value(cls, value: Any) -> XaForget:
        """Decode an unpacked meta value."""
        return cls(check_str(value, "XA_FORGET", "xid"))

    @classmethod
    def decode(cls, meta: bytes) -> XaForget:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "XA_FORGET"))


@dataclass(slots=True)
class SinkBranch:
    """One committed branch of a SINK_COMMIT: ``[xid, [[id, seq]…], [discard id…]]``."""

    xid: str
    seqs: list[list[int]]
    discards: list[int] | None = None  #: (None: the older two-field shape)

    def to_value(self) -> list[Any]:
        """The branch as the record holds it."""
        if self.discards is None:
            return [self.xid, self.seqs]
        return [self.xid, self.seqs, self.discards]

    @classmethod
    def from_value(cls, value: Any) -> SinkBranch:
        """Decode one committed branch."""
        name = "SINK_COMMIT branch"
        fields = check_fields(value, name, 2, 3)
        discards = optional(fields, 2)
        return cls(check_str(fields[0], name, "xid"), check_pairs(fields[1], name, "seqs"),
                   None if discards is None else check_ints(discards, name, "discards"))


@dataclass(slots=True)
class SinkCommit:
    """SINK_COMMIT: the Spark sink's commit (``core/sinks.py``): commits the listed
    prepared branches, rolls back the others and sets the sink's last batch id."""

    @property
    def kind(self) -> int:
        """The record kind, ``Kind.SINK_COMMIT``."""
        return _SINK_COMMIT

    sink: str
    last_batch: int
    commits: list[SinkBranch]
    rollbacks: list[str]  #: xids rolled back
    at_ms: int | None = None  #: (None: absent)

    def encode(self) -> bytes:
        """The meta bytes."""
        commits = [branch.to_value() for branch in self.commits]
        if self.at_ms is None:
            return pack([self.sink, self.last_batch, commits, self.rollbacks])
        return pack([self.sink, self.last_batch, commits, self.rollbacks, self.at_ms])

    @classmethod
    def from_value(cls, value: Any) -> SinkCommit:
        """Decode an unpacked meta value."""
        name = "SINK_COMMIT"
        fields = check_fields(value, name, 4, 5)
        if type(fields[2]) is not list:
            malformed(name, "the committed branches are not a list")
        at = None if len(fields) < 5 else check_int(fields[4], name, "at_ms")
        return cls(check_str(fields[0], name, "sink"), check_int(fields[1], name, "last batch"),
                   [SinkBranch.from_value(branch) for branch in fields[2]],
                   check_strs(fields[3], name, "rollbacks"), at)

    @classmethod
    def decode(cls, meta: bytes) -> SinkCommit:
        """Decode meta bytes."""
        return cls.from_value(unpack_meta(meta, "SINK_COMMIT"))


__all__ = ["HEURISTIC_OUTCOMES", "SinkBranch", "SinkCommit", "XaCommit", "XaForget",
           "XaHeuristic", "XaPrepare", "XaRollback"]
