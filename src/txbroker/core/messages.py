"""The broker's in-memory message index entry.

Theory of operation: a :class:`Message` is what the broker keeps per stored
message — ids, routing and delivery state, and a *ref* to the body in the
store. The body itself is held only while the message is not yet durable (or
for non-persistent messages, which are never stored); afterwards it is read
back from the store on delivery. ``__slots__`` keeps the entry small: the
index must hold millions of them.
"""

from __future__ import annotations

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
        """The ``msg`` tuple of ``core/records.py``."""
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
