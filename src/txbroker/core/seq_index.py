"""The seq index of a queue: which present message has which seq (offset reading).

Theory of operation
-------------------
A stream reader (``core/streams.py``) reads a queue by sequence number. The first
time one needs it, :func:`build_index` sorts the queue's messages by seq into two
parallel columns on the :class:`~txbroker.core.queues.Queue` (``seq_keys``, an
``array`` of seqs, and ``seq_messages``); :meth:`Queue.assign_seqs` appends to them
as messages are committed. Entries go stale when their message leaves the queue, so
every read checks that the message is still this queue's, still has that seq and is
still present; ``seq_head`` skips the entries released for good, and
:func:`compact_index` drops the stale ones once they are the larger part.

Only seqs below ``Queue.readable_seq`` (every lower record durable) are read. The
queue keeps the columns; this module owns how they are built, read and compacted.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING

from txbroker.core.messages import Message, State

if TYPE_CHECKING:
    from txbroker.core.queues import Queue


def build_index(queue: Queue, messages: Iterator[Message]) -> None:
    """Build the seq index from the queue's messages (any order)."""
    found = sorted((m for m in messages if m.seq and m.queue == queue.name),
                   key=lambda m: m.seq)
    queue.seq_keys = array("q", [m.seq for m in found])
    queue.seq_messages = found
    queue.seq_head = 0


def readable_at(queue: Queue, index: int) -> Message | None:
    """The message at index position ``index`` if it is still this queue's."""
    assert queue.seq_keys is not None
    message = queue.seq_messages[index]
    if (message.queue == queue.name and message.seq == queue.seq_keys[index]
            and message.state in (State.READY, State.DELIVERED, State.HELD)):
        return message
    return None


def first_seq(queue: Queue) -> int:
    """The lowest seq still present (``readable_seq`` when none is)."""
    assert queue.seq_keys is not None
    keys, end = queue.seq_keys, queue.readable_seq
    index = queue.seq_head
    while index < len(keys) and keys[index] < end:
        if readable_at(queue, index) is not None:
            return keys[index]
        if queue.seq_messages[index].state is not State.PENDING:
            queue.seq_head = index + 1  # gone for good: never look at it again
        index += 1
    return end


def read_range(queue: Queue, start: int, end: int, max_count: int,
               max_bytes: int) -> tuple[list[Message], int]:
    """Present messages with ``start <= seq < end`` (in seq order, at most
    ``max_count`` / about ``max_bytes``) and the seq to continue from."""
    assert queue.seq_keys is not None
    keys, messages, name = queue.seq_keys, queue.seq_messages, queue.name
    end = min(end, queue.readable_seq)
    index = max(bisect_left(keys, start, queue.seq_head), queue.seq_head)
    stop = bisect_left(keys, end, index) if index < len(keys) else index
    found: list[Message] = []
    size = 0
    ready, delivered, held = State.READY, State.DELIVERED, State.HELD
    for position in range(index, stop):  # (hot: readable_at inlined)
        message = messages[position]
        state = message.state
        if (message.queue != name or message.seq != keys[position]
                or not (state is ready or state is delivered or state is held)):
            continue
        if len(found) >= max_count or (found and size >= max_bytes):
            return found, keys[position]
        found.append(message)
        size += message.size
    return found, max(end, start)


def below(queue: Queue, end: int) -> list[Message]:
    """Present messages with seq < ``end``; the index forgets everything below."""
    assert queue.seq_keys is not None
    keys = queue.seq_keys
    stop = min(bisect_left(keys, end, queue.seq_head), len(keys))
    found = [m for i in range(queue.seq_head, stop) if (m := readable_at(queue, i)) is not None]
    queue.seq_head = max(queue.seq_head, stop)
    if queue.seq_head > 4096 and queue.seq_head * 2 > len(keys):
        compact_index(queue)
    return found


def compact_index(queue: Queue) -> None:
    """Drop the released and stale entries (pending ones stay: they may yet be read)."""
    assert queue.seq_keys is not None
    keep = [i for i in range(queue.seq_head, len(queue.seq_keys))
            if readable_at(queue, i) is not None
            or queue.seq_messages[i].state is State.PENDING]
    queue.seq_messages = [queue.seq_messages[i] for i in keep]
    queue.seq_keys = array("q", [queue.seq_keys[i] for i in keep])
    queue.seq_head = 0
