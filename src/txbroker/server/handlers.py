"""The native protocol's ops (docs/protocol.md), mapped onto broker commands.

Each handler checks its arguments (a clear ``BadRequest`` naming the field)
and calls the pure core. It returns the reply, or ``LATER`` when the core
answers by an effect once something is durable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from txbroker.core import LATER, Broker
from txbroker.core.xa import TMENDRSCAN, TMNOFLAGS, TMSTARTRSCAN, TMSUCCESS
from txbroker.errors import XAER_INVAL, BadRequest, XAError

Handler = Callable[[Broker, int, int, dict[str, Any], int], Any]


def _get(args: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...,
         ) -> Any:
    value = args.get(name, default)
    if value is ...:
        raise BadRequest(f"missing argument {name!r}")
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BadRequest(f"argument {name!r} must be of type {names}")
    return value


def _int(args: dict[str, Any], name: str, default: Any = ...) -> Any:
    value = _get(args, name, int, default)
    if isinstance(value, bool):
        raise BadRequest(f"argument {name!r} must be an integer")
    return value


def _headers(args: dict[str, Any]) -> dict[str, str] | None:
    headers = args.get("headers")
    if headers is None:
        return None
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise BadRequest("argument 'headers' must be a map of strings to strings")
    return headers


def _tags(args: dict[str, Any]) -> list[int]:
    tags: list[int] = _get(args, "tags", list)
    if not tags:
        raise BadRequest("argument 'tags' must list at least one delivery tag")
    return tags


_SEND_OPTIONAL = frozenset(["headers", "message_id", "persistent", "priority", "ttl_ms",
                            "delay_ms", "tx"])


def send(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    dest, body = a.get("dest"), a.get("body")
    if type(dest) is not str:
        raise BadRequest("argument 'dest' must be of type str")
    if type(body) is not bytes:
        raise BadRequest("argument 'body' must be of type bytes")
    if len(a) == 2:  # the common case: no options
        return b.send(session, rid, dest, body, now)
    return b.send(
        session, rid, dest, body, now,
        headers=_headers(a),
        message_id=_get(a, "message_id", str, None),
        persistent=_get(a, "persistent", bool, True),
        priority=_int(a, "priority", 4),
        ttl_ms=_int(a, "ttl_ms", 0) or 0,
        delay_ms=_int(a, "delay_ms", 0) or 0,
        tx=_int(a, "tx", None),
    )


def subscribe(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.subscribe(session, _int(a, "sub"), _get(a, "queue", str), now,
                       prefetch=_int(a, "prefetch", None), ack=_get(a, "ack", str, "client"))


def unsubscribe(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.unsubscribe(session, _int(a, "sub"), now)


def receive(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    if rid == 0:
        raise BadRequest("receive needs a request id to answer")
    timeout = _int(a, "timeout_ms", None)
    if timeout is not None and timeout < 0:
        raise BadRequest("argument 'timeout_ms' must be >= 0")
    return b.receive(session, rid, _get(a, "queue", str), now, timeout)


def ack(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.ack(session, rid, _tags(a), now, tx=_int(a, "tx", None))


def nack(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.nack(session, _tags(a), now, requeue=_get(a, "requeue", bool, True),
                  tx=_int(a, "tx", None))


def tx_begin(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.tx_begin(session)


def tx_commit(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.tx_commit(session, rid, _int(a, "tx"), now)


def tx_rollback(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.tx_rollback(session, _int(a, "tx"), now)


_SETTING_KEYS = frozenset(
    ["max_messages", "max_bytes", "max_deliveries", "dead_letter_queue", "expiry_queue",
     "default_ttl_ms", "redelivery_delay_ms", "ingress", "egress", "dup_window",
     "reject_to_sender_on_discard"]
)


def _settings(a: dict[str, Any]) -> dict[str, Any]:
    nested = a.get("settings")
    if nested is not None and not isinstance(nested, dict):
        raise BadRequest("argument 'settings' must be a map")
    found = dict(nested or {})
    found.update({k: v for k, v in a.items() if k in _SETTING_KEYS})
    return found


def queue_declare(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.queue_declare(session, rid, _get(a, "name", str), now,
                           kind=_get(a, "kind", str, "queue"), settings=_settings(a))


def queue_update(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.queue_update(session, rid, _get(a, "name", str), _settings(a), now)


def queue_delete(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.queue_delete(session, rid, _get(a, "name", str), now)


def queue_purge(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.queue_purge(session, rid, _get(a, "name", str), now)


def queue_list(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.queue_list()


def queue_info(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.queue_info(_get(a, "name", str))


def topic_subscribe(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.topic_subscribe(session, rid, _get(a, "topic", str), _get(a, "name", str), now,
                             durable=_get(a, "durable", bool, True), settings=_settings(a))


def _xid(a: dict[str, Any]) -> str:
    xid = a.get("xid")
    if type(xid) is not str:
        raise XAError(XAER_INVAL, "argument 'xid' must be the Xid's text form "
                                  "(FORMATID-GTRIDHEX-BQUALHEX)")
    return xid


def _flags(a: dict[str, Any], default: int) -> int:
    flags = a.get("flags", default)
    if type(flags) is not int:
        raise XAError(XAER_INVAL, "argument 'flags' must be an integer")
    return flags


def xa_start(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_start(session, _xid(a), _flags(a, TMNOFLAGS), now)


def xa_end(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_end(session, _xid(a), _flags(a, TMSUCCESS), now)


def xa_prepare(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_prepare(session, rid, _xid(a), now)


def xa_commit(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    one_phase = a.get("one_phase", False)
    if type(one_phase) is not bool:
        raise XAError(XAER_INVAL, "argument 'one_phase' must be a boolean")
    return b.xa_commit(session, rid, _xid(a), one_phase, now)


def xa_rollback(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_rollback(session, rid, _xid(a), now)


def xa_recover(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_recover(session, _flags(a, TMSTARTRSCAN | TMENDRSCAN))


def xa_forget(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_forget(session, rid, _xid(a), now)


def xa_heuristic(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    outcome = a.get("outcome")
    if outcome not in ("commit", "rollback"):
        raise XAError(XAER_INVAL, "argument 'outcome' must be 'commit' or 'rollback'")
    return b.xa_heuristic(session, rid, _xid(a), outcome == "commit", now)


def xa_set_timeout(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    seconds = a.get("seconds")
    if type(seconds) is not int:
        raise XAError(XAER_INVAL, "argument 'seconds' must be an integer")
    return b.xa_set_timeout(session, seconds)


def xa_get_timeout(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_get_timeout(session)


def xa_list(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.xa_list(now)


def ping(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return {}


#: op name -> handler. ``hello`` and ``stats`` are answered by the connection.
HANDLERS: dict[str, Handler] = {
    "send": send,
    "subscribe": subscribe,
    "unsubscribe": unsubscribe,
    "receive": receive,
    "ack": ack,
    "nack": nack,
    "tx_begin": tx_begin,
    "tx_commit": tx_commit,
    "tx_rollback": tx_rollback,
    "queue_declare": queue_declare,
    "queue_update": queue_update,
    "queue_delete": queue_delete,
    "queue_purge": queue_purge,
    "queue_list": queue_list,
    "queue_info": queue_info,
    "topic_subscribe": topic_subscribe,
    "ping": ping,
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
}


def _stream_handlers() -> None:
    from txbroker.server.stream_handlers import STREAM_HANDLERS

    HANDLERS.update(STREAM_HANDLERS)


_stream_handlers()

__all__ = ["HANDLERS", "LATER", "Handler"]
