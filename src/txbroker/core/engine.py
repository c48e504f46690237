"""The broker engine: applies commands, returns effects. No I/O, no clock.

Theory of operation
-------------------
One :class:`Broker` owns all state: queues, topics, the message index,
sessions with their consumers, deliveries and transactions. The edge calls a
command method with the current time ``now`` (ms); the method either returns
the reply at once, returns :data:`LATER` (the reply comes as a ``Reply`` /
``Fail`` effect once a record is durable), or raises a ``BrokerError``. After
every call the edge drains :meth:`Broker.take_effects` and carries them out.

Ordering rules that keep the live state equal to what a replay of the log
rebuilds (``core/recovery.py``):

* **metadata** (queue definitions, duplicate-id windows) changes at command
  time, before its record is appended — so the snapshot that starts a new
  segment (taken inside an append) already includes every change appended
  before it; metadata records are idempotent on replay;
* **new messages** become visible only when their record is durable; durable
  callbacks arrive in log order, so messages apply in log order;
* **acks and drops** take the message away at command time (it cannot be
  delivered again) but release its body only once the record is durable;
* **moves** (dead-letter, expiry) of a stored message apply at once: until
  the MOVE record is durable the message is simply still in its old queue
  after a crash.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from txbroker.core import records
from txbroker.core.effects import (
    Cancelled,
    Deliver,
    Effect,
    EffectList,
    Fail,
    Persist,
    Release,
    Reply,
)
from txbroker.core.limits import MAX_NAME_LENGTH, Limits
from txbroker.core.messages import Message, State
from txbroker.core.queues import PRIORITIES, Consumer, Queue
from txbroker.core.records import Kind
from txbroker.core.sessions import Session, Topic
from txbroker.core.transactions import LocalTransaction, TxEvent, TxState
from txbroker.errors import (
    BadRequest,
    Disabled,
    IllegalState,
    MessageTooLarge,
    NotFound,
    QuotaExceeded,
    StorageFailed,
    TooManyUnacked,
    TransactionError,
    TransactionRolledBack,
)

#: Returned by a command whose reply comes later as an effect.
LATER: Any = object()
#: The reply to a send that was stored (shared: never mutated).
NOT_DUPLICATE: dict[str, bool] = {"duplicate": False}
#: The separator in a topic subscription queue's name: ``topic::subscription``.
SUBSCRIPTION_SEPARATOR = "::"


def check_name(name: object, what: str = "queue") -> str:
    """Validate a destination name (BadRequest on bad input)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise BadRequest(f"{what} name must be a string of 1 to {MAX_NAME_LENGTH} characters")
    if any(ord(ch) < 32 for ch in name):
        raise BadRequest(f"{what} name must not contain control characters")
    return name


class Engine:
    """Messaging: sends, deliveries, acks, transactions, time. See the module docstring."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.queues: dict[str, Queue] = {}
        self.topics: dict[str, Topic] = {}
        self.messages: dict[int, Message] = {}  #: stored or pending messages by id
        self.sessions: dict[int, Session] = {}
        self.next_id = 1
        self.failed: BaseException | None = None  #: the store failed: no more writes
        self._effects = EffectList()
        # the open record group: plain sends and acks of the current batch of
        # commands, written as ONE record by flush() (see "Record groups")
        self._group_adds: list[Message] = []
        self._group_acks: list[Message] = []
        self._group_replies: list[tuple[int, int, Any]] = []
        self._receive_deadlines: list[tuple[int, int, int, Consumer]] = []
        self._next_expiry_scan = 0
        self.counters = {"sent": 0, "delivered": 0, "acked": 0, "expired": 0, "dead_lettered": 0}

    # ------------------------------------------------------------------ plumbing
    def take_effects(self) -> list[Effect]:
        """Every effect produced since the last call, in order (closes the record group)."""
        if self._group_adds or self._group_acks:
            self.flush()
        return self._effects.take()

    def _emit(self, effect: Effect) -> None:
        self._effects.items.append(effect)

    def _persist(
        self,
        kind: Kind,
        meta: Any,
        on_durable: Any,
        bodies: list[bytes] | None = None,
        on_refs: Any = None,
    ) -> None:
        if self.failed is not None:
            raise StorageFailed(f"the store failed, the broker takes no writes: {self.failed}")
        if self._group_adds or self._group_acks:
            self.flush()  # keep the log in command order
        self._emit(Persist(int(kind), records.pack(meta), bodies or [], on_durable, on_refs))

    def flush(self) -> None:
        """Close the open record group: its sends and acks go out as one record.

        The edge calls this after each batch of commands (``take_effects``
        does it too). Many pipelined sends of one read become one store
        entry, one checksum and one completion instead of one each.
        """
        adds, acks, replies = self._group_adds, self._group_acks, self._group_replies
        if not adds and not acks:
            return
        self._group_adds, self._group_acks, self._group_replies = [], [], []
        if self.failed is not None:
            self._fail_group(adds, replies, self.failed)
            return

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(adds, refs, strict=True):
                message.ref = ref

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self._storage_failed(error)
                self._fail_group(adds, replies, error)
                return
            self._apply_adds(adds, self._now)
            for message in acks:
                self._forget(message)
            emit = self._effects.items.append
            for session_id, rid, result in replies:
                emit(Reply(session_id, rid, result))

        self._assign_seqs(adds)
        if len(adds) == 1 and not acks:
            kind, meta = Kind.ADD, adds[0].to_record()
        else:
            kind, meta = Kind.TX, [[m.to_record() for m in adds], [m.id for m in acks]]
        bodies = [m.body for m in adds if m.body is not None]
        self._emit(Persist(int(kind), records.pack(meta), bodies, on_durable, on_refs))

    def _assign_seqs(self, messages: Iterable[Message]) -> None:
        """Messages about to be committed get their queue's next sequence numbers
        (in log order: called as their record is built)."""
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

    def _fail_group(self, adds: list[Message], replies: list[tuple[int, int, Any]],
                    error: BaseException) -> None:
        for message in adds:
            self._drop_pending(message)
        for session_id, rid, _ in replies:
            self._emit(Fail(session_id, rid, StorageFailed(str(error))))

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _reply_when_durable(self, session: int, rid: int, result: Any) -> Any:
        def done(error: BaseException | None) -> None:
            if error is not None:
                self._storage_failed(error)
                self._emit(Fail(session, rid, StorageFailed(str(error))))
            else:
                self._emit(Reply(session, rid, result))

        return done

    def _storage_failed(self, error: BaseException) -> None:
        if self.failed is None:
            self.failed = error

    def session(self, session_id: int) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise IllegalState(f"no session {session_id}") from None

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: int, user: str | None = None) -> Session:
        """Register a connection's session."""
        session = Session(session_id, user)
        self.sessions[session_id] = session
        return session

    def close_session(self, session_id: int, now: int) -> None:
        """The connection ended: roll back its transactions, return its unacked
        messages (they are redelivered) and drop its non-durable subscriptions."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        for tx in list(session.transactions.values()):
            if tx.state is TxState.ACTIVE:
                self._rollback(tx, now)
        touched: set[str] = set()
        for consumer in list(session.consumers.values()) + list(session.receivers):
            queue = self.queues.get(consumer.queue)
            if queue is not None:
                queue.remove_consumer(consumer)
        # newest first: each goes to the front, so the oldest ends up first again
        for tag, consumer in reversed(list(session.deliveries.items())):
            message = consumer.unacked.pop(tag, None)
            if message is not None:
                self._requeue(message, now)
                touched.add(message.queue)
        session.deliveries.clear()
        for name in list(session.owned_queues):
            self._delete_queue(name, now)
        for name in touched:
            self._dispatch_name(name, now)

    # ------------------------------------------------------------------ sending
    def send(
        self,
        session_id: int,
        rid: int,
        dest: str,
        body: bytes,
        now: int,
        *,
        headers: dict[str, str] | None = None,
        message_id: str | None = None,
        persistent: bool = True,
        priority: int = 4,
        ttl_ms: int = 0,
        delay_ms: int = 0,
        tx: int | None = None,
    ) -> Any:
        """Send a message to a queue or topic. Replies ``{"duplicate": bool}``."""
        session = self.session(session_id)
        if dest not in self.queues and dest not in self.topics:
            check_name(dest, "destination")  # known names were checked when created
        if len(body) > self.limits.max_message_size:
            raise MessageTooLarge(
                f"message of {len(body)} bytes is above max_message_size "
                f"({self.limits.max_message_size})"
            )
        if not 0 <= priority < PRIORITIES:
            raise BadRequest(f"priority must be 0 to {PRIORITIES - 1}")
        if ttl_ms < 0 or delay_ms < 0:
            raise BadRequest("ttl and delay must be >= 0")
        transaction = session.transaction(tx) if tx is not None else session.xa_work
        if transaction is not None:
            transaction.fire(TxEvent.WORK)
            self._check_tx_room(transaction, 1)
        targets = self._targets(dest, now)
        # an XA branch's quota is checked at prepare (seed 002), not per send
        quota = transaction is None or transaction.id != 0
        for queue in targets:
            self._check_ingress(queue, len(body), quota)
        duplicate = False
        if message_id is not None:
            duplicate = all(queue.seen(message_id) for queue in targets) and bool(targets)
        if duplicate:
            return {"duplicate": True}
        made: list[Message] = []
        for queue in targets:
            if message_id is not None:
                queue.remember(message_id, pending=persistent and queue.durable)
            ttl = ttl_ms or queue.settings.default_ttl_ms
            message = Message(
                self._new_id(),
                queue.name,
                size=len(body),
                message_id=message_id,
                headers=headers or None,
                priority=priority,
                timestamp_ms=now,
                expires_ms=now + ttl if ttl else 0,
                deliver_at_ms=now + delay_ms if delay_ms else 0,
                persistent=persistent and queue.durable,
                body=body,
            )
            queue.pending += 1
            queue.pending_bytes += message.size
            made.append(message)
        self.counters["sent"] += 1
        result = NOT_DUPLICATE
        if transaction is not None:
            transaction.sends.extend(made)
            return result
        stored = [m for m in made if m.persistent]
        for message in made:
            if not message.persistent:
                self._apply_add(message, now)
        if not stored:
            return result
        if self.failed is not None:
            for message in stored:
                self._drop_pending(message)
            raise StorageFailed(f"the store failed, the broker takes no writes: {self.failed}")
        for message in stored:
            self.messages[message.id] = message
        self._group_adds.extend(stored)
        if rid:
            self._group_replies.append((session_id, rid, result))
        return LATER

    def now_hint(self, fallback: int) -> int:
        """The latest time the edge told us (durable callbacks carry no time)."""
        return max(self._now, fallback)

    _now = 0

    def set_now(self, now: int) -> None:
        """The edge tells the core the time before running durable callbacks."""
        self._now = now

    def _targets(self, dest: str, now: int) -> list[Queue]:
        topic = self.topics.get(dest)
        if topic is not None:
            return [self.queues[name] for name in topic.subscriptions if name in self.queues]
        return [self._queue_or_create(dest, now)]

    def _queue_or_create(self, name: str, now: int) -> Queue:
        queue = self.queues.get(name)
        if queue is not None:
            return queue
        if name in self.topics:
            raise BadRequest(f"{name!r} is a topic: consume from one of its subscriptions")
        if not self.limits.auto_create:
            raise NotFound(f"no queue {name!r} (auto_create is off)")
        check_name(name)
        queue = Queue(name)
        self.queues[name] = queue
        self._persist(Kind.QUEUE_PUT, queue.definition(), self._ignore_durable)
        return queue

    def _ignore_durable(self, error: BaseException | None) -> None:
        if error is not None:
            self._storage_failed(error)

    def _check_ingress(self, queue: Queue, size: int, quota: bool = True) -> None:
        settings = queue.settings
        if not settings.ingress:
            raise Disabled(f"queue {queue.name!r} does not accept messages (ingress disabled)")
        if not quota:
            return
        if settings.max_messages and queue.messages + queue.pending + 1 > settings.max_messages:
            raise QuotaExceeded(
                f"queue {queue.name!r} is full: max_messages {settings.max_messages}"
            )
        if settings.max_bytes and queue.bytes + queue.pending_bytes + size > settings.max_bytes:
            raise QuotaExceeded(f"queue {queue.name!r} is full: max_bytes {settings.max_bytes}")

    def _check_tx_room(self, tx: LocalTransaction, more: int) -> None:
        if tx.id == 0:  # an XA branch's work (core/xa_engine.py)
            self._check_branch_room(tx, more)
            return
        if tx.operations + more > self.limits.max_tx_operations:
            raise TransactionError(
                f"transaction {tx.id} has {tx.operations} operations, the limit "
                f"(max_tx_operations)"
            )

    def _check_branch_room(self, tx: LocalTransaction, more: int) -> None:
        """Overridden by the XA engine: the branch message limit."""

    def _apply_add(self, message: Message, now: int) -> None:
        """A new message is durable (or non-persistent): make it visible."""
        queue = self.queues.get(message.queue)
        if queue is None:
            self._forget(message)
            return
        queue.pending -= 1
        queue.pending_bytes -= message.size
        if message.seq:
            queue.settle(message.seq)
        if message.message_id is not None:
            queue.id_settled(message.message_id, durable=True)
        if message.persistent:
            message.body = None  # read back from the store on delivery
        self.messages[message.id] = message
        queue.count_in(message)
        queue.put(message, now)
        self._dispatch(queue, now)

    def _apply_adds(self, messages: list[Message], now: int) -> None:
        """:meth:`_apply_add` for many (hot: a group commit, a transaction, a branch):
        each queue is looked up once per run of messages and dispatched once."""
        queues, index = self.queues, self.messages
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
                    self._forget(message)
                continue
            touched[name] = queue
            if queue.undurable_ids:
                for message in run:
                    if message.message_id is not None:
                        queue.id_settled(message.message_id, durable=True)
            size = 0
            first_seq, seqs = run[0].seq, 0
            for message in run:
                size += message.size
                if message.seq:
                    if message.seq == first_seq + seqs:
                        seqs += 1
                    else:
                        queue.settle(message.seq)
                if message.persistent:
                    message.body = None  # read back from the store on delivery
                index[message.id] = message
                if message.expires_ms:
                    queue.expiring += 1
                queue.put(message, now)
            if seqs:
                queue.settle(first_seq, seqs)
            queue.pending -= len(run)
            queue.pending_bytes -= size
            queue.messages += len(run)  # count_in, for the whole run
            queue.bytes += size
        for queue in touched.values():
            self._dispatch(queue, now)

    def _drop_pending(self, message: Message) -> None:
        queue = self.queues.get(message.queue)
        if queue is not None:
            queue.pending -= 1
            queue.pending_bytes -= message.size
            if message.seq:
                queue.settle(message.seq)
            if message.message_id is not None:
                queue.id_settled(message.message_id, durable=False)
        self._forget(message)

    def _forget(self, message: Message) -> None:
        """The message is gone for good: drop it from the index, free its body."""
        message.state = State.GONE
        self.messages.pop(message.id, None)
        if message.ref is not None:
            self._emit(Release(message.ref))
            message.ref = None
        message.body = None

    # ------------------------------------------------------------------ delivery
    def _dispatch_name(self, name: str, now: int) -> None:
        queue = self.queues.get(name)
        if queue is not None:
            self._dispatch(queue, now)

    def _dispatch(self, queue: Queue, now: int) -> None:
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
                self._expire(queue, message, now)
                continue
            self._deliver(queue, consumer, message, now)

    def _deliver(self, queue: Queue, consumer: Consumer, message: Message, now: int) -> None:
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
        self._emit(Deliver(session.id, sub, consumer.rid, tag, message,
                           message.delivery_count > 1))
        if consumer.ack_auto:
            queue.in_flight -= 1
            self._consume([message], None)
            return
        consumer.unacked[tag] = message
        session.deliveries[tag] = consumer

    def _requeue(self, message: Message, now: int, *, delay_ms: int = 0) -> None:
        """A delivered or held message comes back to its queue (front of its priority)."""
        queue = self.queues.get(message.queue)
        if queue is None or message.state is State.GONE:
            return
        if message.state is State.DELIVERED:
            queue.in_flight -= 1
        settings = queue.settings
        if settings.max_deliveries and message.delivery_count >= settings.max_deliveries:
            self._dead_letter(queue, message, settings.dead_letter_queue, "max_deliveries", now)
            return
        delay = delay_ms or settings.redelivery_delay_ms
        message.deliver_at_ms = now + delay if delay else 0
        queue.put(message, now, front=True)

    def _consume(self, messages: list[Message], reply: tuple[int, int] | None) -> Any:
        """Messages acked (outside a transaction): gone now, bodies freed when durable."""
        if self.failed is not None and any(m.persistent for m in messages):
            raise StorageFailed(f"the store failed, the broker takes no writes: {self.failed}")
        stored = False
        for message in messages:
            queue = self.queues.get(message.queue)
            if queue is not None:
                queue.count_out(message)
            message.state = State.GONE
            self.counters["acked"] += 1
            if message.persistent:
                stored = True
                self._group_acks.append(message)
            else:
                self._forget(message)
        if not stored:
            return {}
        if reply is not None:
            self._group_replies.append((reply[0], reply[1], {}))
        return LATER

    def _expire(self, queue: Queue, message: Message, now: int) -> None:
        self.counters["expired"] += 1
        target = queue.settings.expiry_queue or queue.settings.dead_letter_queue
        self._dead_letter(queue, message, target, "expired", now)

    def _dead_letter(
        self, queue: Queue, message: Message, target_name: str, reason: str, now: int
    ) -> None:
        """Move a message to ``target_name`` (or drop it when there is none)."""
        queue.count_out(message)
        if reason != "expired":
            self.counters["dead_lettered"] += 1
        target = None
        if target_name and target_name != queue.name:
            target = self._queue_or_create(target_name, now)
        if target is None:
            message.state = State.GONE
            if message.persistent:
                stored = message
                self._persist(
                    Kind.DROP, [[message.id], reason], lambda err: self._after_drop(stored, err)
                )
            else:
                self._forget(message)
            return
        message.queue = target.name
        message.expires_ms = 0
        message.deliver_at_ms = 0
        message.seq = 0
        if message.persistent:
            seq = target.assign_seq(message)
            self._persist(Kind.MOVE, [[message.id], target.name, reason, [seq]],
                          lambda err: self._after_move(target.name, seq, err))
        target.count_in(message)
        target.put(message, now)
        self._dispatch(target, now)

    def _after_move(self, target: str, seq: int, error: BaseException | None) -> None:
        if error is not None:
            self._storage_failed(error)
        queue = self.queues.get(target)
        if queue is not None:
            queue.settle(seq)

    def _after_drop(self, message: Message, error: BaseException | None) -> None:
        if error is not None:
            self._storage_failed(error)
            return
        self._forget(message)

    # ------------------------------------------------------------------ consumers
    def subscribe(
        self, session_id: int, sub: int, queue_name: str, now: int, *, prefetch: int | None = None,
        ack: str = "client",
    ) -> Any:
        """Start a subscription: deliveries arrive as ``Deliver`` effects."""
        session = self.session(session_id)
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
        queue = self._queue_or_create(check_name(queue_name), now)
        self._check_not_streamed(queue)
        consumer = Consumer(session_id, sub, queue.name, prefetch, ack_auto=ack == "auto")
        session.consumers[sub] = consumer
        queue.add_consumer(consumer)
        self._dispatch(queue, now)
        return {}

    @staticmethod
    def _check_not_streamed(queue: Queue) -> None:
        if queue.stream_owner is not None:
            raise IllegalState(f"queue {queue.name!r} is owned by stream reader "
                               f"{queue.stream_owner[0]!r}: no consumers while it is attached")

    def unsubscribe(self, session_id: int, sub: int, now: int) -> Any:
        """End a subscription; its unacked messages go back to the queue."""
        session = self.session(session_id)
        consumer = session.consumers.pop(sub, None)
        if consumer is None:
            raise NotFound(f"no subscription {sub} on this connection")
        queue = self.queues.get(consumer.queue)
        if queue is not None:
            queue.remove_consumer(consumer)
        for tag, message in reversed(list(consumer.unacked.items())):
            session.deliveries.pop(tag, None)
            self._requeue(message, now)
        consumer.unacked.clear()
        self._dispatch_name(consumer.queue, now)
        return {}

    def receive(
        self, session_id: int, rid: int, queue_name: str, now: int, timeout_ms: int | None
    ) -> Any:
        """Take one message (client ack). Replies with it, or ``None`` on timeout."""
        session = self.session(session_id)
        queue = self._queue_or_create(check_name(queue_name), now)
        self._check_not_streamed(queue)
        deadline = now + timeout_ms if timeout_ms is not None else 0
        consumer = Consumer(session_id, -rid, queue.name, 1, one_shot=True, rid=rid,
                            deadline_ms=deadline)
        session.receivers.add(consumer)
        queue.add_consumer(consumer)
        self._dispatch(queue, now)
        if consumer not in session.receivers:
            return LATER  # delivered at once: the Deliver effect answers
        if timeout_ms == 0:
            queue.remove_consumer(consumer)
            session.receivers.discard(consumer)
            return None
        if deadline:
            heapq.heappush(self._receive_deadlines, (deadline, session_id, rid, consumer))
        return LATER

    def ack(self, session_id: int, rid: int, tags: Iterable[int], now: int,
            tx: int | None = None) -> Any:
        """Acknowledge deliveries (or stage the acks in a transaction)."""
        session = self.session(session_id)
        transaction = session.transaction(tx) if tx is not None else session.xa_work
        if transaction is not None:
            tags = list(tags)
            self._check_tx_room(transaction, len(tags))
        consumers = self._take_deliveries(session, tags)
        messages = []
        for tag, consumer in consumers:
            message = consumer.unacked.pop(tag)
            queue = self.queues.get(message.queue)
            if queue is not None:
                queue.in_flight -= 1
            messages.append(message)
        if transaction is not None:
            transaction.fire(TxEvent.WORK)
            for message in messages:
                message.state = State.HELD
                transaction.acks[message.id] = message
            result: Any = {}
        else:
            result = self._consume(messages, (session_id, rid) if rid else None)
        for name in {c.queue for _, c in consumers}:
            self._dispatch_name(name, now)
        return result

    def nack(self, session_id: int, tags: Iterable[int], now: int, *, requeue: bool = True,
             tx: int | None = None) -> Any:
        """Reject deliveries: redeliver them, or dead-letter them (``requeue=False``)."""
        session = self.session(session_id)
        consumers = self._take_deliveries(session, tags)
        transaction = session.transaction(tx) if tx is not None else None
        if transaction is not None:
            transaction.fire(TxEvent.WORK)
        for tag, consumer in consumers:
            message = consumer.unacked.pop(tag)
            if transaction is not None:
                queue = self.queues.get(message.queue)
                if queue is not None:
                    queue.in_flight -= 1
                message.state = State.HELD
                transaction.nacks[message.id] = message
            elif requeue:
                self._requeue(message, now)
                self._persist_delivery_count(message)
            else:
                queue = self.queues.get(message.queue)
                if queue is not None:
                    queue.in_flight -= 1
                    self._dead_letter(queue, message, queue.settings.dead_letter_queue,
                                      "rejected", now)
        for name in {c.queue for _, c in consumers}:
            self._dispatch_name(name, now)
        return {}

    def _persist_delivery_count(self, message: Message) -> None:
        if message.persistent and message.state is State.READY:
            self._persist(Kind.UPDATE, [message.id, message.delivery_count,
                                        message.deliver_at_ms], self._ignore_durable)

    def _take_deliveries(self, session: Session, tags: Iterable[int]) -> list[tuple[int, Consumer]]:
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

    # ------------------------------------------------------------------ transactions
    def tx_begin(self, session_id: int) -> Any:
        session = self.session(session_id)
        tx = session.begin()
        return {"tx": tx.id}

    def tx_commit(self, session_id: int, rid: int, tx_id: int, now: int) -> Any:
        """Commit: one TX record with every staged send and ack; reply once durable."""
        session = self.session(session_id)
        tx = session.transaction(tx_id)
        if self.failed is not None:
            self._rollback(tx, now)
            raise TransactionRolledBack(f"the store failed; transaction {tx_id} rolled back")
        tx.fire(TxEvent.COMMIT)
        stored_sends = [m for m in tx.sends if m.persistent]
        stored_acks = [m for m in tx.acks.values() if m.persistent]
        for message in tx.acks.values():
            # gone from now on: compaction must not copy a message whose ack is
            # already in the log (a copy after the ack would bring it back)
            message.state = State.GONE
        for message in stored_sends:
            self.messages[message.id] = message
        self._assign_seqs(stored_sends)
        if not stored_sends and not stored_acks:
            self._finish_commit(tx, now)
            return {}

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(stored_sends, refs, strict=True):
                message.ref = ref

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self._storage_failed(error)
                tx.fire(TxEvent.FAILED)
                for message in tx.sends:
                    self._drop_pending(message)
                self._emit(Fail(session_id, rid, TransactionRolledBack(
                    f"the store failed; transaction {tx_id} rolled back: {error}")))
                return
            self._finish_commit(tx, self.now_hint(now))
            self._emit(Reply(session_id, rid, {}))

        meta = [[m.to_record() for m in stored_sends], [m.id for m in stored_acks], now]
        bodies = [m.body for m in stored_sends if m.body is not None]
        self._persist(Kind.TX, meta, on_durable, bodies, on_refs)
        return LATER

    def _finish_commit(self, tx: LocalTransaction, now: int) -> None:
        if tx.state is TxState.COMMITTING:
            tx.fire(TxEvent.DURABLE)
        session = self.sessions.get(tx.session)
        if session is not None:
            session.transactions.pop(tx.id, None)
        self._apply_adds(tx.sends, now)
        for message in tx.acks.values():
            queue = self.queues.get(message.queue)
            if queue is not None:
                queue.count_out(message)
            self.counters["acked"] += 1
            self._forget(message)
        for message in tx.nacks.values():
            message.state = State.DELIVERED
            self._requeue_held(message, now)

    def _requeue_held(self, message: Message, now: int) -> None:
        queue = self.queues.get(message.queue)
        if queue is None:
            return
        queue.in_flight += 1  # _requeue takes one off for a DELIVERED message
        message.state = State.DELIVERED
        self._requeue(message, now)
        self._dispatch(queue, now)

    def tx_rollback(self, session_id: int, tx_id: int, now: int) -> Any:
        session = self.session(session_id)
        self._rollback(session.transaction(tx_id), now)
        return {}

    def _rollback(self, tx: LocalTransaction, now: int) -> None:
        tx.fire(TxEvent.ROLLBACK)
        if tx.state is not TxState.ROLLED_BACK:
            return  # a commit already on its way to disk completes on its own
        session = self.sessions.get(tx.session)
        if session is not None:
            session.transactions.pop(tx.id, None)
        for message in tx.sends:
            self._drop_pending(message)
        for message in list(tx.acks.values()) + list(tx.nacks.values()):
            self._requeue_held(message, now)

    # ------------------------------------------------------------------ time
    def tick(self, now: int) -> None:
        """Time passed: scheduled messages come due, receives time out, TTLs expire."""
        self._now = max(self._now, now)
        for queue in list(self.queues.values()):
            if any(True for _ in queue.due(now)):
                self._dispatch(queue, now)
        while self._receive_deadlines and self._receive_deadlines[0][0] <= now:
            _, session_id, rid, consumer = heapq.heappop(self._receive_deadlines)
            session = self.sessions.get(session_id)
            if session is None or consumer not in session.receivers:
                continue
            session.receivers.discard(consumer)
            waiting_on = self.queues.get(consumer.queue)
            if waiting_on is not None:
                waiting_on.remove_consumer(consumer)
            self._emit(Reply(session_id, rid, None))
        if now >= self._next_expiry_scan:
            self._next_expiry_scan = now + self.limits.expiry_scan_ms
            self._expire_scan(now)

    def _expire_scan(self, now: int) -> None:
        for queue in list(self.queues.values()):
            if queue.expiring == 0:
                continue
            for message in queue.ready_messages():
                if message.expired(now):
                    queue.discard(message)
                    message.state = State.READY
                    self._expire(queue, message, now)

    def next_wakeup(self) -> int | None:
        """The next time (ms) ``tick`` has something to do, if any."""
        times = [t for q in self.queues.values() if (t := q.next_due_ms()) is not None]
        if self._receive_deadlines:
            times.append(self._receive_deadlines[0][0])
        if any(q.expiring for q in self.queues.values()):
            times.append(self._next_expiry_scan)
        return min(times) if times else None

    # ------------------------------------------------------------------ deletion
    # (queue and topic administration lives in core/admin.py, recovery and
    # snapshots in core/recovery.py)
    def _delete_queue(self, name: str, now: int, on_durable: Any = None) -> int:
        """Remove a queue and every message in it; cancel its consumers."""
        queue = self.queues.pop(name, None)
        if queue is None:
            return 0
        if queue.durable:
            self._persist(Kind.QUEUE_DELETE, name, on_durable or self._ignore_durable)
        if queue.topic is not None and queue.topic in self.topics:
            self.topics[queue.topic].subscriptions.discard(name)
        for consumer in list(queue.consumers):
            session = self.sessions.get(consumer.session)
            if session is None:
                continue
            if consumer.one_shot:
                session.receivers.discard(consumer)
                self._emit(Fail(session.id, consumer.rid, NotFound(f"queue {name!r} deleted")))
            else:
                session.consumers.pop(consumer.id, None)
                self._emit(Cancelled(session.id, consumer.id, f"queue {name!r} deleted"))
            for tag in consumer.unacked:
                session.deliveries.pop(tag, None)
            consumer.unacked.clear()
        dropped = [m for m in self.messages.values() if m.queue == name]
        for message in dropped:
            if message.state is not State.PENDING:
                self._forget(message)
        session_owner = self.sessions.get(queue.owner)
        if session_owner is not None:
            session_owner.owned_queues.discard(name)
        return len(dropped)
