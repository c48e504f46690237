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
* **Authentication** (:meth:`Session.authenticate`, ``server/security/auth.py``): a
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
* **Permissions** (:meth:`Operations.authorize`, ``server/security/acl.py``): every
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
from collections.abc import Callable
from typing import Any, Final

from txbroker.core import Broker
from txbroker.core.effects import Cancelled, Deliver, Fail, Notify, Reply
from txbroker.core.router.log import is_reserved, reserved_refusal
from txbroker.errors import (
    AuthenticationFailed,
    Forbidden,
    NotAuthenticated,
    NotFound,
    TooManyConnections,
)
from txbroker.server.config import ServerConfig
from txbroker.server.ops.seams import ServerPort, SessionSink
from txbroker.server.ops.session import Session
from txbroker.server.ops.values import Delivery
from txbroker.server.security.acl import (
    ADMIN,
    AccessControl,
    AuditLog,
)
from txbroker.server.security.auth import Authenticator

log = logging.getLogger("txbroker.server")

#: The refusal of a connection over ``max_connections``.
TOO_MANY_CONNECTIONS: Final = "too many connections (max_connections)"
#: Admin actions that act on the broker, not on one destination: they need
#: ``admin`` on the pattern ``#`` (``server/security/acl.py``).
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


class Operations:
    """The operation layer of one server: its sessions and the effects routed to them."""

    def __init__(self, server: ServerPort, auth: Authenticator) -> None:
        self.server = server
        self.auth = auth
        self.sessions: dict[int, Session] = {}  #: session id -> session (admitted)
        #: sessions with output to flush, in the order they got it (a dict: a set of
        #: objects iterates in an order of memory addresses, and the simulator replays
        #: a run only if the flushes come in the same order)
        self._touched: dict[Session, None] = {}
        self._next_session = 1
        #: called before replies are written (``flush``; an etcd primary's lease check)
        self.answer_guard: Callable[[], None] | None = None
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
        with ``$router`` are the transaction router's journal: nobody may name them (the
        core refuses them too, with the same error; here the refusal is audited)."""
        if destination is not None and is_reserved(destination):
            self.audit.record(user=session.user, address=session.address,
                              protocol=session.protocol, action=action, op=op,
                              destination=destination, outcome="denied")
            raise reserved_refusal(destination, op)
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
        session's subscriptions, unacked deliveries and open transactions; for a
        protocol with channels (AMQP) its channels (else ``channels`` is None)."""
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
                "channels": session.channels() if session.channels is not None else None,
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
            self._touched[session] = None

    def fail(self, effect: Fail) -> None:
        """A request the core answered later was refused."""
        session = self.sessions.get(effect.session)
        if session is not None:
            session.answered(effect.rid)
            session.sink.refuse(effect.rid, effect.error)
            self._touched[session] = None

    def deliver(self, effect: Deliver) -> None:
        """A message for a subscription, or the answer to a ``receive``."""
        session = self.sessions.get(effect.session)
        if session is None:
            return
        delivery = Delivery(effect.message, self.server.body(effect.message), effect.tag,
                            effect.sub, effect.rid, effect.redelivered)
        session.delivered(delivery)
        self._touched[session] = None

    def cancelled(self, effect: Cancelled) -> None:
        """A subscription ended on the broker's side."""
        session = self.sessions.get(effect.session)
        if session is not None:
            session.forget_subscription(effect.sub)
            session.sink.cancelled(effect.sub, effect.reason)
            self._touched[session] = None

    def hold_input(self, held: bool) -> None:
        """Stop (or go on) reading every client connection: replication takes a dump
        while nothing new comes in (``server/ha/joining.py``)."""
        for session in self.sessions.values():
            session.sink.hold_input(held)

    def abort_all(self) -> None:
        """Cut every client connection at once, nothing more written (a fenced primary
        of ``--ha replicated``: it must not answer anybody again)."""
        for session in list(self.sessions.values()):
            session.sink.abort()

    def notify(self, effect: Notify) -> None:
        """A push of the transaction router (a message, an outcome, an event)."""
        session = self.sessions.get(effect.session)
        if session is not None:
            session.sink.push(effect.event, effect.body)
            self._touched[session] = None

    def flush(self) -> None:
        """Write to every connection an effect touched (``answer_guard`` first: an etcd
        primary fences here if its lease ran out while the process was stopped)."""
        guard = self.answer_guard
        if guard is not None:
            guard()
        for session in self._touched:
            session.sink.flush()
        self._touched.clear()

    def _ended(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        self._touched.pop(session, None)
        if session.authenticated:
            self.broker.close_session(session.id, self.now())
            self.run_effects()
