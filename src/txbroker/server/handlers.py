"""The native protocol's ops (docs/protocol.md), mapped onto broker commands.

Each handler checks its arguments (a clear ``BadRequest`` naming the field)
and calls the pure core. It returns the reply, or ``LATER`` when the core
answers by an effect once something is durable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from txbroker.core import LATER, Broker
from txbroker.errors import BadRequest

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
     "default_ttl_ms", "redelivery_delay_ms", "ingress", "egress", "dup_window"]
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
}

__all__ = ["HANDLERS", "LATER", "Handler"]
