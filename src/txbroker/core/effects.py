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


@dataclass(slots=True)
class Persist:
    """Append one record; call ``on_refs`` with the body refs at once and
    ``on_durable`` once it is on disk (``None``) or failed (the error)."""

    kind: int
    meta: bytes
    bodies: list[bytes]
    on_durable: Callable[[BaseException | None], None]
    on_refs: Callable[[list[int]], None] | None = None


@dataclass(slots=True)
class Reply:
    """Answer request ``rid`` of ``session`` with ``result``."""

    session: int
    rid: int
    result: Any


@dataclass(slots=True)
class Fail:
    """Answer request ``rid`` of ``session`` with an error."""

    session: int
    rid: int
    error: BrokerError


@dataclass(slots=True)
class Deliver:
    """Push ``message`` to a subscription (``sub``), or answer a ``receive``
    (``rid`` != 0) with it. The edge reads the body if it is not in memory."""

    session: int
    sub: int
    rid: int
    tag: int
    message: Message
    redelivered: bool


@dataclass(slots=True)
class Cancelled:
    """A subscription ended on the broker's side (its queue was deleted)."""

    session: int
    sub: int
    reason: str


@dataclass(slots=True)
class Notify:
    """Push ``body`` (a map) to ``session`` as the event ``event`` — the transaction
    router's messages, outcomes and broadcast events (``core/router/engine.py``)."""

    session: int
    event: str
    body: dict[str, Any]


@dataclass(slots=True)
class Release:
    """The body behind ``ref`` is dead; the store may reclaim its space."""

    ref: int


@dataclass(slots=True)
class Continue:
    """Long work (purging or deleting a huge queue) goes on in a later loop turn,
    so that other clients are served in between: the edge calls ``step(now)``
    soon, then drains the effects as after any command. A step that has more to
    do emits another ``Continue``."""

    step: Callable[[int], None]


Effect = Persist | Reply | Fail | Deliver | Cancelled | Notify | Release | Continue
