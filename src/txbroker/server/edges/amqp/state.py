"""The AMQP edge's shared state: the exchange/binding definitions (stored durably)
and which connection owns which exclusive queue.

Theory of operation
-------------------
There is one :class:`AmqpState` per server, shared by every AMQP connection. It
holds :class:`~txbroker.server.edges.amqp.model.Definitions` in memory and keeps them
durable in the broker's own store, so that they are replayed, replicated and
compacted like everything else:

* every change writes the whole definitions as one persistent message to the
  queue :data:`DEFINITIONS_QUEUE` (:meth:`AmqpState.save`), sent by a session
  of the broker's own (``Operations.open_internal``); the change's reply
  (``exchange.declare-ok`` …) waits until that message is durable;
* that session consumes the queue: when snapshot *n* is delivered (which the
  core does only once it is durable), every earlier snapshot is acknowledged,
  so the queue holds one or two snapshots, and always at least one durable one;
* at start (:meth:`AmqpState.load`) the last snapshot in the queue is the
  definitions; queues that were exclusive or not durable, and exchanges that
  were not durable, are deleted then (they do not outlive a restart, as in
  RabbitMQ).

Queues themselves are ordinary core queues (their durable definitions are the
core's own records); the snapshot only adds what AMQP says about them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Final

from txbroker.core import LATER
from txbroker.errors import BrokerError, NotFound, TxBrokerError
from txbroker.server.edges.amqp.content import queue_settings
from txbroker.server.edges.amqp.deadletters import DeadLetters
from txbroker.server.edges.amqp.model import ChannelError, Definitions
from txbroker.server.ops import Delivery, Operations, Session

log = logging.getLogger("txbroker.amqp")

#: The queue that holds the AMQP definitions (``$``: no AMQP client may name it).
DEFINITIONS_QUEUE: Final = "$amqp.definitions"
#: Names AMQP clients may not use for queues (the definitions queue's prefix).
INTERNAL_PREFIX: Final = "$amqp"
#: Snapshots read at start (older ones are acknowledged as the newest arrives:
#: the queue holds one or two).
MAX_SNAPSHOTS_READ: Final = 1000

#: A callback told when a save is durable (None) or failed (the error).
Done = Callable[[BrokerError | None], None]


class AmqpState:
    """Definitions, their durable snapshots, and exclusive queues' owners."""

    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self.definitions = Definitions()
        #: exclusive queue -> the session id of the connection that declared it
        self.exclusive_owner: dict[str, int] = {}
        #: queue -> (session id, subscription) of its exclusive consumer
        self.exclusive_consumer: dict[str, tuple[int, int]] = {}
        self._session: Session | None = None
        self._waiting: dict[int, Done] = {}
        self._next_rid = 1
        self._held_tag = 0
        #: the consumers of the queues' internal dead-letter queues
        self.dead_letters = DeadLetters(ops, self.definitions)
        #: queue -> the timer that deletes it when unused (``x-expires``)
        self._expiry_timers: dict[str, asyncio.TimerHandle] = {}

    # ------------------------------------------------------------------ start
    def load(self) -> None:
        """Read the last snapshot, drop what does not outlive a restart, and start
        consuming the snapshots queue (call once, before AMQP clients are accepted)."""
        ops = self.ops
        self._session = session = ops.open_internal(self, "amqp-definitions")
        broker = ops.broker
        now = ops.now()
        if DEFINITIONS_QUEUE not in broker.queues:
            broker.queue_declare(session.id, 0, DEFINITIONS_QUEUE, now)
        else:
            messages = broker.queue_browse(DEFINITIONS_QUEUE, MAX_SNAPSHOTS_READ)
            problems = []
            for message in reversed(messages):  # the newest snapshot that reads
                try:
                    self.definitions = Definitions.load(ops.server.body(message))
                    break
                except (ValueError, KeyError, TypeError) as exc:
                    problems.append(f"message {message.id}: {exc}")
                    log.error("AMQP: skipping message %d of %s, not a definitions "
                              "snapshot: %s", message.id, DEFINITIONS_QUEUE, exc)
            else:
                if messages:
                    raise RuntimeError(f"no AMQP definitions snapshot in queue "
                                       f"{DEFINITIONS_QUEUE!r} can be read: "
                                       f"{'; '.join(problems)[:500]}")
        self.dead_letters.definitions = self.definitions
        queues, exchanges = self.definitions.transient()
        for name in queues:
            self.delete_queue(name)
        for name in exchanges:
            self.definitions.exchanges.pop(name, None)
            self.definitions.bindings.pop(name, None)
        if queues or exchanges:
            self.save(None)
        broker.subscribe(session.id, 1, DEFINITIONS_QUEUE, now, prefetch=None, ack="client")
        for flags in list(self.definitions.queues.values()):
            if flags.name in broker.queues:
                self._settle_overflow(session, flags.name, flags.arguments)
            if "x-dead-letter-exchange" in flags.arguments and flags.name in broker.queues:
                self.dead_letters.watch(session, flags.name)
            self.queue_used(flags.name)  # x-expires counts from the start
        ops.run_effects()
        log.info("AMQP: %d exchanges, %d bindings, %d queues defined",
                 len(self.definitions.exchanges),
                 sum(len(t) for t in self.definitions.bindings.values()),
                 len(self.definitions.queues))

    def _settle_overflow(self, session: Session, name: str, arguments: dict[str, Any]
                         ) -> None:
        """A queue declared before the edge did ``x-overflow: drop-head`` (RabbitMQ's
        default) gets the overflow its arguments ask for, and its ``.maxlen``
        dead-letter queue."""
        try:
            wanted, _ = queue_settings(name, arguments)
        except ChannelError:
            return
        have = self.ops.broker.queues[name].settings
        changes = {key: wanted.get(key, "") for key in ("overflow", "overflow_queue")
                   if wanted.get(key, "") != getattr(have, key)}
        if changes:
            log.info("AMQP: queue %r takes overflow settings %s", name, changes)
            self.ops.broker.queue_update(session.id, 0, name, changes, self.ops.now())

    def delete_queue(self, name: str) -> None:
        """Delete a queue the edge itself drops (an exclusive queue whose connection
        closed, a transient one at start, an auto-delete one): the core's delete,
        and its flags and bindings (saved by the caller)."""
        self.forget_queue(name)
        session = self._live_session()
        with contextlib.suppress(NotFound):
            self.ops.broker.queue_delete(session.id, 0, name, self.ops.now())

    def forget_queue(self, name: str) -> None:
        """Queue ``name`` is being deleted: its flags, bindings, exclusive owner and
        consumer, and its internal dead-letter queues go (saved by the caller)."""
        self.definitions.drop_queue(name)
        self.exclusive_owner.pop(name, None)
        self.exclusive_consumer.pop(name, None)
        self.dead_letters.forget(self._live_session(), name)
        timer = self._expiry_timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def watch_dead_letters(self, name: str) -> None:
        """Queue ``name`` has a dead-letter exchange: consume its internal queues."""
        self.dead_letters.watch(self._live_session(), name)

    def _live_session(self) -> Session:
        assert self._session is not None
        return self._reopen() if self._session.ended else self._session

    def consumer_ended(self, queue: str, session_id: int, sub: int) -> None:
        """A consumer ended: if it was the queue's exclusive one, others may come."""
        if self.exclusive_consumer.get(queue) == (session_id, sub):
            del self.exclusive_consumer[queue]

    def consumer_gone(self, queue: str, now: int) -> None:
        """A consumer of ``queue`` ended: an auto-delete queue without consumers left
        is deleted (RabbitMQ: once it had one)."""
        flags = self.definitions.queues.get(queue)
        found = self.ops.broker.queues.get(queue)
        if flags is None or found is None or found.consumers:
            return
        if not flags.auto_delete:
            self.queue_used(queue)
            return
        self.delete_queue(queue)
        self.save(None)

    # ------------------------------------------------------------------ x-expires
    def queue_used(self, name: str) -> None:
        """``name`` was declared (not passively), consumed from or read with basic.get:
        with ``x-expires``, it is deleted once unused that long (no consumer, no get,
        no declare), as in RabbitMQ; the clock starts again now."""
        timer = self._expiry_timers.pop(name, None)
        if timer is not None:
            timer.cancel()
        flags = self.definitions.queues.get(name)
        expires = flags.arguments.get("x-expires") if flags is not None else None
        found = self.ops.broker.queues.get(name)
        if not isinstance(expires, int) or expires <= 0 or found is None or found.consumers:
            return
        self._expiry_timers[name] = asyncio.get_running_loop().call_later(
            expires / 1000, self._expire, name)

    def _expire(self, name: str) -> None:
        self._expiry_timers.pop(name, None)
        found = self.ops.broker.queues.get(name)
        if found is None or found.consumers or name not in self.definitions.queues:
            return
        log.info("AMQP: queue %r unused for its x-expires: deleted", name)
        self.delete_queue(name)
        self.save(None)
        self.ops.run_effects()

    def connection_closed(self, session_id: int, queues: set[str]) -> None:
        """A connection ended (after its core session): its exclusive queues are
        deleted, and auto-delete queues it consumed from that have no consumer left."""
        changed = False
        for name in [q for q, owner in self.exclusive_owner.items() if owner == session_id]:
            self.delete_queue(name)
            changed = True
        for name in queues:
            flags = self.definitions.queues.get(name)
            found = self.ops.broker.queues.get(name)
            if flags is not None and flags.auto_delete and found is not None \
                    and not found.consumers:
                self.delete_queue(name)
                changed = True
            else:
                self.queue_used(name)
        if changed:
            self.save(None)
            self.ops.run_effects()

    # ------------------------------------------------------------------ saving
    def save(self, done: Done | None) -> None:
        """Write the definitions as they are now; ``done`` is called once durable."""
        session = self._session
        assert session is not None
        if session.ended:  # an administrator closed it (txbroker's connections list)
            session = self._reopen()
        rid = self._next_rid
        self._next_rid += 1
        try:
            result = session.core.send(session.id, rid, DEFINITIONS_QUEUE,
                                       self.definitions.snapshot(), self.ops.now(),
                                       persistent=True)
        except BrokerError as exc:
            log.error("AMQP: the definitions could not be saved: %s", exc)
            if done is not None:
                done(exc)
            return
        if result is LATER:
            if done is not None:
                self._waiting[rid] = done
        elif done is not None:
            done(None)

    def _reopen(self) -> Session:
        """A new internal session consuming the snapshots queue (the old one ended:
        its unacked snapshot went back to the queue and is delivered again)."""
        ops = self.ops
        self._session = session = ops.open_internal(self, "amqp-definitions")
        self._held_tag = 0
        if DEFINITIONS_QUEUE not in ops.broker.queues:
            ops.broker.queue_declare(session.id, 0, DEFINITIONS_QUEUE, ops.now())
        ops.broker.subscribe(session.id, 1, DEFINITIONS_QUEUE, ops.now(), prefetch=None,
                             ack="client")
        self.dead_letters.resubscribe(session)
        log.warning("AMQP: the definitions session was closed; opened session %d",
                    session.id)
        return session

    # ------------------------------------------------------------------ SessionSink
    def answer(self, rid: int, result: Any) -> None:
        """A snapshot is durable."""
        done = self._waiting.pop(rid, None)
        if done is not None:
            done(None)

    def refuse(self, rid: int, error: BrokerError) -> None:
        """A snapshot could not be stored."""
        log.error("AMQP: the definitions could not be saved: %s", error)
        done = self._waiting.pop(rid, None)
        if done is not None:
            done(error)

    def deliver(self, delivery: Delivery) -> None:
        """Snapshot delivered (so durable): the one before it is acknowledged."""
        session = self._session
        if session is None or self.dead_letters.deliver(session, delivery):
            return
        try:
            Definitions.load(delivery.body)
        except (ValueError, KeyError, TypeError) as exc:
            # not ours (another protocol sent it): dropped, never taken for the newest
            log.error("AMQP: dropping a message of %s that is not a definitions snapshot: "
                      "%s", DEFINITIONS_QUEUE, exc)
            with contextlib.suppress(TxBrokerError):
                session.core.ack(session.id, 0, [delivery.tag], self.ops.now())
            return
        held, self._held_tag = self._held_tag, delivery.tag
        if held:
            try:
                session.core.ack(session.id, 0, [held], self.ops.now())
            except TxBrokerError as exc:  # pragma: no cover - a core bug
                log.error("AMQP: acknowledging an old definitions snapshot failed: %s", exc)

    def cancelled(self, sub: int, reason: str) -> None:
        """The snapshots queue was deleted (by an administrator): write it again."""
        log.error("AMQP: queue %s was deleted (%s); writing the definitions again",
                  DEFINITIONS_QUEUE, reason)

    def push(self, event: str, data: dict[str, Any]) -> None:
        """No pushes reach this session."""

    def flush(self) -> None:
        """Nothing to write: this session has no socket."""

    def hold_input(self, held: bool) -> None:
        """Nothing to hold: this session reads no socket."""

    def abort(self) -> None:
        """Nothing to cut: this session has no socket."""

    def close(self) -> None:
        """Shutdown."""
