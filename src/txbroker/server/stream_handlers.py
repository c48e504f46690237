"""The native protocol's ops for offset reading, batched sends and the Spark sink
(core/streams.py; docs/protocol.md lists their arguments and replies)."""

from __future__ import annotations

from typing import Any

from txbroker.core import Broker
from txbroker.errors import BadRequest
from txbroker.server.handlers import Handler, _get, _int


def _list_of(args: dict[str, Any], name: str, kind: type, length: int) -> Any:
    values = args.get(name)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != length:
        raise BadRequest(f"argument {name!r} must be a list as long as 'bodies'")
    for value in values:
        if value is not None and not isinstance(value, kind):
            raise BadRequest(f"argument {name!r} must hold {kind.__name__} values or nil")
    if kind is dict:
        for value in values:
            if value is not None and not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in value.items()):
                raise BadRequest(f"argument {name!r} must hold maps of strings to strings")
    return values


def send_batch(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    dest = _get(a, "dest", str)
    bodies = _get(a, "bodies", list)
    return b.send_batch(session, rid, dest, bodies, now,
                        headers=_list_of(a, "headers", dict, len(bodies)),
                        message_ids=_list_of(a, "message_ids", str, len(bodies)),
                        persistent=_get(a, "persistent", bool, True))


def stream_open(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.stream_open(session, _get(a, "queue", str), _get(a, "name", str))


def stream_info(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.stream_info(session, _get(a, "queue", str))


def stream_read(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.stream_read(session, _get(a, "queue", str), _int(a, "start"), _int(a, "end"),
                         name=_get(a, "name", str, None), max_count=_int(a, "max", None),
                         max_bytes=_int(a, "max_bytes", None))


def stream_commit(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.stream_commit(session, rid, _get(a, "queue", str), _get(a, "name", str),
                           _int(a, "end"))


def stream_close(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.stream_close(session, _get(a, "queue", str), _get(a, "name", str))


def sink_status(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.sink_status(session, _get(a, "sink", str))


def sink_commit(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.sink_commit(session, rid, _get(a, "sink", str), _int(a, "batch"),
                         _get(a, "xids", list), now)


def sink_abort(b: Broker, session: int, rid: int, a: dict[str, Any], now: int) -> Any:
    return b.sink_abort(session, rid, _get(a, "sink", str), _int(a, "batch"), now)


STREAM_HANDLERS: dict[str, Handler] = {
    "send_batch": send_batch,
    "stream_open": stream_open,
    "stream_info": stream_info,
    "stream_read": stream_read,
    "stream_commit": stream_commit,
    "stream_close": stream_close,
    "sink_status": sink_status,
    "sink_commit": sink_commit,
    "sink_abort": sink_abort,
}
