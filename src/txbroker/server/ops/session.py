"""One client connection's session in the operation layer (see ``operations.py``):
authentication, sends, subscriptions, acknowledgements and transactions, decided once
for every protocol edge."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from txbroker.core import LATER
from txbroker.core.router.log import is_reserved
from txbroker.errors import (
    AuthenticationFailed,
    BadRequest,
    NotAuthenticated,
    TxBrokerError,
)
from txbroker.server.ops.seams import SessionSink
from txbroker.server.ops.values import (
    WRONG_CREDENTIALS,
    Delivery,
    GroupsAcked,
    as_refusal,
    unknown_delivery,
)
from txbroker.server.security.acl import BROWSE, CONSUME, SEND, destination_of

if TYPE_CHECKING:
    from txbroker.server.ops.operations import Operations

log = logging.getLogger("txbroker.server")


class Session:
    """One client connection's session, whatever its protocol. See the module docstring.

    The edge calls the core through it for the operations whose decisions are
    shared (authentication, send, subscriptions, acks, transactions); other
    core commands take :attr:`core` and :attr:`id`. Every request's result goes
    through :meth:`started`, which counts those answered later.
    """

    __slots__ = ("_cumulative", "_cumulative_sub", "address", "authenticated", "channels",
                 "core", "ended", "id", "opened_ms", "ops", "peer", "protocol", "reading_paused",
                 "sink", "user", "waiting")

    def __init__(self, ops: Operations, sink: SessionSink, session_id: int, peer: str) -> None:
        self.ops = ops
        self.sink = sink
        self.id = session_id
        self.peer = peer
        self.protocol = "native"  #: "native", "stomp", "http"
        self.address = peer  #: host:port when the edge knows it
        self.opened_ms = 0
        self.core = ops.broker
        self.user: str | None = None
        self.authenticated = False
        self.ended = False
        #: requests answered later (``LATER``) and not yet answered
        self.waiting = 0
        self.reading_paused = False
        #: a protocol with channels (AMQP) describes them for the connections list
        #: (``Operations.connections``): one dict per channel
        self.channels: Callable[[], list[dict[str, Any]]] | None = None
        #: cumulative subscriptions: sub -> its unacked tags in delivery order
        self._cumulative: dict[int, dict[int, None]] = {}
        self._cumulative_sub: dict[int, int] = {}  #: tag -> its cumulative subscription

    # ------------------------------------------------------------- gate
    def authenticate(self, user: object, password: object) -> None:
        """Check the credentials and open the core session; raise AuthenticationFailed."""
        name = user if isinstance(user, str) else None
        secret = password if isinstance(password, str) else None
        if not self.ops.auth.check(name, secret):
            log.warning("authentication failed for user %r from %s", user, self.peer)
            self.ops.audit.record(user=name, address=self.address, protocol=self.protocol,
                                  action="login", op="authenticate", destination=None,
                                  outcome="denied")
            raise AuthenticationFailed(WRONG_CREDENTIALS)
        self.authenticated = True
        self.user = name
        self.core.open_session(self.id, name)

    def authorize(self, action: str, destination: str | None, op: str) -> None:
        """Raise Forbidden unless this session's user may do ``action`` on
        ``destination`` (:meth:`Operations.authorize`)."""
        self.ops.authorize(self, action, destination, op=op)

    def require_authenticated(self, opening: str) -> None:
        """Raise NotAuthenticated before authentication (``opening``: the request that
        authenticates, in the client's terms)."""
        if not self.authenticated:
            raise NotAuthenticated(f"the first request must be {opening}")

    def end(self) -> None:
        """The connection is gone: the core rolls back its transactions and
        redelivers its unacked messages. Idempotent."""
        if not self.ended:
            self.ended = True
            self.ops._ended(self)

    # ------------------------------------------------------------- back-pressure
    def started(self, rid: int, result: Any) -> bool:
        """Count a request the core answers later; True if it does (``LATER``)."""
        if result is LATER:
            if rid:
                self.waiting += 1
            return True
        return False

    def answered(self, rid: int) -> None:
        """A request counted by :meth:`started` got its answer."""
        if rid:
            self.waiting -= 1

    def should_pause(self) -> bool:
        """True once, when reading must pause: too many requests are waiting."""
        if not self.reading_paused and self.waiting > self.ops.config.max_pending_requests:
            self.reading_paused = True
            return True
        return False

    def should_resume(self) -> bool:
        """True once, when a paused connection may be read again (half answered)."""
        if self.reading_paused and self.waiting <= self.ops.config.max_pending_requests // 2:
            self.reading_paused = False
            return True
        return False

    # ------------------------------------------------------------- deliveries
    def delivered(self, delivery: Delivery) -> None:
        """Hand a delivery to the connection (remembering the order of a cumulative
        subscription's tags)."""
        if delivery.sub == 0:
            self.answered(delivery.rid)
        elif self._cumulative:
            order = self._cumulative.get(delivery.sub)
            if order is not None:
                order[delivery.tag] = None
                self._cumulative_sub[delivery.tag] = delivery.sub
        self.sink.deliver(delivery)

    def forget_subscription(self, sub: int) -> None:
        """The subscription ended: forget the order of its tags."""
        order = self._cumulative.pop(sub, None)
        if order:
            for tag in order:
                self._cumulative_sub.pop(tag, None)

    # ------------------------------------------------------------- operations
    def send(self, rid: int, dest: str, body: bytes, now: int, *,
             headers: dict[str, str] | None = None, message_id: str | None = None,
             persistent: bool = True, priority: int = 4, ttl_ms: int = 0, delay_ms: int = 0,
             tx: int | None = None) -> Any:
        """Send a message to a queue or topic (or stage it in transaction ``tx``)."""
        if self.ops.acl.enforcing or is_reserved(dest):
            self.ops.authorize(self, SEND, dest, op="send")
        return self.core.send(self.id, rid, dest, body, now, headers=headers,
                              message_id=message_id, persistent=persistent, priority=priority,
                              ttl_ms=ttl_ms, delay_ms=delay_ms, tx=tx)

    def subscribe(self, sub: int, queue: str, now: int, *, prefetch: int | None = None,
                  ack: str = "client", cumulative: bool = False) -> Any:
        """Start a subscription; ``cumulative``: an ack of one of its deliveries
        acknowledges every earlier one too (:meth:`covered`)."""
        self.authorize(CONSUME, queue, "subscribe")
        result = self.core.subscribe(self.id, sub, queue, now, prefetch=prefetch, ack=ack)
        if cumulative:
            self._cumulative[sub] = {}
        return result

    def unsubscribe(self, sub: int, now: int, *, keep_unacked: bool = False) -> Any:
        """End a subscription; its unacked deliveries go back to the queue (or, with
        ``keep_unacked``, stay this session's to ack: AMQP's ``basic.cancel``)."""
        result = self.core.unsubscribe(self.id, sub, now, keep_unacked=keep_unacked)
        self.forget_subscription(sub)
        return result

    def covered(self, tag: int) -> list[int]:
        """The tags an ack (or nack) naming ``tag`` stands for: on a cumulative
        subscription, every unacked delivery of it up to ``tag`` (taken out of the
        order kept here), else ``tag`` alone. Whether they are unacked deliveries is
        the core's decision when the ack is made."""
        sub = self._cumulative_sub.get(tag)
        if sub is None:
            return [tag]
        order = self._cumulative[sub]
        tags = []
        for earlier in order:
            if earlier > tag:
                break
            tags.append(earlier)
        for each in tags:
            del order[each]
            del self._cumulative_sub[each]
        return tags

    def ack(self, rid: int, tags: Sequence[int], now: int, *, tx: int | None = None) -> Any:
        """Acknowledge deliveries (or stage the acks in transaction ``tx``)."""
        _check_tags(tags)
        result = self.core.ack(self.id, rid, tags, now, tx=tx)
        if self._cumulative_sub:
            self._acked(tags)
        return result

    def ack_by_id(self, rid: int, queue: str, message_id: int, now: int, *,
                  tx: int | None = None) -> Any:
        """Acknowledge a message delivered on an earlier connection of the client (seed
        004: an ack after a failover), named by its queue and id: IllegalState when it
        was sent to another receiver meanwhile (``core/delivery.py``)."""
        self.authorize(CONSUME, queue, "ack_by_id")
        return self.core.ack_by_id(self.id, rid, queue, message_id, now, tx=tx)

    def ack_groups(self, rid: int, groups: Sequence[Sequence[int]], now: int) -> GroupsAcked:
        """Several ack requests in a row (no transaction) as ONE core ack, hence
        one record. If it is refused, the requests are acknowledged one by one up
        to the first refused one, as if each had been sent alone."""
        tags = [tag for group in groups for tag in group]
        try:
            return GroupsAcked(self.ack(rid, tags, now))
        except TxBrokerError as error:
            if len(groups) == 1:
                return GroupsAcked(None, 0, as_refusal(error))
        for index, group in enumerate(groups):
            try:
                self.ack(0, group, now)
            except TxBrokerError as error:
                return GroupsAcked(None, index, as_refusal(error))
        return GroupsAcked({})  # pragma: no cover - the whole was refused, so a part is

    def settle_written(self, tags: Sequence[int], now: int) -> None:
        """Acknowledge deliveries the edge acks itself once written (STOMP's
        ``ack:auto``); a tag the client acked or nacked meanwhile is skipped."""
        if self.ended or not self.authenticated:
            return
        try:
            self.ack(0, tags, now)
        except TxBrokerError:
            for tag in tags:
                try:
                    self.ack(0, [tag], now)
                except TxBrokerError:
                    continue

    def nack(self, tags: Sequence[int], now: int, *, requeue: bool = True,
             tx: int | None = None) -> Any:
        """Reject deliveries: redeliver them, or dead-letter them (``requeue=False``)."""
        _check_tags(tags)
        result = self.core.nack(self.id, tags, now, requeue=requeue, tx=tx)
        if self._cumulative_sub:
            self._acked(tags)
        return result

    def recover(self, now: int) -> dict[str, int]:
        """Give back every unacked delivery of this session (JMS ``Session.recover()``):
        the core nacks them with requeue. Replies ``{"recovered": n, "next_tag": t}``;
        a delivery tag below ``t`` was given back."""
        result = self.core.recover(self.id, now)
        for order in self._cumulative.values():  # every unacked tag was given back
            order.clear()
        self._cumulative_sub.clear()
        return result

    def _acked(self, tags: Sequence[int]) -> None:
        """Tags the core took: forget their place in a cumulative order."""
        for tag in tags:
            sub = self._cumulative_sub.pop(tag, None)
            if sub is not None:
                self._cumulative[sub].pop(tag, None)

    def tx_begin(self) -> int:
        """Open a local transaction; its id."""
        result: dict[str, int] = self.core.tx_begin(self.id)
        return result["tx"]

    def tx_commit(self, rid: int, tx: int, now: int) -> Any:
        """Commit: one record; answered once durable."""
        return self.core.tx_commit(self.id, rid, tx, now)

    def tx_rollback(self, tx: int, now: int, *, keep_delivered: bool = False) -> Any:
        """Roll back: staged sends dropped, consumed messages redelivered (or, with
        ``keep_delivered``, this session's unacked deliveries again: AMQP's ``tx.rollback``)."""
        return self.core.tx_rollback(self.id, tx, now, keep_delivered=keep_delivered)

    def declare(self, rid: int, name: str, now: int, *, kind: str = "queue",
                settings: dict[str, Any] | None = None) -> Any:
        """Declare a queue or topic (an admin action)."""
        self.ops.require_admin(self, "declare", name)
        return self.core.queue_declare(self.id, rid, name, now, kind=kind, settings=settings)

    def topic_subscribe(self, rid: int, topic: str, name: str, now: int, *,
                        durable: bool = True, settings: dict[str, Any] | None = None) -> Any:
        """Create (or find) the subscription queue ``topic::name``."""
        self.authorize(CONSUME, topic, "topic_subscribe")
        return self.core.topic_subscribe(self.id, rid, topic, name, now, durable=durable,
                                         settings=settings)

    def delete(self, rid: int, name: str, now: int) -> Any:
        """Delete a queue or topic (an admin action)."""
        self.ops.require_admin(self, "delete", name)
        return self.core.queue_delete(self.id, rid, name, now)

    def update(self, rid: int, name: str, settings: dict[str, Any], now: int) -> Any:
        """Change a queue's settings (an admin action)."""
        self.ops.require_admin(self, "update", name)
        return self.core.queue_update(self.id, rid, name, settings, now)

    def purge(self, rid: int, name: str, now: int) -> Any:
        """Drop a queue's ready and scheduled messages; in-flight ones stay with their
        consumers (RabbitMQ's purge). An admin action."""
        self.ops.require_admin(self, "purge", name)
        return self.core.queue_purge(self.id, rid, name, now)

    def browse(self, name: str, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` visible messages of a queue in delivery order, not
        consumed: each as a dict with its ``body`` (bytes)."""
        self.authorize(BROWSE, name, "browse")
        messages = self.core.queue_browse(name, limit)
        bodies = self.ops.server.bodies(messages).split() if messages else []
        return [{
            "id": m.id,
            "seq": m.seq,
            "message_id": m.message_id,
            "headers": dict(m.headers or {}),
            "priority": m.priority,
            "timestamp_ms": m.timestamp_ms,
            "expires_ms": m.expires_ms,
            "deliver_at_ms": m.deliver_at_ms,
            "delivery_count": m.delivery_count,
            "persistent": m.persistent,
            "size": m.size,
            "state": "scheduled" if m.deliver_at_ms else "ready",
            "body": body,
        } for m, body in zip(messages, bodies, strict=True)]

    def move(self, rid: int, source: str, target: str | None, limit: int, now: int) -> Any:
        """Move visible messages of ``source`` to ``target`` (default: the one queue
        whose dead-letter or expiry queue ``source`` is): a DLQ's re-drive. An admin
        action."""
        self.ops.require_admin(self, "move", source)
        if target is not None:
            self.authorize(SEND, target, "move")
        return self.core.queue_move(self.id, rid, source, target, limit, now)

    def connections(self) -> list[dict[str, Any]]:
        """Every connection (:meth:`Operations.connections`): an admin action on the
        broker."""
        self.ops.require_admin(self, "list_connections", "")
        return self.ops.connections()

    def xa_heuristic(self, rid: int, xid: Any, commit: bool, now: int) -> Any:
        """Complete a prepared XA branch by hand (an admin action)."""
        self.ops.require_admin(self, "xa_heuristic", str(xid))
        return self.core.xa_heuristic(self.id, rid, xid, commit, now)

    def xa_forget(self, rid: int, xid: Any, now: int) -> Any:
        """Forget a heuristically completed branch (an admin action)."""
        self.ops.require_admin(self, "xa_forget", str(xid))
        return self.core.xa_forget(self.id, rid, xid, now)

    def ensure_topic(self, rid: int, name: str, now: int, action: str) -> Any:
        """Create topic ``name`` on first use by a send or a subscription (STOMP):
        allowed by ``action`` (send, consume) on it, not by ``admin``."""
        self.authorize(action, name, "declare_topic")
        return self.core.queue_declare(self.id, rid, name, now, kind="topic")

    def delete_subscription(self, rid: int, queue: str, now: int) -> Any:
        """Delete a topic subscription queue ``topic::name`` its subscriber ends
        (STOMP UNSUBSCRIBE): allowed by ``consume`` on the topic."""
        self.authorize(CONSUME, destination_of(queue), "unsubscribe")
        return self.core.queue_delete(self.id, rid, queue, now)

    def stats(self) -> dict[str, Any]:
        """The server's counters."""
        return self.ops.server.stats()


def _check_tags(tags: Sequence[object]) -> None:
    """Tags must be integers; a tag named twice is, the second time, not an unacked
    delivery any more. (``object``, not ``int``: compiled by mypyc, a loop over a
    ``Sequence[int]`` raises TypeError at a non-int item before this check runs.)"""
    if len(tags) == 1:
        if type(tags[0]) is not int:
            raise BadRequest("delivery tags must be integers")
        return
    seen: set[object] = set()
    for tag in tags:
        if type(tag) is not int:
            raise BadRequest("delivery tags must be integers")
        if tag in seen:
            raise unknown_delivery(tag)
        seen.add(tag)
