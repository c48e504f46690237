"""Dead letters and expiry: a message leaves its queue for another one, or is dropped.

A message whose time to live ran out (:func:`expire`), that was delivered
``max_deliveries`` times, that a client rejected or that a full ``drop_head`` queue
pushed out (``core/overflow.py``) moves to the queue's expiry or dead-letter queue
(:func:`dead_letter`, created if missing) with a ``MOVE`` record, or is dropped with a
``DROP`` record when there is none. A move applies at once (see "Ordering rules" in
``core/queue_index.py``); the record settles the message's new seq when durable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from txbroker.core.messages import Message, State
from txbroker.core.queues import Queue
from txbroker.core.records import Drop, Move

if TYPE_CHECKING:
    from txbroker.core.queue_index import QueueIndex


def expire(index: QueueIndex, queue: Queue, message: Message, now: int) -> None:
    """A message's time to live ran out: to the expiry (or dead-letter) queue."""
    index.counters["expired"] += 1
    queue.expired += 1
    target = queue.settings.expiry_queue or queue.settings.dead_letter_queue
    dead_letter(index, queue, message, target, "expired", now)


def dead_letter(index: QueueIndex, queue: Queue, message: Message, target_name: str,
                reason: str, now: int) -> None:
    """Move a message to ``target_name`` (or drop it when there is none)."""
    queue.count_out(message)
    if reason != "expired":
        index.counters["dead_lettered"] += 1
        queue.dead_lettered += 1
    target = None
    if target_name and target_name != queue.name:
        # an operator's setting, not a client naming a destination: a missing
        # dead-letter queue is created even when its name has "::"
        target = index.queues.get(target_name) or index.create_queue(target_name)
    if target is None:
        message.state = State.GONE
        if message.persistent:
            stored = message
            index.outbox.write(Drop([message.id], reason),
                           lambda error: _after_drop(index, stored, error))
        else:
            index.forget(message)
        return
    readdress(message, target.name)
    if message.persistent:
        seq = target.assign_seq(message)
        index.outbox.write(Move([message.id], target.name, reason, [seq]),
                           lambda error: _after_move(index, target.name, seq, error))
    target.count_in(message)
    target.enqueued += 1
    target.put(message, now)
    index.dispatch(target, now)


def _after_move(index: QueueIndex, target: str, seq: int, error: BaseException | None) -> None:
    if error is not None:
        index.outbox.storage_failed(error)
    queue = index.queues.get(target)
    if queue is not None:
        queue.settle(seq)


def _after_drop(index: QueueIndex, message: Message, error: BaseException | None) -> None:
    if error is not None:
        index.outbox.storage_failed(error)
        return
    index.forget(message)


def readdress(message: Message, queue: str) -> None:
    """A message moves to ``queue`` (dead-lettered, expired or re-driven): its TTL and
    delay are cleared and its seq is the new queue's to give."""
    message.queue = queue
    message.expires_ms = 0
    message.deliver_at_ms = 0
    message.seq = 0
