"""Consumers: subscriptions, receives, acks and nacks, sessions that end, and time.

Theory of operation
-------------------
:class:`Delivery` runs the commands of the consuming side on the queue index
(``core/queue_index.py``): a subscription is a :class:`~txbroker.core.queues.Consumer`
with credit (its prefetch); a ``receive`` is a one-shot consumer that answers
one request (or times out); every delivery gets a tag, unique in its session,
that ack and nack name. :meth:`Delivery.take_deliveries` is the one place
that decides "ack of an unknown delivery" for every protocol: each tag must
be an unacked delivery of this session, else the whole request is refused
with IllegalState and nothing is taken. :meth:`Delivery.recover` (JMS
``Session.recover()``) is a nack with requeue of every unacked delivery of
the session.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from txbroker.core.dead_letters import dead_letter, expire
from txbroker.core.drop_jobs import delete_queue
from txbroker.core.effects import Reply
from txbroker.core.limits import Limits
from txbroker.core.messages import Message, State
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import LATER, QueueIndex, check_name, check_not_streamed
from txbroker.core.queues import Consumer
from txbroker.core.records import Update
from txbroker.core.sessions import Session
from txbroker.core.transactions import LocalTransaction, TxEvent
from txbroker.errors import BadRequest, IllegalState, NotFound, TooManyUnacked


@dataclass(order=True, slots=True)
class ReceiveDeadline:
    """When a waiting ``receive`` times out (a heap entry)."""

    at_ms: int
    session: int
    rid: int
    consumer: Consumer = field(compare=False)


class Delivery:
    """The consuming side's commands and timers. See the module docstring."""

    def __init__(self, index: QueueIndex, limits: Limits, outbox: Outbox) -> None:
        self.index = index
        self.limits = limits
        self.outbox = outbox
        self._receive_deadlines: list[ReceiveDeadline] = []
        self._next_expiry_scan = 0


    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: int, user: str | None = None) -> Session:
        """Register a connection's session."""
        session = Session(session_id, user)
        self.index.sessions[session_id] = session
        return session

    def detach_consumers(self, session: Session) -> None:
        """A session is ending: its subscriptions and waiting receives stop taking messages."""
        for consumer in list(session.consumers.values()) + list(session.receivers):
            queue = self.index.queues.get(consumer.queue)
            if queue is not None:
                queue.remove_consumer(consumer)

    def close_session(self, session: Session, now: int) -> None:
        """The connection ended (its transactions are rolled back already): its unacked
        messages are redelivered and its non-durable subscriptions dropped."""
        self.index.sessions.pop(session.id, None)
        self.detach_consumers(session)
        touched: set[str] = set()
        # newest first: each goes to the front, so the oldest ends up first again
        for tag, consumer in reversed(list(session.deliveries.items())):
            message = consumer.unacked.pop(tag, None)
            if message is not None:
                self.index.requeue(message, now)
                touched.add(message.queue)
        session.deliveries.clear()
        for name in list(session.owned_queues):
            delete_queue(self.index, name, now)
        for name in touched:
            self.index.dispatch_name(name, now)

    # ------------------------------------------------------------------ consumers
    def subscribe(self, session: Session, sub: int, queue_name: str, now: int, *,
                  prefetch: int | None = None, ack: str = "client") -> Any:
        """Start a subscription: deliveries arrive as ``Deliver`` effects."""
        if sub in session.consumers:
            raise BadRequest(f"subscription id {sub} is already in use on this connection")
        if ack not in ("client", "auto"):
            raise BadRequest("ack must be 'client' or 'auto'")
        prefetch = self.limits.default_prefetch if prefetch is None else prefetch
        if prefetch < 1:
            raise BadRequest("prefetch must be >= 1")
        if prefetch > self.limits.max_unacked_per_consumer:
            raise TooManyUnacked(
                f"prefetch {prefetch} is above max_unacked_per_consumer "
                f"({self.limits.max_unacked_per_consumer})"
            )
        queue = self.index.queue_or_create(check_name(queue_name), now)
        check_not_streamed(queue)
        consumer = Consumer(session.id, sub, queue.name, prefetch, ack_auto=ack == "auto")
        session.consumers[sub] = consumer
        queue.add_consumer(consumer)
        self.index.dispatch(queue, now)
        return {}

    def unsubscribe(self, session: Session, sub: int, now: int, *,
                    keep_unacked: bool = False) -> Any:
        """End a subscription; its unacked messages go back to the queue, or, with
        ``keep_unacked`` (AMQP's ``basic.cancel``, as RabbitMQ), stay the session's
        unacked deliveries: a later ack, nack or recover of them works, and the end of
        the session gives them back. A delivery still held for its delivered mark
        (never sent) goes back at once either way."""
        consumer = session.consumers.pop(sub, None)
        if consumer is None:
            raise NotFound(f"no subscription {sub} on this connection")
        queue = self.index.queues.get(consumer.queue)
        if queue is not None:
            queue.remove_consumer(consumer)
        unsent: set[int] = set()
        if keep_unacked and queue is not None and queue.held_deliveries:
            unsent = {d.tag for d in queue.held_deliveries
                      if d.session == session.id and d.sub == sub}
        for tag, message in reversed(list(consumer.unacked.items())):
            if keep_unacked and tag not in unsent:
                continue
            del consumer.unacked[tag]
            session.deliveries.pop(tag, None)
            self.index.requeue(message, now)
        self.index.dispatch_name(consumer.queue, now)
        return {}

    def receive(self, session: Session, rid: int, queue_name: str, now: int,
                timeout_ms: int | None) -> Any:
        """Take one message (client ack). Replies with it, or ``None`` on timeout."""
        queue = self.index.queue_or_create(check_name(queue_name), now)
        check_not_streamed(queue)
        deadline = now + timeout_ms if timeout_ms is not None else 0
        consumer = Consumer(session.id, -rid, queue.name, 1, one_shot=True, rid=rid,
                            deadline_ms=deadline)
        session.receivers.add(consumer)
        queue.add_consumer(consumer)
        self.index.dispatch(queue, now)
        if consumer not in session.receivers:
            return LATER  # delivered at once: the Deliver effect answers
        if timeout_ms == 0:
            queue.remove_consumer(consumer)
            session.receivers.discard(consumer)
            return None
        if deadline:
            heapq.heappush(self._receive_deadlines,
                           ReceiveDeadline(deadline, session.id, rid, consumer))
        return LATER

    def ack(self, session: Session, rid: int, tags: list[int], now: int,
            work: LocalTransaction | None) -> Any:
        """Acknowledge deliveries, or stage the acks in ``work`` (a transaction or branch)."""
        taken = self.take_deliveries(session, tags)
        messages = []
        for tag, consumer in taken:
            message = consumer.unacked.pop(tag)
            queue = self.index.queues.get(message.queue)
            if queue is not None:
                queue.in_flight -= 1
            messages.append(message)
        if work is not None:
            work.fire(TxEvent.WORK)
            for message, (tag, consumer) in zip(messages, taken, strict=True):
                message.state = State.HELD
                work.acks[message.id] = message
                work.delivered[message.id] = (tag, consumer)
            result: Any = {}
        else:
            result = self.index.consume(messages, (session.id, rid) if rid else None)
        for name in {consumer.queue for _, consumer in taken}:
            self.index.dispatch_name(name, now)
        return result

    def ack_by_id(self, session: Session, rid: int, queue_name: Any, message_id: Any,
                  now: int, work: LocalTransaction | None) -> Any:
        """Acknowledge a message the client was delivered on an *earlier* session (seed
        004: an ack after a failover; that session's deliveries went back to their
        queues), named by its queue and id. Seed 004: the ack fails with IllegalState
        only when the message "has already been sent to another queue receiver"
        (delivered to, or consumed by, another session) or is gone (acknowledged,
        expired, moved); with one receiver it succeeds. A message still READY (or
        waiting for its redelivery delay) is taken and acknowledged; one delivered
        again to *this* session (a restored subscription) has that delivery
        acknowledged. Replies as ``ack`` does. Inside a transaction or XA branch only
        the second kind is staged: a READY message must be acknowledged outside."""
        if not isinstance(queue_name, str) or type(message_id) is not int:
            raise BadRequest("ack_by_id names a queue (string) and a message id (integer)")
        message = self.index.messages.get(message_id)
        if message is None or message.queue != queue_name or message.state in (
                State.PENDING, State.GONE):
            raise IllegalState(f"message {message_id} is no longer in {queue_name!r}: "
                               "acknowledged, expired, moved, or consumed by another receiver")
        if message.state is State.DELIVERED:
            for tag, consumer in session.deliveries.items():
                if consumer.unacked.get(tag) is message:
                    return self.ack(session, rid, [tag], now, work)
        if message.state is not State.READY:  # DELIVERED elsewhere, or HELD by a transaction
            raise IllegalState(f"message {message_id} of {queue_name!r} was sent to another "
                               "receiver after the failover")
        queue = self.index.queues.get(queue_name)
        if queue is None:
            raise IllegalState(f"queue {queue_name!r} is gone")
        if work is not None:
            raise IllegalState(f"message {message_id} was delivered before a failover: "
                               "acknowledge it outside a transaction or XA branch")
        queue.discard(message)
        return self.index.consume([message], (session.id, rid) if rid else None)

    def nack(self, session: Session, tags: Iterable[int], now: int, *, requeue: bool,
             work: LocalTransaction | None) -> Any:
        """Reject deliveries: redeliver them, or dead-letter them (``requeue=False``).
        In a local transaction (``work``) the nack is staged until commit."""
        taken = self.take_deliveries(session, tags)
        if work is not None:
            work.fire(TxEvent.WORK)
        for tag, consumer in taken:
            message = consumer.unacked.pop(tag)
            if work is not None:
                queue = self.index.queues.get(message.queue)
                if queue is not None:
                    queue.in_flight -= 1
                message.state = State.HELD
                work.nacks[message.id] = message
                work.delivered[message.id] = (tag, consumer)
            elif requeue:
                self.index.requeue(message, now)
                self._persist_delivery_count(message)
            else:
                queue = self.index.queues.get(message.queue)
                if queue is not None:
                    queue.in_flight -= 1
                    dead_letter(self.index, queue, message, queue.settings.dead_letter_queue,
                                "rejected", now)
        for name in {consumer.queue for _, consumer in taken}:
            self.index.dispatch_name(name, now)
        return {}

    def recover(self, session: Session, now: int) -> dict[str, int]:
        """Give back every unacked delivery of the session, as a nack with requeue does
        (redelivered, ``delivery_count`` one up when delivered again, dead-lettered at
        ``max_deliveries``). Messages consumed by a transaction or an XA branch are not
        unacked deliveries any more and stay where they are. Replies
        ``{"recovered": n, "next_tag": t}``: deliveries made from now on (the
        redeliveries too) have tags from ``t`` on; lower ones were given back."""
        next_tag = session.next_tag
        tags = [tag for tag, consumer in session.deliveries.items() if tag in consumer.unacked]
        # newest first: each goes to the front, so the oldest ends up first again
        self.nack(session, reversed(tags), now, requeue=True, work=None)
        return {"recovered": len(tags), "next_tag": next_tag}

    def _persist_delivery_count(self, message: Message) -> None:
        if message.persistent and message.state is State.READY:
            self.outbox.write(Update(message.id, message.delivery_count,
                                     message.deliver_at_ms), self.outbox.ignore_durable)

    def take_deliveries(self, session: Session,
                        tags: Iterable[int]) -> list[tuple[int, Consumer]]:
        """The unacked deliveries ``tags`` of ``session``, taken out of its table. This is
        the one place that decides "ack of an unknown delivery": every tag must be an
        unacked delivery of this session, else IllegalState and nothing is taken."""
        found: list[tuple[int, Consumer]] = []
        for tag in tags:
            if not isinstance(tag, int) or isinstance(tag, bool):
                raise BadRequest("delivery tags must be integers")
            consumer = session.deliveries.get(tag)
            if consumer is None or tag not in consumer.unacked:
                raise IllegalState(
                    f"delivery tag {tag} is not an unacked delivery of this connection"
                )
            found.append((tag, consumer))
        for tag, _ in found:
            session.deliveries.pop(tag, None)
        return found

    # ------------------------------------------------------------------ time
    def tick(self, now: int) -> None:
        """Time passed: scheduled messages come due, receives time out, TTLs expire."""
        for queue in list(self.index.queues.values()):
            if any(True for _ in queue.due(now)):
                self.index.dispatch(queue, now)
        deadlines = self._receive_deadlines
        while deadlines and deadlines[0].at_ms <= now:
            deadline = heapq.heappop(deadlines)
            session = self.index.sessions.get(deadline.session)
            consumer = deadline.consumer
            if session is None or consumer not in session.receivers:
                continue
            session.receivers.discard(consumer)
            waiting_on = self.index.queues.get(consumer.queue)
            if waiting_on is not None:
                waiting_on.remove_consumer(consumer)
            self.outbox.emit(Reply(deadline.session, deadline.rid, None))
        if now >= self._next_expiry_scan:
            self._next_expiry_scan = now + self.limits.expiry_scan_ms
            self._expire_scan(now)

    def _expire_scan(self, now: int) -> None:
        for queue in list(self.index.queues.values()):
            if queue.expiring == 0:
                continue
            for message in queue.ready_messages():
                if message.expired(now):
                    queue.discard(message)
                    message.state = State.READY
                    expire(self.index, queue, message, now)

    def next_wakeup(self) -> int | None:
        """The next time (ms) ``tick`` has something to do, if any."""
        times = [t for q in self.index.queues.values() if (t := q.next_due_ms()) is not None]
        if self._receive_deadlines:
            times.append(self._receive_deadlines[0].at_ms)
        if any(q.expiring for q in self.index.queues.values()):
            times.append(self._next_expiry_scan)
        return min(times) if times else None


__all__ = ["Delivery", "ReceiveDeadline"]
