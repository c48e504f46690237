"""The broker's in-memory message index entry.

Theory of operation: a :class:`Message` is what the broker keeps per stored
message — ids, routing and delivery state, and a *ref* to the body in the
store. The body itself is held only while the message is not yet durable (or
for non-persistent messages, which are never stored); afterwards it is read
back from the store on delivery. ``__slots__`` keeps the entry small: the
index must hold millions of them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterator
from enum import IntEnum
from typing import Any


class State(IntEnum):
    """Where a message is in its life."""

    PENDING = 0  #: written, not yet durable: invisible
    READY = 1  #: waiting in its queue (or scheduled for later)
    DELIVERED = 2  #: out to a consumer, unacked
    HELD = 3  #: acked inside an open transaction, not yet committed
    GONE = 4  #: acked, dropped or moved away


class Message:
    """One message in the broker's index. See the module docstring."""

    __slots__ = (
        "body",
        "deliver_at_ms",
        "delivery_count",
        "expires_ms",
        "headers",
        "id",
        "message_id",
        "persistent",
        "priority",
        "queue",
        "ref",
        "seq",
        "size",
        "state",
        "timestamp_ms",
    )

    def __init__(
        self,
        id: int,
        queue: str,
        size: int,
        message_id: str | None = None,
        headers: dict[str, str] | None = None,
        priority: int = 4,
        timestamp_ms: int = 0,
        expires_ms: int = 0,
        deliver_at_ms: int = 0,
        delivery_count: int = 0,
        persistent: bool = True,
        body: bytes | None = None,
        ref: int | None = None,
    ) -> None:
        self.id = id
        self.queue = queue
        self.size = size
        self.message_id = message_id
        self.headers = headers
        self.priority = priority
        self.timestamp_ms = timestamp_ms
        self.expires_ms = expires_ms
        self.deliver_at_ms = deliver_at_ms
        self.delivery_count = delivery_count
        self.persistent = persistent
        self.body = body
        self.ref = ref
        self.state = State.PENDING
        self.seq = 0  #: the queue's gap-free sequence number, set when committed (0 = none)

    def to_record(self) -> list[Any]:
        """The ``msg`` tuple of ``core/records/__init__.py``."""
        return [
            self.id,
            self.queue,
            self.message_id,
            self.headers,
            self.priority,
            self.timestamp_ms,
            self.expires_ms,
            self.deliver_at_ms,
            self.delivery_count,
            self.seq,
        ]

    @classmethod
    def from_record(cls, msg: list[Any], size: int, ref: int | None) -> Message:
        """Rebuild an index entry from a replayed ``msg`` tuple (hot: positional)."""
        id, queue, message_id, headers, priority, timestamp, expires, deliver_at, count = msg[:9]
        message = cls(id, queue, size, message_id, headers, priority, timestamp, expires,
                      deliver_at, count, True, None, ref)
        if len(msg) > 9:
            message.seq = msg[9]
        return message

    def expired(self, now_ms: int) -> bool:
        """True once the message's time to live has run out."""
        return self.expires_ms != 0 and self.expires_ms <= now_ms

    def __repr__(self) -> str:
        return f"Message(id={self.id}, queue={self.queue!r}, state={self.state.name})"


# ---------------------------------------------------------------------- the compact index
#: Plain ready messages per :class:`Chunk` (one queue, one priority, ascending ids).
CHUNK_SIZE = 4096
#: Ids per lookup block of :class:`MessageIndex` (``id >> BLOCK_SHIFT``).
BLOCK_SHIFT = 14
#: A chunk slot's mark: taken (or dropped), compact (no object exists), promoted
#: (its object is in :attr:`MessageIndex.objects`; the slot keeps its place in the queue).
TAKEN, COMPACT, PROMOTED = 0, 1, 2
_LOW = (1 << 32) - 1
#: A compact slot's ref must be below ``COMPACT_REF_LIMIT << 32``, its size below
#: ``COMPACT_SIZE_LIMIT`` (array item ranges).
COMPACT_REF_LIMIT = 1 << 63
COMPACT_SIZE_LIMIT = 1 << 32
#: The ordinal of a message added after the restart (``MessageIndex.values`` order).
NO_ORDINAL = (1 << 32) - 1


def compactable(message: Message) -> bool:
    """Can this READY message live as a chunk slot (nothing but ids, seq, ref, size,
    priority, timestamp and delivery count to keep)?"""
    ref = message.ref
    return (ref is not None and message.message_id is None and not message.headers
            and message.expires_ms == 0 and message.persistent and message.body is None
            and 0 <= message.priority < 10 and 0 <= ref >> 32 < COMPACT_REF_LIMIT
            and 0 <= message.size < COMPACT_SIZE_LIMIT and 0 <= message.delivery_count < 65536
            and message.id > 0 and message.seq >= 0)


class Columns:
    """Compact messages of one queue and priority level as parallel arrays, in queue
    order with ascending ids: ids, seqs, the ref's high and low halves, sizes,
    timestamps, delivery counts, ordinals. The one layout of a live :class:`Chunk` and of
    a replay's settled run (``core/replay_settled.py``), so that arrays are copied
    between them as they are."""

    __slots__ = ("counts", "ids", "ords", "priority", "queue", "ref_hi", "ref_lo", "seqs",
                 "sizes", "stamps")

    def __init__(self, queue: str, priority: int) -> None:
        self.queue = queue
        self.priority = priority
        self.ids: array[int] = array("q")
        self.seqs: array[int] = array("q")
        self.ref_hi: array[int] = array("Q")
        self.ref_lo: array[int] = array("I")
        self.sizes: array[int] = array("I")
        self.stamps: array[int] = array("q")
        self.counts: array[int] = array("H")
        #: log order of messages restored by a restart (``NO_ORDINAL``: added later)
        self.ords: array[int] = array("I")

    def columns(self) -> list[array[int]]:
        """The columns, in :meth:`Chunk.extend_arrays` order."""
        return [self.ids, self.seqs, self.ref_hi, self.ref_lo, self.sizes, self.stamps,
                self.counts, self.ords]

    def add_row(self, message_id: int, seq: int, ref: int, size: int, stamp: int,
                count: int, ordinal: int) -> None:
        """Add a message behind the last (its id is higher)."""
        self.ids.append(message_id)
        self.seqs.append(seq)
        self.ref_hi.append(ref >> 32)
        self.ref_lo.append(ref & _LOW)
        self.sizes.append(size)
        self.stamps.append(stamp)
        self.counts.append(count)
        self.ords.append(ordinal)


class Chunk(Columns):
    """Up to :data:`CHUNK_SIZE` plain READY messages of one queue and priority, in
    queue order, as parallel arrays (:class:`Columns`: 47 bytes a message instead
    of a :class:`Message` and its ints, ~300 bytes). Ids ascend within a chunk, so a
    slot is found by bisection (:meth:`MessageIndex.get`). A slot whose message
    was looked up is *promoted*: the object lives in the index's ``objects`` and
    the slot only keeps its place in the queue (stale once the object leaves).
    """

    __slots__ = ("head", "home", "live", "marks")

    def __init__(self, home: MessageIndex, queue: str, priority: int) -> None:
        super().__init__(queue, priority)
        self.home = home
        self.marks = bytearray()
        self.head = 0  #: slots below are taken
        self.live = 0  #: slots not taken

    def takes(self, message_id: int) -> bool:
        """Can ``message_id`` be appended (room left, ids still ascending)?"""
        ids = self.ids
        return len(ids) < CHUNK_SIZE and (not ids or ids[-1] < message_id)

    def append(self, message_id: int, seq: int, ref: int, size: int, stamp: int,
               count: int, ordinal: int = -1) -> None:
        """Append one compact slot (the caller checked :meth:`takes`)."""
        ids = self.ids
        if not ids or (ids[-1] >> BLOCK_SHIFT) != (message_id >> BLOCK_SHIFT):
            self.home.blocks.setdefault(message_id >> BLOCK_SHIFT, []).append(self)
        self.add_row(message_id, seq, ref, size, stamp, count,
                     NO_ORDINAL if ordinal < 0 else ordinal)
        self.marks.append(COMPACT)
        self.live += 1
        self.home.compact += 1

    def extend(self, ids: list[int], seqs: list[int], refs: list[int], sizes: list[int],
               stamps: list[int], counts: list[int], ords: list[int]) -> None:
        """Append many compact slots (ascending ids above this chunk's, room for all)."""
        mine = self.ids
        blocks = self.home.blocks
        first = ids[0] >> BLOCK_SHIFT
        if mine and mine[-1] >> BLOCK_SHIFT == first:
            first += 1  # (registered already)
        for block in range(first, (ids[-1] >> BLOCK_SHIFT) + 1):
            blocks.setdefault(block, []).append(self)
        mine.extend(ids)
        self.seqs.extend(seqs)
        self.ref_hi.extend([ref >> 32 for ref in refs])
        self.ref_lo.extend([ref & _LOW for ref in refs])
        self.sizes.extend(sizes)
        self.stamps.extend(stamps)
        self.counts.extend(counts)
        self.ords.extend(ords)
        self.marks.extend(bytes([COMPACT]) * len(ids))
        self.live += len(ids)
        self.home.compact += len(ids)

    def extend_arrays(self, ids: array[int], seqs: array[int], ref_hi: array[int],
                      ref_lo: array[int], sizes: array[int], stamps: array[int],
                      counts: array[int], ords: array[int]) -> None:
        """:meth:`extend` from arrays of this chunk's own typecodes (copied as they
        are: a warm standby's settled messages, ``core/replay_settled.py``)."""
        mine = self.ids
        blocks = self.home.blocks
        first = ids[0] >> BLOCK_SHIFT
        if mine and mine[-1] >> BLOCK_SHIFT == first:
            first += 1  # (registered already)
        for block in range(first, (ids[-1] >> BLOCK_SHIFT) + 1):
            blocks.setdefault(block, []).append(self)
        mine.extend(ids)
        self.seqs.extend(seqs)
        self.ref_hi.extend(ref_hi)
        self.ref_lo.extend(ref_lo)
        self.sizes.extend(sizes)
        self.stamps.extend(stamps)
        self.counts.extend(counts)
        self.ords.extend(ords)
        self.marks.extend(bytes([COMPACT]) * len(ids))
        self.live += len(ids)
        self.home.compact += len(ids)

    def find(self, message_id: int) -> int:
        """The slot of ``message_id`` (-1: not here)."""
        ids = self.ids
        if not ids or message_id < ids[0] or message_id > ids[-1]:
            return -1
        slot = bisect_left(ids, message_id)
        return slot if slot < len(ids) and ids[slot] == message_id else -1

    def build(self, slot: int) -> Message:
        """A fresh READY :class:`Message` for a compact slot."""
        message = Message(self.ids[slot], self.queue, self.sizes[slot], None, None,
                          self.priority, self.stamps[slot], 0, 0, self.counts[slot], True,
                          None, self.ref_hi[slot] << 32 | self.ref_lo[slot])
        message.seq = self.seqs[slot]
        message.state = State.READY
        return message

    def ref_at(self, slot: int) -> int:
        """The body ref of a slot (no promotion)."""
        return self.ref_hi[slot] << 32 | self.ref_lo[slot]

    def set_ref(self, slot: int, ref: int) -> None:
        """Point a compact slot at another copy of its body (compaction)."""
        self.ref_hi[slot] = ref >> 32
        self.ref_lo[slot] = ref & _LOW

    def record_at(self, slot: int) -> list[Any]:
        """The ``msg`` tuple of a compact slot, as :meth:`Message.to_record` of
        :meth:`build` would give it, without building the object."""
        return [self.ids[slot], self.queue, None, None, self.priority, self.stamps[slot],
                0, 0, self.counts[slot], self.seqs[slot]]

    def message_at(self, slot: int) -> Message | None:
        """The message of a slot, promoted if it was compact (None: taken, or stale)."""
        mark = self.marks[slot]
        if mark == COMPACT:
            message = self.build(slot)
            self.marks[slot] = PROMOTED
            home = self.home
            home.compact -= 1
            home.objects[message.id] = message
            if self.ords[slot] != NO_ORDINAL:
                home.restored[message.id] = self.ords[slot]
            return message
        if mark == PROMOTED:
            found = self.home.objects.get(self.ids[slot])
            if found is not None and found.state is State.READY and found.queue == self.queue:
                return found
        return None

    def take_front(self) -> Message | None:
        """Take the head slot: its message (registered in the index's ``objects``)
        or None when it was stale."""
        slot = self.head
        self.head = slot + 1
        mark = self.marks[slot]
        if mark == TAKEN:
            return None
        self.marks[slot] = TAKEN
        self.live -= 1
        home = self.home
        if mark == COMPACT:
            home.compact -= 1
            message = self.build(slot)
            home.objects[message.id] = message
            return message
        found = home.objects.get(self.ids[slot])
        if found is not None and found.state is State.READY and found.queue == self.queue:
            return found
        return None

    @property
    def drained(self) -> bool:
        """Every slot taken."""
        return self.head >= len(self.ids)

    def messages(self) -> list[Message]:
        """Every live message from the head (promoting compact slots)."""
        found = []
        for slot in range(self.head, len(self.ids)):
            message = self.message_at(slot)
            if message is not None:
                found.append(message)
        return found

    def drop(self) -> None:
        """The chunk leaves its queue: compact slots are promoted first (a detached
        level is walked later), then it leaves the lookup blocks."""
        ids = self.ids
        if not ids:
            return
        for slot in range(self.head, len(ids)):
            if self.marks[slot] == COMPACT:
                self.message_at(slot)
        blocks = self.home.blocks
        for block in range(ids[0] >> BLOCK_SHIFT, (ids[-1] >> BLOCK_SHIFT) + 1):
            found = blocks.get(block)
            if found is not None and self in found:
                found.remove(self)
                if not found:
                    del blocks[block]

    def retire(self) -> None:
        """A drained chunk leaves the lookup blocks."""
        self.drop()


class MessageIndex:
    """The broker's messages by id: :class:`Message` objects (pending, delivered,
    held, and READY ones that do not fit a chunk) in :attr:`objects`, and the
    compact slots of the queues' chunks, found through :attr:`blocks`. Behaves as
    the ``dict[int, Message]`` it replaces: a lookup that finds a compact slot
    promotes it (the same object on every later lookup)."""

    def __init__(self) -> None:
        self.objects: dict[int, Message] = {}
        #: chunks by ``id >> BLOCK_SHIFT`` of the ids they hold
        self.blocks: dict[int, list[Chunk]] = {}
        self.compact = 0  #: compact (not promoted) slots
        #: log order (an ordinal) of the objects a restart restored, while compact slots
        #: restored with them remain: ``values()`` keeps the log order of a restart
        self.restored: dict[int, int] = {}

    def _promote(self, message_id: int) -> Message | None:
        for chunk in self.blocks.get(message_id >> BLOCK_SHIFT, ()):
            slot = chunk.find(message_id)
            if slot >= 0 and chunk.marks[slot] == COMPACT:
                return chunk.message_at(slot)
        return None

    def compact_slot(self, message_id: int) -> tuple[Chunk, int] | None:
        """The chunk and slot of ``message_id`` while it is a compact slot (no
        promotion: compaction copies and re-points millions of parked messages)."""
        if not self.compact:
            return None
        for chunk in self.blocks.get(message_id >> BLOCK_SHIFT, ()):
            slot = chunk.find(message_id)
            if slot >= 0 and chunk.marks[slot] == COMPACT:
                return chunk, slot
        return None

    def get(self, message_id: int, default: Message | None = None) -> Message | None:
        """The message ``message_id`` (promoted if compact), or ``default``."""
        found = self.objects.get(message_id)
        if found is None and self.compact:
            found = self._promote(message_id)
        return default if found is None else found

    def __getitem__(self, message_id: int) -> Message:
        found = self.get(message_id)
        if found is None:
            raise KeyError(message_id)
        return found

    def __contains__(self, message_id: object) -> bool:
        if not isinstance(message_id, int):
            return False
        return self.get(message_id) is not None

    def __setitem__(self, message_id: int, message: Message) -> None:
        self.objects[message_id] = message

    def pop(self, message_id: int, default: Message | None = None) -> Message | None:
        """Remove and return ``message_id`` (``default`` when absent)."""
        if self.compact and message_id not in self.objects:
            self._promote(message_id)
        return self.objects.pop(message_id, default)

    def __len__(self) -> int:
        return len(self.objects) + self.compact

    def chunks(self) -> list[Chunk]:
        """Every chunk holding compact slots (each once)."""
        seen: dict[int, Chunk] = {}
        for found in self.blocks.values():
            for chunk in found:
                seen[id(chunk)] = chunk
        return list(seen.values())

    def promote_all(self) -> None:
        """Make every compact slot an object (streams, dumps: rare). The objects end up
        in the order a plain dict would have: a restart's survivors in log order,
        then the rest as they were added."""
        if not self.compact:
            return
        order: dict[int, int] = self.restored
        for chunk in self.chunks():
            for slot in range(chunk.head, len(chunk.ids)):
                if chunk.marks[slot] == COMPACT:
                    chunk.message_at(slot)
                    order[chunk.ids[slot]] = chunk.ords[slot]
        objects = self.objects
        ordered = [(i, objects[i]) for i in sorted(objects, key=lambda i: order.get(i, NO_ORDINAL))]
        objects.clear()
        objects.update(ordered)
        self.restored = {}

    def values(self) -> list[Message]:
        """Every message (compact slots promoted first)."""
        self.promote_all()
        return list(self.objects.values())

    def items(self) -> list[tuple[int, Message]]:
        """``(id, message)`` of every message (compact slots promoted first)."""
        self.promote_all()
        return list(self.objects.items())

    def keys(self) -> list[int]:
        """Every message id (objects first, then compact slots; nothing promoted)."""
        found = list(self.objects)
        if self.compact:
            for chunk in self.chunks():
                marks, ids = chunk.marks, chunk.ids
                found.extend(ids[slot] for slot in range(chunk.head, len(ids))
                             if marks[slot] == COMPACT)
        return found

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MessageIndex):
            return dict(self.items()) == dict(other.items())
        if isinstance(other, dict):
            return dict(self.items()) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
