"""The seams between the server's parts, as small protocol types.

::

    app.BrokerServer ──implements──▶ ServerPort ◀──uses── ops.Operations
          │                                                 │
          │ builds, starts listeners of                     │ routes effects to
          ▼                                                 ▼
    connection.ClientConnection (native) ──implements──▶ SessionSink
    stomp.StompServerConnection (STOMP)  ──implements──▶ SessionSink

``app.py`` imports the edges (``connection.py``, ``stomp.py``) and the
operation layer (``ops.py``); none of them imports ``app.py``: what they need
from the running server is :class:`ServerPort`, and what the server needs from
a connection is :class:`SessionSink` (every edge's connection, HTTP's request sink
and the AMQP edge's internal session implement all of it). A new protocol is one more
:class:`SessionSink` calling the operation layer. (The replication link is not one: it
talks to the hub, ``server/ha/replication.py``, which sees the server as its
``HubPort``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from txbroker.core import Broker
    from txbroker.core.messages import Message
    from txbroker.errors import BrokerError
    from txbroker.server.config import ServerConfig
    from txbroker.server.ops import Delivery
    from txbroker.storage.interface import PackedBodies


class ServerPort(Protocol):
    """What the operation layer and the connections need from the running server."""

    @property
    def config(self) -> ServerConfig:
        """The server's settings (limits, users, ports)."""

    @property
    def broker(self) -> Broker:
        """The pure core, owned by the server's event loop."""

    def now(self) -> int:
        """Wall-clock milliseconds: the only clock the core sees."""

    def run_effects(self) -> None:
        """Carry out what the core asked for; write to the touched connections."""

    def body(self, message: Message) -> bytes:
        """A message's body, held in memory or read from the store."""

    def bodies(self, messages: Sequence[Message]) -> PackedBodies:
        """Several bodies back to back (one store read when they are all stored)."""

    def stats(self) -> dict[str, Any]:
        """The broker's counters, the store's and the server's."""


class SessionSink(Protocol):
    """One client connection of any protocol, as the operation layer sees it.

    Every method only gathers output; :meth:`flush` writes it.
    """

    def answer(self, rid: int, result: Any) -> None:
        """The reply to request ``rid``, which the core answered later."""

    def refuse(self, rid: int, error: BrokerError) -> None:
        """The refusal of request ``rid``, which the core answered later."""

    def deliver(self, delivery: Delivery) -> None:
        """A message for a subscription, or the answer to a ``receive`` (``sub`` 0)."""

    def cancelled(self, sub: int, reason: str) -> None:
        """Subscription ``sub`` ended on the broker's side (its queue was deleted)."""

    def push(self, event: str, data: dict[str, Any]) -> None:
        """An event the client did not ask for (the transaction router's messages);
        a protocol without pushes ignores it."""

    def flush(self) -> None:
        """Write what was gathered since the last flush."""

    def close(self) -> None:
        """Write what is gathered and close the connection (shutdown)."""

    def hold_input(self, held: bool) -> None:
        """Stop (``held``) or go on reading the client's input (replicated HA describes
        its state for a backup's dump while no request comes in); a sink without a
        socket of its own does nothing."""

    def abort(self) -> None:
        """Cut the connection at once, nothing more written (a fenced primary must not
        answer anybody again); a sink without a socket of its own does nothing."""


def hold_reading(transport: asyncio.Transport | None, held: bool) -> None:
    """What a socket edge's :meth:`SessionSink.hold_input` does: pause (``held``) or
    resume reading its transport, unless it is gone or closing."""
    if transport is None or transport.is_closing():
        return
    if held:
        transport.pause_reading()
    else:
        transport.resume_reading()


def abort_transport(transport: asyncio.Transport | None) -> None:
    """What a socket edge's :meth:`SessionSink.abort` does: cut the transport at once."""
    if transport is not None:
        transport.abort()
