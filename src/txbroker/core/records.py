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
====  ==============  ==================================================  ======

Times and seqs (added with offset reading; replay accepts records without
them): ``msg`` has a 10th field ``seq``, the message's gap-free sequence number
in its queue (0 = none: not yet committed, or not persistent). A local
transaction's TX record has a 3rd element ``committed_ms`` (a record group of
plain sends and acks has two). MOVE has a 4th element ``[seq…]`` (the moved
messages' seqs in the target queue). XA_PREPARE has a 6th element
``prepared_ms``. XA_COMMIT is ``[xid, [discard id…], [[id, seq]…],
committed_ms]``; XA_ROLLBACK is ``[xid, rolled_back_ms]`` (formerly the bare
xid); XA_HEURISTIC is ``[xid, outcome, [discard id…], [[id, seq]…], at_ms]``.
A queue ``def`` carries ``"next_seq"`` and ``"delivered_seq"`` (the delivered
mark, ``core/queue_index.py``: a ``QUEUE_PUT`` is also written to move it); the
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
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

#: What the store hands back per body (an opaque int; ``storage/interface.py``).
BodyRef = int


class Kind(IntEnum):
    """Record kinds (the ``kind`` of a store entry)."""

    SNAPSHOT = 1
    QUEUE_PUT = 2
    QUEUE_DELETE = 3
    ADD = 4
    TX = 5
    ACK = 6
    DROP = 7
    MOVE = 8
    UPDATE = 9
    RELOCATE = 10
    XA_PREPARE = 11
    XA_COMMIT = 12
    XA_ROLLBACK = 13
    XA_HEURISTIC = 14
    XA_FORGET = 15
    SINK_COMMIT = 16
    RELOCATE_MANY = 17


#: Positions in the ``msg`` tuple.
MSG_ID, MSG_QUEUE, MSG_MESSAGE_ID, MSG_HEADERS, MSG_PRIORITY = 0, 1, 2, 3, 4
MSG_TIMESTAMP, MSG_EXPIRES, MSG_DELIVER_AT, MSG_DELIVERY_COUNT = 5, 6, 7, 8
MSG_SEQ = 9
MSG_FIELDS = 9  #: the fewest fields a ``msg`` has (records written before seqs)

_packer = msgpack.Packer(use_bin_type=True)


def pack(value: Any) -> bytes:
    """Encode a meta value."""
    return _packer.pack(value)


def unpack(meta: bytes) -> Any:
    """Decode a meta value (strings as ``str``, bodies never appear here)."""
    return msgpack.unpackb(meta, raw=False, strict_map_key=False, use_list=True)


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """One entry read back by a store's ``recover`` or ``entries_of``: what replay
    takes (``core/replay.py``)."""

    kind: int
    meta: bytes
    refs: tuple[BodyRef, ...]
