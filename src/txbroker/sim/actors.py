"""The base of every simulated process that talks to a broker node: connect, call,
reconnect after a crash.

An actor issues requests on its connection and continues in a callback when the
answer arrives (``ok, result``); a lost connection drops every callback (the answer
will never come) and calls :meth:`Actor.on_lost`; the actor then connects again
after a pause, to whatever incarnation of the node is up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from txbroker.errors import BrokerError
from txbroker.sim.node import BrokerNode, Command, Connection, Delivered
from txbroker.sim.world import World

#: Pause before connecting again after a loss, or while the node is down (ms).
RECONNECT_MS = (5, 40)

#: A request's continuation: (succeeded, result or error).
Then = Callable[[bool, Any], None]


class Actor:
    """A process with one connection to ``node`` at a time (see the module docstring)."""

    def __init__(self, world: World, node: BrokerNode, name: str) -> None:
        self.world = world
        self.node = node
        self.name = name
        self.conn: Connection | None = None
        self.stopped = False
        self._waiting: dict[int, Then] = {}

    # -- life cycle -------------------------------------------------------------
    def connect_soon(self) -> None:
        """Connect after a pause."""
        self.world.schedule(self.world.delay(*RECONNECT_MS), self._connect)

    def _connect(self) -> None:
        if self.stopped or self.conn is not None:
            return
        conn = self.node.connect(self)
        if conn is None:
            self.connect_soon()
            return
        self.conn = conn
        self._waiting = {}
        self.world.log(f"{self.name} connected s{conn.session_id}")
        self.on_connected()

    def reset(self, noticed_after_ms: int) -> None:
        """The connection breaks and this side notices first: the actor connects again
        at once, as after a loss; the broker ends the old session
        ``noticed_after_ms`` later (after what was in flight)."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        self._waiting = {}
        self.world.log(f"{self.name} reset s{conn.session_id}")
        conn.close(noticed_after_ms)
        self.on_lost()
        self.connect_soon()

    def die(self) -> None:
        """The process dies: its connection closes (the broker sees it after what was
        sent); its callbacks are dropped."""
        conn, self.conn = self.conn, None
        self._waiting = {}
        if conn is not None:
            self.world.log(f"{self.name} dies")
            conn.close()

    # -- requests ---------------------------------------------------------------
    def call(self, op: str, command: Command, then: Then) -> None:
        """Send a request; ``then`` runs with its answer (never, if the connection dies)."""
        conn = self.conn
        if conn is None:
            return
        rid = conn.request(op, command)
        self._waiting[rid] = then

    def answered(self, conn: Connection, rid: int, result: Any) -> None:
        """Request ``rid`` succeeded."""
        then = self._waiting.pop(rid, None) if conn is self.conn else None
        if then is not None:
            then(True, result)

    def failed(self, conn: Connection, rid: int, error: BrokerError) -> None:
        """Request ``rid`` failed."""
        then = self._waiting.pop(rid, None) if conn is self.conn else None
        if then is not None:
            then(False, error)

    def pushed(self, conn: Connection, item: Delivered | dict[str, Any]) -> None:
        """A push arrived on a connection (only the current one counts)."""
        if conn is self.conn:
            self.on_push(item)

    def lost(self, conn: Connection) -> None:
        """The connection died with the broker."""
        if conn is not self.conn:
            return
        self.conn = None
        self._waiting = {}
        self.world.log(f"{self.name} lost s{conn.session_id}")
        self.on_lost()
        self.connect_soon()

    # -- for subclasses -----------------------------------------------------------
    def on_connected(self) -> None:
        """A new connection is up."""

    def on_lost(self) -> None:
        """The connection died; every request in flight is unanswered."""

    def on_push(self, item: Delivered | dict[str, Any]) -> None:
        """A push arrived."""
