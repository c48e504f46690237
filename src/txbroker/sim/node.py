"""A simulated broker node: the real ``txbroker.core.Broker`` over a simulated disk and
simulated connections.

Theory of operation
-------------------
The node is the edge of the core, as ``server/app.py`` is in production, with every
I/O replaced by events of the :class:`~txbroker.sim.world.World`:

- **Disk.** A ``Persist`` effect is *written* at once (its body refs given) and
  *synced* by a group commit that completes after a random virtual delay; only then
  are its ``on_durable`` callbacks run, in log order. A crash keeps the synced
  prefix and nothing else (a torn last write is the same as an unwritten one; bit
  flips are a later slice). A restart replays the synced entries into a fresh
  ``Broker``, finishes recovery and restores the router from its journal, as the
  server does at start (and as ``tests/core/harness.py`` ``crash()`` does).
- **Connections.** An actor's request reaches the core after a random delay, and
  the core's effects (replies, failures, deliveries, router pushes) reach the actor
  after another; each connection is FIFO in both directions (as TCP is), but
  connections are not ordered with one another. A closed connection (its process
  died) still delivers what it had sent, then closes the session (a FIN after the
  data). A node crash kills every connection: what the node had sent still
  arrives (the kernel sends it), then the reset.
- **Failing fsync.** While ``faults`` is on, one sync in ``FAILED_SYNC_ODDS``
  fails: a random prefix of its batch reached the disk anyway, every completion of
  the batch reports the error, the store takes no more writes, and a supervisor
  restarts the broker shortly after.
- **Timers.** The core's ``next_wakeup`` becomes a ``tick`` event.

Planted bugs (``txbroker/sim/plants.py``) act here, by perturbing what the real
code's edge does, never the core: ``early_ops`` answers a request whose reply the
core holds back until its record is durable at once, as a broken edge would;
``lying_fsync`` makes a crash lose the last synced entry too; ``strip_redelivered``
delivers without the redelivered flag.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from txbroker.core import LATER, Broker, Limits
from txbroker.core.effects import Continue, Deliver, Fail, Notify, Persist, Release, Reply
from txbroker.core.records import StoredEntry
from txbroker.errors import BrokerError
from txbroker.sim.world import World

#: Network delay of one message between an actor and the broker (ms, uniform).
NET_DELAY_MS = (0, 8)
#: An fsync's duration (ms, uniform); one in ``SLOW_SYNC_ODDS`` takes up to
#: ``SLOW_SYNC_MS`` (a slow disk).
SYNC_MS = (1, 10)
SLOW_SYNC_MS = 120
SLOW_SYNC_ODDS = 10
#: One fsync in this many fails while faults are on (``BrokerNode.faults``); the
#: broker then takes no more writes and is restarted ``SUPERVISOR_MS`` later.
FAILED_SYNC_ODDS = 150
SUPERVISOR_MS = (5, 30)

#: What a request does on the core: ``command(broker, session_id, rid, now)``.
Command = Callable[[Broker, int, int, int], Any]


@dataclass(frozen=True, slots=True)
class Delivered:
    """A message delivered to an actor (a ``Deliver`` effect with its body read)."""

    sub: int
    rid: int
    tag: int
    message_id: int
    queue: str
    body: bytes
    redelivered: bool


class Endpoint(Protocol):
    """What a connection tells the actor that owns it."""

    def answered(self, conn: Connection, rid: int, result: Any) -> None:
        """Request ``rid`` succeeded with ``result``."""

    def failed(self, conn: Connection, rid: int, error: BrokerError) -> None:
        """Request ``rid`` failed."""

    def pushed(self, conn: Connection, item: Delivered | dict[str, Any]) -> None:
        """A subscription's delivery or a router push arrived."""

    def lost(self, conn: Connection) -> None:
        """The connection died with the broker."""


@dataclass
class SimDisk:
    """A node's disk: what was synced survives a crash; what was only written does not."""

    synced: list[StoredEntry] = field(default_factory=list)
    written: list[tuple[Persist, StoredEntry]] = field(default_factory=list)
    bodies: dict[int, bytes] = field(default_factory=dict)
    next_ref: int = 1
    syncing: bool = False

    def write(self, effect: Persist) -> StoredEntry:
        """Append a record (not yet durable); its bodies get refs at once."""
        refs = []
        for body in effect.bodies:
            self.bodies[self.next_ref] = body
            refs.append(self.next_ref)
            self.next_ref += 1
        entry = StoredEntry(effect.kind, effect.meta, tuple(refs))
        self.written.append((effect, entry))
        return entry

    def crash(self) -> None:
        """Forget every unsynced write."""
        self.written.clear()
        self.syncing = False


class Connection:
    """One actor's connection (and session) to one incarnation of a node."""

    def __init__(self, node: BrokerNode, session_id: int, owner: Endpoint) -> None:
        self.node = node
        self.session_id = session_id
        self.owner = owner
        self.incarnation = node.incarnation
        self.alive = True
        self.closing = False
        self._next_rid = 1
        self._up_at = node.world.now
        self._down_at = node.world.now

    def _arrival(self, up: bool) -> int:
        world = self.node.world
        when = world.now + world.delay(*NET_DELAY_MS)
        if up:
            when = self._up_at = max(when, self._up_at)
        else:
            when = self._down_at = max(when, self._down_at)
        return when

    def request(self, op: str, command: Command) -> int:
        """Send a request; its answer comes to the owner's ``answered``/``failed``."""
        rid = self._next_rid
        self._next_rid += 1
        if self.alive and not self.closing:
            self.node.world.at(self._arrival(True),
                               lambda: self.node.handle(self, op, rid, command))
        return rid

    def close(self, noticed_after_ms: int = 0) -> None:
        """The owner is done with the connection (its process died, or it saw the
        connection break): what it sent still arrives, then the session ends — at least
        ``noticed_after_ms`` later (a broker notices a half-open connection late, by
        its heartbeat)."""
        if not self.alive or self.closing:
            return
        self.closing = True
        when = max(self._arrival(True), self.node.world.now + noticed_after_ms)
        self.node.world.at(when, lambda: self.node.hang_up(self))

    def down(self, action: Callable[[], None]) -> None:
        """Deliver something to the owner after the network's delay (FIFO)."""
        self.node.world.at(self._arrival(False),
                           lambda: None if self.closing else action())


class BrokerNode:
    """The real core behind a simulated disk and network (see the module docstring)."""

    def __init__(self, world: World, name: str = "broker", *,
                 early_ops: frozenset[str] = frozenset(), lying_fsync: bool = False,
                 strip_redelivered: bool = False, limits: Limits | None = None) -> None:
        self.world = world
        self.name = name
        #: planted: requests answered before their record is durable
        self.early_ops = early_ops
        #: planted: a crash also loses the last synced entry (fsync said done, was not)
        self.lying_fsync = lying_fsync
        #: planted: deliveries go out without their redelivered flag
        self.strip_redelivered = strip_redelivered
        self.limits = limits or Limits()
        self.disk = SimDisk()
        self.broker = Broker(self.limits)
        #: failing fsyncs happen while this is on (the scenarios turn it off to heal)
        self.faults = False
        self.store_failed = False
        #: errors the core raised from commands that must not fail (for the report)
        self.core_errors: list[str] = []
        self.up = False
        self.incarnation = 0
        self.conns: dict[int, Connection] = {}
        self._next_session = 1
        self._early: set[tuple[int, int]] = set()
        self._tick_at: int | None = None

    # -- life cycle -----------------------------------------------------------
    def start(self) -> None:
        """Start (or restart) from what the disk synced."""
        if self.up:
            raise RuntimeError(f"{self.name} is already up")
        now = self.world.now
        self.incarnation += 1
        broker = self.broker = Broker(self.limits)
        bodies = self.disk.bodies
        broker.body_size_of = lambda ref: len(bodies[ref])
        for entry in self.disk.synced:
            broker.replay(entry)
        broker.finish_recovery(now)
        problems = broker.restore_router(
            lambda m: None if m.ref is None else bodies[m.ref], now)
        if problems:
            raise AssertionError(f"router restore: {problems}")
        self.up = True
        self.store_failed = False
        self._tick_at = None
        self.world.log(f"{self.name} start #{self.incarnation} entries={len(self.disk.synced)}")
        self.drain()

    def crash(self, restart_after_ms: int | None = None) -> None:
        """Die: unsynced writes are lost, every connection breaks; with
        ``restart_after_ms``, start again that much later."""
        if not self.up:
            return
        if restart_after_ms is not None:
            incarnation = self.incarnation + 1  # the one this crash begins
            self.world.schedule(restart_after_ms, lambda: self._restart(incarnation))
        self.world.log(f"{self.name} crash unsynced={len(self.disk.written)}")
        self.up = False
        self.disk.crash()
        if self.lying_fsync and self.disk.synced:
            self.disk.synced.pop()
        self.incarnation += 1
        conns, self.conns = list(self.conns.values()), {}
        for conn in conns:  # what the dead node had sent still arrives, then the reset
            conn.alive = False
            conn.down(lambda conn=conn: conn.owner.lost(conn))  # type: ignore[misc]

    def _restart(self, incarnation: int) -> None:
        if not self.up and self.incarnation == incarnation:
            self.start()

    def crash_now_and_then(self, mean_gap_ms: int, restart_ms: tuple[int, int],
                           until_ms: int) -> None:
        """Crash at random moments (exponential gaps) until ``until_ms``, restarting
        after ``restart_ms`` each time."""
        world = self.world

        def crash() -> None:
            if world.now >= until_ms:
                return
            self.crash(world.delay(*restart_ms))
            world.schedule(int(world.rng.expovariate(1 / mean_gap_ms)), crash)

        world.schedule(int(world.rng.expovariate(1 / mean_gap_ms)), crash)

    def connect(self, owner: Endpoint) -> Connection | None:
        """A new connection and session (None while the node is down)."""
        if not self.up:
            return None
        session_id = self._next_session
        self._next_session += 1
        self.broker.open_session(session_id)
        conn = Connection(self, session_id, owner)
        self.conns[session_id] = conn
        return conn

    # -- requests -------------------------------------------------------------
    def handle(self, conn: Connection, op: str, rid: int, command: Command) -> None:
        """A request arrived: run it on the core, answer now or when the core does."""
        if not self.up or conn.incarnation != self.incarnation or not conn.alive:
            return
        now = self.world.now
        self.broker.set_now(now)
        try:
            result = command(self.broker, conn.session_id, rid, now)
        except BrokerError as error:
            failure = error  # ``error`` is unbound after the except block
            self.world.log(f"s{conn.session_id} {op}#{rid} -> {type(error).__name__}")
            conn.down(lambda: conn.owner.failed(conn, rid, failure))
        else:
            if result is not LATER:
                conn.down(lambda: conn.owner.answered(conn, rid, result))
            elif op in self.early_ops:  # planted: answered before it is durable
                self._early.add((conn.session_id, rid))
                conn.down(lambda: conn.owner.answered(conn, rid, {"early": True}))
        self.drain()

    def hang_up(self, conn: Connection) -> None:
        """The connection's FIN arrived: the session ends."""
        if not self.up or conn.incarnation != self.incarnation:
            return
        conn.alive = False
        self.conns.pop(conn.session_id, None)
        self.world.log(f"s{conn.session_id} closed")
        try:
            self.broker.close_session(conn.session_id, self.world.now)
        except BrokerError as error:  # a command that should not fail did (reported)
            self.core_errors.append(f"close_session: {type(error).__name__}: {error}")
            self.world.log(f"CORE-ERROR close_session s{conn.session_id}: "
                           f"{type(error).__name__}")
        self.drain()

    # -- effects --------------------------------------------------------------
    def drain(self) -> None:
        """Carry out the core's effects."""
        if not self.up:
            return
        for effect in self.broker.take_effects():
            if isinstance(effect, Persist):
                entry = self.disk.write(effect)
                if effect.on_refs is not None:
                    effect.on_refs(list(entry.refs))
            elif isinstance(effect, Reply | Fail):
                self._answer(effect)
            elif isinstance(effect, Deliver | Notify):
                self._push(effect)
            elif isinstance(effect, Continue):
                incarnation = self.incarnation
                self.world.schedule(0, lambda e=effect, i=incarnation: self._continue(e, i))  # type: ignore[misc]
            elif isinstance(effect, Release):
                pass  # bodies stay readable: a replay may still name them
        if self.disk.written and not self.disk.syncing:
            self._start_sync()
        self._arm_tick()

    def _answer(self, effect: Reply | Fail) -> None:
        conn = self.conns.get(effect.session)
        if conn is None:
            return
        if (effect.session, effect.rid) in self._early:
            self._early.discard((effect.session, effect.rid))
            return
        if isinstance(effect, Reply):
            result = effect.result
            conn.down(lambda: conn.owner.answered(conn, effect.rid, result))
        else:
            error = effect.error
            conn.down(lambda: conn.owner.failed(conn, effect.rid, error))

    def _push(self, effect: Deliver | Notify) -> None:
        conn = self.conns.get(effect.session)
        if conn is None:
            return
        if isinstance(effect, Notify):
            body = dict(effect.body)
            conn.down(lambda: conn.owner.pushed(conn, body))
            return
        m = effect.message
        body_bytes = m.body if m.body is not None else self.disk.bodies[m.ref]  # type: ignore[index]
        item = Delivered(effect.sub, effect.rid, effect.tag, m.id, m.queue, body_bytes,
                         effect.redelivered and not self.strip_redelivered)
        if effect.rid:
            conn.down(lambda: conn.owner.answered(conn, effect.rid, item))
        else:
            conn.down(lambda: conn.owner.pushed(conn, item))

    def _continue(self, effect: Continue, incarnation: int) -> None:
        if self.up and incarnation == self.incarnation:
            effect.step(self.world.now)
            self.drain()

    # -- the disk's group commit ------------------------------------------------
    def _start_sync(self) -> None:
        if self.store_failed:
            return  # a failed store writes nothing more
        self.disk.syncing = True
        batch = len(self.disk.written)
        world = self.world
        if world.rng.randrange(SLOW_SYNC_ODDS) == 0:
            took = world.delay(SYNC_MS[1], SLOW_SYNC_MS)
        else:
            took = world.delay(*SYNC_MS)
        incarnation = self.incarnation
        world.schedule(took, lambda: self._synced(batch, incarnation))

    def _synced(self, batch: int, incarnation: int) -> None:
        if not self.up or incarnation != self.incarnation:
            return
        done, self.disk.written = self.disk.written[:batch], self.disk.written[batch:]
        self.disk.syncing = False
        self.broker.set_now(self.world.now)
        if self.faults and self.world.rng.randrange(FAILED_SYNC_ODDS) == 0:
            self._sync_failed(done)
            return
        self.disk.synced.extend(entry for _, entry in done)
        self.world.log(f"{self.name} synced {batch}")
        for effect, _ in done:
            effect.on_durable(None)
        self.drain()

    def _sync_failed(self, done: list[tuple[Persist, StoredEntry]]) -> None:
        """The fsync failed: some of the batch may be on disk anyway (a prefix); every
        entry's completion reports the failure; the store takes no more writes, and a
        supervisor restarts the broker."""
        kept = self.world.rng.randint(0, len(done))
        self.disk.synced.extend(entry for _, entry in done[:kept])
        self.store_failed = True
        self.world.log(f"{self.name} fsync failed, {kept} of {len(done)} on disk")
        error = OSError(errno.EIO, "simulated fsync failure")
        for effect, _ in done:
            effect.on_durable(error)
        self.drain()
        self.world.schedule(self.world.delay(*SUPERVISOR_MS),
                            lambda: self.crash(self.world.delay(*SUPERVISOR_MS)))

    # -- timers ---------------------------------------------------------------
    def _arm_tick(self) -> None:
        wakeup = self.broker.next_wakeup()
        if wakeup is None or (self._tick_at is not None and self._tick_at <= wakeup):
            return
        self._tick_at = wakeup
        incarnation = self.incarnation
        self.world.at(wakeup, lambda: self._tick(wakeup, incarnation))

    def _tick(self, wakeup: int, incarnation: int) -> None:
        if not self.up or incarnation != self.incarnation or self._tick_at != wakeup:
            return
        self._tick_at = None
        self.broker.tick(self.world.now)
        self.drain()
