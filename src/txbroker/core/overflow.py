"""Queue overflow: what a full queue does with one more message.

Theory of operation
-------------------
A queue with ``max_messages`` or ``max_bytes`` is full when one more message
would go past them. Its ``overflow`` setting (``core/queue_settings.py``) says what
happens then:

* ``reject`` (the default; every native and STOMP queue): the send is refused
  with QuotaExceeded before anything changes (``sending.check_room``); every
  stored message counts, delivered ones too.
* ``drop_head`` (RabbitMQ's ``x-overflow: drop-head``, its default for
  ``x-max-length``; the AMQP edge asks for it): the send is taken and the
  queue's head — its oldest ready messages, the next ones a consumer would get
  — leaves until the new messages fit (:func:`make_room`). As in RabbitMQ,
  ready messages count and delivered (unacked) ones do not: a queue whose
  messages are all delivered has no head to drop and takes the send.

Where a dropped message goes, and in which record:

* the queue has an ``overflow_queue`` (the AMQP edge's internal ``.maxlen``
  queue of a queue with a dead-letter exchange): the message is moved there
  (a MOVE record with reason ``maxlen``, ``QueueIndex.dead_letter``), written
  just before the send's record; after a crash between the two, the old
  message is in the overflow queue and the send unanswered (its sender sends
  it again): never lost, never twice;
* otherwise it is consumed: its ack joins the open record group, so a plain
  send and the drops it caused are ONE record (``QueueIndex.close_group``):
  after a crash, both happened or neither did.

Sends a transaction or an XA branch stages are not dropped for (they may
roll back): the queue is trimmed when they become visible, as it is when
several plain sends were on their way at once (each send counts the ready
messages, not those still on their way): :func:`trim`, called by
``QueueIndex.apply_adds`` once messages became visible, drops the head of a
``drop_head`` queue that is over its limits, its acks in the next record.
"""

from __future__ import annotations

from txbroker.core.dead_letters import dead_letter
from txbroker.core.messages import Message, State
from txbroker.core.queue_index import QueueIndex
from txbroker.core.queue_settings import OVERFLOW_DROP_HEAD
from txbroker.core.queues import Queue

#: The reason a dropped message's MOVE record (and the AMQP ``x-death``) carries.
MAXLEN_REASON = "maxlen"


def drops_head(queue: Queue) -> bool:
    """Is ``queue`` a ``drop_head`` queue with a limit?"""
    settings = queue.settings
    return settings.overflow == OVERFLOW_DROP_HEAD and bool(
        settings.max_messages or settings.max_bytes)


def is_over(queue: Queue, count: int, size: int) -> bool:
    """Would ``count`` more messages of ``size`` bytes in all take ``queue`` past its
    limits? Ready (and scheduled) messages count, delivered ones do not; bytes are
    every stored message's (the queue keeps no byte count per state)."""
    settings = queue.settings
    if settings.max_messages and \
            queue.messages - queue.in_flight + count > settings.max_messages:
        return True
    return bool(settings.max_bytes and queue.bytes + size > settings.max_bytes)


def make_room(index: QueueIndex, queue: Queue, count: int, size: int, now: int) -> int:
    """Drop the head of ``queue`` (a ``drop_head`` queue) until ``count`` more
    messages of ``size`` bytes fit, or no ready message is left; returns how many
    were dropped (module docstring: where they go)."""
    dropped = 0
    if index.outbox.failed is not None:
        return dropped  # no more writes: the send itself is refused
    while queue.ready_count and is_over(queue, count, size):
        message = queue.pop_ready()
        if message is None:
            break
        drop(index, queue, message, now)
        dropped += 1
    return dropped


def trim(index: QueueIndex, queue: Queue, now: int) -> None:
    """Messages became visible in ``queue``: a ``drop_head`` queue over its limits
    drops its head (``QueueIndex.apply_adds`` calls this)."""
    if drops_head(queue):
        make_room(index, queue, 0, 0, now)


def drop(index: QueueIndex, queue: Queue, message: Message, now: int) -> None:
    """One ready message (taken off the ready list) leaves for the overflow queue, or
    is consumed, its ack in the open record group."""
    target = queue.settings.overflow_queue
    if target:
        dead_letter(index, queue, message, target, MAXLEN_REASON, now)
        return
    queue.count_out(message)
    queue.dead_lettered += 1
    index.counters["dead_lettered"] += 1
    message.state = State.GONE
    if message.persistent:
        index.outbox.group.acks.append(message)  # forgotten once the group is durable
    else:
        index.forget(message)


__all__ = ["MAXLEN_REASON", "drop", "drops_head", "is_over", "make_room", "trim"]
