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

**Promises** (Raft's vote, without its log comparison: rule 4 is that). Checking the
peers' standings and then acting on them is two steps, and between them another
operator may promote another node, or the old primary, alive behind a partial
partition, may record a newer version of its ready set on a peer. So the node being
promoted, having passed rules 1-4 for term T, first promises T to itself, then asks
every peer to **promise term T** to it (:func:`promise_refusal`: a peer refuses when
it is a primary or being promoted, holds a record of term T or newer, still hears its
primary, promised a term to another node moments ago, or promised T or newer to
another node), and is promoted only if rules 2-4
hold again over the peers that promised (else it withdraws its own promise). A
promise is synced before it is answered and kept across the copy's replacement; from
then on the peer refuses any record older than T (:func:`record_refusal`) and leaves
the primary it followed — so the old primary can neither record a smaller ready set
nor have its entries acknowledged by a majority, and answers nothing the new primary
could miss. Two operators promoting two nodes at once each promise the term to their
own node first: at most one of them gets a majority.

Pure: records and standings are plain values (``to_wire`` / ``from_wire`` for the link
and the ``REPLICA_STATE`` file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HEARS_WITHIN", "PROMISE_HOLD", "Promise", "ReadyRecord", "Standing", "majority",
           "newest", "next_term", "promise_refusal", "promotion_refusal", "record_refusal"]


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
class Promise:
    """A node's promise to take no record older than ``term``, nor one of ``term`` from
    any primary but ``candidate`` (Raft's current term and vote)."""

    term: int
    candidate: str

    def to_wire(self) -> dict[str, Any]:
        """As the link and the ``HA_PROMISE`` file carry it."""
        return {"term": self.term, "candidate": self.candidate}

    @staticmethod
    def from_wire(value: Any) -> Promise | None:
        """A promise read from the link or a file (None when absent or malformed)."""
        if not isinstance(value, dict):
            return None
        term, candidate = value.get("term"), value.get("candidate")
        if not (isinstance(term, int) and not isinstance(term, bool) and term > 0
                and isinstance(candidate, str) and candidate):
            return None
        return Promise(term, candidate)


@dataclass(frozen=True, slots=True)
class Standing:
    """What one node says when asked before a promotion."""

    node: str
    role: str  #: "backup", "promoting", "primary", "stopped"
    record: ReadyRecord | None  #: the newest ready-set record it holds
    following: str = ""  #: the primary it follows over a live link ("" for none)
    promised: int = 0  #: the newest term it promised (0: none)
    granted: bool = False  #: it promised the term just asked for
    hears: str = ""  #: the primary it heard from just now (``HEARS_WITHIN``; "": none)

    def to_wire(self) -> dict[str, Any]:
        """As the link carries it."""
        return {"node": self.node, "role": self.role, "following": self.following,
                "record": None if self.record is None else self.record.to_wire(),
                "promised": self.promised, "granted": self.granted, "hears": self.hears}

    @staticmethod
    def from_wire(value: Any) -> Standing | None:
        """A standing read from the link (None when malformed)."""
        if not isinstance(value, dict) or not isinstance(value.get("node"), str) \
                or not isinstance(value.get("role"), str):
            return None
        following, promised = value.get("following"), value.get("promised")
        hears = value.get("hears")
        return Standing(value["node"], value["role"], ReadyRecord.from_wire(value.get("record")),
                        following if isinstance(following, str) else "",
                        promised if isinstance(promised, int) and promised > 0 else 0,
                        value.get("granted") is True, hears if isinstance(hears, str) else "")


#: A backup that heard from its primary this recently (s) promises nobody else a term:
#: two heartbeats (``server/ha/replica.py`` ``HEARTBEAT_INTERVAL``, 0.25 s).
HEARS_WITHIN = 0.5
#: After promising a term to a node, promise no other node any term for this long (s):
#: time for the promised node to become the primary (its first record then stops
#: older terms by itself).
PROMISE_HOLD = 2.0


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
    """The term of a primary promoted after these standings were heard: newer than any
    record they hold and any term they promised."""
    record = newest([s.record for s in standings])
    highest = max([0 if record is None else record.term, *(s.promised for s in standings)])
    return highest + 1


def promise_refusal(own: Standing, promised: Promise | None, term: int,
                    candidate: str, *, recently: str = "") -> str | None:
    """Why ``own.node`` may not promise ``term`` to ``candidate`` (None: it may; a
    promise repeated to the same candidate is granted again). ``recently``: the node it
    promised a term to less than :data:`PROMISE_HOLD` ago ("": none)."""
    # P1: a primary, or a node being promoted, promises nobody else a term.
    if own.role in ("primary", "promoting") and candidate != own.node:
        return f"{own.node} is the {own.role}"
    # P2: it holds a record of this term or newer: that primary was promoted already.
    if own.record is not None and own.record.term >= term and not (
            own.record.term == term and own.record.primary == candidate):
        return (f"{own.node} holds term {own.record.term} (primary {own.record.primary})")
    # P3: it hears its primary (a message within ``HEARS_WITHIN``): that primary is
    # alive, and a promise would depose it (Raft's leader stickiness, as PreVote
    # nodes refuse while they hear a leader). A dead primary's link ends, or falls
    # silent, and the promise is granted.
    if own.hears and own.hears != candidate:
        return f"{own.node} hears its primary {own.hears}"
    # P4: it promised a term to another node just now: that promotion is under way
    # (Raft's election timeout: one vote per round). Without it, two operators'
    # promotions a few ms apart each got a promise from the same peer, the newer
    # term deposed the first primary at once and left it fenced (replicated-live
    # seeds 30018, 30026).
    if recently and recently != candidate:
        return f"{own.node} promised a term to {recently} less than {PROMISE_HOLD} s ago"
    # P5: it promised a newer term, or this term to another node.
    if promised is not None and (promised.term > term or (
            promised.term == term and promised.candidate != candidate)):
        return f"{own.node} promised term {promised.term} to {promised.candidate}"
    return None


def record_refusal(mine: ReadyRecord | None, promised: Promise | None,
                   record: ReadyRecord) -> str | None:
    """Why a backup refuses a primary's ``record`` (None: it takes it), holding
    ``mine`` and having promised ``promised``."""
    # R1: an older term than one recorded here: a newer primary was promoted since.
    # R2: a second primary of the same term (two promotions at once: the first to
    # reach this node keeps the term).
    if mine is not None and (record.term < mine.term or (
            record.term == mine.term and record.primary != mine.primary)):
        return (f"its term {record.term} is not newer than term {mine.term} "
                f"(primary {mine.primary}) recorded here")
    # R3: older than the term promised. (Of that term from another node than the one
    # promised: that node won the term — each node promises a term once, so only one
    # gets a majority — and is followed, as Raft follows a leader whatever it voted.)
    if promised is not None and record.term < promised.term:
        return (f"its term {record.term} is older than term {promised.term}, promised "
                f"to {promised.candidate}")
    return None


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
