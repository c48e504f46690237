"""Record kinds the broker writes to its store, and their ``meta`` encoding.

A store entry is ``(kind, meta, bodies)`` (see ``storage/interface.py``); the
store frames and checksums it. This module fixes what ``kind`` and ``meta``
mean. ``meta`` is always one msgpack value (``use_bin_type=True``); message
bodies are never inside ``meta`` but in the entry's ``bodies``, so that the
store can hand out a ref per body.

Kinds and their meta (``id`` is the broker-wide message id, an int that only
grows; ``msg`` is the message tuple described below):

====  ==============  ==================================================  ======
kind  name            meta                                                bodies
====  ==============  ==================================================  ======
1     SNAPSHOT        ``{"next_id", "queues": {name: def}, "dups":        0
                      {queue: [message_id…]}}`` — the whole metadata state;
                      replaces it on replay. First entry of every segment.
2     QUEUE_PUT       ``def`` of one queue or topic (declare / update)    0
3     QUEUE_DELETE    ``name``                                            0
4     ADD             ``msg``                                             1
5     TX              ``[[msg…], [acked id…]]`` — one local transaction,   n
                      atomic: all of it or none of it is in the log
6     ACK             ``[id…]`` — messages consumed (gone)                0
7     DROP            ``[[id…], reason]`` — purged / expired / deleted    0
8     MOVE            ``[[id…], queue, reason]`` — dead-lettered or       0
                      expired to another queue, same id and body
9     UPDATE          ``[id, delivery_count, deliver_at_ms]``             0
10    RELOCATE        ``msg`` (as it is now: queue, delivery count) — a    1
                      fresh copy of a live message written by compaction;
                      replayed like ADD (replaces an older copy), because
                      the segment holding the original ADD may be deleted
11    XA_PREPARE      ``[xid, [msg…], [[consumed id, delivery count]…],  n
                      [discard id…],
                      created_ms]`` — a prepared XA branch's whole
                      content, atomic; bodies are the sends' (``msg``
                      order). ``xid`` is the Xid text form
12    XA_COMMIT       ``[xid, [discard id…]]`` — two-phase commit of a     0
                      prepared branch: its sends (but the discards) are
                      added, its consumed messages are gone
13    XA_ROLLBACK     ``xid`` — a prepared branch rolled back: its sends   0
                      are dropped, its consumed messages come back
14    XA_HEURISTIC    ``[xid, "commit"|"rollback", [discard id…]]`` — an   0
                      operator completed a prepared branch; its outcome
                      applies as for 12/13 and the branch stays
                      HEURISTIC_* until forgotten
15    XA_FORGET       ``xid`` — a heuristically completed branch removed   0
16    SINK_COMMIT     ``[sink, last batch id, [[xid, [[id, seq]…],         0
                      [discard id…]]…], [rolled-back xid…], at_ms]`` — the
                      Spark sink's commit (core/streams.py): commits the
                      listed prepared branches, rolls back the others and
                      sets the sink's last committed batch id, atomically
17    RELOCATE_MANY   ``[msg…]`` — fresh copies of many live messages       n
                      written by compaction in one entry (bodies in
                      ``msg`` order); each replayed like RELOCATE
18    REPLICA_AT      ``[epoch, lsn]`` — only in a replicated backup's     0
                      own log: every later entry is the primary's entry
                      of the next LSN (``epoch`` "": none from here); a
                      backup's SNAPSHOT carries the same as ``"replica"``
====  ==============  ==================================================  ======

Times and seqs (added with offset reading; replay accepts records without
them): ``msg`` has a 10th field ``seq``, the message's gap-free sequence number
in its queue (0 = none: not yet committed, or not persistent). A local
transaction's TX record has a 3rd element ``committed_ms`` (a record group of
plain sends and acks has two). MOVE has a 4th element ``[seq…]`` (the moved
messages' seqs in the target queue). XA_PREPARE has a 6th element
``prepared_ms`` (in a backup's dump written before the record classes, the
branch's ``created_ms``: ``xa_records.py`` says why). XA_COMMIT is ``[xid,
[discard id…], [[id, seq]…], committed_ms]``; XA_ROLLBACK is ``[xid,
rolled_back_ms]`` (formerly the bare xid); XA_HEURISTIC is ``[xid, outcome,
[discard id…], [[id, seq]…], at_ms]``.
A queue ``def`` carries ``"next_seq"`` and ``"delivered_seq"`` (the delivered
mark, ``core/delivered_mark.py``: a ``QUEUE_PUT`` is also written to move it); the
SNAPSHOT carries ``"sinks": {sink: last batch id}``. Seqs, marks and sink batch
ids only grow: replay keeps the larger.

The SNAPSHOT also carries ``"xa": {xid: [state, [msg…], [ref…], [[consumed
id, delivery count]…], [discard id…], created_ms]}`` (each ref as big-endian bytes:
refs do not fit msgpack ints) for every durably PREPARED branch that sends
no stored message, and every HEURISTIC_* branch (``state`` is the BranchState
value; a heuristic branch has empty lists): an ``XA_PREPARE`` without bodies
could otherwise sit in a segment that gets deleted. A branch that sends stored
messages is left out: its ``XA_PREPARE`` holds their bodies, which keep its
segment (they are never relocated while prepared); snapshots written before
this carried it too, which replay accepts. Replaying it adds unknown branches (it never
removes one: completion records do that); a heuristic state for a branch
that replay knows as prepared applies that outcome.

``msg`` = ``[id, queue, message_id, headers, priority, timestamp_ms,
expires_ms, deliver_at_ms, delivery_count, seq]`` (``message_id`` and ``headers``
may be nil; 0 means "none" for the times).

``def`` = ``{"name", "kind": "queue"|"topic", "topic": str|nil, "settings":
{…}}`` — ``topic`` names the topic a subscription queue belongs to.

Every metadata record is idempotent on replay (a snapshot may already
contain the change a later record repeats).

The vocabulary
--------------
One class per kind (:data:`RECORD_CLASSES`): ``metadata.py`` (SNAPSHOT,
QUEUE_PUT, QUEUE_DELETE, REPLICA_AT), ``message_records.py`` (ADD, TX, ACK, DROP, MOVE,
UPDATE, RELOCATE, RELOCATE_MANY) and ``xa_records.py`` (XA_*, SINK_COMMIT).
Every writer builds one and appends ``record.encode()`` under ``record.kind``
(``Outbox.write`` takes the record; the router journal too); every reader decodes with
:func:`decode` (or a class's ``decode``/``from_value``), which accepts every
shape above and raises :class:`~txbroker.errors.MalformedRecord` (a
``ValueError``) for anything else: a field missing or extra, or of the wrong
type. ``common.py`` holds the kinds, the codec and the field checks.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from txbroker.core.records.common import (
    CHECKPOINT_KIND,
    MSG_DELIVER_AT,
    MSG_DELIVERY_COUNT,
    MSG_EXPIRES,
    MSG_FIELDS,
    MSG_FIELDS_MAX,
    MSG_HEADERS,
    MSG_ID,
    MSG_MESSAGE_ID,
    MSG_PRIORITY,
    MSG_QUEUE,
    MSG_SEQ,
    MSG_TIMESTAMP,
    BodyRef,
    Kind,
    MalformedRecord,
    StoredEntry,
    check_msg,
    pack,
    unpack,
    unpack_meta,
)
from txbroker.core.records.message_records import (
    Ack,
    Add,
    Drop,
    Move,
    Relocate,
    RelocateMany,
    Tx,
    Update,
)
from txbroker.core.records.metadata import (
    QueueDelete,
    QueuePut,
    ReplicaAt,
    Snapshot,
    SnapshotBranch,
)
from txbroker.core.records.xa_records import (
    SinkBranch,
    SinkCommit,
    XaCommit,
    XaForget,
    XaHeuristic,
    XaPrepare,
    XaRollback,
)


class Record(Protocol):
    """What every record class is: a kind and its meta bytes."""

    @property
    def kind(self) -> int:
        """The record kind (:class:`Kind`)."""

    def encode(self) -> bytes:
        """The meta bytes."""


#: The record class of each kind. (The kind is a property of each class, not a class
#: attribute: mypyc takes a ``ClassVar`` in a dataclass for a field.)
RECORD_CLASSES: Final[dict[int, Any]] = {
    int(Kind.SNAPSHOT): Snapshot, int(Kind.QUEUE_PUT): QueuePut,
    int(Kind.QUEUE_DELETE): QueueDelete, int(Kind.ADD): Add, int(Kind.TX): Tx,
    int(Kind.ACK): Ack, int(Kind.DROP): Drop, int(Kind.MOVE): Move, int(Kind.UPDATE): Update,
    int(Kind.RELOCATE): Relocate, int(Kind.XA_PREPARE): XaPrepare,
    int(Kind.XA_COMMIT): XaCommit, int(Kind.XA_ROLLBACK): XaRollback,
    int(Kind.XA_HEURISTIC): XaHeuristic, int(Kind.XA_FORGET): XaForget,
    int(Kind.SINK_COMMIT): SinkCommit, int(Kind.RELOCATE_MANY): RelocateMany,
    int(Kind.REPLICA_AT): ReplicaAt,
}


def from_value(kind: int, value: Any) -> Any:
    """The record of ``kind`` from its unpacked meta value (``MalformedRecord`` if it
    is not one, or the kind is unknown)."""
    cls = RECORD_CLASSES.get(kind)
    if cls is None:
        raise MalformedRecord(f"unknown record kind {kind}")
    return cls.from_value(value)


def entry(record: Record, refs: tuple[BodyRef, ...] = ()) -> StoredEntry:
    """A store entry holding ``record`` (a store handing entries back builds them so)."""
    return StoredEntry(record.kind, record.encode(), refs)


def decode(kind: int, meta: bytes) -> Any:
    """The record of ``kind`` from its meta bytes (see :func:`from_value`)."""
    return from_value(kind, unpack_meta(meta, f"kind {kind}"))


__all__ = ["CHECKPOINT_KIND", "MSG_DELIVERY_COUNT", "MSG_DELIVER_AT", "MSG_EXPIRES", "MSG_FIELDS",
           "MSG_FIELDS_MAX", "MSG_HEADERS", "MSG_ID", "MSG_MESSAGE_ID", "MSG_PRIORITY",
           "MSG_QUEUE", "MSG_SEQ", "MSG_TIMESTAMP", "RECORD_CLASSES", "Ack", "Add",
           "BodyRef", "Drop", "Kind", "MalformedRecord", "Move", "QueueDelete", "QueuePut",
           "Record", "Relocate", "RelocateMany", "ReplicaAt", "SinkBranch", "SinkCommit",
           "Snapshot", "SnapshotBranch", "StoredEntry", "Tx", "Update", "XaCommit", "XaForget",
           "XaHeuristic", "XaPrepare", "XaRollback", "check_msg", "decode", "entry",
           "from_value", "pack", "unpack", "unpack_meta"]
