"""Sending: ``send`` and ``send_batch``, and the one function that makes a sent message.

Theory of operation
-------------------
A send names a destination: a queue (created on first use when
``auto_create`` is on) or a topic, whose subscription queues each get a copy.
Every check is made before anything changes — the name, the size, the
priority, the queue's ingress switch and quota — so a refused request leaves
no trace. :func:`build_messages` is the only place a sent message is made,
for ``send`` and ``send_batch`` alike: it applies the duplicate window (an id
seen in every target queue is a duplicate and is not sent again; a new id is
remembered, marked *pending* until its send is durable, so that a send that
is rolled back or fails leaves the window) and counts the new messages as
pending in their queues (they count against quotas until they are added or
dropped).

What happens next depends on where the send goes: staged in a local
transaction or an XA branch (``work``), or — a plain send — into the
outbox's record group, answered when that group is durable
(:meth:`QueueIndex.store_sends`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from txbroker.core.limits import Limits
from txbroker.core.messages import Message
from txbroker.core.overflow import drops_head, make_room
from txbroker.core.queue_index import QueueIndex, check_name
from txbroker.core.queue_settings import OVERFLOW_REJECT
from txbroker.core.queues import DEFAULT_PRIORITY, PRIORITIES, Queue
from txbroker.core.transactions import LocalTransaction, TxEvent
from txbroker.errors import BadRequest, Disabled, MessageTooLarge, QuotaExceeded

#: The reply to a send that was stored (shared: never mutated).
NOT_DUPLICATE: dict[str, bool] = {"duplicate": False}
#: The reply to a send whose message id is in every target's duplicate window.
DUPLICATE: dict[str, bool] = {"duplicate": True}


def check_room(queue: Queue, count: int, size: int, *, quota: bool) -> None:
    """Can ``queue`` take ``count`` more messages of ``size`` bytes in all? The ingress
    switch always applies; the quota not for an XA branch (checked at prepare, seed 002)
    nor for a ``drop_head`` queue (it makes room: ``core/overflow.py``)."""
    settings = queue.settings
    if not settings.ingress:
        raise Disabled(f"queue {queue.name!r} does not accept messages (ingress disabled)")
    if not quota or settings.overflow != OVERFLOW_REJECT:
        return
    suffix = "; nothing was sent" if count > 1 else ""
    if settings.max_messages and queue.messages + queue.pending + count > settings.max_messages:
        raise QuotaExceeded(f"queue {queue.name!r} is full: max_messages "
                            f"{settings.max_messages}{suffix}")
    if settings.max_bytes and queue.bytes + queue.pending_bytes + size > settings.max_bytes:
        raise QuotaExceeded(f"queue {queue.name!r} is full: max_bytes "
                            f"{settings.max_bytes}{suffix}")


def build_messages(
    index: QueueIndex, targets: list[Queue], bodies: list[bytes], sizes: list[int], now: int,
    message_ids: list[str | None] | None = None,
    headers: list[dict[str, str] | None] | None = None, priority: int = DEFAULT_PRIORITY,
    ttl_ms: int = 0, delay_ms: int = 0, persistent: bool = True,
) -> tuple[list[Message], int]:
    """Make the messages of a send (one body) or a batch: one per body and target queue.

    Returns ``(messages, duplicates)``: bodies whose message id every target has
    seen are skipped and counted. See the module docstring (duplicate window,
    pending counts).
    """
    next_id = index.next_id
    deliver_at = now + delay_ms if delay_ms else 0
    if len(bodies) == 1 and len(targets) == 1 and message_ids is None:
        # the common case (one plain send to one queue), without the loops' overhead
        queue = targets[0]
        size = sizes[0]
        ttl = ttl_ms or queue.settings.default_ttl_ms
        durable = persistent and queue.durable
        message = Message(next_id, queue.name, size, None,
                          (headers[0] or None) if headers is not None else None, priority, now,
                          now + ttl if ttl else 0, deliver_at, 0, durable, bodies[0])
        index.next_id = next_id + 1
        queue.pending += 1
        queue.pending_bytes += size
        return [message], 0
    made: list[Message] = []
    append = made.append
    duplicates = kept_bytes = 0
    for position, body in enumerate(bodies):
        message_id = message_ids[position] if message_ids is not None else None
        if message_id is not None:
            if targets and all(queue.seen(message_id) for queue in targets):
                duplicates += 1
                continue
            for queue in targets:
                queue.remember(message_id, pending=persistent and queue.durable)
        header = (headers[position] or None) if headers is not None else None
        size = sizes[position]
        kept_bytes += size
        for queue in targets:
            ttl = ttl_ms or queue.settings.default_ttl_ms
            append(Message(next_id, queue.name, size, message_id, header, priority, now,
                           now + ttl if ttl else 0, deliver_at, 0, persistent and queue.durable,
                           body))
            next_id += 1
    index.next_id = next_id
    kept = len(bodies) - duplicates  # each target got one message per kept body
    for queue in targets:
        queue.pending += kept
        queue.pending_bytes += kept_bytes
    return made, duplicates


class Sending:
    """``send`` and ``send_batch`` (see the module docstring)."""

    def __init__(self, index: QueueIndex, limits: Limits,
                 check_work_room: Callable[[LocalTransaction, int], None]) -> None:
        self.index = index
        self.limits = limits
        #: raises when a transaction or branch cannot take that many more messages
        self.check_work_room = check_work_room

    def _destination(self, dest: Any, now: int) -> list[Queue]:
        index = self.index
        if not isinstance(dest, str) or (dest not in index.queues and dest not in index.topics):
            check_name(dest, "destination")  # known names were checked when created
        return index.targets(dest, now)

    def send(
        self, session_id: int, rid: int, dest: str, body: bytes, now: int,
        work: LocalTransaction | None, headers: dict[str, str] | None = None,
        message_id: str | None = None, persistent: bool = True,
        priority: int = DEFAULT_PRIORITY, ttl_ms: int = 0, delay_ms: int = 0,
    ) -> Any:
        """Send one message (staged in ``work`` if given). Replies ``{"duplicate": bool}``.
        (Hot: the options are positional, the common queue lookup inline.)"""
        index = self.index
        queue = index.queues.get(dest)
        if queue is None and dest not in index.topics:
            check_name(dest, "destination")  # known names were checked when created
        size = len(body)
        if size > self.limits.max_message_size:
            raise MessageTooLarge(
                f"message of {size} bytes is above max_message_size "
                f"({self.limits.max_message_size})"
            )
        if not 0 <= priority < PRIORITIES:
            raise BadRequest(f"priority must be 0 to {PRIORITIES - 1}")
        if ttl_ms < 0 or delay_ms < 0:
            raise BadRequest("ttl and delay must be >= 0")
        if work is not None:
            work.fire(TxEvent.WORK)
            self.check_work_room(work, 1)
        targets = [queue] if queue is not None else index.targets(dest, now)
        quota = work is None or not work.is_xa
        for target in targets:
            check_room(target, 1, size, quota=quota)
        made, duplicates = build_messages(
            index, targets, [body], [size], now,
            None if message_id is None else [message_id], None if headers is None else [headers],
            priority, ttl_ms, delay_ms, persistent)
        if duplicates:
            return DUPLICATE
        index.counters["sent"] += 1
        if work is not None:
            work.sends.extend(made)
            return NOT_DUPLICATE
        for target in targets:
            if target.settings.overflow != OVERFLOW_REJECT and drops_head(target):
                make_room(index, target, 1, size, now)
        return index.store_sends(session_id, rid, made, NOT_DUPLICATE, now)

    def send_batch(
        self, session_id: int, rid: int, dest: Any, bodies: list[bytes], now: int,
        work: LocalTransaction | None, *, headers: list[dict[str, str] | None] | None = None,
        message_ids: list[str | None] | None = None, persistent: bool = True,
    ) -> Any:
        """Send many messages to one destination in one request (all checked first).

        Replies ``{"count", "duplicates"}`` once every stored one is durable (inside
        an XA branch: at once, staged).
        """
        count = len(bodies)
        if headers is not None and len(headers) != count:
            raise BadRequest("headers must be a list as long as bodies")
        if message_ids is not None and len(message_ids) != count:
            raise BadRequest("message_ids must be a list as long as bodies")
        limit = self.limits.max_message_size
        if not set(map(type, bodies)) <= {bytes}:  # (map: no Python-level loop per body)
            position = next(i for i, body in enumerate(bodies) if type(body) is not bytes)
            raise BadRequest(f"bodies[{position}] must be bytes")
        sizes = list(map(len, bodies))
        if sizes and max(sizes) > limit:
            position = next(i for i, size in enumerate(sizes) if size > limit)
            raise MessageTooLarge(f"bodies[{position}] is {sizes[position]} bytes, above "
                                  f"max_message_size ({limit}); nothing was sent")
        if work is not None:
            work.fire(TxEvent.WORK)
            if count:
                self.check_work_room(work, count)
        targets = self._destination(dest, now)
        total = sum(sizes)
        for queue in targets:
            check_room(queue, count, total, quota=work is None or not work.is_xa)
        made, duplicates = build_messages(self.index, targets, bodies, sizes, now,
                                          message_ids=message_ids, headers=headers,
                                          persistent=persistent)
        self.index.counters["sent"] += count - duplicates
        reply = {"count": count - duplicates, "duplicates": duplicates}
        if work is not None:
            work.sends.extend(made)
            return reply
        for queue in targets:
            if queue.settings.overflow != OVERFLOW_REJECT and drops_head(queue):
                mine = [m.size for m in made if m.queue == queue.name]
                make_room(self.index, queue, len(mine), sum(mine), now)
        return self.index.store_sends(session_id, rid, made, reply, now)


__all__ = ["DUPLICATE", "NOT_DUPLICATE", "Sending", "build_messages", "check_room"]
