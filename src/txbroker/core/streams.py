"""Offset reading: stream readers (Kafka-style, for the Spark source).

Theory of operation
-------------------
**Sequence numbers.** Every message committed into a queue gets the queue's
next *seq* when its record is built (``Queue.assign_seq``): 1, 2, 3 … in log
order, gap-free, written in the record (``msg`` field 10, MOVE and commit
records) so that a replay gives every message the same seq again. A seq is
*unsettled* until its record is durable; readers see only seqs below
``Queue.readable_seq``, so a range once read is the same range forever — as
long as nothing consumed from it (a consumed message leaves a hole).

**Stream readers** (Kafka-style offset reading, for the Spark source):

==================  ====================================================
``stream_open``     attach as the queue's exclusive reader (refused while
                    consumers or unacked deliveries exist, or another live
                    reader of another name holds it; the same name from a
                    new connection takes over). While attached nothing is
                    delivered from the queue and new consumers are refused.
``stream_read``     messages with ``start <= seq < end``, in seq order,
                    without consuming them: repeatable.
``stream_commit``   everything below ``end`` is consumed (ACK records):
                    idempotent, "release below an offset".
``stream_close``    detach (also when the connection ends).
==================  ====================================================

The Spark sink's commits are ``core/sinks.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from txbroker.core import seq_index
from txbroker.core.limits import Limits
from txbroker.core.messages import Message, State
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import LATER, QueueIndex, check_name
from txbroker.core.queues import Queue
from txbroker.errors import BadRequest, IllegalState, NotFound


@dataclass(slots=True)
class ReadResult:
    """What ``stream_read`` returns: the edge reads the bodies and encodes it."""

    queue: str
    messages: list[Message]
    next: int  #: the seq to continue from (``end`` when the range is done)


class StreamReaders:
    """Stream readers over the queue index. See the module docstring."""

    def __init__(self, index: QueueIndex, limits: Limits, outbox: Outbox) -> None:
        self.index = index
        self.limits = limits
        self.outbox = outbox
        self._stream_sessions: dict[int, set[str]] = {}  #: session -> queues it reads

    # ------------------------------------------------------------------ lookups
    def _stream_queue(self, name: Any) -> Queue:
        index = self.index
        queue = index.queues.get(check_name(name))
        if queue is None:
            if name in index.topics:
                raise BadRequest(f"{name!r} is a topic: read one of its durable subscriptions "
                                 f"('{name}::<subscription>')")
            raise NotFound(f"no queue {name!r}")
        if queue.seq_keys is None:
            seq_index.build_index(queue, (m for m in index.messages.values()
                                          if m.queue == queue.name))
        return queue

    def _check_reader(self, queue: Queue, name: str | None) -> None:
        owner = queue.stream_owner
        if owner is not None and owner[0] != name and owner[1] in self.index.sessions:
            raise IllegalState(f"queue {queue.name!r} is owned by stream reader {owner[0]!r}")

    @staticmethod
    def _info(queue: Queue) -> dict[str, Any]:
        return {"queue": queue.name, "first": seq_index.first_seq(queue),
                "next": queue.readable_seq,
                "reader": queue.stream_owner[0] if queue.stream_owner else None}

    # ------------------------------------------------------------------ commands
    def open(self, session_id: int, queue_name: Any, name: Any) -> Any:
        """Attach as the queue's exclusive stream reader ``name``; replies its offsets."""
        reader = check_name(name, "stream reader")
        queue = self._stream_queue(queue_name)
        self._check_reader(queue, reader)
        if queue.consumers:
            raise IllegalState(f"queue {queue.name!r} has {len(queue.consumers)} consumer(s): "
                               "a stream reader needs the queue to itself")
        if queue.in_flight:
            raise IllegalState(f"queue {queue.name!r} has {queue.in_flight} unacked "
                               "deliveries: a stream reader needs the queue to itself")
        if queue.stream_owner is not None:
            self._stream_sessions.get(queue.stream_owner[1], set()).discard(queue.name)
        queue.stream_owner = (reader, session_id)
        self._stream_sessions.setdefault(session_id, set()).add(queue.name)
        return self._info(queue)

    def info(self, queue_name: Any) -> Any:
        """A queue's offsets (``first``, ``next``) and its reader, without attaching."""
        return self._info(self._stream_queue(queue_name))

    def read(self, queue_name: Any, start: int, end: int, name: str | None = None,
             max_count: int | None = None, max_bytes: int | None = None) -> ReadResult:
        """Messages with ``start <= seq < end`` (seq order), not consumed."""
        queue = self._stream_queue(queue_name)
        if name is not None:  # reading consumes nothing: anonymous reads are allowed
            self._check_reader(queue, name)
        if start < 0 or end < start:
            raise BadRequest("a range needs 0 <= start <= end")
        limit = self.limits.max_stream_read
        count = limit if max_count is None else max(1, min(max_count, limit))
        size = self.limits.max_stream_read_bytes
        size = size if max_bytes is None else max(1, min(max_bytes, size))
        found, after = seq_index.read_range(queue, start, end, count, size)
        return ReadResult(queue.name, found, after)

    def commit(self, session_id: int, rid: int, queue_name: Any, name: Any, end: int) -> Any:
        """Consume every message below seq ``end`` (idempotent). Replies ``{"released"}``."""
        reader = check_name(name, "stream reader")
        queue = self._stream_queue(queue_name)
        self._check_reader(queue, reader)
        released = [m for m in seq_index.below(queue, end) if m.state is State.READY]
        for message in released:
            queue.discard(message)  # out of the ready lists; consume counts it out
        result = {"released": len(released)}
        if not released:
            return result
        if self.index.consume(released, None) is not LATER:
            return result
        self.outbox.reply_later(session_id, rid, result)
        return LATER

    def close(self, session_id: int, queue_name: Any, name: Any) -> Any:
        """Detach the stream reader; the queue delivers to consumers again."""
        queue = self.index.queues.get(check_name(queue_name))
        if queue is not None and queue.stream_owner == (name, session_id):
            queue.stream_owner = None
            self._stream_sessions.get(session_id, set()).discard(queue.name)
            self.index.dispatch(queue, self.outbox.now)
        return {}

    def session_closed(self, session_id: int) -> None:
        """The session ended: the queues it read from are free again."""
        for name in self._stream_sessions.pop(session_id, set()):
            queue = self.index.queues.get(name)
            if queue is not None and queue.stream_owner and queue.stream_owner[1] == session_id:
                queue.stream_owner = None


__all__ = ["ReadResult", "StreamReaders"]
