"""Replaying the log and metadata snapshots.

Theory of operation
-------------------
On start the edge feeds every stored entry, in log order, to
:meth:`Replay.replay`, then calls :meth:`Replay.finish`. Replay keeps
messages only as their decoded ``msg`` lists (``core/records/__init__.py``, with the
seq and the body ref appended: :data:`RAW_SEQ`, :data:`RAW_REF`) in a dict by
id, in log order — no object per message: acks, drops and moves of later
records are cheap dict operations, and the bodies of everything that died are
released as they die. ``finish`` then puts the survivors into their queues in
log order (commit order): plain ones as compact chunk slots
(``core/messages.py``), the others as :class:`Message` objects.

:meth:`Replay.snapshot` is the metadata state (queues, topics, duplicate-id
windows, the next message id, durable XA branches a body does not keep, the
sinks' last batches) that the store writes first in every segment; replaying
a snapshot replaces the metadata, so deleting old segments never loses a
queue. ``core/records/__init__.py`` describes every record kind.

XA branches come back PREPARED (rule 16 of ``core/xa.py``) from their
``XA_PREPARE`` record or the snapshot; a later completion record applies
their outcome. The messages a prepared branch consumed stay HELD; the
message ids of its sends are back in their queues' duplicate windows (still
pending: a rollback takes them out again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from txbroker.core import records
from txbroker.core.effects import Release
from txbroker.core.messages import COMPACT_REF_LIMIT, COMPACT_SIZE_LIMIT, Message, State
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import QueueIndex
from txbroker.core.queue_settings import QueueSettings
from txbroker.core.queues import Queue
from txbroker.core.records import MSG_FIELDS, Kind, Snapshot, SnapshotBranch, StoredEntry
from txbroker.core.sessions import Topic
from txbroker.core.sinks import Sinks
from txbroker.core.xa import Branch, BranchState, Request
from txbroker.core.xa_branches import XaBranches, parse_xid
from txbroker.errors import CorruptStore
from txbroker.xid import Xid

S = BranchState
#: The store's ``body_size``: the edge sets it before replaying.
BodySize = Callable[[int], int]
#: A replayed message: its ``msg`` list, seq at RAW_SEQ, body ref at RAW_REF.
RAW_SEQ, RAW_REF = 9, 10


def pack_ref(ref: int | None) -> bytes | None:
    """A body ref as msgpack can carry it: refs are opaque ints of up to 136 bits."""
    return None if ref is None else ref.to_bytes((ref.bit_length() + 7) // 8 or 1, "big")


def unpack_ref(value: Any) -> int | None:
    """The inverse of :func:`pack_ref` (also takes a plain int)."""
    return int.from_bytes(value, "big") if isinstance(value, bytes) else value


class Replay:
    """Snapshots and replay over the index, the XA branches and the sinks."""

    def __init__(self, index: QueueIndex, xa: XaBranches, sinks: Sinks, outbox: Outbox) -> None:
        self.index = index
        self.xa = xa
        self.sinks = sinks
        self.outbox = outbox
        self.body_size_of: BodySize | None = None
        #: Xids completed by a record during replay: a later snapshot (taken while the
        #: completion was on its way to disk) must not bring such a branch back.
        self._completed: set[Xid] = set()
        #: replayed messages by id, in log order (see the module docstring)
        self.raw: dict[int, list[Any]] = {}

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> tuple[int, bytes]:
        """``(kind, meta)`` of the metadata snapshot (records.py SNAPSHOT)."""
        index = self.index
        defs: dict[str, Any] = {}
        dups: dict[str, list[str]] = {}
        for topic in index.topics.values():
            defs[topic.name] = topic.definition()
        for queue in index.queues.values():
            if not queue.durable:
                continue
            defs[queue.name] = queue.definition()
            if queue.dups:
                dups[queue.name] = queue.durable_dups()
        snapshot = Snapshot(index.next_id, defs, dups,
                            self._xa_snapshot() if self.xa.branches else None,
                            dict(self.sinks.sinks) if self.sinks.sinks else None)
        return snapshot.kind, snapshot.encode()

    def _xa_snapshot(self) -> dict[str, SnapshotBranch]:
        """The ``"xa"`` part of the SNAPSHOT: the durable branches whose XA_PREPARE
        entry no stored body keeps (consumes only), and heuristic ones."""
        found: dict[str, SnapshotBranch] = {}
        for branch in self.xa.branches.values():
            if branch.state in (S.PREPARED, S.COMMITTING, S.ROLLING_BACK):
                sends = [m for m in branch.work.sends if m.persistent]
                if sends and None not in [m.ref for m in sends]:
                    # Its XA_PREPARE entry holds these bodies, so the store keeps that
                    # entry's segment while they live (they are never relocated): replay
                    # finds the branch there. Copying it here would cost every segment
                    # roll as much as all prepared sends (a Spark micro-batch prepares
                    # millions), quadratic in the batch.
                    continue
                found[str(branch.xid)] = SnapshotBranch(
                    S.PREPARED.value, [m.to_record() for m in sends],
                    [pack_ref(m.ref) for m in sends],
                    [[m.id, m.delivery_count] for m in branch.work.acks.values()]
                    + branch.ref_ids,
                    sorted(branch.discards), branch.created_ms)
            elif branch.state in (S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK):
                found[str(branch.xid)] = SnapshotBranch(branch.state.value, [], [], [], [],
                                                        branch.created_ms)
        return found

    # ------------------------------------------------------------------ replay
    def replay(self, entry: StoredEntry) -> None:
        """Apply one stored entry (log order) to the recovering state."""
        try:
            self._replay(entry.kind, records.unpack(entry.meta), entry.refs)
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # (MalformedRecord too)
            raise CorruptStore("<entry>", 0, f"undecodable record of kind {entry.kind}: {exc}") \
                from exc

    def _replay(self, kind: int, meta: Any, refs: tuple[int, ...]) -> None:
        """Decode ``meta`` as its kind's record (``core/records``) and apply it."""
        if kind == Kind.TX:
            tx = records.Tx.from_value(meta)
            if len(tx.adds) != len(refs):
                raise ValueError(f"{len(tx.adds)} messages but {len(refs)} bodies")
            self._add_many(tx.adds, refs)
            self._gone(tx.acks)
        elif kind == Kind.ADD:
            self._add_many([records.Add.from_value(meta).msg], refs[:1] if refs else (None,))
        elif kind == Kind.RELOCATE:
            # the full, current message: the segment with its ADD may be gone
            self._add_many([records.Relocate.from_value(meta).msg], refs[:1] if refs else (None,))
        elif kind == Kind.ACK:
            self._gone(records.Ack.from_value(meta).ids)
        elif kind == Kind.DROP:
            self._gone(records.Drop.from_value(meta).ids)
        elif kind == Kind.MOVE:
            self._move(records.Move.from_value(meta))
        elif kind == Kind.UPDATE:
            update = records.Update.from_value(meta)
            msg = self.raw.get(update.id)
            if msg is not None:
                msg[records.MSG_DELIVERY_COUNT] = update.delivery_count
                msg[records.MSG_DELIVER_AT] = update.deliver_at_ms
        elif kind == Kind.RELOCATE_MANY:
            msgs = records.RelocateMany.from_value(meta).msgs
            if len(msgs) != len(refs):
                raise ValueError(f"{len(msgs)} messages but {len(refs)} bodies")
            self._add_many(msgs, refs)
        elif kind == Kind.QUEUE_PUT:
            self._definition(records.QueuePut.from_value(meta).definition)
        elif kind == Kind.QUEUE_DELETE:
            self._delete(records.QueueDelete.from_value(meta).name)
        elif kind == Kind.SNAPSHOT:
            snapshot = Snapshot.from_value(meta)
            self._snapshot(snapshot)
            if snapshot.xa is not None:
                self._xa_snapshot_entries(snapshot.xa)
        elif Kind.XA_PREPARE <= kind <= Kind.XA_FORGET:
            self._xa(kind, meta, refs)
        elif kind == Kind.SINK_COMMIT:
            self._sink(records.SinkCommit.from_value(meta))
        else:
            raise records.MalformedRecord(f"unknown record kind {kind}")

    def _add_many(self, msgs: list[list[Any]], refs: Sequence[int | None]) -> None:
        """Index replayed messages, ``msg`` tuples with their body refs (the hottest loop
        of a restart: one pass per message, everything it touches in locals)."""
        index = self.index
        raw, emit = self.raw, self.outbox.emit
        next_id = index.next_id
        for msg, ref in zip(msgs, refs, strict=True):  # (9 or 10 fields: records.check_msg)
            if len(msg) == MSG_FIELDS:  # written before seqs
                msg.append(0)
            msg.append(ref)
            message_id = msg[0]
            old = raw.get(message_id)
            if old is not None and old[RAW_REF] is not None:  # a relocated copy replaces
                emit(Release(old[RAW_REF]))  # it (and keeps the old one's place)
            raw[message_id] = msg
            if message_id >= next_id:
                next_id = message_id + 1
            if msg[2] is not None:
                self._queue(msg[1]).remember(msg[2])
        index.next_id = next_id

    def _gone(self, ids: Iterable[int]) -> None:
        raw = self.raw
        for message_id in ids:
            msg = raw.pop(message_id, None)
            if msg is not None and msg[RAW_REF] is not None:
                self.outbox.emit(Release(msg[RAW_REF]))

    def _move(self, move: records.Move) -> None:
        ids, target = move.ids, move.queue
        seqs = move.seqs if move.seqs is not None else [0] * len(ids)
        self._queue(target)
        raw = self.raw
        for message_id, seq in zip(ids, seqs, strict=True):
            msg = raw.get(message_id)
            if msg is not None:
                msg[records.MSG_QUEUE] = target
                msg[records.MSG_EXPIRES] = 0
                msg[records.MSG_DELIVER_AT] = 0
                msg[RAW_SEQ] = seq

    def _queue(self, name: str) -> Queue:
        queues = self.index.queues
        queue = queues.get(name)
        if queue is None:
            queue = Queue(name)
            queues[name] = queue
        return queue

    def _definition(self, definition: dict[str, Any]) -> None:
        name = definition["name"]
        topics = self.index.topics
        if definition["kind"] == "topic":
            topics.setdefault(name, Topic(name))
            return
        settings = QueueSettings.from_dict(definition.get("settings") or {})
        queue = self._queue(name)
        queue.settings = settings
        queue.next_seq = max(queue.next_seq, int(definition.get("next_seq", 1)))
        queue.delivered_seq = max(queue.delivered_seq, int(definition.get("delivered_seq", 0)))
        topic_name = definition.get("topic")
        if topic_name:
            queue.topic = topic_name
            topics.setdefault(topic_name, Topic(topic_name)).subscriptions.add(name)

    def _delete(self, name: str) -> None:
        index = self.index
        topic = index.topics.pop(name, None)
        if topic is not None:
            return
        queue = index.queues.pop(name, None)
        if queue is not None and queue.topic and queue.topic in index.topics:
            index.topics[queue.topic].subscriptions.discard(name)
        # queues are created lazily during replay: drop its messages either way
        self._gone([i for i, msg in self.raw.items() if msg[records.MSG_QUEUE] == name])

    def _snapshot(self, snapshot: Snapshot) -> None:
        index = self.index
        index.next_id = max(index.next_id, snapshot.next_id)
        defs = snapshot.queues
        for name in [n for n in index.queues if n not in defs]:
            self._delete(name)
        for name in [n for n in index.topics if n not in defs]:
            index.topics.pop(name)
        for definition in defs.values():
            if definition["kind"] == "topic":
                self._definition(definition)
        for definition in defs.values():
            if definition["kind"] != "topic":
                self._definition(definition)
        sinks = self.sinks.sinks
        for sink, last in (snapshot.sinks or {}).items():
            sinks[sink] = max(sinks.get(sink, -1), last)
        for name, ids in snapshot.dups.items():
            queue = index.queues.get(name)
            if queue is not None:
                for message_id in ids:
                    queue.remember(message_id)

    # ------------------------------------------------------------------ XA and sinks
    def _xa(self, kind: int, meta: Any, refs: tuple[int, ...]) -> None:
        if kind == Kind.XA_PREPARE:
            prepare = records.XaPrepare.from_value(meta)
            xid = parse_xid(prepare.xid)
            self._completed.discard(xid)
            branch = self._branch(xid, prepare.sends, list(refs), prepare.consumed,
                                  prepare.discards, prepare.created_ms)
            branch.prepared_ms = prepare.prepared_or_created
        elif kind == Kind.XA_COMMIT:
            commit_ = records.XaCommit.from_value(meta)
            self._commit(parse_xid(commit_.xid), commit_.discards, commit_.seqs or [])
        elif kind == Kind.XA_ROLLBACK:
            self._rollback(parse_xid(records.XaRollback.from_value(meta).xid))
        elif kind == Kind.XA_HEURISTIC:
            heuristic = records.XaHeuristic.from_value(meta)
            known = self.xa.branches.get(parse_xid(heuristic.xid))
            if known is not None and known.state is S.PREPARED:
                commit = heuristic.commit
                known.discards.update(heuristic.discards)
                if commit and heuristic.seqs is not None:
                    self._seqs(known, heuristic.seqs)
                self._outcome(known, commit=commit)
                known.fire(Request.HEURISTIC_COMMIT if commit else Request.HEURISTIC_ROLLBACK)
        else:  # XA_FORGET
            xid = parse_xid(records.XaForget.from_value(meta).xid)
            self.xa.branches.pop(xid, None)
            self._completed.add(xid)

    def _commit(self, xid: Xid, discards: list[int], seqs: list[Any]) -> None:
        """Replay a branch's commit (XA_COMMIT, or one branch of a SINK_COMMIT)."""
        branch = self.xa.branches.pop(xid, None)
        self._completed.add(xid)
        if branch is not None:
            branch.discards.update(discards)
            self._seqs(branch, seqs)
            self._outcome(branch, commit=True)

    def _rollback(self, xid: Xid) -> None:
        branch = self.xa.branches.pop(xid, None)
        self._completed.add(xid)
        if branch is not None:
            self._outcome(branch, commit=False)

    @staticmethod
    def _seqs(branch: Branch, pairs: list[list[int]]) -> None:
        seqs = dict((int(pair[0]), int(pair[1])) for pair in pairs)
        for message in branch.work.sends:
            message.seq = seqs.get(message.id, 0)

    def _xa_snapshot_entries(self, found: dict[str, SnapshotBranch]) -> None:
        for xid_text, saved in found.items():
            xid = parse_xid(xid_text)
            if xid in self._completed:
                continue
            wanted = S(saved.state)
            branch = self.xa.branches.get(xid)
            if branch is None:
                branch = self._branch(xid, saved.sends, list(saved.refs), saved.consumed,
                                      saved.discards, saved.created_ms)
                branch.prepared_ms = saved.created_ms  # (a snapshot does not keep it)
            if wanted is not S.PREPARED and branch.state is S.PREPARED:
                commit = wanted is S.HEURISTIC_COMMITTED
                self._outcome(branch, commit=commit)
                branch.fire(Request.HEURISTIC_COMMIT if commit else Request.HEURISTIC_ROLLBACK)

    def _branch(self, xid: Xid, sends: list[Any], refs: list[Any], consumed: list[Any],
                discards: list[int], created: int) -> Branch:
        index = self.index
        branch = Branch(xid, 0, created, 0)
        branch.session = None
        branch.work.session = 0
        branch.fire(Request.RECOVER)
        body_size_of = self.body_size_of
        for msg, packed in zip(sends, refs, strict=True):
            ref = unpack_ref(packed)
            size = int(body_size_of(ref)) if body_size_of is not None and ref is not None else 0
            message = Message.from_record(msg, size, ref)
            branch.work.sends.append(message)
            if message.id >= index.next_id:
                index.next_id = message.id + 1
        branch.ref_ids = [[int(pair[0]), int(pair[1])] for pair in consumed]  # [id, count]
        branch.discards = set(discards)
        self.xa.branches[xid] = branch
        return branch

    def _outcome(self, branch: Branch, *, commit: bool) -> None:
        raw = self.raw
        for message in branch.work.sends:
            if commit and message.id not in branch.discards:
                raw[message.id] = [*message.to_record(), message.ref]
            elif message.ref is not None:
                self.outbox.emit(Release(message.ref))
        if commit:
            self._gone([message_id for message_id, _ in branch.ref_ids])
        branch.work.sends = []
        branch.ref_ids = []
        branch.discards = set()

    def _sink(self, record: records.SinkCommit) -> None:
        sinks = self.sinks.sinks
        sinks[record.sink] = max(sinks.get(record.sink, -1), record.last_batch)
        for committed in record.commits:
            self._commit(parse_xid(committed.xid), committed.discards or [], committed.seqs)
        for xid_text in record.rollbacks:
            self._rollback(parse_xid(xid_text))

    # ------------------------------------------------------------------ finish
    def finish(self, now: int) -> None:
        """Put every surviving message into its queue, in log order (messages consumed
        by prepared XA branches stay held)."""
        held = self._hold_consumed() if self.xa.branches else []
        index = self.index
        queues, home = index.queues, index.messages
        objects = home.objects
        body_size_of = self.body_size_of
        name, queue = "", None
        raw, self.raw = self.raw, {}
        restored = home.restored
        #: compact survivors not yet in their level, by (queue, priority): the columns
        #: of ``Queue.extend_compact`` (a level is flushed before an object joins it)
        batches: dict[tuple[str, int], tuple[Queue, list[list[int]]]] = {}
        batch: list[list[int]] = []
        ordinal = 0
        for msg in raw.values():  # (the hottest loop of a restart: all in locals)
            (message_id, qname, client_id, headers, priority, timestamp, expires,
             deliver_at, count, seq, ref) = msg
            if qname != name:
                name = qname
                queue = queues.get(name) or self._queue(name)
            assert queue is not None
            ordinal += 1
            size = body_size_of(ref) if ref is not None and body_size_of is not None else 0
            queue.messages += 1  # count_in + put, inlined: this loop runs per message
            if seq >= queue.next_seq:
                queue.next_seq = seq + 1
            if seq <= queue.delivered_seq and not count:
                count = 1  # may have been delivered before the crash
            queue.bytes += size
            if expires:
                queue.expiring += 1
            elif (client_id is None and not headers and deliver_at <= now and ref is not None
                  and 0 <= priority < 10 and 0 <= ref >> 32 < COMPACT_REF_LIMIT
                  and 0 <= size < COMPACT_SIZE_LIMIT and 0 <= count < 65536
                  and message_id > 0 and seq >= 0):
                key = (name, priority)
                found = batches.get(key)
                if found is None:
                    batch = [[], [], [], [], [], [], []]
                    batches[key] = (queue, batch)
                else:
                    batch = found[1]
                batch[0].append(message_id)
                batch[1].append(seq)
                batch[2].append(ref)
                batch[3].append(size)
                batch[4].append(timestamp)
                batch[5].append(count)
                batch[6].append(ordinal)
                continue
            if 0 <= priority < 10:
                pending = batches.pop((name, priority), None)
                if pending is not None:  # keep the level's order
                    queue.extend_compact(home, priority, pending[1])
            message = Message(message_id, qname, size, client_id, headers, priority,
                              timestamp, expires, deliver_at, count, True, None, ref)
            message.seq = seq
            objects[message_id] = message
            restored[message_id] = ordinal
            queue.put(message, now)
        for (_, priority), (owner, columns) in batches.items():
            owner.extend_compact(home, priority, columns)
        raw.clear()
        if self.xa.branches:
            self._finish_branches(held)
        self.outbox.set_now(now)

    def _hold_consumed(self) -> list[Message]:
        """Before the survivors go into their queues: take out the messages consumed by
        prepared branches (they stay HELD). Returns them for :meth:`_finish_branches`."""
        held: list[Message] = []
        raw, body_size_of = self.raw, self.body_size_of
        for branch in self.xa.branches.values():
            for message_id, delivery_count in branch.ref_ids:
                msg = raw.pop(message_id, None)
                if msg is not None:
                    ref = msg[RAW_REF]
                    size = body_size_of(ref) if ref is not None and body_size_of else 0
                    message = Message.from_record(msg[:RAW_REF], size, ref)
                    message.delivery_count = max(message.delivery_count, delivery_count)
                    held.append(message)
                    branch.work.acks[message_id] = message
            branch.ref_ids = []
        return held

    def _finish_branches(self, held: list[Message]) -> None:
        """After recovery: held messages counted in their queues; prepared sends pending
        (a new message is counted in ``pending`` until it is added or dropped) with
        their message ids in the duplicate window (pending too)."""
        index = self.index
        for message in held:
            queue = index.queues.get(message.queue)
            if queue is not None:
                queue.count_in(message)
            message.state = State.HELD
            index.messages[message.id] = message
        for branch in self.xa.branches.values():
            for message in branch.work.sends:
                queue = index.queues.get(message.queue)
                if queue is not None:
                    queue.pending += 1
                    queue.pending_bytes += message.size
                    if message.message_id is not None:
                        queue.remember(message.message_id, pending=True)


__all__ = ["BodySize", "Replay", "pack_ref", "unpack_ref"]
