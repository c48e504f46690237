"""Queues: ready messages by priority, scheduled messages, consumers and credit.

Theory of operation
-------------------
A :class:`Queue` holds the *visible* messages of one destination: ten FIFO
deques, one per priority 0–9 (highest served first, FIFO within a priority),
and a heap of messages scheduled for later (delayed delivery or redelivery
back-off). Consumers compete: :meth:`Queue.next_consumer` walks them round
robin and picks the next one with credit (unacked < prefetch). A message that
comes back (nack, rolled-back transaction, consumer gone) goes to the *front*
of its priority so order is kept as far as possible.

A queue knows nothing of the store or of sessions; the broker moves messages
between queues, consumers and the store and records every change.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Iterator
from typing import Any

from txbroker.core.effects import Deliver
from txbroker.core.messages import CHUNK_SIZE, Chunk, Message, MessageIndex, State
from txbroker.core.queue_settings import QueueSettings
from txbroker.core.seq_index import compact_index

#: Priorities are 0–9 as in JMS; 4 is the JMS default.
PRIORITIES = 10
DEFAULT_PRIORITY = 4


class Consumer:
    """A subscription (or a one-shot ``receive``) on one queue."""

    __slots__ = ("ack_auto", "deadline_ms", "id", "one_shot", "prefetch", "queue", "rid", "session",
                 "unacked")

    def __init__(
        self,
        session: int,
        id: int,
        queue: str,
        prefetch: int,
        *,
        ack_auto: bool = False,
        one_shot: bool = False,
        rid: int = 0,
        deadline_ms: int = 0,
    ) -> None:
        self.session = session
        self.id = id
        self.queue = queue
        self.prefetch = prefetch
        self.ack_auto = ack_auto
        self.one_shot = one_shot  #: a ``receive``: removed after one delivery
        self.rid = rid  #: the request a one-shot consumer answers
        self.deadline_ms = deadline_ms  #: one-shot timeout (0 = none)
        self.unacked: dict[int, Message] = {}  #: delivery tag -> message

    @property
    def has_credit(self) -> bool:
        """May this consumer take another delivery (unacked below its prefetch)?"""
        return len(self.unacked) < self.prefetch



#: A delivered mark reaches this many seqs (plus the consumers' free credit) past
#: the delivery that needed it (``core/delivered_mark.py``): about
#: one small record per half this many deliveries of a queue.
MARK_AHEAD = 256


class Queue:
    """A queue (or a topic's subscription queue). See the module docstring."""

    def __init__(
        self, name: str, settings: QueueSettings | None = None, topic: str | None = None
    ) -> None:
        self.name = name
        self.settings = settings or QueueSettings()
        self.topic = topic  #: the topic this subscription queue belongs to, if any
        self.durable = True  #: non-durable subscription queues are never stored
        self.owner = 0  #: session owning a non-durable subscription queue
        #: per priority: messages and :class:`~txbroker.core.messages.Chunk` s of plain
        #: ones (the compact index), in queue order
        self._ready: list[deque[Message | Chunk]] = [deque() for _ in range(PRIORITIES)]
        self._scheduled: list[tuple[int, int, Message]] = []
        self.ready_count = 0
        self.messages = 0  #: stored messages: ready + scheduled + delivered + held
        self.bytes = 0
        self.expiring = 0  #: messages with a TTL (only those queues are scanned)
        self.pending = 0  #: accepted sends not yet durable (count against quotas)
        self.pending_bytes = 0
        self.in_flight = 0
        # -- counts since the broker started (not persisted; /metrics' counters) --
        self.enqueued = 0  #: messages that became visible here (sent, moved or dead-lettered in)
        self.dequeued = 0  #: messages consumed (acked, or consumed by a committed transaction)
        self.expired = 0  #: messages whose time to live ran out here
        self.dead_lettered = 0  #: messages moved out after max_deliveries (or a nack)
        self.consumers: list[Consumer] = []
        self._next_consumer = 0
        self.dups: dict[str, None] = {}  #: insertion-ordered duplicate-id window
        #: ids of the window whose send is not durable yet (an open transaction's, a
        #: record on its way): left out of snapshots, forgotten if the send is dropped
        self.undurable_ids: set[str] = set()
        # -- offset reading (core/streams.py) -------------------------------
        self.next_seq = 1  #: the seq the next committed message gets (persisted)
        #: runs ``[first, stop]`` of seqs whose record is not yet durable, in log order
        self.unsettled: deque[list[int]] = deque()
        #: the seq index, built when a stream reader first needs it: seqs and the
        #: messages that had them (entries go stale when a message leaves)
        self.seq_keys: array[int] | None = None
        self.seq_messages: list[Message] = []
        self.seq_head = 0  #: entries below are released
        self.stream_owner: tuple[str, int] | None = None  #: (reader name, session)
        # -- the delivered mark (core/delivered_mark.py) ----------------------------
        #: every seq up to this may have been delivered (durable: in a QUEUE_PUT)
        self.delivered_seq = 0
        #: the highest mark written and not yet durable (0: none)
        self.reserving = 0
        #: how far past a delivery a new mark reaches (doubles when deliveries outrun it)
        self.mark_reach = MARK_AHEAD
        #: deliveries waiting for a mark to be durable, in order
        self.held_deliveries: deque[Deliver] = deque()

    # -- content ---------------------------------------------------------
    def put(self, message: Message, now_ms: int, *, front: bool = False) -> None:
        """Make a message visible (or schedule it if it is not due)."""
        message.state = State.READY
        if message.deliver_at_ms > now_ms:
            heapq.heappush(self._scheduled, (message.deliver_at_ms, message.id, message))
            return
        message.deliver_at_ms = 0
        if front:
            self._ready[message.priority].appendleft(message)
        else:
            self._ready[message.priority].append(message)
        self.ready_count += 1

    def put_compact(self, home: MessageIndex, message_id: int, priority: int, seq: int,
                    ref: int, size: int, stamp: int, count: int) -> None:
        """Make a plain READY message visible as a compact chunk slot (no object:
        ``messages.compactable`` holds; the caller counts it in)."""
        level = self._ready[priority]
        last = level[-1] if level else None
        if not isinstance(last, Chunk) or not last.takes(message_id):
            last = Chunk(home, self.name, priority)
            level.append(last)
        last.append(message_id, seq, ref, size, stamp, count)
        self.ready_count += 1

    def extend_compact(self, home: MessageIndex, priority: int, columns: list[list[int]]
                       ) -> None:
        """:meth:`put_compact` for many (a restart): ``columns`` are the lists of ids,
        seqs, refs, sizes, timestamps, delivery counts and ordinals, in queue order."""
        ids, seqs, refs, sizes, stamps, counts, ords = columns
        total = len(ids)
        if not total:
            return
        level = self._ready[priority]
        last = level[-1] if level else None
        if ids != sorted(ids):
            for i in range(total):  # (rare: ids not ascending) one at a time
                self.put_compact(home, ids[i], priority, seqs[i], refs[i], sizes[i], stamps[i],
                                 counts[i])
                chunk = self._ready[priority][-1]
                assert isinstance(chunk, Chunk)
                chunk.ords[-1] = ords[i]
            return
        start = 0
        while start < total:
            if not isinstance(last, Chunk) or len(last.ids) >= CHUNK_SIZE \
                    or not last.takes(ids[start]):
                last = Chunk(home, self.name, priority)
                level.append(last)
            stop = min(total, start + CHUNK_SIZE - len(last.ids))
            last.extend(ids[start:stop], seqs[start:stop], refs[start:stop], sizes[start:stop],
                        stamps[start:stop], counts[start:stop], ords[start:stop])
            start = stop
        self.ready_count += total

    def ready_level(self, priority: int) -> deque[Message | Chunk]:
        """The READY messages and chunks of one priority, in order (a restart fills it)."""
        return self._ready[priority]

    def count_in(self, message: Message) -> None:
        """Account a message that now belongs to this queue."""
        self.messages += 1
        self.bytes += message.size
        if message.expires_ms:
            self.expiring += 1

    def count_out(self, message: Message) -> None:
        """Account a message that left this queue for good."""
        self.messages -= 1
        self.bytes -= message.size
        if message.expires_ms:
            self.expiring -= 1

    def pop_ready(self) -> Message | None:
        """The next ready message: highest priority first, FIFO within one."""
        if self.ready_count == 0:
            return None
        name = self.name
        for level in range(PRIORITIES - 1, -1, -1):
            ready = self._ready[level]
            while ready:
                item = ready[0]
                if isinstance(item, Chunk):
                    found = item.take_front()
                    if item.drained:
                        ready.popleft()
                        item.retire()
                    if found is None:
                        continue
                    message = found
                else:
                    message = item
                    ready.popleft()
                # slots left by discard() or a move to another queue are stale
                if message.state is State.READY and message.queue == name:
                    self.ready_count -= 1
                    return message
        return None

    def discard(self, message: Message) -> None:
        """Take a visible message out (purge, expiry); stale deque slots are skipped later."""
        if message.state is State.READY and message.deliver_at_ms == 0:
            self.ready_count -= 1
        message.state = State.GONE

    def trim(self) -> None:
        """Drop the stale slots at the head of the ready lists: a queue nobody
        consumes (the router's journal, ``core/router/log.py``) never pops them."""
        name = self.name
        for ready in self._ready:
            while ready:
                item = ready[0]
                if isinstance(item, Chunk):
                    while not item.drained and item.marks[item.head] != 1 \
                            and item.message_at(item.head) is None:
                        item.head += 1  # (a taken or stale slot)
                    if not item.drained:
                        break
                    ready.popleft()
                    item.retire()
                elif item.state is not State.READY or item.queue != name:
                    ready.popleft()
                else:
                    break

    def due(self, now_ms: int) -> Iterator[Message]:
        """Move scheduled messages whose time has come to ready; yield them."""
        while self._scheduled and self._scheduled[0][0] <= now_ms:
            _, _, message = heapq.heappop(self._scheduled)
            if message.state is State.READY and message.queue == self.name:
                message.deliver_at_ms = 0
                self._ready[message.priority].append(message)
                self.ready_count += 1
                yield message

    def next_due_ms(self) -> int | None:
        """When the earliest scheduled message becomes due."""
        while self._scheduled and (self._scheduled[0][2].state is not State.READY
                                   or self._scheduled[0][2].queue != self.name):
            heapq.heappop(self._scheduled)
        return self._scheduled[0][0] if self._scheduled else None

    @property
    def scheduled_count(self) -> int:
        """Messages waiting for their delivery time (delay or redelivery back-off)."""
        return sum(1 for _, _, m in self._scheduled
                   if m.state is State.READY and m.queue == self.name)

    def ready_messages(self) -> list[Message]:
        """Every visible message (ready and scheduled), e.g. for purge."""
        name = self.name
        found = [m for level in self._ready for m in _walk(level)
                 if m.state is State.READY and m.queue == name]
        found.extend(m for _, _, m in self._scheduled if m.state is State.READY and m.queue == name)
        return found

    def browse(self, limit: int) -> list[Message]:
        """The first ``limit`` visible messages in delivery order (ready ones by
        priority, then scheduled ones by due time), without taking them."""
        found: list[Message] = []
        if limit <= 0:
            return found
        name = self.name
        for level in reversed(self._ready):
            for message in _walk(level):
                if message.state is State.READY and message.queue == name:
                    found.append(message)
                    if len(found) == limit:
                        return found
        for _, _, message in sorted(self._scheduled, key=lambda item: item[:2]):
            if message.state is State.READY and message.queue == name:
                found.append(message)
                if len(found) == limit:
                    break
        return found

    def detach_visible(self) -> Iterator[Message]:
        """Take every visible message (ready and scheduled) out at once — O(1): the
        queue keeps fresh empty lists — and return them lazily, highest priority
        first (purge and deletion work through them a slice at a time)."""
        ready, scheduled = self._ready, self._scheduled
        self._ready = [deque() for _ in range(PRIORITIES)]
        self._scheduled = []
        self.ready_count = 0
        return self._visible_in(ready, scheduled)

    def _visible_in(self, ready: list[deque[Message | Chunk]],
                    scheduled: list[tuple[int, int, Message]]) -> Iterator[Message]:
        name = self.name
        for level in ready:
            for item in level:
                if isinstance(item, Chunk):
                    item.drop()  # (promotes its compact slots: found by id meanwhile)
        for level in reversed(ready):
            for message in _walk(level):
                if message.state is State.READY and message.queue == name:
                    yield message
        for _, _, message in scheduled:
            if message.state is State.READY and message.queue == name:
                yield message

    # -- sequence numbers and the seq index (offset reading) -------------
    def assign_seq(self, message: Message) -> int:
        """Give a message about to be committed into this queue its sequence number.

        Called when its record is built (log order); the seq stays *unsettled*
        until the record is durable (:meth:`settle`), so readers never see past it.
        """
        self.assign_seqs([message])
        return message.seq

    def assign_seqs(self, messages: list[Message]) -> None:
        """:meth:`assign_seq` for a run of messages of this queue (one record)."""
        first = self.next_seq
        stop = first + len(messages)
        for message, seq in zip(messages, range(first, stop), strict=True):
            message.seq = seq
        self.next_seq = stop
        unsettled = self.unsettled
        if unsettled and unsettled[-1][1] == first:
            unsettled[-1][1] = stop
        else:
            unsettled.append([first, stop])
        if self.seq_keys is not None:
            self.seq_keys.extend(range(first, stop))
            self.seq_messages.extend(messages)
            if len(self.seq_keys) - self.seq_head > 2 * (self.messages + self.pending) + 4096:
                compact_index(self)

    def settle(self, seq: int, count: int = 1) -> None:
        """The record that committed seqs ``seq`` … ``seq + count - 1`` is durable (or
        failed). Records complete in log order, so this is nearly always the front."""
        unsettled = self.unsettled
        if unsettled and unsettled[0][0] == seq and seq + count <= unsettled[0][1]:
            run = unsettled[0]
            run[0] += count
            if run[0] == run[1]:
                unsettled.popleft()
            return
        for one in range(seq, seq + count):  # out of order (a failed record): split runs
            for index, run in enumerate(unsettled):
                if run[0] <= one < run[1]:
                    if run[0] == one:
                        run[0] += 1
                    elif one == run[1] - 1:
                        run[1] -= 1
                    else:
                        unsettled.insert(index + 1, [one + 1, run[1]])
                        run[1] = one
                    if run[0] >= run[1]:
                        del unsettled[index]
                    break

    @property
    def readable_seq(self) -> int:
        """One past the highest seq a reader may read: every lower one is durable."""
        return self.unsettled[0][0] if self.unsettled else self.next_seq

    def promote(self) -> None:
        """Make every compact slot of this queue an object (the seq index needs them)."""
        for level in self._ready:
            for item in level:
                if isinstance(item, Chunk):
                    item.messages()


    # -- consumers -------------------------------------------------------
    def add_consumer(self, consumer: Consumer) -> None:
        """A consumer starts competing for this queue's messages."""
        self.consumers.append(consumer)

    def remove_consumer(self, consumer: Consumer) -> None:
        """A consumer stops taking this queue's messages."""
        if consumer in self.consumers:
            self.consumers.remove(consumer)

    def next_consumer(self) -> Consumer | None:
        """Round robin over consumers with credit (competing consumers)."""
        count = len(self.consumers)
        for step in range(count):
            index = (self._next_consumer + step) % count
            consumer = self.consumers[index]
            if consumer.has_credit:
                self._next_consumer = index + 1
                return consumer
        return None

    # -- duplicate detection ---------------------------------------------
    def seen(self, message_id: str) -> bool:
        """Is ``message_id`` in the duplicate window?"""
        return message_id in self.dups

    def remember(self, message_id: str, *, pending: bool = False) -> None:
        """Add an id to the window; ``pending``: its send is not durable yet."""
        window = self.settings.dup_window
        if window == 0:
            return
        if pending and message_id not in self.dups:
            self.undurable_ids.add(message_id)
        self.dups[message_id] = None
        while len(self.dups) > window:
            oldest = next(iter(self.dups))
            del self.dups[oldest]
            self.undurable_ids.discard(oldest)

    def id_settled(self, message_id: str, *, durable: bool) -> None:
        """A pending send with this id became durable, or was dropped (rolled back,
        failed, discarded): then its id leaves the window, so that a retry of the
        same message is not taken for a duplicate."""
        if message_id in self.undurable_ids:
            self.undurable_ids.discard(message_id)
            if not durable:
                self.dups.pop(message_id, None)

    def durable_dups(self) -> list[str]:
        """The window as a snapshot may carry it: ids of durable sends only (a
        snapshot can reach the disk while the record of a later send does not)."""
        if not self.undurable_ids:
            return list(self.dups)
        return [i for i in self.dups if i not in self.undurable_ids]

    # -- admin -----------------------------------------------------------
    def definition(self) -> dict[str, Any]:
        """The ``def`` persisted for this queue (records.py)."""
        return {
            "name": self.name,
            "kind": "queue",
            "topic": self.topic,
            "settings": self.settings.to_dict(),
            "next_seq": self.next_seq,
            "delivered_seq": max(self.delivered_seq, self.reserving),
        }

    def info(self) -> dict[str, Any]:
        """Depth, counts, consumers and settings (``queue_info``, ``txbroker queues``)."""
        return {
            "name": self.name,
            "kind": "queue",
            "topic": self.topic,
            "durable": self.durable,
            "depth": self.messages - self.in_flight,
            "ready": self.ready_count,
            "scheduled": self.scheduled_count,
            "in_flight": self.in_flight,
            "messages": self.messages,
            "consumers": len(self.consumers),
            "bytes": self.bytes,
            "enqueued": self.enqueued,
            "dequeued": self.dequeued,
            "expired": self.expired,
            "dead_lettered": self.dead_lettered,
            "settings": self.settings.to_dict(),
            "next_seq": self.next_seq,
            "stream_reader": self.stream_owner[0] if self.stream_owner else None,
        }


def _walk(level: deque[Message | Chunk]) -> Iterator[Message]:
    """The messages of a ready level in order, compact slots promoted as they are
    reached (stale ones included: the caller checks state and queue)."""
    for item in level:
        if isinstance(item, Chunk):
            for slot in range(item.head, len(item.ids)):
                message = item.message_at(slot)
                if message is not None:
                    yield message
        else:
            yield item
