"""The native protocol's ops (docs/protocol.md): the one table, :data:`HANDLERS`.

A handler translates one request's arguments (checked by ``native_args.py``:
a clear ``BadRequest`` naming the field) into an operation of the session
(``ops.Session``) or a core command, and returns the reply, or ``LATER`` when
the core answers by an effect once something is durable. ``hello`` is answered
by the connection (it opens the session); the stream and sink ops live in
``stream_handlers.py`` and are listed here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from txbroker.core import LATER
from txbroker.core.xa import TMENDRSCAN, TMNOFLAGS, TMSTARTRSCAN, TMSUCCESS
from txbroker.errors import XAER_INVAL, BadRequest, XAError
from txbroker.server.edges.native import stream_handlers as streams
from txbroker.server.edges.native.args import (
    arg,
    flags_arg,
    headers_arg,
    int_arg,
    settings_arg,
    tags_arg,
    xid_arg,
)
from txbroker.server.edges.native.router_handlers import ROUTER_HANDLERS
from txbroker.server.ops import Session
from txbroker.server.security.acl import CONSUME

#: ``handler(session, rid, args, now)`` -> the reply, or LATER.
Handler = Callable[[Session, int, dict[str, Any], int], Any]


def send(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Send one message."""
    dest, body = args.get("dest"), args.get("body")
    if type(dest) is not str:
        raise BadRequest("argument 'dest' must be of type str")
    if type(body) is not bytes:
        raise BadRequest("argument 'body' must be of type bytes")
    if len(args) == 2:  # the common case: no options
        return session.send(rid, dest, body, now)
    return session.send(
        rid, dest, body, now,
        headers=headers_arg(args),
        message_id=arg(args, "message_id", str, None),
        persistent=arg(args, "persistent", bool, True),
        priority=int_arg(args, "priority", 4),
        ttl_ms=int_arg(args, "ttl_ms", 0) or 0,
        delay_ms=int_arg(args, "delay_ms", 0) or 0,
        tx=int_arg(args, "tx", None),
    )


def subscribe(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Start a subscription (the client chooses ``sub``)."""
    return session.subscribe(int_arg(args, "sub"), arg(args, "queue", str), now,
                             prefetch=int_arg(args, "prefetch", None),
                             ack=arg(args, "ack", str, "client"))


def unsubscribe(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """End a subscription."""
    return session.unsubscribe(int_arg(args, "sub"), now)


def receive(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Take one message (answered when one arrives or at the timeout)."""
    if rid == 0:
        raise BadRequest("receive needs a request id to answer")
    timeout = int_arg(args, "timeout_ms", None)
    if timeout is not None and timeout < 0:
        raise BadRequest("argument 'timeout_ms' must be >= 0")
    queue = arg(args, "queue", str)
    session.authorize(CONSUME, queue, "receive")
    return session.core.receive(session.id, rid, queue, now, timeout)


def ack(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Acknowledge delivery tags."""
    return session.ack(rid, tags_arg(args), now, tx=int_arg(args, "tx", None))


def ack_by_id(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Acknowledge a message delivered before a failover, by its queue and id."""
    return session.ack_by_id(rid, arg(args, "queue", str), int_arg(args, "id"), now,
                             tx=int_arg(args, "tx", None))


def nack(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Reject delivery tags."""
    return session.nack(tags_arg(args), now, requeue=arg(args, "requeue", bool, True),
                        tx=int_arg(args, "tx", None))


def recover(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Give back every unacked delivery of the connection (JMS ``Session.recover()``)."""
    return session.recover(now)


def tx_begin(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Open a local transaction."""
    return {"tx": session.tx_begin()}


def tx_commit(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Commit a local transaction."""
    return session.tx_commit(rid, int_arg(args, "tx"), now)


def tx_rollback(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Roll back a local transaction."""
    return session.tx_rollback(int_arg(args, "tx"), now)


def queue_declare(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Create a queue or topic."""
    return session.declare(rid, arg(args, "name", str), now,
                           kind=arg(args, "kind", str, "queue"), settings=settings_arg(args))


def queue_update(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Change a queue's settings."""
    return session.update(rid, arg(args, "name", str), settings_arg(args) or {}, now)


def queue_delete(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Delete a queue or topic."""
    return session.delete(rid, arg(args, "name", str), now)


def queue_purge(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Drop a queue's messages."""
    return session.purge(rid, arg(args, "name", str), now)


def queue_browse(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """The first ``limit`` visible messages of a queue, not consumed."""
    return session.browse(arg(args, "name", str), int_arg(args, "limit", 10) or 0)


def queue_move(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Move visible messages to another queue (a DLQ's re-drive)."""
    return session.move(rid, arg(args, "name", str), arg(args, "to", str, None),
                        int_arg(args, "limit", 1000) or 0, now)


def conn_list(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Every connection: protocol, user, address, subscriptions, unacked."""
    return session.connections()


def conn_close(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Close another connection."""
    return session.ops.close_connection(session, int_arg(args, "id"))


def queue_list(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Every queue's info."""
    return session.core.queue_list()


def queue_info(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """One queue's info."""
    return session.core.queue_info(arg(args, "name", str))


def topic_subscribe(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Create (or find) a topic's subscription queue."""
    return session.topic_subscribe(rid, arg(args, "topic", str), arg(args, "name", str), now,
                                   durable=arg(args, "durable", bool, True),
                                   settings=settings_arg(args))


def xa_start(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Start (join, resume) an XA branch."""
    return session.core.xa_start(session.id, xid_arg(args), flags_arg(args, TMNOFLAGS), now)


def xa_end(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """End (suspend, fail) the association with an XA branch."""
    return session.core.xa_end(session.id, xid_arg(args), flags_arg(args, TMSUCCESS), now)


def xa_prepare(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Prepare an XA branch (answered once durable)."""
    return session.core.xa_prepare(session.id, rid, xid_arg(args), now)


def xa_commit(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Commit an XA branch (two-phase, or one-phase)."""
    one_phase = args.get("one_phase", False)
    if type(one_phase) is not bool:
        raise XAError(XAER_INVAL, "argument 'one_phase' must be a boolean")
    return session.core.xa_commit(session.id, rid, xid_arg(args), one_phase, now)


def xa_rollback(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Roll back an XA branch."""
    return session.core.xa_rollback(session.id, rid, xid_arg(args), now)


def xa_recover(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """The prepared and heuristically completed branches."""
    return session.core.xa_recover(session.id, flags_arg(args, TMSTARTRSCAN | TMENDRSCAN))


def xa_forget(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Forget a heuristically completed branch."""
    return session.xa_forget(rid, xid_arg(args), now)


def xa_heuristic(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Complete a prepared branch by hand (the operator's decision)."""
    outcome = args.get("outcome")
    if outcome not in ("commit", "rollback"):
        raise XAError(XAER_INVAL, "argument 'outcome' must be 'commit' or 'rollback'")
    return session.xa_heuristic(rid, xid_arg(args), outcome == "commit", now)


def xa_set_timeout(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Set this session's XA transaction timeout."""
    seconds = args.get("seconds")
    if type(seconds) is not int:
        raise XAError(XAER_INVAL, "argument 'seconds' must be an integer")
    return session.core.xa_set_timeout(session.id, seconds)


def xa_get_timeout(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """This session's XA transaction timeout."""
    return session.core.xa_get_timeout(session.id)


def xa_list(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Every XA branch the broker knows."""
    return session.core.xa_list(now)


def ping(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Nothing: a round trip."""
    return {}


def stats(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """The server's counters."""
    return session.stats()


#: op name -> handler: every op of the native protocol but ``hello``.
HANDLERS: Final[dict[str, Handler]] = {
    "send": send,
    "subscribe": subscribe,
    "unsubscribe": unsubscribe,
    "receive": receive,
    "ack": ack,
    "ack_by_id": ack_by_id,
    "nack": nack,
    "recover": recover,
    "tx_begin": tx_begin,
    "tx_commit": tx_commit,
    "tx_rollback": tx_rollback,
    "queue_declare": queue_declare,
    "queue_update": queue_update,
    "queue_delete": queue_delete,
    "queue_purge": queue_purge,
    "queue_list": queue_list,
    "queue_info": queue_info,
    "queue_browse": queue_browse,
    "queue_move": queue_move,
    "conn_list": conn_list,
    "conn_close": conn_close,
    "topic_subscribe": topic_subscribe,
    "ping": ping,
    "stats": stats,
    "xa_start": xa_start,
    "xa_end": xa_end,
    "xa_prepare": xa_prepare,
    "xa_commit": xa_commit,
    "xa_rollback": xa_rollback,
    "xa_recover": xa_recover,
    "xa_forget": xa_forget,
    "xa_heuristic": xa_heuristic,
    "xa_set_timeout": xa_set_timeout,
    "xa_get_timeout": xa_get_timeout,
    "xa_list": xa_list,
    "send_batch": streams.send_batch,
    "stream_open": streams.stream_open,
    "stream_info": streams.stream_info,
    "stream_read": streams.stream_read,
    "stream_commit": streams.stream_commit,
    "stream_close": streams.stream_close,
    "sink_status": streams.sink_status,
    "sink_commit": streams.sink_commit,
    "sink_abort": streams.sink_abort,
    **ROUTER_HANDLERS,
}

__all__ = ["HANDLERS", "LATER", "Handler"]
