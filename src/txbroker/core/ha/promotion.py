"""Who may be promoted in a replicated group without etcd: the ready set recorded on a
majority, and a promotion checked against a majority (docs/replication.md, "Who may be
promoted").

Theory of operation
-------------------
An entry is answered once it is durable on the primary and on every backup of the
**ready set**; so a node has every answered entry when it was the primary, or in the
ready set, of the newest *term* (one primary's time in office). A backup cut off from
the primary never hears that it was dropped, so its own view can be stale: the truth
is the primary's. The primary therefore writes each version of its ready set as a
:class:`ReadyRecord` — term, version, primary, members — to the data directory of
every backup it reaches, and **acts on a smaller set (stops waiting for a backup that
left) only once a majority of the group holds it** (itself counting as one). A new
primary's first record (its term, an empty ready set) must reach a majority before it
answers anything. So every majority of the group holds, among its members, the newest
record under which anything was answered.

``txbroker ha promote`` of node X asks the peers it reaches for their
:class:`Standing` and promotes X only when :func:`promotion_refusal` finds no reason not
to — the rules, in order:

1. X itself must be promotable by its own copy (whole, not catching up).
2. Nobody reached is a primary (or on its way): promoting a second would split the
   group. (One it cannot reach, still followed by a peer over a live link, cannot get
   anything past the new primary: the peer holds the new term once it joins it.)
3. X and the peers that answered are a majority of the group: fewer may have missed a
   newer record.
4. Of the records they hold, the newest (term, then version) names X as its primary or
   in its ready set: X has every answered entry. No record at all: a new group.

``ha promote --force`` waives rules 3 and 4 (the operator knows the others are gone
for good and accepts losing what only they held), never 1 and 2.

The new primary's term is one more than the highest term any of them holds
(:func:`next_term`). A backup refuses a record of an older term than one it holds (it
has seen a newer primary): the old primary then cannot get a smaller ready set onto a
majority, and so answers nothing a newer primary could miss.

Pure: records and standings are plain values (``to_wire`` / ``from_wire`` for the link
and the ``REPLICA_STATE`` file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ReadyRecord", "Standing", "majority", "newest", "next_term", "promotion_refusal"]


@dataclass(frozen=True, slots=True)
class ReadyRecord:
    """One version of a primary's ready set: who has every entry answered under it."""

    term: int  #: the primary's term (1, 2, 3 … one per promotion)
    version: int  #: 0 for the term's first record, one more per change
    primary: str  #: the node that was primary in the term
    ready: tuple[str, ...]  #: the backups entries wait for (sorted)

    def key(self) -> tuple[int, int]:
        """Order of records: the newer term, then the newer version."""
        return (self.term, self.version)

    def covers(self, node: str) -> bool:
        """Does ``node`` hold every entry answered under this record?"""
        return node == self.primary or node in self.ready

    def to_wire(self) -> dict[str, Any]:
        """As the link and the ``REPLICA_STATE`` file carry it."""
        return {"term": self.term, "version": self.version, "primary": self.primary,
                "ready": list(self.ready)}

    @staticmethod
    def from_wire(value: Any) -> ReadyRecord | None:
        """A record read from the link or a file (None when absent or malformed)."""
        if not isinstance(value, dict):
            return None
        term, version = value.get("term"), value.get("version")
        primary, ready = value.get("primary"), value.get("ready")
        if not (isinstance(term, int) and isinstance(version, int) and term >= 0
                and version >= 0 and isinstance(primary, str) and isinstance(ready, list)
                and all(isinstance(name, str) for name in ready)):
            return None
        return ReadyRecord(term, version, primary, tuple(sorted(ready)))


@dataclass(frozen=True, slots=True)
class Standing:
    """What one node says when asked before a promotion."""

    node: str
    role: str  #: "backup", "promoting", "primary", "stopped"
    record: ReadyRecord | None  #: the newest ready-set record it holds
    following: str = ""  #: the primary it follows over a live link ("" for none)

    def to_wire(self) -> dict[str, Any]:
        """As the link carries it."""
        return {"node": self.node, "role": self.role, "following": self.following,
                "record": None if self.record is None else self.record.to_wire()}

    @staticmethod
    def from_wire(value: Any) -> Standing | None:
        """A standing read from the link (None when malformed)."""
        if not isinstance(value, dict) or not isinstance(value.get("node"), str) \
                or not isinstance(value.get("role"), str):
            return None
        following = value.get("following")
        return Standing(value["node"], value["role"], ReadyRecord.from_wire(value.get("record")),
                        following if isinstance(following, str) else "")


def majority(group_size: int) -> int:
    """The smallest majority of a group of ``group_size`` nodes."""
    return group_size // 2 + 1


def newest(records: Sequence[ReadyRecord | None]) -> ReadyRecord | None:
    """The newest of ``records`` (None when there is none)."""
    found: ReadyRecord | None = None
    for record in records:
        if record is not None and (found is None or record.key() > found.key()):
            found = record
    return found


def next_term(standings: Sequence[Standing]) -> int:
    """The term of a primary promoted after these standings were heard."""
    record = newest([s.record for s in standings])
    return 1 if record is None else record.term + 1


def promotion_refusal(own: Standing, own_refusal: str | None, group_size: int,
                      peers: Sequence[Standing], *, force: bool = False) -> str | None:
    """Why ``own.node`` may not be promoted now, having heard ``peers`` (None: it may).
    ``own_refusal`` is what its own copy says (``ReplicatedNode.promotable``); ``force``
    (``ha promote --force``) waives rules 3 and 4, never 1 and 2."""
    # Rule 1: its own copy first (incomplete, catching up, not a backup).
    if own_refusal is not None:
        return own_refusal
    # Rule 2: a live primary anywhere reached: promoting another splits the group. (A
    # peer that says it follows a primary we cannot reach is not enough: over a link
    # gone silent it says so until it notices; and promoted meanwhile, we answer
    # nothing until a majority holds our first record — it joins us once it does.)
    for peer in peers:
        if peer.role in ("primary", "promoting"):
            return f"{peer.node} is the {peer.role}"
    if force:
        return None
    # Rule 3: a majority must answer, or a newer record may be out of sight.
    heard = 1 + len({peer.node for peer in peers if peer.node != own.node})
    needed = majority(group_size)
    if heard < needed:
        return (f"only {heard} of the {group_size} nodes answered (a majority, {needed}, "
                "must: the others may hold a newer ready set)")
    # Rule 4: the newest record they hold must cover it (no record: a new group).
    record = newest([own.record, *(peer.record for peer in peers)])
    if record is not None and not record.covers(own.node):
        ready = ", ".join(record.ready) or "none"
        instead = record.primary if not record.ready else f"{record.primary} or {ready}"
        return (f"the newest ready set (term {record.term}, version {record.version}, "
                f"primary {record.primary}) does not hold it: ready {ready}; it may miss "
                f"answered entries — promote {instead}")
    return None
