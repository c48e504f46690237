"""The native protocol's ops for offset reading, batched sends and the Spark sink
(core/streams.py; docs/protocol.md lists their arguments and replies).

Handlers like those of ``handlers.py`` (which holds the one table of ops).
"""

from __future__ import annotations

from typing import Any

from txbroker.server.edges.native.args import arg, int_arg, list_arg
from txbroker.server.ops import Session
from txbroker.server.security.acl import BROWSE, CONSUME, SEND


def send_batch(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Send many bodies to one destination in one request."""
    dest = arg(args, "dest", str)
    bodies = arg(args, "bodies", list)
    session.authorize(SEND, dest, "send_batch")
    return session.core.send_batch(
        session.id, rid, dest, bodies, now,
        headers=list_arg(args, "headers", dict, len(bodies)),
        message_ids=list_arg(args, "message_ids", str, len(bodies)),
        persistent=arg(args, "persistent", bool, True))


def stream_open(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Attach as a queue's exclusive stream reader."""
    queue = arg(args, "queue", str)
    session.authorize(CONSUME, queue, "stream_open")
    return session.core.stream_open(session.id, queue, arg(args, "name", str))


def stream_info(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """A queue's stream offsets, without attaching."""
    queue = arg(args, "queue", str)
    session.authorize(BROWSE, queue, "stream_info")
    return session.core.stream_info(session.id, queue)


def stream_read(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Messages of a seq range, not consumed (the edge encodes the page)."""
    queue = arg(args, "queue", str)
    session.authorize(BROWSE, queue, "stream_read")
    return session.core.stream_read(
        session.id, queue, int_arg(args, "start"), int_arg(args, "end"),
        name=arg(args, "name", str, None), max_count=int_arg(args, "max", None),
        max_bytes=int_arg(args, "max_bytes", None))


def stream_commit(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Consume everything below a seq."""
    queue = arg(args, "queue", str)
    session.authorize(CONSUME, queue, "stream_commit")
    return session.core.stream_commit(session.id, rid, queue,
                                      arg(args, "name", str), int_arg(args, "end"))


def stream_close(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Detach a stream reader."""
    return session.core.stream_close(session.id, arg(args, "queue", str),
                                     arg(args, "name", str))


def sink_status(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """A sink's last committed batch id."""
    return session.core.sink_status(session.id, arg(args, "sink", str))


def sink_commit(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Commit a sink batch's prepared branches in one record."""
    return session.core.sink_commit(session.id, rid, arg(args, "sink", str),
                                    int_arg(args, "batch"), arg(args, "xids", list), now)


def sink_abort(session: Session, rid: int, args: dict[str, Any], now: int) -> Any:
    """Roll back a sink batch unless it is committed."""
    return session.core.sink_abort(session.id, rid, arg(args, "sink", str),
                                   int_arg(args, "batch"), now)
