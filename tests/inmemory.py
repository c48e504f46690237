"""Real brokers in memory, for the client libraries' tests (issue 26): the real core, the
real operation layer and the real native edge, joined to the real client library by
pipes that pass bytes in memory instead of a socket.

Theory of operation
-------------------
Like h11's ``ConnectionPair``, with asyncio's ``Transport``/``Protocol`` on the broker's
side and the client's :class:`~txbroker.client.transport.Stream` on the other.

An :class:`InMemoryNetwork` is the client's transport (``connect(url,
transport=network)``, ``ConnectOptions.transport``): it maps ``host:port`` addresses
to :class:`Node` objects. A node is one broker process at one address:

* :meth:`Node.start` runs a real ``BrokerServer`` (``server/app.py``: store → Broker →
  Operations; its ``store_opener`` opens a ``MemoryStore``) on the node's
  ``MemoryState``; each connection gets the real native edge, ``ClientConnection``.
  Several nodes may share one state, as the two brokers of a shared-store HA pair share
  their store: only one may hold it at a time (the state's lock);
* :meth:`Node.standby` serves the real standby edge (``StandbyConnection``, which
  refuses ``hello`` with ``Standby``), as the other broker of a pair does;
* :meth:`Node.kill` crashes the broker: the store loses what was not synced
  (``MemoryStore.crash``), the server runs no more code for its connections, every
  client sees its connection reset, and the address refuses connections until the
  node is started again (on the same state: a restart, or another node's takeover).

Each connection is a ``Pipe`` (``tests/inmemory_pipe.py``). Bytes the client writes reach the broker
protocol's ``data_received`` in a later turn of the broker's loop; bytes the broker
writes reach the client's ``read`` on the client's loop. The two loops may differ (the
sync client runs its own loop on a thread): bytes always cross with
``call_soon_threadsafe``, which keeps their order. Faults are injected here, never by
faking an answer: :meth:`Node.drop_connections` (a reset both sides see),
:meth:`Node.stall` (the broker's bytes held back, in order, until
:meth:`Node.unstall`: a stalled reply), a refused connect (a node that is down),
:meth:`Node.fail_store` (the store's next sync fails), :meth:`Node.crash`.

Every byte also passes a wire tap: the node's ``WireLog`` decodes both directions
with the real codec, so that a test can see which requests reached the broker and
what it answered (and when).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from tests.inmemory_pipe import ClientSide, Pipe, WireLog
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.edges.native.connection import ClientConnection
from txbroker.server.ha.shared_store import StandbyConnection
from txbroker.server.security.auth import Authenticator
from txbroker.storage.interface import Dispatch, SnapshotProvider, Store
from txbroker.storage.memory import MemoryState, MemoryStore
from txbroker.storage.store_lock import StoreLock

T = TypeVar("T")

#: The most messages ``queue_browse`` shows (its own limit, ``core/admin.py``).
BROWSE_LIMIT = 1000
#: Seconds a call into a :class:`LoopThread` may take.
THREAD_CALL_TIMEOUT = 10.0


class Node:
    """One broker "process" at one address (see the module docstring)."""

    def __init__(self, network: InMemoryNetwork, address: str, state: MemoryState,
                 config: ServerConfig) -> None:
        self.network = network
        self.address = address
        self.state = state
        self.config = config
        self.server: BrokerServer | None = None
        self.log = WireLog()
        self.pipes: set[Pipe] = set()
        #: what each new connection is served by (None: refused, the node is down)
        self.serve: Callable[[], asyncio.Protocol] | None = None
        #: True while the broker's bytes are held back (:meth:`stall`)
        self.stalled = False
        #: counts the node's processes: each start (broker, standby, peer) and crash ends one
        self.incarnation = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        """``txb://`` URL of this node alone."""
        return f"txb://{self.address}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the node's broker runs on (the one it was started on)."""
        assert self._loop is not None, "the node was never started"
        return self._loop

    @property
    def running(self) -> BrokerServer:
        """The running broker (AssertionError if there is none)."""
        assert self.server is not None, f"{self.address} is not running a broker"
        return self.server

    # ---- life
    def _open_store(self, dispatch: Dispatch, snapshot: SnapshotProvider,
                    lock: StoreLock | None) -> Store:
        return MemoryStore(self.state, dispatch=dispatch, snapshot_provider=snapshot)

    async def start(self) -> Node:
        """Run a broker on the node's store (a restart, or a standby's takeover)."""
        assert self.server is None, f"{self.address} already runs a broker"
        self._loop = asyncio.get_running_loop()
        self.incarnation += 1
        server = BrokerServer(self.config, store_opener=self._open_store)
        await server.recover()
        self.server = server
        ops = server.ops
        self.serve = lambda: ClientConnection(ops)
        return self

    def standby(self) -> Node:
        """Serve the standby edge: every ``hello`` is refused with ``Standby``."""
        assert self.server is None, f"{self.address} runs a broker: kill it first"
        self._loop = asyncio.get_running_loop()
        self.incarnation += 1
        config = self.config
        text = (f"this broker ({self.address}) is the standby of a shared-store pair: "
                "connect to the active one")
        self.serve = lambda: StandbyConnection(
            config, Authenticator(config.users), refusal=lambda op: text,
            status=lambda: {"role": "standby"}, role=lambda: "standby")
        return self

    def serve_with(self, factory: Callable[[], asyncio.Protocol]) -> Node:
        """Serve each new connection with ``factory()`` (a wire-edge test's peer)."""
        self._loop = asyncio.get_running_loop()
        self.incarnation += 1
        self.serve = factory
        return self

    def crash(self) -> BrokerServer | None:
        """Die at once (no loop turn): the address refuses connections, every client
        sees a reset, the store loses what was not synced. Returns the dead server, for
        :meth:`bury`."""
        self.serve = None
        self.incarnation += 1
        self.stalled = False  # (the held bytes die with the connections)
        for pipe in list(self.pipes):
            pipe.sever()
        self.pipes.clear()
        server, self.server = self.server, None
        if server is not None and isinstance(server.store, MemoryStore):
            server.store.crash()
        return server

    @staticmethod
    async def bury(server: BrokerServer | None) -> None:
        """Stop a crashed server's timers (its crashed store and dead pipes ignore the
        rest of ``BrokerServer.stop``)."""
        if server is not None:
            await server.stop()
        await asyncio.sleep(0)

    async def kill(self) -> None:
        """Crash (see :meth:`crash`); the node stays down until started again."""
        await self.bury(self.crash())

    async def take_over(self, active: Node) -> Node:
        """``active`` (on this node's store) crashes and this node, its standby, runs a
        broker on the store at once — no client gets a turn in between."""
        assert active.state is self.state, "a takeover needs the same store"
        dead = active.crash()
        self.serve = None
        await self.start()  # (recovering a MemoryStore never yields to the loop)
        await self.bury(dead)
        return self

    async def stop(self) -> None:
        """A clean shutdown (``BrokerServer.stop``: clients read end of stream)."""
        self.serve = None
        server, self.server = self.server, None
        if server is not None:
            await server.stop()
        await asyncio.sleep(0)

    def drop_connections(self) -> None:
        """Reset every connection (the broker lives on and sees them lost)."""
        for pipe in list(self.pipes):
            pipe.cut()

    def stall(self) -> None:
        """Hold back every byte the broker writes from now on (requests still arrive)."""
        self.stalled = True

    def unstall(self) -> None:
        """Let the held bytes go, in order."""
        self.stalled = False
        for pipe in list(self.pipes):
            pipe.release()

    def fail_store(self) -> None:
        """The store's next sync fails (``MemoryStore.sync_step``): the broker takes
        no more writes, and what waited for that sync is refused."""
        store = self.running.store
        assert isinstance(store, MemoryStore)

        def failing_sync() -> None:
            raise OSError("injected: the disk failed")

        store.sync_step = failing_sync

    # ---- the real core's state, for assertions
    def info(self, queue: str) -> dict[str, Any]:
        """The core's ``queue_info`` (depth, in_flight, consumers …)."""
        return self.running.broker.queue_info(queue)

    def bodies(self, queue: str) -> list[bytes]:
        """The bodies of the (first 1,000) messages ready in ``queue``, in the order they
        would go."""
        server = self.running
        if queue not in server.broker.queues:
            return []
        return [server.body(m) for m in server.broker.queue_browse(queue, BROWSE_LIMIT)]

    # ---- the network's side
    def accept(self, client_loop: asyncio.AbstractEventLoop) -> ClientSide:
        """A new connection (called on the client's loop)."""
        serve = self.serve
        if serve is None:
            raise ConnectionRefusedError(f"{self.address}: connection refused")
        pipe = Pipe(self, serve(), client_loop)
        self.loop.call_soon_threadsafe(pipe.connect)
        return pipe.stream


class InMemoryNetwork:
    """Addresses → nodes; the client's transport (``connect(url, transport=network)``)."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._ports = itertools.count(1)
        self._lock = threading.Lock()

    def node(self, state: MemoryState | None = None, *, host: str = "broker",
             **config: Any) -> Node:
        """A node (down until started) at a new address, on ``state`` (a new store by
        default; give another node's ``state`` for an HA pair); ``config``:
        ``ServerConfig`` settings (``users``, ``max_connections``, ``router_facilities`` …)."""
        with self._lock:
            address = f"{host}:{next(self._ports)}"
        settings = ServerConfig(data=Path("/nonexistent/in-memory"), **config)
        node = Node(self, address, state if state is not None else MemoryState(name=address),
                    settings)
        self.nodes[address] = node
        return node

    async def broker(self, state: MemoryState | None = None, **config: Any) -> Node:
        """A node running a broker (see :meth:`node`)."""
        return await self.node(state, **config).start()

    def url(self, *nodes: Node, auth: str = "") -> str:
        """The failover list of ``nodes`` (``auth``: ``"user:password@"``)."""
        return "txb://" + auth + ",".join(node.address for node in nodes)

    async def open(self, host: str, port: int) -> ClientSide:
        """Connect to ``host:port`` (the client's ``Transport``); OSError if refused."""
        node = self.nodes.get(f"{host}:{port}")
        if node is None:
            raise ConnectionRefusedError(f"{host}:{port}: connection refused")
        return node.accept(asyncio.get_running_loop())

    async def close(self) -> None:
        """Stop every running broker (cleanly)."""
        for node in list(self.nodes.values()):
            if node.server is not None and node.loop is asyncio.get_running_loop():
                await node.stop()


async def until(condition: Callable[[], object], what: str = "condition",
                timeout: float = 10.0) -> None:
    """Wait (bounded) until ``condition()`` is true, yielding to the loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.002)


def run(main: Callable[[InMemoryNetwork], Coroutine[Any, Any, T]], timeout: float = 15.0) -> T:
    """Run ``main(network)`` on a fresh event loop, bounded in time; stop its brokers after."""

    async def runner() -> T:
        network = InMemoryNetwork()
        try:
            return await asyncio.wait_for(main(network), timeout)
        finally:
            await network.close()

    return asyncio.run(runner())


class LoopThread:
    """An event loop on a thread for the brokers of the sync clients' tests (the sync
    client runs its own loop: the pipes carry bytes across)."""

    def __init__(self) -> None:
        self.network = InMemoryNetwork()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the brokers' loop and return its result."""
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro,
                                                                                self.loop)
        return future.result(THREAD_CALL_TIMEOUT)

    def settle(self) -> None:
        """Return once the brokers' loop ran what was queued for it before (bytes the
        clients wrote are read in that order)."""
        self.call(asyncio.sleep(0))

    def broker(self, state: MemoryState | None = None, **config: Any) -> Node:
        """A running broker on the loop's thread (see :meth:`InMemoryNetwork.node`)."""
        return self.call(self.network.broker(state, **config))

    def stop(self) -> None:
        """Stop the brokers, then the loop and its thread."""
        self.call(self.network.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(THREAD_CALL_TIMEOUT)
        self.loop.close()
