"""The native ops of the transaction router (``rtr_*``, docs/router.md).

Each handler checks its arguments (a clear ``BadRequest`` naming the field), builds
the router command (``core/router/commands.py``) and hands it to the core's front
(``Broker.rtr``), the router's only door.
Permissions, decided once here for every op (``server/security/acl.py`` patterns): a
client controller needs ``send`` on ``router.<facility>``, a server controller
``consume`` on it; defining a facility, changing a partition, retiring a partition's
secondary site and resolving an exception transaction need ``admin`` on it (audited).
The rest acts on a controller the session registered, so it needs nothing more.
"""

from __future__ import annotations

from typing import Any, Final

from txbroker.core.router.commands import (
    Accept,
    Collected,
    CommitException,
    Define,
    DiscardException,
    Done,
    Exceptions,
    FacilityOf,
    Outcome,
    Register,
    Reject,
    RetireShadow,
    Send,
    SetPartition,
    Show,
    Unregister,
    UserEvent,
    Vote,
)
from txbroker.core.router.model import (
    Role,
    check_size,
    check_tid,
    parse_events,
    parse_recipient,
)
from txbroker.errors import BadRequest
from txbroker.server.edges.native.args import arg, headers_arg, int_arg
from txbroker.server.ops import Session
from txbroker.server.security.acl import CONSUME, SEND

#: The ACL destination a facility's permissions are written for.
ACL_PREFIX: Final = "router."


def _facility_arg(args: dict[str, Any]) -> str:
    return str(arg(args, "facility", str))


def _tid_arg(args: dict[str, Any]) -> str:
    arg(args, "tid", str)
    return check_tid(args["tid"])


def _key_arg(args: dict[str, Any]) -> Any:
    key = args.get("key")
    if type(key) not in (int, str):
        raise BadRequest("argument 'key' must be an int or a string")
    return key


def rtr_register(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Register a client controller on a facility, or a server controller on a partition."""
    facility = _facility_arg(args)
    kind = arg(args, "kind", str, "client")
    if kind not in ("client", "server"):
        raise BadRequest("argument 'kind' must be 'client' or 'server'")
    server = kind == "server"
    role_name = arg(args, "role", str, "primary")
    try:
        role = Role(role_name)
    except ValueError:
        raise BadRequest("argument 'role' must be one of primary, standby, concurrent, "
                         "shadow") from None
    partition = args.get("partition")
    if server and partition is None:
        raise BadRequest("a server controller names its partition (argument 'partition')")
    explicit = arg(args, "explicit_prepare", bool, False)
    recipient = parse_recipient(args.get("recipient"))
    events = parse_events(args.get("events"))
    session.authorize(CONSUME if server else SEND, ACL_PREFIX + facility, "rtr_register")
    return session.core.rtr(session.id, rid, Register(
        facility, server=server, partition=partition, role=role, explicit_prepare=explicit,
        recipient=recipient, events=events), now)


def rtr_unregister(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """End a registration."""
    return session.core.rtr(session.id, rid, Unregister(int_arg(args, "controller")), now)


def rtr_send(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """A client's message (``accept: true``: the client's accept goes with it)."""
    body = args.get("body")
    if type(body) is not bytes:
        raise BadRequest("argument 'body' must be of type bytes")
    # the core refuses it too; checked here first, the size error comes before the
    # other arguments' (as it always did)
    check_size(body, session.core.limits.max_message_size)
    controller, tid, key = int_arg(args, "controller"), _tid_arg(args), _key_arg(args)
    headers, accept = headers_arg(args), arg(args, "accept", bool, False)
    index = int_arg(args, "index", None)
    # with accept: answered once the accept is durable
    return session.core.rtr(session.id, rid, Send(controller, tid, key, body, headers, index,
                                                  accept), now)


def rtr_accept(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """The client accepts its transaction (the outcome comes as a push)."""
    controller, tid = int_arg(args, "controller"), _tid_arg(args)
    return session.core.rtr(session.id, rid, Accept(controller, tid), now)


def rtr_reject(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """The client rejects its transaction."""
    controller, tid = int_arg(args, "controller"), _tid_arg(args)
    reason = arg(args, "reason", str, "CLIENT")
    return session.core.rtr(session.id, rid, Reject(controller, tid, reason), now)


def rtr_ack(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """The client collected outcomes."""
    controller, tids = int_arg(args, "controller"), arg(args, "tids", list)
    return session.core.rtr(session.id, rid, Collected(controller, tids), now)


def rtr_outcome(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """What became of a transaction (a reconnected client asks)."""
    tid, controller = _tid_arg(args), int_arg(args, "controller", None)
    return session.core.rtr(session.id, rid, Outcome(tid, controller), now)


def rtr_vote(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """A server's vote."""
    controller, tid = int_arg(args, "controller"), _tid_arg(args)
    accept, reason = arg(args, "accept", bool), arg(args, "reason", str, "")
    seen = int_arg(args, "seen", None)
    return session.core.rtr(session.id, rid, Vote(controller, tid, accept, reason, seen), now)


def rtr_done(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """A server acknowledges the outcome."""
    controller, tid = int_arg(args, "controller"), _tid_arg(args)
    return session.core.rtr(session.id, rid, Done(controller, tid), now)


def rtr_event(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Broadcast a user event."""
    controller, number = int_arg(args, "controller"), int_arg(args, "number")
    body, recipient = arg(args, "body", bytes, b""), arg(args, "recipient", str, None)
    return session.core.rtr(session.id, rid, UserEvent(controller, number, body, recipient),
                            now)


def rtr_define(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Define a facility and its partitions (admin)."""
    facility, partitions = _facility_arg(args), arg(args, "partitions", list)
    session.ops.require_admin(session, "router_define", ACL_PREFIX + facility)
    return session.core.rtr(session.id, rid, Define(facility, partitions), now)


def rtr_show(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Facilities, partitions, servers and roles, transactions by state."""
    return session.core.rtr(session.id, rid, Show(arg(args, "facility", str, None)), now)


def rtr_set_partition(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Change a partition's retry count or vote timeout (admin)."""
    facility, partition = _facility_arg(args), arg(args, "partition", str)
    retry_count = int_arg(args, "retry_count", None)
    vote_timeout_ms = int_arg(args, "vote_timeout_ms", None)
    session.ops.require_admin(session, "router_set_partition", ACL_PREFIX + facility)
    return session.core.rtr(session.id, rid, SetPartition(facility, partition, retry_count,
                                                          vote_timeout_ms), now)


def rtr_retire_shadow(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Retire a partition's secondary site (admin): it is no longer shadowed, and what
    the router kept for it goes."""
    facility, partition = _facility_arg(args), arg(args, "partition", str)
    session.ops.require_admin(session, "router_retire_shadow", ACL_PREFIX + facility)
    return session.core.rtr(session.id, rid, RetireShadow(facility, partition), now)


def rtr_exceptions(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """The exception transactions."""
    return session.core.rtr(session.id, rid, Exceptions(arg(args, "facility", str, None)),
                            now)


def _exception_facility(session: Session, rid: int, tid: str, now: int) -> str:
    """The ACL destination of an exception transaction's facility (NotFound first for a
    tid the router does not know: there is nothing to permit)."""
    return ACL_PREFIX + str(session.core.rtr(session.id, rid, FacilityOf(tid), now))


def rtr_exception_commit(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Commit an exception transaction by hand (admin)."""
    tid = _tid_arg(args)
    session.ops.require_admin(session, "router_exception_commit",
                              _exception_facility(session, rid, tid, now))
    return session.core.rtr(session.id, rid, CommitException(tid), now)


def rtr_exception_discard(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Discard an exception transaction (admin)."""
    tid = _tid_arg(args)
    session.ops.require_admin(session, "router_exception_discard",
                              _exception_facility(session, rid, tid, now))
    return session.core.rtr(session.id, rid, DiscardException(tid), now)


#: op name -> handler (merged into ``handlers.HANDLERS``).
ROUTER_HANDLERS: Final = {
    "rtr_register": rtr_register,
    "rtr_unregister": rtr_unregister,
    "rtr_send": rtr_send,
    "rtr_accept": rtr_accept,
    "rtr_reject": rtr_reject,
    "rtr_ack": rtr_ack,
    "rtr_outcome": rtr_outcome,
    "rtr_vote": rtr_vote,
    "rtr_done": rtr_done,
    "rtr_event": rtr_event,
    "rtr_define": rtr_define,
    "rtr_show": rtr_show,
    "rtr_set_partition": rtr_set_partition,
    "rtr_retire_shadow": rtr_retire_shadow,
    "rtr_exceptions": rtr_exceptions,
    "rtr_exception_commit": rtr_exception_commit,
    "rtr_exception_discard": rtr_exception_discard,
}

__all__ = ["ACL_PREFIX", "ROUTER_HANDLERS"]
