"""The operation layer: every decision about a client and its requests, made once
for every protocol.

Theory of operation
-------------------
A protocol edge (``connection.py`` for the native protocol, ``stomp.py`` for
STOMP) turns its frames into calls on a :class:`Session` and the outcomes into
its frames; it decides nothing about the request itself. What is decided here,
the same for every edge:

* **Listening and admission** (:meth:`Operations.check_listen`,
  :meth:`Operations.open`): a broker without users is open and serves loopback
  only — it refuses to listen on another address, and refuses a peer that is
  not on loopback; beyond ``max_connections`` a connection is refused
  (``TOO_MANY_CONNECTIONS``).
* **Authentication** (:meth:`Session.authenticate`, ``server/auth.py``): a
  wrong user or password is ``AUTHENTICATION_FAILED``, "wrong user or password".
* **Back-pressure** (:meth:`Session.should_pause` / :meth:`Session.should_resume`):
  a session with more than ``max_pending_requests`` requests waiting for the
  core's later answer stops being read until half of them are answered.
* **Acknowledgement ids** (:meth:`Session.ack`, :meth:`Session.nack`,
  :func:`unknown_delivery`): the core owns the delivery table and decides
  whether a delivery tag is an unacked delivery of the session. An ack or nack
  naming one that is not — unknown, already acked, named twice, or a wire id
  that names no tag at all — is refused as a whole with ``ILLEGAL_STATE``,
  "delivery tag <id> is not an unacked delivery of this connection", and
  nothing of it is applied. Cumulative acknowledgement (STOMP's ``ack:client``)
  is expanded here (:meth:`Session.covered`), from the order of the tags handed
  out on such subscriptions: the one thing the core does not keep.
* **Errors**: anything the core raises reaches the edge as a
  :class:`~txbroker.errors.BrokerError` (:func:`as_refusal`).
* **Permissions** (:meth:`Operations.authorize`, ``server/acl.py``): every
  request that names a destination is checked here, before the core sees it,
  as one of ``send``, ``consume``, ``browse``, ``admin`` on that destination
  (the map of requests to actions is in docs/security.md); a refusal is
  ``FORBIDDEN`` and changes nothing. Admin actions (allowed or not) and every
  refusal go to the audit log (``txbroker.audit``).
* **Administration** (every edge that offers it: native ops, HTTP): queue
  changes, purge, delete, browse, move (a DLQ's re-drive), XA heuristics,
  listing and closing connections. Every action that changes or drops
  something another client owns goes through :meth:`Operations.require_admin`:
  ``admin`` on the destination, or on ``#`` for the broker's own (above).

Results the core gives later arrive as effects; the server hands Reply, Fail,
Deliver and Cancelled to :class:`Operations`, which finds the session, keeps
its count of waiting requests and passes a typed :class:`Delivery` (the core's
message and its body) to the connection (``seams.SessionSink``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from txbroker.core import LATER, Broker
from txbroker.core.effects import Cancelled, Deliver, Fail, Notify, Reply
from txbroker.core.messages import Message
from txbroker.core.router_log import RESERVED_PREFIX
from txbroker.errors import (
    AuthenticationFailed,
    BadRequest,
    BrokerError,
    Forbidden,
    IllegalState,
    NotAuthenticated,
    NotFound,
    TooManyConnections,
    TxBrokerError,
)
from txbroker.server.acl import (
    ADMIN,
    BROWSE,
    CONSUME,
    SEND,
    AccessControl,
    AuditLog,
    destination_of,
)
from txbroker.server.auth import Authenticator
from txbroker.server.config import ServerConfig
from txbroker.server.seams import ServerPort, SessionSink

log = logging.getLogger("txbroker.server")

#: The refusal of a connection over ``max_connections``.
TOO_MANY_CONNECTIONS: Final = "too many connections (max_connections)"
#: The refusal of wrong credentials (whatever the protocol calls them).
WRONG_CREDENTIALS: Final = "wrong user or password"
#: Admin actions that act on the broker, not on one destination: they need
#: ``admin`` on the pattern ``#`` (``server/acl.py``).
BROKER_ACTIONS: Final = frozenset({"xa_heuristic", "xa_forget", "close_connection",
                                   "list_connections"})


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (IPv4-mapped ones included)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def unknown_delivery(ack_id: object) -> IllegalState:
    """The refusal of an ack/nack naming ``ack_id`` (as the client wrote it), which is
    not an unacked delivery of the connection: the core's words, so that an id the
    core refuses and one no tag stands for read the same."""
    return IllegalState(f"delivery tag {ack_id} is not an unacked delivery of this connection")


def as_refusal(error: TxBrokerError) -> BrokerError:
    """Any error of a request as the BrokerError its client is told (``INTERNAL``
    for what is not a refusal of the broker)."""
    return error if isinstance(error, BrokerError) else BrokerError(str(error))


@dataclass(slots=True)  # not frozen: a frozen init costs 4x as much, once per delivery
class Delivery:
    """A message handed to a connection: for subscription ``sub``, or the answer
    to ``receive`` request ``rid`` (``sub`` 0). ``tag`` is what acks name. Read-only
    by convention."""

    message: Message
    body: bytes
    tag: int
    sub: int
    rid: int
    redelivered: bool


@dataclass(frozen=True, slots=True)
class GroupsAcked:
    """The outcome of :meth:`Session.ack_groups`: the core's result (``LATER``:
    answered later under the rid), or the first refused group (``refused`` is its
    index, ``error`` why; the groups before it were acknowledged)."""

    result: Any
    refused: int = -1
    error: BrokerError | None = None


class Operations:
    """The operation layer of one server: its sessions and the effects routed to them."""

    def __init__(self, server: ServerPort, auth: Authenticator) -> None:
        self.server = server
        self.auth = auth
        self.sessions: dict[int, Session] = {}  #: session id -> session (admitted)
        self._touched: set[Session] = set()
        self._next_session = 1
        #: the ``[acl]`` rules (everything allowed without them) and the audit log
        self.acl = AccessControl(self.config.acl)
        self.audit = AuditLog(self.config.audit_log)

    @property
    def config(self) -> ServerConfig:
        """The server's settings."""
        return self.server.config

    @property
    def broker(self) -> Broker:
        """The core."""
        return self.server.broker

    def now(self) -> int:
        """The server's clock (ms)."""
        return self.server.now()

    def run_effects(self) -> None:
        """Let the server carry out the core's effects (and flush the sessions)."""
        self.server.run_effects()

    # ------------------------------------------------------------- listening, admission
    def check_listen(self, host: str) -> None:
        """Raise ValueError if no listener may be opened on ``host``: a broker
        without users is open, and serves loopback only."""
        if self.auth.open and not is_loopback(host):
            raise ValueError(f"no users are configured: the broker runs open and only on "
                             f"loopback; refusing to listen on {host}")

    def open(self, sink: SessionSink, peer_host: str | None, *, protocol: str = "native",
             address: str | None = None) -> Session:
        """Admit a new connection (``peer_host``: its address, None if unknown;
        ``address``: host:port for listings) or raise the BrokerError it is refused
        with."""
        if self.auth.open and peer_host is not None and not is_loopback(peer_host):
            log.warning("refused %s: the broker is open (no users) and serves loopback only",
                        peer_host)
            raise AuthenticationFailed("the broker has no users configured and serves "
                                       "loopback clients only")
        if len(self.sessions) >= self.config.max_connections:
            raise TooManyConnections(TOO_MANY_CONNECTIONS)
        session_id = self._next_session
        self._next_session += 1
        session = Session(self, sink, session_id, peer_host or "?")
        session.protocol = protocol
        session.address = address or peer_host or "?"
        session.opened_ms = self.now()
        self.sessions[session_id] = session
        return session

    def open_internal(self, sink: SessionSink, protocol: str) -> Session:
        """A session of the broker's own, for an edge's bookkeeping (the AMQP edge
        stores its exchange definitions through one): no socket, no user, admitted
        and authenticated without credentials; listed among the connections with
        ``protocol``. What it does is the edge's decision, never a client's request."""
        session_id = self._next_session
        self._next_session += 1
        session = Session(self, sink, session_id, "internal")
        session.protocol = protocol
        session.opened_ms = self.now()
        session.authenticated = True
        self.sessions[session_id] = session
        self.broker.open_session(session_id, None)
        return session

    # ------------------------------------------------------------- permissions
    def authorize(self, session: Session, action: str, destination: str | None, *,
                  op: str, resource: str | None = None) -> None:
        """The one permission check of every protocol: raise Forbidden unless the
        session's user may do ``action`` (send, consume, browse, admin) on
        ``destination`` (None: the broker itself). ``op`` names the request for the
        audit log, ``resource`` what it acts on when that is no destination (an xid,
        a connection). Admin actions and refusals are audited. Destinations beginning
        with ``$router`` are the transaction router's journal: nobody may name them."""
        if destination is not None and destination.startswith(RESERVED_PREFIX):
            self.audit.record(user=session.user, address=session.address,
                              protocol=session.protocol, action=action, op=op,
                              destination=destination, outcome="denied")
            raise Forbidden(f"forbidden: {destination!r} is the transaction router's journal; "
                            "clients may not use destinations beginning with "
                            f"{RESERVED_PREFIX!r} ({op})")
        allowed = self.acl.allows(session.user, action, destination)
        if action == ADMIN or not allowed:
            self.audit.record(user=session.user, address=session.address,
                              protocol=session.protocol, action=action, op=op,
                              destination=resource if destination is None else destination,
                              outcome="allowed" if allowed else "denied")
        if not allowed:
            where = "the broker" if destination is None else repr(destination)
            raise Forbidden(f"forbidden: user {session.user!r} has no {action} permission "
                            f"on {where} ({op})")

    def require_admin(self, session: Session, action: str, resource: str) -> None:
        """An administrative ``action`` ("declare", "update", "purge", "delete",
        "move", "xa_heuristic", "xa_forget", "close_connection", …) on ``resource``:
        ``admin`` on that destination, or on the broker for :data:`BROKER_ACTIONS`
        (whose resource is an xid or a connection id)."""
        if not session.authenticated:
            raise NotAuthenticated(f"{action} on {resource!r} needs an authenticated session")
        if action in BROKER_ACTIONS:
            self.authorize(session, ADMIN, None, op=action, resource=resource)
        else:
            self.authorize(session, ADMIN, resource, op=action)

    def connections(self) -> list[dict[str, Any]]:
        """Every admitted connection: protocol, user, address, age and its core
        session's subscriptions, unacked deliveries and open transactions."""
        found = []
        for session in self.sessions.values():
            core = self.broker.sessions.get(session.id) if session.authenticated else None
            found.append({
                "id": session.id,
                "protocol": session.protocol,
                "user": session.user,
                "address": session.address,
                "authenticated": session.authenticated,
                "opened_ms": session.opened_ms,
                "subscriptions": len(core.consumers) if core is not None else 0,
                "unacked": len(core.deliveries) if core is not None else 0,
                "transactions": len(core.transactions) if core is not None else 0,
                "xa_branch": (str(core.xa_xid) if core is not None
                              and core.xa_xid is not None else None),
                "waiting": session.waiting,
            })
        return found

    def close_connection(self, by: Session, session_id: int) -> dict[str, int]:
        """Close connection ``session_id`` (the core rolls back its transactions and
        redelivers its unacked messages, as for any lost connection)."""
        self.require_admin(by, "close_connection", str(session_id))
        target = self.sessions.get(session_id)
        if target is None:
            raise NotFound(f"no connection {session_id}")
        log.warning("connection %d (%s, user %r, %s) closed by %r", session_id,
                    target.protocol, target.user, target.address, by.user)
        target.sink.close()
        target.end()
        self.run_effects()
        return {"closed": session_id}

    def close_all(self) -> None:
        """Shutdown: close every connection."""
        for session in list(self.sessions.values()):
            session.sink.close()
        self.audit.close()

    # ------------------------------------------------------------- effects
    def reply(self, effect: Reply) -> None:
        """A request the core answered later succeeded."""
        session = self.sessions.get(effect.session)
        if session is not None:
            session.answered(effect.rid)
            session.sink.answer(effect.rid, effect.result)
            self._touched.add(session)

    def fail(self, effect: Fail) -> None:
        """A request the core answered later was refused."""
        session = self.sessions.get(effect.session)
        if session is not None:
            session.answered(effect.rid)
            session.sink.refuse(effect.rid, effect.error)
            self._touched.add(session)

    def deliver(self, effect: Deliver) -> None:
        """A message for a subscription, or the answer to a ``receive``."""
        session = self.sessions.get(effect.session)
        if session is None:
            return
        delivery = Delivery(effect.message, self.server.body(effect.message), effect.tag,
                            effect.sub, effect.rid, effect.redelivered)
        session.delivered(delivery)
        self._touched.add(session)

    def cancelled(self, effect: Cancelled) -> None:
        """A subscription ended on the broker's side."""
        session = self.sessions.get(effect.session)
        if session is not None:
            session.forget_subscription(effect.sub)
            session.sink.cancelled(effect.sub, effect.reason)
            self._touched.add(session)

    def hold_input(self, held: bool) -> None:
        """Stop (or go on) reading every client connection: replication takes a dump
        while nothing new comes in (``server/replication.py``)."""
        for session in self.sessions.values():
            transport = getattr(session.sink, "transport", None)
            if transport is None or transport.is_closing():
                continue
            if held:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def abort_all(self) -> None:
        """Cut every client connection at once, nothing more written (a fenced
        primary of ``--ha replicated``: it must not answer anybody again)."""
        for session in list(self.sessions.values()):
            transport = getattr(session.sink, "transport", None)
            if transport is not None:
                transport.abort()

    def notify(self, effect: Notify) -> None:
        """A push of the transaction router (a message, an outcome, an event)."""
        session = self.sessions.get(effect.session)
        if session is not None:
            session.sink.push(effect.event, effect.body)
            self._touched.add(session)

    def flush(self) -> None:
        """Write to every connection an effect touched."""
        for session in self._touched:
            session.sink.flush()
        self._touched.clear()

    def _ended(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        self._touched.discard(session)
        if session.authenticated:
            self.broker.close_session(session.id, self.now())
            self.run_effects()


class Session:
    """One client connection's session, whatever its protocol. See the module docstring.

    The edge calls the core through it for the operations whose decisions are
    shared (authentication, send, subscriptions, acks, transactions); other
    core commands take :attr:`core` and :attr:`id`. Every request's result goes
    through :meth:`started`, which counts those answered later.
    """

    __slots__ = ("_cumulative", "_cumulative_sub", "address", "authenticated", "core", "ended",
                 "id", "opened_ms", "ops", "peer", "protocol", "reading_paused", "sink", "user",
                 "waiting")

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
        if self.ops.acl.enforcing or dest.startswith(RESERVED_PREFIX):
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

    def unsubscribe(self, sub: int, now: int) -> Any:
        """End a subscription; its unacked deliveries go back to the queue."""
        result = self.core.unsubscribe(self.id, sub, now)
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

    def tx_rollback(self, tx: int, now: int) -> Any:
        """Roll back: staged sends dropped, consumed messages redelivered."""
        return self.core.tx_rollback(self.id, tx, now)

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
