"""Effects: what the pure broker core asks its edge to do.

The core never writes, sends or waits. Each command leaves a list of effects
that the server (the edge) carries out in order: append records to the
store, reply to a request, push a delivery, release a body. Callbacks inside
:class:`Persist` are plain functions of the core; the edge calls them when
the store reports the record durable (or failed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from txbroker.core.messages import Message
from txbroker.errors import BrokerError


#: The effects are made once per message or record: each class writes its own
#: ``__init__`` (``init=False``). A dataclass-generated ``__init__`` stays
#: interpreted Python under mypyc (dataclasses builds it with ``exec``), about 0.1 µs
#: more per object than a compiled one; ``tests/test_hot_classes.py`` keeps it so.
@dataclass(slots=True, init=False)
class Persist:
    """Append one record; call ``on_refs`` with the body refs at once and
    ``on_durable`` once it is on disk (``None``) or failed (the error)."""

    kind: int
    meta: bytes
    bodies: list[bytes]
    on_durable: Callable[[BaseException | None], None]
    on_refs: Callable[[list[int]], None] | None = None

    def __init__(self, kind: int, meta: bytes, bodies: list[bytes],
                 on_durable: Callable[[BaseException | None], None],
                 on_refs: Callable[[list[int]], None] | None = None) -> None:
        self.kind = kind
        self.meta = meta
        self.bodies = bodies
        self.on_durable = on_durable
        self.on_refs = on_refs


@dataclass(slots=True, init=False)
class Reply:
    """Answer request ``rid`` of ``session`` with ``result``."""

    session: int
    rid: int
    result: Any

    def __init__(self, session: int, rid: int, result: Any) -> None:
        self.session = session
        self.rid = rid
        self.result = result


@dataclass(slots=True, init=False)
class Fail:
    """Answer request ``rid`` of ``session`` with an error."""

    session: int
    rid: int
    error: BrokerError

    def __init__(self, session: int, rid: int, error: BrokerError) -> None:
        self.session = session
        self.rid = rid
        self.error = error


@dataclass(slots=True, init=False)
class Deliver:
    """Push ``message`` to a subscription (``sub``), or answer a ``receive``
    (``rid`` != 0) with it. The edge reads the body if it is not in memory."""

    session: int
    sub: int
    rid: int
    tag: int
    message: Message
    redelivered: bool

    def __init__(self, session: int, sub: int, rid: int, tag: int, message: Message,
                 redelivered: bool) -> None:
        self.session = session
        self.sub = sub
        self.rid = rid
        self.tag = tag
        self.message = message
        self.redelivered = redelivered


@dataclass(slots=True, init=False)
class Cancelled:
    """A subscription ended on the broker's side (its queue was deleted)."""

    session: int
    sub: int
    reason: str

    def __init__(self, session: int, sub: int, reason: str) -> None:
        self.session = session
        self.sub = sub
        self.reason = reason


@dataclass(slots=True, init=False)
class Notify:
    """Push ``body`` (a map) to ``session`` as the event ``event`` — the transaction
    router's messages, outcomes and broadcast events (``core/router/engine.py``)."""

    session: int
    event: str
    body: dict[str, Any]

    def __init__(self, session: int, event: str, body: dict[str, Any]) -> None:
        self.session = session
        self.event = event
        self.body = body


@dataclass(slots=True, init=False)
class Release:
    """The body behind ``ref`` is dead; the store may reclaim its space."""

    ref: int

    def __init__(self, ref: int) -> None:
        self.ref = ref


@dataclass(slots=True, init=False)
class Continue:
    """Long work (purging or deleting a huge queue) goes on in a later loop turn,
    so that other clients are served in between: the edge calls ``step(now)``
    soon, then drains the effects as after any command. A step that has more to
    do emits another ``Continue``."""

    step: Callable[[int], None]

    def __init__(self, step: Callable[[int], None]) -> None:
        self.step = step


Effect = Persist | Reply | Fail | Deliver | Cancelled | Notify | Release | Continue
