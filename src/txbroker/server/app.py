"""The asyncio edge: store, listeners, effect runner, timers, shutdown.

Theory of operation
-------------------
One event loop owns the :class:`~txbroker.core.Broker` (no locks). Each
listener (native protocol, STOMP, and each of them over TLS — all opened by
:meth:`BrokerServer.listen`; a TLS listener runs the handshake first,
``server/security/tls.py``) makes one connection object per client; a connection turns
frames into operations of the operation layer (``server/ops/operations.py``), which calls
the core.
After each batch the server runs the core's effects: records go to the store
(whose single writer thread does group commit and hands completions back to
the loop in one call per batch), replies and deliveries go through the
operation layer to the connections they belong to, bodies the core no longer
needs are released, long work is resumed in a later loop turn. One timer is
kept armed at the core's next wake-up time (delays, receive timeouts, expiry
scans); a periodic task lets the store drop dead segments and asks the core to
relocate live bodies out of a mostly-dead old segment.

This module imports the edges and the operation layer; they see the server
only as ``seams.ServerPort`` (no import circle inside ``server/``).

SIGTERM / SIGINT: stop accepting, let the store flush and sync what is
queued, close the connections, close the segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import ssl
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from txbroker.core import Broker
from txbroker.core.effects import (
    Cancelled,
    Continue,
    Deliver,
    Fail,
    Notify,
    Persist,
    Release,
    Reply,
)
from txbroker.core.messages import Message
from txbroker.errors import StorageFailed
from txbroker.server.config import ServerConfig
from txbroker.server.edges.amqp.connection import AmqpServerConnection, AmqpSettings
from txbroker.server.edges.amqp.state import AmqpState
from txbroker.server.edges.native.connection import ClientConnection
from txbroker.server.edges.stomp.connection import StompServerConnection, StompSettings
from txbroker.server.ops import Operations, is_loopback
from txbroker.server.process import (
    GC_THRESHOLDS,
    GIL_SWITCH_INTERVAL,
    gc_paused,
    release_free_memory,
)
from txbroker.server.recovery import (
    Checkpointer,
    checkpoint_store,
    closing,
    replay_store,
    restore_router,
)
from txbroker.server.security.auth import Authenticator
from txbroker.server.security.tls import tls_factory
from txbroker.server.space import maintain_loop
from txbroker.server.stores import StoreOpener, open_store
from txbroker.storage.interface import (
    PackedBodies,
    Relocation,
    Store,
    StoreStats,
)
from txbroker.storage.store_lock import StoreLock

log = logging.getLogger("txbroker.server")

#: Pending connections the kernel queues on each listener.
LISTEN_BACKLOG = 1024

__all__ = ["BrokerServer", "is_loopback", "run", "serve"]

def wall_clock_ms() -> int:
    """Milliseconds since the epoch, from the system's clock."""
    return time.time_ns() // 1_000_000


class BrokerServer:
    """A running broker: see the module docstring."""

    def __init__(self, config: ServerConfig, stomp_settings: StompSettings | None = None,
                 *, lock: StoreLock | None = None, store_opener: StoreOpener | None = None,
                 broker: Broker | None = None) -> None:
        config.validate()
        if stomp_settings is not None:
            stomp_settings.validate()
        self.config = config
        self.stomp_settings = stomp_settings or StompSettings()
        self.broker = broker or Broker(config.limits)  # a warm standby's: server/ha/warm.py
        #: the operation layer: sessions, admission, and every decision about a request
        self.ops = Operations(self, Authenticator(config.users))
        self.store: Store | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self.stomp_port = 0
        self.amqp_port = 0
        self.amqps_port = 0
        #: the AMQP edge's shared state (exchanges, bindings), once it listens
        self.amqp: AmqpState | None = None
        self.http_port = 0
        #: the HTTP edge (server/edges/http/), when --http-port is set
        self._http: Any = None
        #: the event loop's clock when the store opened (uptime); the loop's clock is
        #: the monotonic one (or the simulator's virtual one)
        self._started = 0.0
        #: the bound ports of the TLS listeners (0: not listening)
        self.tls_port = 0
        self.stomp_tls_port = 0
        self.https_port = 0
        self._listeners: list[asyncio.Server] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None
        self._maintainer: asyncio.Task[None] | None = None
        #: the running broker's recovery checkpoints (``server/recovery.py``)
        self._checkpointer: Checkpointer | None = None
        self._stopping = asyncio.Event()
        self._stopped = False
        self.recovery_seconds = 0.0
        ops = self.ops
        self._runners: dict[type, Callable[[Any], None]] = {
            Persist: self._persist, Deliver: ops.deliver, Reply: ops.reply,
            Fail: ops.fail, Release: self._release, Cancelled: ops.cancelled,
            Continue: self._continue, Notify: ops.notify,
        }
        self.recovered_messages = 0
        #: the store's lock when the HA part took it before the store opened
        self._lock = lock
        #: opens the store (``open_store`` on ``config`` unless one is given)
        self._store_opener = store_opener or functools.partial(open_store, config)
        #: the HA part's status (``stats()["ha"]``), when the broker is one of a pair
        self.ha_status: Callable[[], dict[str, Any]] | None = None
        #: the wall clock, in ms since the epoch; the simulator gives its virtual one
        #: (``txbroker/sim/loop.py``)
        self.clock: Callable[[], int] = wall_clock_ms

    @property
    def auth(self) -> Authenticator:
        """The users' table (open when empty)."""
        return self.ops.auth

    # ------------------------------------------------------------------ time
    def now(self) -> int:
        """Wall-clock milliseconds (:attr:`clock`): the only clock the core ever sees."""
        return self.clock()

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        """Recover the store, then listen."""
        await self.recover()
        await self.open_listeners()

    async def recover(self) -> None:
        """Open the store and rebuild the broker from it (no listener yet), with the
        cyclic GC off (:func:`gc_paused`)."""
        started = asyncio.get_running_loop().time()
        with gc_paused():
            self.open_store()
            self.finish_recovery(started)

    def open_store(self) -> None:
        """Open the store and replay every entry it holds into the core, without
        finishing recovery: a backup of ``--ha replicated`` goes on replaying what its
        primary sends (``server/ha/replica.py``) until it is promoted."""
        self.loop = asyncio.get_running_loop()
        self._started = self.loop.time()
        self.ops.check_listen(self.config.host)  # before a long recovery
        if self.auth.open:
            log.warning("no users configured: the broker is OPEN (no authentication), "
                        "listening on loopback only")
        loop = self.loop

        def dispatch(completions: Callable[[], None]) -> None:
            loop.call_soon_threadsafe(self.complete, completions)

        store = self._store_opener(dispatch, self.broker.snapshot, self._lock)
        replay_store(self, store)
        self.store = store

    def wrap_store(self, wrap: Callable[[Store], Store]) -> None:
        """Put ``wrap(store)`` in the open store's place: the one way the store is
        replaced (replicated HA's primary: ``ReplicationHub.wrap``)."""
        assert self.store is not None, "wrap_store needs an open store"
        self.store = wrap(self.store)
        self.broker.body_size_of = self.store.body_size

    def finish_recovery(self, started: float) -> None:
        """Replay is over: messages go into their queues, the router reads its journal."""
        self.broker.finish_recovery(self.now())
        self.recovered_messages = len(self.broker.messages)
        if self.broker.xa.leftovers_committed:
            log.info("recovery: %d voted local commits had no outcome in the log: committed "
                     "(presumed commit, docs/replication.md)", self.broker.xa.leftovers_committed)
        restore_router(self)
        self.run_effects()
        release_free_memory()  # the replay's garbage (issue 12: memory per message)
        self.recovery_seconds = asyncio.get_running_loop().time() - started
        log.info("recovered %d messages in %d queues in %.2f s", self.recovered_messages,
                 len(self.broker.queues), self.recovery_seconds)

    async def open_listeners(self) -> None:
        """Open the client listeners the config asks for (a port of 0 disables one:
        DESIGN.md, docs/tls.md, docs/amqp.md), the plain ones first; start the timers."""
        config = self.config
        plain = ((config.port, self.listen_native), (config.stomp_port, self.listen_stomp),
                 (config.amqp_port, self.listen_amqp), (config.http_port, self.listen_http))
        secure = ((config.tls_port, self.listen_native),
                  (config.stomp_tls_port, self.listen_stomp),
                  (config.https_port, self.listen_http), (config.amqps_port, self.listen_amqp))
        tls = config.server_ssl_context() if any(port for port, _ in secure) else None
        for port, listen in plain:
            if port:
                await listen(config.host, port)
        for port, listen in secure:
            if port:
                await listen(config.host, port, tls=tls)
        self._maintainer = asyncio.create_task(maintain_loop(self))
        journal = checkpoint_store(self.store)
        if config.checkpoint_interval and journal is not None:
            self._checkpointer = Checkpointer(self, journal, config.checkpoint_interval)
        self._arm_timer()

    async def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`), then shut down."""
        assert self.loop is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self.loop.add_signal_handler(sig, self.request_stop)
        await self._stopping.wait()
        await self.stop()

    def request_stop(self) -> None:
        """Make :meth:`serve_forever` shut down."""
        self._stopping.set()

    # ------------------------------------------------------------------ listeners
    async def listen(self, factory: Callable[[], asyncio.Protocol], host: str, port: int,
                     protocol: str, *, tls: ssl.SSLContext | None = None) -> asyncio.Server:
        """Open a listener (``port`` 0: any free port): the one place every
        protocol's listener is opened, after the operation layer's check. With
        ``tls`` (``ServerConfig.server_ssl_context()``), each connection does the TLS
        handshake first (``server/security/tls.py``; a failed one is a log line)."""
        self.ops.check_listen(host)
        loop = asyncio.get_running_loop()
        if tls is not None:
            protocol = f"{protocol} over TLS"
            factory = tls_factory(factory, tls, protocol)
        listener = await loop.create_server(factory, host, port, reuse_address=True,
                                            backlog=LISTEN_BACKLOG)
        self._listeners.append(listener)
        bound = listener.sockets[0].getsockname()
        log.info("%s on %s:%d", protocol, bound[0], bound[1])
        return listener

    def _bound(self, listener: asyncio.Server, attribute: str) -> None:
        """Record a listener's bound port as ``attribute`` (:attr:`port` …)."""
        setattr(self, attribute, listener.sockets[0].getsockname()[1])

    async def listen_native(self, host: str, port: int, *, tls: ssl.SSLContext | None = None
                            ) -> asyncio.Server:
        """Listen for native-protocol clients; sets :attr:`port` (with ``tls``:
        :attr:`tls_port`, clients use ``txbs://``)."""
        ops = self.ops
        listener = await self.listen(lambda: ClientConnection(ops), host, port,
                                     "native protocol", tls=tls)
        self._bound(listener, "port" if tls is None else "tls_port")
        return listener

    async def listen_stomp(self, host: str, port: int, settings: StompSettings | None = None,
                           *, tls: ssl.SSLContext | None = None) -> asyncio.Server:
        """Listen for STOMP clients (``settings``: the server's by default); sets
        :attr:`stomp_port` (with ``tls``: :attr:`stomp_tls_port`)."""
        if settings is not None:
            settings.validate()
        chosen = settings or self.stomp_settings
        ops = self.ops
        listener = await self.listen(lambda: StompServerConnection(ops, chosen), host, port,
                                     "STOMP", tls=tls)
        self._bound(listener, "stomp_port" if tls is None else "stomp_tls_port")
        return listener

    async def listen_amqp(self, host: str, port: int, settings: AmqpSettings | None = None,
                          *, tls: ssl.SSLContext | None = None) -> asyncio.Server:
        """Listen for AMQP 0-9-1 clients (docs/amqp.md); sets :attr:`amqp_port` (with
        ``tls``: :attr:`amqps_port`, clients use ``amqps://``). The first call loads the
        exchange definitions (``server/edges/amqp/state.py``)."""
        chosen = settings or AmqpSettings()
        chosen.validate()
        if self.amqp is None:
            self.amqp = AmqpState(self.ops)
            self.amqp.load()
        ops, state = self.ops, self.amqp
        listener = await self.listen(lambda: AmqpServerConnection(ops, state, chosen), host,
                                     port, "AMQP 0-9-1", tls=tls)
        self._bound(listener, "amqp_port" if tls is None else "amqps_port")
        return listener

    async def listen_http(self, host: str, port: int, *, tls: ssl.SSLContext | None = None
                          ) -> asyncio.Server:
        """Listen for HTTP (REST API, ``/metrics``, console: ``server/edges/http/``); sets
        :attr:`http_port` (with ``tls``: HTTPS, :attr:`https_port`). Starlette and
        uvicorn are imported only here."""
        from txbroker.server.edges.http import HttpEdge

        if self._http is None:
            self._http = HttpEdge(self)
        listener = await self.listen(self._http.protocol, host, port, "HTTP", tls=tls)
        self._bound(listener, "http_port" if tls is None else "https_port")
        return listener

    def store_stats(self) -> StoreStats | None:
        """The store's counters and histograms (None without an open store)."""
        return self.store.stats() if self.store is not None else None

    async def stop(self) -> None:
        """Graceful shutdown: stop accepting, flush the store, close everything."""
        for listener in self._listeners:
            listener.close()
        if self._http is not None:
            self._http.close()
        if self._maintainer is not None:
            self._maintainer.cancel()
        if self._checkpointer is not None:
            await self._checkpointer.stop()
        if self._timer is not None:
            self._timer.cancel()
        store = self.store
        if store is not None:
            close = await closing(self, store)
            await asyncio.get_running_loop().run_in_executor(None, close)
            await asyncio.sleep(0)  # let the last completions run
            self.run_effects()
        self.ops.close_all()
        self.store = None
        self._stopped = True
        log.info("broker stopped")

    # ------------------------------------------------------------------ effects
    def complete(self, completions: Callable[[], None]) -> None:
        """The one completion path: a group commit finished (the store's writer hands
        its callbacks to the loop), or a backup acknowledged or left (replicated HA):
        the core's clock is set, the callbacks run, then the effects."""
        self.broker.set_now(self.now())
        completions()
        self.run_effects()

    def hold_input(self, held: bool) -> None:
        """Stop (or go on) reading every client connection (a dump is being described,
        ``server/ha/joining.py``)."""
        self.ops.hold_input(held)

    def after_turn(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the loop's current turn is done (the replication hub
        writes a turn's entries to a backup together, ``server/ha/replication.py``)."""
        assert self.loop is not None
        self.loop.call_soon(callback)

    def run_effects(self) -> None:
        """Carry out every effect the core produced; write to touched connections.
        After :meth:`stop` they are dropped: the connections' ends, which come later,
        must not deliver (the store is closed) nor write."""
        broker = self.broker
        if self._stopped:
            broker.take_effects()
            return
        runners = self._runners
        while True:
            effects = broker.take_effects()
            if not effects:
                break
            for effect in effects:
                runners[type(effect)](effect)
        self.ops.flush()
        self._arm_timer()

    def _continue(self, effect: Continue) -> None:
        def step() -> None:
            effect.step(self.now())
            self.run_effects()

        assert self.loop is not None
        self.loop.call_soon(step)

    def _release(self, effect: Release) -> None:
        if self.store is not None:
            self.store.release(effect.ref)

    def _persist(self, effect: Persist) -> None:
        store = self.store
        try:
            if store is None:
                raise StorageFailed("the store is closed")
            refs = store.append(effect.kind, effect.meta, effect.bodies, effect.on_durable)
        except ValueError as exc:  # a record the store cannot hold: a bug, never silent
            log.error("store refused a record of kind %d: %s", effect.kind, exc)
            effect.on_durable(StorageFailed(f"store refused a record: {exc}"))
            return
        except StorageFailed as exc:
            log.error("store append failed: %s", exc)
            effect.on_durable(exc)
            return
        if effect.on_refs is not None:
            effect.on_refs(refs)

    def body(self, message: Message) -> bytes:
        """A message's body: held in memory, or read from the store."""
        if message.body is not None:
            return message.body
        assert self.store is not None and message.ref is not None
        return self.store.read_body(message.ref)

    def bodies(self, messages: Sequence[Message]) -> PackedBodies:
        """Several bodies back to back: one store read when all are stored (the
        usual case), else each from memory or the store."""
        refs = [m.ref for m in messages]
        if self.store is not None and refs.count(None) == 0:
            return self.store.read_bodies(refs)  # type: ignore[arg-type]
        return PackedBodies.of([self.body(m) for m in messages])

    # ------------------------------------------------------------------ timers
    def _arm_timer(self) -> None:
        if self.loop is None:
            return
        wake = self.broker.next_wakeup()
        if wake is None or (self._timer_at is not None and self._timer_at <= wake):
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, (wake - self.now()) / 1000)
        self._timer_at = wake
        self._timer = self.loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.broker.tick(self.now())
        self.run_effects()

    def maintain(self) -> Relocation | None:
        """Let the store drop dead segments; return the relocation it asks for."""
        store = self.store
        if store is None or self.broker.failed is not None:
            return None
        return store.maintain()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """The core's counters, the connections, recovery time and the store's counters."""
        result = self.broker.stats()
        result["connections"] = len(self.ops.sessions)
        result["recovery_seconds"] = round(self.recovery_seconds, 3)
        uptime = 0.0 if self.loop is None else self.loop.time() - self._started
        result["uptime_seconds"] = round(uptime, 3)
        if self._checkpointer is not None:
            result["checkpoints"] = dict(self._checkpointer.counts)
        if self.ha_status is not None:
            result["ha"] = self.ha_status()
        if self.store is not None:
            s = self.store.stats()
            result["store"] = {
                "appends": s.appends, "syncs": s.syncs, "bytes_written": s.bytes_written,
                "segments": s.segments, "disk_bytes": s.disk_bytes,
                "live_bodies": s.live_bodies, "live_body_bytes": s.live_body_bytes,
                "body_cache_bytes": s.body_cache_bytes, "recovered_bytes": s.recovered_bytes,
                "recovered_segments": s.recovered_segments,
                "recovered_entries": s.recovered_entries,
                "recovered_from_checkpoint": s.recovered_from_checkpoint,
            }
        return result


async def serve(config: ServerConfig, ready: Callable[[BrokerServer], None] | None = None) -> None:
    """Start a broker and run it until SIGTERM/SIGINT."""
    server = BrokerServer(config)
    await server.start()
    if ready is not None:
        ready(server)
    await server.serve_forever()


def run(config: ServerConfig, ready: Callable[[BrokerServer], None] | None = None, *,
        main: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
    """Blocking entry point of ``txbroker serve`` (uses uvloop when available): runs
    :func:`serve`, or ``main()`` instead (an HA node's ``run``)."""
    # The journal writer hands the GIL back after each fsync; the default 5 ms
    # switch interval makes it wait behind the loop thread (measured in issue 5).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    # The index holds millions of small objects that live long and form no cycles
    # worth finding often: with the default thresholds the cyclic GC rescans them
    # again and again (a 1M-message XA branch took 3x longer to prepare).
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main() if main is not None else serve(config, ready))
