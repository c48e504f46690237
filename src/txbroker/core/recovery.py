"""Replaying the log, metadata snapshots and body relocation: the full ``Broker``.

Theory of operation
-------------------
On start the edge feeds every stored entry, in log order, to
:meth:`Broker.replay`, then calls :meth:`Broker.finish_recovery`. Replay
keeps messages only in the index (not yet in queues): acks, drops and moves
of later records are cheap dict operations. ``finish_recovery`` then puts the
survivors into their queues in log order (commit order), and releases the
bodies of everything that died.

:meth:`Broker.snapshot` is the metadata state (queues, topics, duplicate-id
windows, the next message id) that the store writes first in every segment;
replaying a snapshot replaces the metadata, so deleting old segments never
loses a queue.

Relocation lets the store drop a mostly-dead old segment: the edge reads the
bodies of the live messages it holds, a slice at a time, and the broker
writes fresh copies of each slice in one entry (``RELOCATE_MANY``); once
durable each message points at its copy and the old ref is released.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from txbroker.core import records
from txbroker.core.effects import Release
from txbroker.core.messages import Message, State
from txbroker.core.queues import Queue, QueueSettings
from txbroker.core.records import Kind, StoredEntry
from txbroker.core.sessions import Topic
from txbroker.core.streams import Streams
from txbroker.errors import CorruptStore


class Broker(Streams):
    """The complete broker core: engine + admin + XA + streams + recovery."""

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> tuple[int, bytes]:
        """``(kind, meta)`` of the metadata snapshot (records.py SNAPSHOT)."""
        defs: dict[str, Any] = {}
        dups: dict[str, list[str]] = {}
        for topic in self.topics.values():
            defs[topic.name] = topic.definition()
        for queue in self.queues.values():
            if not queue.durable:
                continue
            defs[queue.name] = queue.definition()
            if queue.dups:
                dups[queue.name] = queue.durable_dups()
        meta: dict[str, Any] = {"next_id": self.next_id, "queues": defs, "dups": dups}
        if self.branches:
            meta["xa"] = self.xa_snapshot()
        if self.sinks:
            meta["sinks"] = dict(self.sinks)
        return int(Kind.SNAPSHOT), records.pack(meta)

    # ------------------------------------------------------------------ replay
    def replay(self, entry: StoredEntry) -> None:
        """Apply one stored entry (log order) to the recovering state."""
        try:
            meta = records.unpack(entry.meta)
            self._replay(entry.kind, meta, entry.refs)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise CorruptStore("<entry>", 0, f"undecodable record of kind {entry.kind}: {exc}") \
                from exc

    def _replay(self, kind: int, meta: Any, refs: tuple[int, ...]) -> None:
        if kind == Kind.ADD:
            self._replay_add(meta, refs[0] if refs else None, 0)
        elif kind == Kind.TX:
            adds, acks = meta[0], meta[1]  # (a local transaction adds committed_ms)
            for msg, ref in zip(adds, refs, strict=True):
                self._replay_add(msg, ref, 0)
            self._replay_gone(acks)
        elif kind in (Kind.ACK,):
            self._replay_gone(meta)
        elif kind == Kind.DROP:
            self._replay_gone(meta[0])
        elif kind == Kind.MOVE:
            ids, target = meta[0], meta[1]
            seqs = meta[3] if len(meta) > 3 else [0] * len(ids)
            self._replay_queue(target)
            for message_id, seq in zip(ids, seqs, strict=True):
                message = self.messages.get(message_id)
                if message is not None:
                    message.queue = target
                    message.expires_ms = 0
                    message.deliver_at_ms = 0
                    message.seq = seq
        elif kind == Kind.UPDATE:
            message = self.messages.get(meta[0])
            if message is not None:
                message.delivery_count, message.deliver_at_ms = meta[1], meta[2]
        elif kind == Kind.RELOCATE:
            # the full, current message: the segment with its ADD may be gone
            self._replay_add(meta, refs[0], 0)
        elif kind == Kind.RELOCATE_MANY:
            for msg, ref in zip(meta, refs, strict=True):
                self._replay_add(msg, ref, 0)
        elif kind == Kind.QUEUE_PUT:
            self._replay_definition(meta)
        elif kind == Kind.QUEUE_DELETE:
            self._replay_delete(meta)
        elif kind == Kind.SNAPSHOT:
            self._replay_snapshot(meta)
            if "xa" in meta:
                self._replay_xa_snapshot(meta["xa"])
        elif Kind.XA_PREPARE <= kind <= Kind.XA_FORGET:
            self._replay_xa(kind, meta, refs)
        elif kind == Kind.SINK_COMMIT:
            self._replay_sink(meta)
        else:
            raise ValueError(f"unknown record kind {kind}")

    def _replay_add(self, msg: list[Any], ref: int | None, size: int) -> None:
        """Index a replayed message (hot during recovery: kept lean)."""
        body_size_of = self.body_size_of
        if ref is not None and body_size_of is not None:
            size = body_size_of(ref)
        if len(msg) > 9:
            (message_id, queue, client_id, headers, priority, timestamp, expires, deliver_at,
             count, seq) = msg
        else:  # written before seqs
            message_id, queue, client_id, headers, priority, timestamp, expires, deliver_at, \
                count = msg
            seq = 0
        message = Message(message_id, queue, size, client_id, headers, priority, timestamp,
                          expires, deliver_at, count, True, None, ref)
        message.seq = seq
        old = self.messages.get(message_id)
        if old is not None and old.ref is not None:  # a relocated copy replaces it
            self._emit(Release(old.ref))
        self.messages[message_id] = message
        if message_id >= self.next_id:
            self.next_id = message_id + 1
        if client_id is not None:
            self._replay_queue(queue).remember(client_id)

    #: The edge sets this to the store's ``body_size`` before replaying.
    body_size_of: Any = None

    def _body_size(self, ref: int) -> int:
        return int(self.body_size_of(ref)) if self.body_size_of is not None else 0

    def _replay_gone(self, ids: Iterable[int]) -> None:
        for message_id in ids:
            message = self.messages.pop(message_id, None)
            if message is not None and message.ref is not None:
                self._emit(Release(message.ref))

    def _replay_queue(self, name: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            queue = Queue(name)
            self.queues[name] = queue
        return queue

    def _replay_definition(self, definition: dict[str, Any]) -> None:
        name = definition["name"]
        if definition["kind"] == "topic":
            self.topics.setdefault(name, Topic(name))
            return
        settings = QueueSettings.from_dict(definition.get("settings") or {})
        queue = self._replay_queue(name)
        queue.settings = settings
        queue.next_seq = max(queue.next_seq, int(definition.get("next_seq", 1)))
        topic_name = definition.get("topic")
        if topic_name:
            queue.topic = topic_name
            self.topics.setdefault(topic_name, Topic(topic_name)).subscriptions.add(name)

    def _replay_delete(self, name: str) -> None:
        topic = self.topics.pop(name, None)
        if topic is not None:
            return
        queue = self.queues.pop(name, None)
        if queue is not None and queue.topic and queue.topic in self.topics:
            self.topics[queue.topic].subscriptions.discard(name)
        # queues are created lazily during replay: drop its messages either way
        self._replay_gone([m.id for m in self.messages.values() if m.queue == name])

    def _replay_snapshot(self, meta: dict[str, Any]) -> None:
        self.next_id = max(self.next_id, int(meta["next_id"]))
        defs: dict[str, Any] = meta["queues"]
        for name in [n for n in self.queues if n not in defs]:
            self._replay_delete(name)
        for name in [n for n in self.topics if n not in defs]:
            self.topics.pop(name)
        for definition in defs.values():
            if definition["kind"] == "topic":
                self._replay_definition(definition)
        for definition in defs.values():
            if definition["kind"] != "topic":
                self._replay_definition(definition)
        for sink, last in meta.get("sinks", {}).items():
            self.sinks[sink] = max(self.sinks.get(sink, -1), int(last))
        for name, ids in meta.get("dups", {}).items():
            queue = self.queues.get(name)
            if queue is not None:
                for message_id in ids:
                    queue.remember(message_id)

    def finish_recovery(self, now: int) -> None:
        """Put every surviving message into its queue, in log order (messages consumed
        by prepared XA branches stay held)."""
        held = self._xa_hold_recovered() if self.branches else []
        queues = self.queues
        name, queue = "", None
        for message in self.messages.values():
            if message.queue != name:
                name = message.queue
                queue = queues.get(name) or self._replay_queue(name)
            assert queue is not None
            queue.messages += 1  # count_in + put, inlined: this loop runs per message
            if message.seq >= queue.next_seq:
                queue.next_seq = message.seq + 1
            queue.bytes += message.size
            if message.expires_ms:
                queue.expiring += 1
            queue.put(message, now)
        if self.branches:
            self._xa_finish(held)
        self._now = now

    # ------------------------------------------------------------------ relocation
    def live_refs(self, entries: Iterable[StoredEntry]) -> list[tuple[int, int]]:
        """``(message id, ref)`` of messages whose current body lives in ``entries``."""
        found: list[tuple[int, int]] = []
        for entry in entries:
            if entry.kind not in (Kind.ADD, Kind.TX, Kind.RELOCATE, Kind.RELOCATE_MANY,
                                  Kind.XA_PREPARE) or not entry.refs:
                continue
            meta = records.unpack(entry.meta)
            if entry.kind == Kind.ADD:
                ids = [meta[records.MSG_ID]]
            elif entry.kind == Kind.TX:
                ids = [msg[records.MSG_ID] for msg in meta[0]]
            elif entry.kind == Kind.XA_PREPARE:  # committed sends of a branch (else unindexed)
                ids = [msg[records.MSG_ID] for msg in meta[1]]
            elif entry.kind == Kind.RELOCATE_MANY:
                ids = [msg[records.MSG_ID] for msg in meta]
            else:
                ids = [meta[records.MSG_ID]]
            found.extend(zip(ids, entry.refs, strict=False))
        return self.still_live(found)

    def still_live(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those ``(message id, ref)`` of a relocation whose message still has that
        body and may be copied (the edge reads only their bodies)."""
        found = []
        for message_id, ref in pairs:
            message = self.messages.get(message_id)
            # GONE: its ack is in the log; HELD: consumed by an open transaction or a
            # prepared XA branch — never copied (a rollback brings it back)
            if message is not None and message.ref == ref and \
                    message.state is not State.GONE and message.state is not State.HELD:
                found.append((message_id, ref))
        return found

    def relocate(self, message_id: int, old_ref: int, body: bytes) -> None:
        """Write a fresh copy of a live message's body (compaction)."""
        self.relocate_many([(message_id, old_ref)], [body])

    def relocate_many(self, pairs: list[tuple[int, int]], bodies: list[bytes]) -> None:
        """Write fresh copies of live messages' bodies in one entry (compaction).

        ``pairs`` are ``(message id, old ref)`` with the bodies read at the old refs;
        a message gone or changed since is skipped. Once durable, each message
        that still has its old body points at the copy and the old ref is
        released (else the copy is released).
        """
        copied = [(self.messages[message_id], old_ref, body)
                  for (message_id, old_ref), body in zip(pairs, bodies, strict=True)
                  if message_id in self.messages]
        if not copied:
            return
        new_refs: list[int] = []

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self._storage_failed(error)
                return
            for (message, old_ref, _), new_ref in zip(copied, new_refs, strict=True):
                if self.messages.get(message.id) is message and message.ref == old_ref:
                    message.ref = new_ref
                    self._emit(Release(old_ref))
                else:
                    self._emit(Release(new_ref))

        self._persist(Kind.RELOCATE_MANY, [message.to_record() for message, _, _ in copied],
                      on_durable, [body for _, _, body in copied], new_refs.extend)
