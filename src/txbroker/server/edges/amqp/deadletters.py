"""AMQP dead-letter exchanges over txbroker's dead-letter and expiry queues.

Theory of operation
-------------------
The core dead-letters to a queue: a message rejected without requeue (or
delivered ``max_deliveries`` times) goes to the queue's ``dead_letter_queue``,
an expired one to its ``expiry_queue``, one dropped by ``x-overflow: drop-head``
to its ``overflow_queue`` (``core/overflow.py``), each move one durable record.
RabbitMQ dead-letters through an exchange, with a routing key, and records the
story in the ``x-death`` header. A queue declared with ``x-dead-letter-exchange``
gets three internal queues of its own (:func:`internal_queues`:
``$amqp.dlx.<digest>.rejected``, ``.expired`` and ``.maxlen``) as those settings,
and the broker's own AMQP session consumes them (:class:`DeadLetters`): each
message that arrives there is routed through the dead-letter exchange (with
``x-dead-letter-routing-key``, or the routing key it was published with), its
properties given an ``x-death`` entry (``count``, ``reason`` ``rejected``,
``expired`` or ``maxlen``, ``queue``, ``time``, ``exchange``, ``routing-keys``)
and the ``x-first-death-*`` headers, and sent to the queues the exchange routes
it to **in one local transaction with the ack of its internal copy**: after a
crash it is in the internal queue or in its targets, never both, never neither.
A dead letter the exchange routes nowhere is dropped, as RabbitMQ drops it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any, Final

from txbroker.errors import TxBrokerError
from txbroker.server.edges.amqp.content import delivery_facts, internal_queues, message_headers
from txbroker.server.edges.amqp.model import ChannelError, Definitions
from txbroker.server.ops import Delivery, Operations, Session

log = logging.getLogger("txbroker.amqp")

#: Dead letters one internal queue hands the broker's session at a time.
DEAD_LETTER_PREFETCH: Final = 100
#: The reasons RabbitMQ writes in ``x-death``, by internal queue (``internal_queues``).
REASONS: Final = ("rejected", "expired", "maxlen")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class DeadLetters:
    """The consumers of the internal dead-letter queues (module docstring)."""

    def __init__(self, ops: Operations, definitions: Definitions) -> None:
        self.ops = ops
        self.definitions = definitions
        #: subscription -> (the queue whose dead letters it takes, the reason)
        self._subs: dict[int, tuple[str, str]] = {}
        self._next_sub = 2  # 1 is the definitions snapshots' subscription
        #: ids of dead letters whose routing failed inside a transaction (rolled back):
        #: when they come back they are dropped
        self._failed: set[int] = set()

    def watch(self, session: Session, queue: str) -> None:
        """Consume ``queue``'s internal dead-letter queues (made if missing)."""
        if any(origin == queue for origin, _ in self._subs.values()):
            return
        broker = self.ops.broker
        now = self.ops.now()
        for name, reason in zip(internal_queues(queue), REASONS, strict=True):
            if name not in broker.queues:
                broker.queue_declare(session.id, 0, name, now)
            sub = self._next_sub
            self._next_sub += 1
            broker.subscribe(session.id, sub, name, now, prefetch=DEAD_LETTER_PREFETCH,
                             ack="client")
            self._subs[sub] = (queue, reason)

    def forget(self, session: Session, queue: str) -> None:
        """``queue`` was deleted: its internal queues go too."""
        broker = self.ops.broker
        now = self.ops.now()
        for sub in [s for s, (origin, _) in self._subs.items() if origin == queue]:
            del self._subs[sub]
            if not session.ended and sub in session.core.sessions[session.id].consumers:
                broker.unsubscribe(session.id, sub, now)
        for name in internal_queues(queue):
            if name in broker.queues:
                broker.queue_delete(session.id, 0, name, now)

    def resubscribe(self, session: Session) -> None:
        """The broker's session was opened again: consume every internal queue again."""
        origins = {origin for origin, _ in self._subs.values()}
        self._subs.clear()
        for origin in origins:
            self.watch(session, origin)

    def deliver(self, session: Session, delivery: Delivery) -> bool:
        """A dead letter (True), or not one of ours (False)."""
        found = self._subs.get(delivery.sub)
        if found is None:
            return False
        origin, reason = found
        now = self.ops.now()
        core = session.core
        if delivery.message.id in self._failed:  # came back from a rolled-back attempt
            self._failed.discard(delivery.message.id)
            with contextlib.suppress(TxBrokerError):
                core.ack(session.id, 0, [delivery.tag], now)  # dropped, as logged
            return True
        tx: int | None = None
        try:
            targets, headers = self._route(origin, reason, delivery, now)
            tx = core.tx_begin(session.id)["tx"]
            for target in targets:
                core.send(session.id, 0, target, delivery.body, now, headers=headers,
                          persistent=delivery.message.persistent,
                          priority=delivery.message.priority, tx=tx)
            core.ack(session.id, 0, [delivery.tag], now, tx=tx)
            core.tx_commit(session.id, 0, tx, now)
        except (TxBrokerError, ValueError, TypeError) as exc:  # (pamqp's encoding errors)
            log.error("AMQP: dead letter of queue %r dropped: %s", origin, exc)
            if tx is not None:  # its staged sends go
                with contextlib.suppress(TxBrokerError):
                    core.tx_rollback(session.id, tx, now)
            try:
                core.ack(session.id, 0, [delivery.tag], now)  # dropped, as logged
            except TxBrokerError:  # the rollback gave it back (its ack was staged):
                self._failed.add(delivery.message.id)  # dropped when it comes back
        return True

    def _route(self, origin: str, reason: str, delivery: Delivery, now: int
               ) -> tuple[list[str], dict[str, str]]:
        """(target queues, txbroker headers) of a dead letter."""
        flags = self.definitions.queues.get(origin)
        arguments = flags.arguments if flags is not None else {}
        exchange = _text(arguments.get("x-dead-letter-exchange", ""))
        properties, published_to, published_key = delivery_facts(delivery.message)
        override = arguments.get("x-dead-letter-routing-key")
        key = _text(override) if override else published_key
        table: dict[str, Any] = dict(properties.headers or {})
        earlier = table.get("x-death")
        deaths: list[dict[str, Any]] = [d for d in earlier if isinstance(d, dict)] \
            if isinstance(earlier, list) else []
        for death in deaths:
            if death.get("queue") == origin and death.get("reason") == reason:
                death["count"] = int(death.get("count", 0)) + 1
                deaths.remove(death)
                deaths.insert(0, death)
                break
        else:
            deaths.insert(0, {
                "count": 1, "reason": reason, "queue": origin,
                "time": datetime.datetime.fromtimestamp(now / 1000, tz=datetime.UTC),
                "exchange": published_to, "routing-keys": [published_key]})
        table["x-death"] = deaths
        table.setdefault("x-first-death-reason", reason)
        table.setdefault("x-first-death-queue", origin)
        table.setdefault("x-first-death-exchange", published_to)
        properties.headers = table
        if reason == "expired":
            properties.expiration = None  # RabbitMQ drops it: it would expire again
        try:
            targets = self.definitions.route(exchange, key, table, self.ops.broker.queues)
        except ChannelError as exc:  # the exchange is gone: dropped, as RabbitMQ
            log.warning("AMQP: dead letter of queue %r dropped: %s", origin, exc.text)
            targets = []
        return targets, message_headers(exchange, key, properties)
