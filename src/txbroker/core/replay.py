"""Replaying the log and metadata snapshots.

Theory of operation
-------------------
On start the edge feeds every stored entry, in log order, to
:meth:`Replay.replay`, then calls :meth:`Replay.finish`. Replay keeps
messages only as their decoded ``msg`` lists (``core/records/__init__.py``, with the
seq, the body ref and the log-order ordinal appended: ``RAW_SEQ``, ``RAW_REF``,
``RAW_ORD`` of ``core/replay_settled.py``) in a dict by id, in log order — no
object per message: acks, drops and moves of later records are cheap dict
operations, and the bodies of everything that died are released as they die.
``finish`` then puts the survivors into their queues in log order (commit
order): plain ones as compact chunk slots (``core/messages.py``), the others as
:class:`Message` objects. A warm standby calls :meth:`Replay.settle` while it
follows: the messages that will be compact slots whatever comes later leave the
dict for ``core/replay_settled.py`` (that module says how the result stays a
cold recovery's), and ``finish`` only walks what is left.

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
from txbroker.core.records import MSG_FIELDS, Kind, Snapshot, StoredEntry
from txbroker.core.replay_settled import RAW_ORD, RAW_REF, RAW_SEQ, Settled
from txbroker.core.replay_xa import (
    pack_ref,
    replay_sink,
    replay_xa,
    unpack_ref,
    xa_snapshot,
    xa_snapshot_entries,
)
from txbroker.core.sessions import Topic
from txbroker.core.sinks import Sinks
from txbroker.core.xa_branches import XaBranches
from txbroker.errors import CorruptStore
from txbroker.xid import Xid

#: The store's ``body_size``: the edge sets it before replaying.
BodySize = Callable[[int], int]
#: Ordinals above this are renumbered (``MessageIndex`` keeps them as 32-bit ints).
ORDINAL_LIMIT = 1 << 31


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
        self.completed: set[Xid] = set()
        #: replayed messages by id, in log order (see the module docstring)
        self.raw: dict[int, list[Any]] = {}
        #: the ordinal of the last message that entered ``raw``
        self.ordinal = 0
        #: ``raw`` is not in ordinal order (a settled message came back)
        self._unsorted = False
        #: messages settled ahead of :meth:`finish` (``core/replay_settled.py``)
        self.settled = Settled()
        #: a replicated backup's log: the primary's epoch and LSN of the last entry
        #: replayed (``REPLICA_AT``; every other entry but a snapshot counts one LSN)
        self.replica: records.ReplicaAt | None = None

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
                            xa_snapshot(self) if self.xa.branches else None,
                            dict(self.sinks.sinks) if self.sinks.sinks else None, self.replica)
        return snapshot.kind, snapshot.encode()

    # ------------------------------------------------------------------ replay
    def replay(self, entry: StoredEntry) -> None:
        """Apply one stored entry (log order) to the recovering state."""
        try:
            self._replay(entry.kind, records.unpack(entry.meta), entry.refs)
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # (MalformedRecord too)
            raise CorruptStore("<entry>", 0, f"undecodable record of kind {entry.kind}: {exc}") \
                from exc
        replica = self.replica
        if replica is not None and entry.kind != Kind.SNAPSHOT \
                and entry.kind != Kind.REPLICA_AT:  # the primary's next entry
            self.replica = records.ReplicaAt(replica.epoch, replica.lsn + 1)

    def _replay(self, kind: int, meta: Any, refs: tuple[int, ...]) -> None:
        """Decode ``meta`` as its kind's record (``core/records``) and apply it."""
        if kind == Kind.TX:
            tx = records.Tx.from_value(meta)
            if len(tx.adds) != len(refs):
                raise ValueError(f"{len(tx.adds)} messages but {len(refs)} bodies")
            self._add_many(tx.adds, refs)
            self.gone(tx.acks)
        elif kind == Kind.ADD:
            self._add_many([records.Add.from_value(meta).msg], refs[:1] if refs else (None,))
        elif kind == Kind.RELOCATE:
            # the full, current message: the segment with its ADD may be gone
            self._add_many([records.Relocate.from_value(meta).msg], refs[:1] if refs else (None,))
        elif kind == Kind.ACK:
            self.gone(records.Ack.from_value(meta).ids)
        elif kind == Kind.DROP:
            self.gone(records.Drop.from_value(meta).ids)
        elif kind == Kind.MOVE:
            self._move(records.Move.from_value(meta))
        elif kind == Kind.UPDATE:
            update = records.Update.from_value(meta)
            msg = self.raw.get(update.id)
            if msg is None and update.id in self.settled.at:
                if not update.deliver_at_ms and \
                        self.settled.set_count(update.id, update.delivery_count):
                    return
                msg = self.settled.take(update.id)
                self._to_raw(msg)
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
            self.replica = snapshot.replica
            if snapshot.xa is not None:
                xa_snapshot_entries(self, snapshot.xa)
        elif Kind.XA_PREPARE <= kind <= Kind.XA_FORGET:
            replay_xa(self, kind, meta, refs)
        elif kind == Kind.SINK_COMMIT:
            replay_sink(self, records.SinkCommit.from_value(meta))
        elif kind == Kind.REPLICA_AT:
            at = records.ReplicaAt.from_value(meta)
            self.replica = at if at.epoch else None
        else:
            raise records.MalformedRecord(f"unknown record kind {kind}")

    def _add_many(self, msgs: list[list[Any]], refs: Sequence[int | None]) -> None:
        """Index replayed messages, ``msg`` tuples with their body refs (the hottest loop
        of a restart: one pass per message, everything it touches in locals)."""
        index = self.index
        raw, emit, settled = self.raw, self.outbox.emit, self.settled.at
        next_id, ordinal = index.next_id, self.ordinal
        for msg, ref in zip(msgs, refs, strict=True):  # (9 or 10 fields: records.check_msg)
            if len(msg) == MSG_FIELDS:  # written before seqs
                msg.append(0)
            msg.append(ref)
            message_id = msg[0]
            old = raw.get(message_id)
            if old is not None:  # a relocated copy replaces it (and keeps its place)
                if old[RAW_REF] is not None:
                    emit(Release(old[RAW_REF]))
                msg.append(old[RAW_ORD])
                raw[message_id] = msg
            elif settled and message_id in settled:
                self._relocate_settled(msg)
            else:
                ordinal += 1
                msg.append(ordinal)
                raw[message_id] = msg
            if message_id >= next_id:
                next_id = message_id + 1
            if msg[2] is not None:
                self._queue(msg[1]).remember(msg[2])
        index.next_id, self.ordinal = next_id, ordinal

    def _relocate_settled(self, msg: list[Any]) -> None:
        """A relocated copy of a settled message (``msg`` with its body ref)."""
        settled = self.settled
        ref = msg[RAW_REF]
        size = self.body_size_of(ref) if ref is not None and self.body_size_of else 0
        run = settled.at[msg[0]]
        msg.append(run.ords[run.slot(msg[0])])
        old_ref = settled.relocate(msg, size)
        if old_ref is None:
            old_ref = settled.take(msg[0])[RAW_REF]
            self._to_raw(msg)
        self.outbox.emit(Release(old_ref))

    def _to_raw(self, msg: list[Any]) -> None:
        """Put a message that was settled back into ``raw`` (sorted again at the next
        settle or finish); its level comes back with it if settled ones follow it."""
        level = (msg[records.MSG_QUEUE], msg[records.MSG_PRIORITY])
        raw = self.raw
        if self.settled.last_ord.get(level, 0) > msg[RAW_ORD]:
            for back in self.settled.take_level(level):
                raw[back[0]] = back
        raw[msg[0]] = msg
        self._unsorted = True

    def put_raw(self, msg: list[Any]) -> None:
        """A message (with its body ref) into ``raw``, as a new one or in its place."""
        message_id = msg[0]
        old = self.raw.get(message_id)
        if old is not None:
            msg.append(old[RAW_ORD])
            self.raw[message_id] = msg
        elif message_id in self.settled.at:
            msg.append(self.settled.take(message_id)[RAW_ORD])
            self._to_raw(msg)
        else:
            self.ordinal += 1
            msg.append(self.ordinal)
            self.raw[message_id] = msg

    def _pop(self, message_id: int) -> list[Any] | None:
        """Take a message out of ``raw`` or the settled ones (None: not there)."""
        msg = self.raw.pop(message_id, None)
        if msg is None and self.settled.at and message_id in self.settled.at:
            return self.settled.take(message_id)
        return msg

    def gone(self, ids: Iterable[int]) -> None:
        """The messages ``ids`` died (acked, dropped, consumed): their bodies released."""
        raw, settled, emit = self.raw, self.settled.at, self.outbox.emit
        for message_id in ids:  # (a restart's second hottest loop: inlined _pop)
            msg = raw.pop(message_id, None)
            if msg is None and settled and message_id in settled:
                msg = self.settled.take(message_id)
            if msg is not None and msg[RAW_REF] is not None:
                emit(Release(msg[RAW_REF]))

    def _move(self, move: records.Move) -> None:
        ids, target = move.ids, move.queue
        seqs = move.seqs if move.seqs is not None else [0] * len(ids)
        self._queue(target)
        raw = self.raw
        settled = self.settled.at
        for message_id, seq in zip(ids, seqs, strict=True):
            msg = raw.get(message_id)
            back = msg is None and bool(settled) and message_id in settled
            if back:
                msg = self.settled.take(message_id)
            if msg is not None:
                msg[records.MSG_QUEUE] = target
                msg[records.MSG_EXPIRES] = 0
                msg[records.MSG_DELIVER_AT] = 0
                msg[RAW_SEQ] = seq
                if back:
                    self._to_raw(msg)

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
        self.gone([i for i, msg in self.raw.items() if msg[records.MSG_QUEUE] == name])
        for msg in self.settled.take_queue(name) if self.settled.levels else ():
            self.outbox.emit(Release(msg[RAW_REF]))

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

    # ------------------------------------------------------------------ settle
    def settle(self) -> int:
        """Settle what will be compact slots ahead of :meth:`finish` (a warm standby,
        while it follows: ``core/replay_settled.py``); how many messages stay in
        ``raw``. Does nothing before the edge set :attr:`body_size_of`."""
        if self.body_size_of is None:
            return len(self.raw)
        if self.ordinal >= ORDINAL_LIMIT:
            self._unsettle_all()
        self.sort_raw()
        self.raw = self.settled.settle(self.raw, self.body_size_of)
        return len(self.raw)

    def sort_raw(self) -> None:
        """``raw`` in log order again after settled messages came back (and ordinals
        renumbered from 1 when they grew large)."""
        if self._unsorted:
            self.raw = dict(sorted(self.raw.items(), key=_ordinal_of))
            self._unsorted = False
        if self.ordinal >= ORDINAL_LIMIT and not self.settled.at:
            for number, msg in enumerate(self.raw.values(), 1):
                msg[RAW_ORD] = number
            self.ordinal = len(self.raw)

    def _unsettle_all(self) -> None:
        """Every settled message back into ``raw``."""
        raw = self.raw
        for msg in self.settled.take_all():
            raw[msg[0]] = msg
        self._unsorted = True

    # ------------------------------------------------------------------ finish
    def finish(self, now: int) -> None:
        """Put every surviving message into its queue, in log order (messages consumed
        by prepared XA branches stay held)."""
        held = self._hold_consumed() if self.xa.branches else []
        index = self.index
        queues, home = index.queues, index.messages
        #: compact survivors not yet in their level, by (queue, priority): the columns
        #: of ``Queue.extend_compact`` (a level is flushed before an object joins it)
        batches: dict[tuple[str, int], tuple[Queue, list[list[int]]]] = {}
        if self.settled.levels:
            if self.ordinal < ORDINAL_LIMIT and \
                    all(level[0] in queues for level in self.settled.levels):
                self.settled.fill(queues, home)
            else:  # (a queue finish creates: keep the order it creates them in)
                self._unsettle_all()
        self.sort_raw()
        objects = home.objects
        body_size_of = self.body_size_of
        name, queue = "", None
        raw, self.raw = self.raw, {}
        restored = home.restored
        batch: list[list[int]] = []
        for msg in raw.values():  # (the hottest loop of a restart: all in locals)
            (message_id, qname, client_id, headers, priority, timestamp, expires,
             deliver_at, count, seq, ref, ordinal) = msg
            if qname != name:
                name = qname
                queue = queues.get(name) or self._queue(name)
            assert queue is not None
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
        self.ordinal = 0
        if self.xa.branches:
            self._finish_branches(held)
        self.outbox.set_now(now)

    def _hold_consumed(self) -> list[Message]:
        """Before the survivors go into their queues: take out the messages consumed by
        prepared branches (they stay HELD). Returns them for :meth:`_finish_branches`."""
        held: list[Message] = []
        pop, body_size_of = self._pop, self.body_size_of
        for branch in self.xa.branches.values():
            for message_id, delivery_count in branch.ref_ids:
                msg = pop(message_id)
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


def _ordinal_of(item: tuple[int, list[Any]]) -> int:
    return int(item[1][RAW_ORD])


__all__ = ["BodySize", "Replay", "pack_ref", "unpack_ref"]
