"""The queue index: queues, topics, sessions, the message index, and hand-off.

Theory of operation
-------------------
:class:`QueueIndex` owns the state every other part works on: queues and
topics, the index of stored (or pending) messages by id, the sessions, and
the counters. It makes messages visible, hands them to consumers with credit
(:meth:`QueueIndex.dispatch`), takes them back (nack, a consumer gone, a
rolled-back transaction), dead-letters and expires them. The commands that
create and end consumers are ``core/delivery.py``'s.

Ordering rules that keep the live state equal to what a replay of the log
rebuilds (``core/replay.py``):

* **metadata** (queue definitions, duplicate-id windows) changes at command
  time, before its record is appended — so the snapshot that starts a new
  segment (taken inside an append) already includes every change appended
  before it; metadata records are idempotent on replay;
* **new messages** become visible only when their record is durable; durable
  callbacks arrive in log order, so messages apply in log order
  (:meth:`QueueIndex.apply_adds`);
* **acks and drops** take the message away at command time (it cannot be
  delivered again) but release its body only once the record is durable;
* **moves** (dead-letter, expiry) of a stored message apply at once: until
  the MOVE record is durable the message is simply still in its old queue
  after a crash.

Plain sends and acks wait in the outbox's record group; :meth:`close_group`
writes them as one record (``core/outbox.py``).

The delivered mark that holds a delivery until a record says it may have happened
is ``core/delivered_mark.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from txbroker.core.dead_letters import dead_letter, expire
from txbroker.core.delivered_mark import MAX_MARK_REACH, write_mark
from txbroker.core.effects import Deliver, Fail, Persist, Release, Reply
from txbroker.core.limits import MAX_NAME_LENGTH, Limits
from txbroker.core.messages import Message, MessageIndex, State, compactable
from txbroker.core.outbox import Outbox, RecordGroup
from txbroker.core.queue_settings import OVERFLOW_REJECT
from txbroker.core.queues import Consumer, Queue
from txbroker.core.records import Add, QueuePut, Tx
from txbroker.core.sessions import Session, Topic
from txbroker.errors import BadRequest, IllegalState, NotFound, StorageFailed

#: Returned by a command whose reply comes later as an effect.
LATER: Any = object()
#: The separator in a topic subscription queue's name: ``topic::subscription``.
SUBSCRIPTION_SEPARATOR = "::"
#: Ready messages in a queue with consumers past which new plain messages are kept
#: as compact chunk slots (below, they are about to be delivered: kept as objects).
COMPACT_BACKLOG = 1024


def check_name(name: object, what: str = "queue") -> str:
    """Validate a destination name (BadRequest on bad input)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise BadRequest(f"{what} name must be a string of 1 to {MAX_NAME_LENGTH} characters")
    if any(ord(ch) < 32 for ch in name):
        raise BadRequest(f"{what} name must not contain control characters")
    return name


class QueueIndex:
    """Queues, topics, sessions, the message index and hand-off. See the module docstring."""

    def __init__(self, limits: Limits, outbox: Outbox) -> None:
        self.limits = limits
        self.outbox = outbox
        outbox.close_group = self.close_group
        self.queues: dict[str, Queue] = {}
        self.topics: dict[str, Topic] = {}
        #: stored or pending messages by id (plain READY ones as compact chunk slots)
        self.messages = MessageIndex()
        self.sessions: dict[int, Session] = {}
        self.next_id = 1
        self.counters = {"sent": 0, "delivered": 0, "acked": 0, "expired": 0, "dead_lettered": 0,
                         "delivered_marks": 0, "deliveries_held": 0}
        #: names of queues whose deletion is still dropping messages (``core/drop_jobs.py``)
        self.deleting: dict[str, int] = {}
        #: messages held by open transactions and XA branches (installed by the broker)
        self.held_messages: Callable[[], Iterable[Message]] = tuple
        #: a queue whose overflow is not ``reject`` got messages (installed by the broker:
        #: ``core/overflow.py`` trims a ``drop_head`` queue over its limits)
        self.trim_overflow: Callable[[Queue, int], None] = lambda queue, now: None

    # ------------------------------------------------------------------ lookups
    def session(self, session_id: int) -> Session:
        """The session of a connection (IllegalState if there is none)."""
        try:
            return self.sessions[session_id]
        except KeyError:
            raise IllegalState(f"no session {session_id}") from None

    def new_id(self) -> int:
        """The next broker-wide message id."""
        self.next_id += 1
        return self.next_id - 1

    def existing_queue(self, name: Any) -> Queue:
        """A queue that must exist (NotFound otherwise)."""
        if not isinstance(name, str):
            raise BadRequest("queue name must be a string")
        queue = self.queues.get(name)
        if queue is None:
            raise NotFound(f"no queue {name!r}")
        return queue

    def queue_or_create(self, name: str, now: int) -> Queue:
        """The queue ``name``, created (and its definition written) when auto_create is on."""
        queue = self.queues.get(name)
        if queue is not None:
            return queue
        if name in self.topics:
            raise BadRequest(f"{name!r} is a topic: consume from one of its subscriptions")
        topic, separator, _ = check_name(name).partition(SUBSCRIPTION_SEPARATOR)
        if separator:  # seed 004: never a plain queue in a topic's place (issue 28)
            raise NotFound(f"no subscription {name!r}: a topic's subscription queue is made "
                           f"by topic_subscribe (of topic {topic!r}), never by naming it")
        return self.create_queue(name)

    def create_queue(self, name: str) -> Queue:
        """Create plain queue ``name`` and write its definition (auto_create permitting)."""
        if not self.limits.auto_create:
            raise NotFound(f"no queue {name!r} (auto_create is off)")
        check_name(name)
        queue = Queue(name)
        self.queues[name] = queue
        self.outbox.write(QueuePut(queue.definition()), self.outbox.ignore_durable)
        return queue

    def targets(self, dest: str, now: int) -> list[Queue]:
        """The queues a message sent to ``dest`` goes to (a topic's subscriptions)."""
        topic = self.topics.get(dest)
        if topic is not None:
            return [self.queues[name] for name in topic.subscriptions if name in self.queues]
        return [self.queue_or_create(dest, now)]

    # ------------------------------------------------------------------ the record group
    def store_sends(self, session_id: int, rid: int, made: list[Message], result: Any,
                    now: int) -> Any:
        """Plain (non-transactional) sends: non-persistent ones are visible at once, stored
        ones join the record group and ``result`` is the reply once they are durable."""
        if len(made) == 1 and made[0].persistent:  # the common case: one stored send
            outbox = self.outbox
            if outbox.failed is None:
                message = made[0]
                self.messages[message.id] = message
                group = outbox.group
                group.adds.append(message)
                if rid:
                    group.replies.append(Reply(session_id, rid, result))
                return LATER
        stored = [m for m in made if m.persistent]
        if len(stored) != len(made):
            for message in made:
                if not message.persistent:
                    self.apply_add(message, now)
        if not stored:  # (also: a topic without subscriptions made nothing)
            return result
        outbox = self.outbox
        if outbox.failed is not None:
            for message in stored:
                self.drop_pending(message)
            outbox.check_writable()
        messages = self.messages
        for message in stored:
            messages[message.id] = message
        group = outbox.group
        group.adds.extend(stored)
        if rid:
            group.replies.append(Reply(session_id, rid, result))
        return LATER

    def close_group(self) -> None:
        """Write the open record group's sends and acks as one record (``core/outbox.py``)."""
        group = self.outbox.group
        if not group:
            return
        self.outbox.group = RecordGroup()
        adds, acks, replies = group.adds, group.acks, group.replies
        if self.outbox.failed is not None:
            self._fail_group(adds, replies, self.outbox.failed)
            return

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(adds, refs, strict=True):
                message.ref = ref

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self.outbox.storage_failed(error)
                self._fail_group(adds, replies, error)
                return
            self.apply_adds(adds, self.outbox.now)
            for message in acks:
                self.forget(message)
            self.outbox.items.extend(replies)  # the waiting Reply effects, in order

        self.assign_seqs(adds)
        record: Add | Tx  # (a record group has no committed_ms: two fields)
        if len(adds) == 1 and not acks:
            record = Add(adds[0].to_record())
        else:
            record = Tx([m.to_record() for m in adds], [m.id for m in acks])
        bodies = [m.body for m in adds if m.body is not None]
        self.outbox.emit(Persist(record.kind, record.encode(), bodies, on_durable, on_refs))

    def _fail_group(self, adds: list[Message], replies: list[Reply],
                    error: BaseException) -> None:
        for message in adds:
            self.drop_pending(message)
        for reply in replies:
            self.outbox.emit(Fail(reply.session, reply.rid, StorageFailed(str(error))))

    def assign_seqs(self, messages: Iterable[Message]) -> None:
        """Messages about to be committed get their queue's next sequence numbers
        (in log order: called as their record is built), one run per queue."""
        run: list[Message] = []
        for message in messages:
            if not message.persistent:
                continue
            if run and run[0].queue != message.queue:
                self._assign_run(run)
                run = []
            run.append(message)
        if run:
            self._assign_run(run)

    def _assign_run(self, run: list[Message]) -> None:
        queue = self.queues.get(run[0].queue)
        if queue is not None:
            queue.assign_seqs(run)

    # ------------------------------------------------------------------ visibility
    def apply_add(self, message: Message, now: int) -> None:
        """A new message is durable (or non-persistent): make it visible."""
        queue = self.queues.get(message.queue)
        if queue is None:
            self.forget(message)
            return
        self._unpend(queue, message, durable=True)
        if message.persistent:
            message.body = None  # read back from the store on delivery
        self.messages[message.id] = message
        queue.count_in(message)
        queue.enqueued += 1
        queue.put(message, now)
        self.dispatch(queue, now)
        if queue.settings.overflow != OVERFLOW_REJECT:
            self.trim_overflow(queue, now)

    def apply_adds(self, messages: list[Message], now: int) -> None:
        """:meth:`apply_add` for many (hot: a group commit, a transaction, a branch):
        each queue is looked up once per run of messages and dispatched once."""
        queues, index = self.queues, self.messages
        objects = index.objects
        touched: dict[str, Queue] = {}
        start, count = 0, len(messages)
        while start < count:  # runs of messages of one queue (usually one run)
            name = messages[start].queue
            stop = start + 1
            while stop < count and messages[stop].queue == name:
                stop += 1
            run = messages[start:stop] if start or stop < count else messages
            start = stop
            queue = queues.get(name)
            if queue is None:
                for message in run:
                    self.forget(message)
                continue
            touched[name] = queue
            if queue.undurable_ids:
                for message in run:
                    if message.message_id is not None:
                        queue.id_settled(message.message_id, durable=True)
            size = 0
            first_seq, seqs = run[0].seq, 0
            # a backlog (or nobody to take them): plain messages become compact slots
            compact = queue.seq_keys is None and (
                not queue.consumers or queue.ready_count >= COMPACT_BACKLOG)
            for message in run:
                size += message.size
                if message.seq:
                    if message.seq == first_seq + seqs:
                        seqs += 1
                    else:
                        queue.settle(message.seq)
                if message.persistent:
                    message.body = None  # read back from the store on delivery
                if message.expires_ms:
                    queue.expiring += 1
                if compact and message.deliver_at_ms <= now and compactable(message):
                    message.state = State.READY
                    objects.pop(message.id, None)
                    queue.put_compact(index, message.id, message.priority, message.seq,
                                      message.ref or 0, message.size, message.timestamp_ms,
                                      message.delivery_count)
                    continue
                objects[message.id] = message
                queue.put(message, now)
            if seqs:
                queue.settle(first_seq, seqs)
            queue.pending -= len(run)
            queue.pending_bytes -= size
            queue.messages += len(run)  # count_in, for the whole run
            queue.enqueued += len(run)
            queue.bytes += size
        for queue in touched.values():
            self.dispatch(queue, now)
            if queue.settings.overflow != OVERFLOW_REJECT:
                self.trim_overflow(queue, now)

    def drop_pending(self, message: Message) -> None:
        """A send that never became visible is dropped (rolled back, failed, discarded)."""
        queue = self.queues.get(message.queue)
        if queue is not None:
            self._unpend(queue, message, durable=False)
        self.forget(message)

    @staticmethod
    def _unpend(queue: Queue, message: Message, *, durable: bool) -> None:
        """A pending send leaves ``pending``: added (``durable``) or dropped; its seq
        settles and its message id stays in the duplicate window only if added."""
        queue.pending -= 1
        queue.pending_bytes -= message.size
        if message.seq:
            queue.settle(message.seq)
        if message.message_id is not None:
            queue.id_settled(message.message_id, durable=durable)

    def forget(self, message: Message) -> None:
        """The message is gone for good: drop it from the index, free its body."""
        message.state = State.GONE
        self.messages.pop(message.id, None)
        if message.ref is not None:
            self.outbox.emit(Release(message.ref))
            message.ref = None
        message.body = None

    # ------------------------------------------------------------------ dispatch
    def dispatch_name(self, name: str, now: int) -> None:
        """:meth:`dispatch` the queue ``name`` if it exists."""
        queue = self.queues.get(name)
        if queue is not None:
            self.dispatch(queue, now)

    def dispatch(self, queue: Queue, now: int) -> None:
        """Hand ready messages to consumers with credit."""
        if not queue.settings.egress or not queue.consumers or queue.stream_owner:
            return
        while queue.ready_count:
            consumer = queue.next_consumer()
            if consumer is None:
                return
            message = queue.pop_ready()
            if message is None:
                return
            if message.expired(now):
                expire(self, queue, message, now)
                continue
            self._deliver(queue, consumer, message)

    def _deliver(self, queue: Queue, consumer: Consumer, message: Message) -> None:
        session = self.sessions[consumer.session]
        message.delivery_count += 1
        message.state = State.DELIVERED
        tag = session.new_tag()
        queue.in_flight += 1
        self.counters["delivered"] += 1
        if consumer.one_shot:
            queue.remove_consumer(consumer)
            session.receivers.discard(consumer)
        sub = 0 if consumer.one_shot else consumer.id
        deliver = Deliver(session.id, sub, consumer.rid, tag, message,
                          message.delivery_count > 1)
        seq = message.seq
        if not seq or consumer.ack_auto or not queue.durable or (
                seq <= queue.delivered_seq - queue.mark_reach // 2
                and not queue.held_deliveries):
            self.outbox.emit(deliver)  # the usual case: well below the durable mark
        elif seq <= queue.delivered_seq and not queue.held_deliveries:
            self.outbox.emit(deliver)
            write_mark(self, queue, seq)  # half-way through the reserve: the next one, early
        else:
            if queue.reserving >= seq and queue.mark_reach < MAX_MARK_REACH:
                queue.mark_reach *= 2  # the early mark was not durable in time: reach further
            write_mark(self, queue, seq)
            queue.held_deliveries.append(deliver)  # handed out when the mark is durable
            self.counters["deliveries_held"] += 1
        if consumer.ack_auto:
            queue.in_flight -= 1
            self.consume([message], None)
            return
        consumer.unacked[tag] = message
        session.deliveries[tag] = consumer

    def requeue(self, message: Message, now: int, *, delay_ms: int = 0) -> None:
        """A delivered or held message comes back to its queue (front of its priority)."""
        queue = self.queues.get(message.queue)
        if queue is None or message.state is State.GONE:
            return
        if message.state is State.DELIVERED:
            queue.in_flight -= 1
        settings = queue.settings
        if settings.max_deliveries and message.delivery_count >= settings.max_deliveries:
            dead_letter(self, queue, message, settings.dead_letter_queue, "max_deliveries", now)
            return
        delay = delay_ms or settings.redelivery_delay_ms
        message.deliver_at_ms = now + delay if delay else 0
        queue.put(message, now, front=True)

    def requeue_held(self, message: Message, now: int) -> None:
        """A message held by a transaction (acked or nacked in it) comes back."""
        queue = self.queues.get(message.queue)
        if queue is None or message.state is State.GONE:  # (its queue was deleted)
            return
        queue.in_flight += 1  # requeue takes one off for a DELIVERED message
        message.state = State.DELIVERED
        self.requeue(message, now)
        self.dispatch(queue, now)

    def consume(self, messages: list[Message], reply: tuple[int, int] | None) -> Any:
        """Messages acked (outside a transaction): gone now, bodies freed when durable."""
        if any(m.persistent for m in messages):
            self.outbox.check_writable()
        stored = False
        for message in messages:
            queue = self.queues.get(message.queue)
            if queue is not None:
                queue.count_out(message)
                queue.dequeued += 1
            message.state = State.GONE
            self.counters["acked"] += 1
            if message.persistent:
                stored = True
                self.outbox.group.acks.append(message)
            else:
                self.forget(message)
        if not stored:
            return {}
        if reply is not None:
            self.outbox.reply_later(reply[0], reply[1], {})
        return LATER

    def count_acked(self, message: Message) -> None:
        """A message consumed by a committed transaction or branch leaves for good."""
        queue = self.queues.get(message.queue)
        if queue is not None:
            queue.count_out(message)
            queue.dequeued += 1
        self.counters["acked"] += 1
        self.forget(message)


def check_not_streamed(queue: Queue) -> None:
    """A queue owned by a stream reader takes no consumers (``core/streams.py``)."""
    if queue.stream_owner is not None:
        raise IllegalState(f"queue {queue.name!r} is owned by stream reader "
                           f"{queue.stream_owner[0]!r}: no consumers while it is attached")


__all__ = ["LATER", "SUBSCRIPTION_SEPARATOR", "QueueIndex", "check_name", "check_not_streamed"]
