"""The directory store's own block infos: an XA branch's header and a RESOLVE.

Theory of operation
-------------------
Most block infos are the broker's records or parts of them (a NEW block's
``msg`` tuple, an UPDATE's patch, the METADATA ``SNAPSHOT``:
``dirstore_format.py``). Two are the store's own, and each has a class here, as
the broker's records have in ``core/records``: one field per name, ``encode()``
to the exact bytes the store has always written (one msgpack list), ``decode``
taking them back or raising :class:`~txbroker.errors.MalformedRecord` (a
``ValueError``) that names the block and the field — a field count other than
the one below, or a field of the wrong type. What the values mean (a parsable
Xid, a known state or outcome) is checked where they are used: recovery
(``dirstore_recovery.py``) and the writer (``dirstore_writer.py``).

* :class:`BranchHeader` — the info of an XA branch's first block (a DUMMY):
  ``[xid, [discard id…], created_ms, prepared_ms, state]``; written by the index
  when the branch is prepared (``dirstore_index.py``), rewritten with a heuristic
  outcome as its state by the writer, read by recovery.
* :class:`ResolveInfo` — the info of a RESOLVE block: ``[outcome, xid, GTRID,
  first seq, block count, branch tid, [[id, seq]…], [discard id…]]``; written by
  the index, carried out by the writer.

Each has had this one shape since the store kept XA branches; a field added later
is to be optional on decode, so that a data directory written before still opens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from txbroker.core.records.common import (
    check_fields,
    check_int,
    check_ints,
    check_pairs,
    check_str,
    pack,
    unpack_meta,
)

#: Fields of a branch header and of a RESOLVE info.
BRANCH_HEADER_FIELDS: Final = 5
RESOLVE_FIELDS: Final = 8


@dataclass(slots=True)
class BranchHeader:
    """The info of an XA branch's first block (a DUMMY; ``dirstore_format.py``)."""

    xid: str  #: the Xid's text form
    discards: list[int]  #: the branch's sends a commit does not add
    created_ms: int
    prepared_ms: int
    #: ``"prepared"``, or the heuristic outcome an operator gave it (``dirstore_model``)
    state: str

    def encode(self) -> bytes:
        """The info bytes."""
        return pack([self.xid, self.discards, self.created_ms, self.prepared_ms, self.state])

    @classmethod
    def from_value(cls, value: Any) -> BranchHeader:
        """Decode an unpacked info."""
        name = "XA branch header"
        xid, discards, created, prepared, state = check_fields(
            value, name, BRANCH_HEADER_FIELDS, BRANCH_HEADER_FIELDS)
        return cls(check_str(xid, name, "xid"), check_ints(discards, name, "discards"),
                   check_int(created, name, "created_ms"),
                   check_int(prepared, name, "prepared_ms"), check_str(state, name, "state"))

    @classmethod
    def decode(cls, info: bytes) -> BranchHeader:
        """Decode info bytes."""
        return cls.from_value(unpack_meta(info, "XA branch header"))


@dataclass(slots=True)
class ResolveInfo:
    """The info of a RESOLVE block: which branch, where its blocks are, and the
    outcome to apply to them (``dirstore_writer.DirOps.resolve``)."""

    #: ``"commit"``, ``"rollback"``, ``"heuristic-commit"``, ``"heuristic-rollback"``
    #: or ``"forget"`` (``dirstore_model``)
    outcome: str
    xid: str  #: the Xid's text form
    gtrid: str  #: the gtrid in uppercase hex: the prefix of the branch's block names
    first: int  #: the number in the name of the branch's first block
    count: int  #: the branch's blocks
    branch_tid: int  #: the transaction id in the headers of the branch's blocks
    seqs: list[list[int]]  #: ``[id, seq]`` of every send a commit keeps
    discards: list[int]  #: sends a commit does not keep

    def encode(self) -> bytes:
        """The info bytes."""
        return pack([self.outcome, self.xid, self.gtrid, self.first, self.count,
                     self.branch_tid, self.seqs, self.discards])

    @classmethod
    def from_value(cls, value: Any) -> ResolveInfo:
        """Decode an unpacked info."""
        name = "RESOLVE"
        outcome, xid, gtrid, first, count, branch_tid, seqs, discards = check_fields(
            value, name, RESOLVE_FIELDS, RESOLVE_FIELDS)
        return cls(check_str(outcome, name, "outcome"), check_str(xid, name, "xid"),
                   check_str(gtrid, name, "gtrid"), check_int(first, name, "first"),
                   check_int(count, name, "count"), check_int(branch_tid, name, "branch tid"),
                   check_pairs(seqs, name, "seqs"), check_ints(discards, name, "discards"))

    @classmethod
    def decode(cls, info: bytes) -> ResolveInfo:
        """Decode info bytes."""
        return cls.from_value(unpack_meta(info, "RESOLVE"))


__all__ = ["BRANCH_HEADER_FIELDS", "RESOLVE_FIELDS", "BranchHeader", "ResolveInfo"]
