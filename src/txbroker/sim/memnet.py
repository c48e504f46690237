"""The simulated network of a :class:`~txbroker.sim.loop.SimLoop`: listeners and
connections made of in-memory transports.

Theory of operation
-------------------
Code under simulation listens and connects as it does in production
(``loop.create_server``, ``asyncio.open_connection``); the loop hands both to its
:class:`SimNetwork`:

- A **listener** is registered under (host, port); port 0 gets a free one.
  Connecting to an address nobody listens on is refused (``ConnectionRefusedError``)
  after one network delay, as a closed port answers with a reset.
- A **connection** is a pair of :class:`MemoryTransport` objects. Bytes written on
  one end arrive at the other end's protocol (``data_received``) after a delay drawn
  from the loop's random source, and in the order they were written (TCP is FIFO per
  direction); different connections are not ordered with one another.
- **Closing** (``close``) sends what was written, then an end of stream
  (``eof_received``); the closing end's protocol gets ``connection_lost(None)``.
  **Aborting** (``abort``) is a reset: the other end gets what was already on its
  way, then ``connection_lost(ConnectionResetError)``.
- **Faults.** :meth:`SimNetwork.partition` cuts one direction (or both) between two
  hosts: bytes sent across it are held — TCP keeps retransmitting — and arrive after
  :meth:`SimNetwork.heal`, in order; a connection attempt across it hangs (the
  caller's timeout decides). :meth:`SimNetwork.crash` is a process dying
  (``SimLoop.kill``): its listeners vanish, its connections' other ends get what was
  in flight, then a reset, and nothing reaches the dead process's protocols any more.
- **Processes.** What reaches one end of a connection runs in the context of the
  process that owns that end (:data:`PROCESS`, :data:`HOST`): the connecting
  process, or a copy of the listening process's context for an accepted one — so the
  tasks a broker starts for a connection belong to the broker.

Every delivery is recorded in :attr:`SimNetwork.trace` (time, connection, direction,
bytes); :meth:`SimNetwork.trace_hash` is its digest, equal for two runs of one seed.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from txbroker.sim.loop import SimLoop

__all__ = ["HOST", "PROCESS", "MemoryTransport", "SimListener", "SimNetwork"]

#: The simulated host the running code is on: the address its connections come from.
#: A task inherits it from the code that created it, so setting it where a simulated
#: process starts (``HOST.set("127.0.0.21")``, or ``contextvars.copy_context().run``)
#: names every connection that process makes. Hosts are loopback addresses
#: (127.x.y.z), so that a broker without users, which serves loopback only, serves them.
HOST: contextvars.ContextVar[str] = contextvars.ContextVar("txbroker_sim_host",
                                                            default="127.0.0.1")
#: The simulated process the running code belongs to (0: the simulation itself).
#: ``SimLoop.spawn`` starts a process; ``SimLoop.kill`` ends it: none of its callbacks
#: runs again, and its connections and listeners go as a dead process's do.
PROCESS: contextvars.ContextVar[int] = contextvars.ContextVar("txbroker_sim_process",
                                                              default=0)

#: One-way delay of a network message, seconds (uniform).
DELAY_S = (0.000_05, 0.002)
#: The least gap between two arrivals on one direction of a connection (keeps FIFO).
ORDER_STEP_S = 0.000_001
#: The first port :meth:`SimNetwork.listen` hands out for port 0 (and clients use).
FIRST_FREE_PORT = 30_000


class _Socket:
    """What ``server.sockets[0]`` offers the code that reads its bound port."""

    def __init__(self, host: str, port: int) -> None:
        self._address = (host, port)

    def getsockname(self) -> tuple[str, int]:
        return self._address


class SimListener:
    """A listening "socket" of the simulated network (``asyncio.Server``'s face)."""

    def __init__(self, network: SimNetwork, factory: Callable[[], asyncio.BaseProtocol],
                 host: str, port: int) -> None:
        self._network = network
        self.factory = factory
        self.host = host
        self.port = port
        self.sockets = [_Socket(host, port)]
        self._serving = True
        #: the listening process's context: its accepted connections run in copies of it
        self.context = contextvars.copy_context()
        self.owner = self.context.get(PROCESS, 0)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop it listens on."""
        return self._network.loop

    def is_serving(self) -> bool:
        """True until closed."""
        return self._serving

    def close(self) -> None:
        """Stop listening (connections already made stay)."""
        if self._serving:
            self._serving = False
            self._network.listeners.pop((self.host, self.port), None)

    async def wait_closed(self) -> None:
        """Nothing to wait for in memory."""
        return None

    async def start_serving(self) -> None:
        """It serves from the start."""
        return None

    async def serve_forever(self) -> None:
        """Wait for ever (until the task is cancelled)."""
        await self._network.loop.create_future()

    async def __aenter__(self) -> SimListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class MemoryTransport(asyncio.Transport):
    """One end of a simulated connection (see the module docstring)."""

    def __init__(self, network: SimNetwork, conn_id: int, side: str,
                 local: tuple[str, int], remote: tuple[str, int],
                 context: contextvars.Context) -> None:
        super().__init__({"peername": remote, "sockname": local, "socket": None})
        #: the owning process's context: what reaches this end runs in it
        self.context = context
        self.owner = context.get(PROCESS, 0)
        self._network = network
        self.conn_id = conn_id
        self.side = side  #: "c" (the connecting end) or "s" (the listener's end)
        self.local = local
        self.remote = remote
        self.peer: MemoryTransport | None = None
        self._protocol: asyncio.BaseProtocol | None = None
        self._closing = False  # close() or abort() called here
        self._dead = False  # nothing reaches this end's protocol any more
        self._paused = False
        self._parked: list[bytes | None] = []  # arrived while paused (or not connected)
        self._reset_early = False  # reset before this end was connected
        #: the earliest time the next message towards the peer may arrive (FIFO)
        self.next_arrival = 0.0

    # -- asyncio.Transport --------------------------------------------------------

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The protocol this end hands what arrives to."""
        assert self._protocol is not None
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand what arrives to ``protocol`` from now on."""
        self._protocol = protocol

    def is_closing(self) -> bool:
        """True once closed, aborted, reset or dead."""
        return self._closing or self._dead

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` to the other end (arrives after a network delay, in order)."""
        if self._closing or self._dead or not data:
            return
        self._network.send(self, bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        """Send the concatenation of ``list_of_data``."""
        self.write(b"".join(list_of_data))

    def can_write_eof(self) -> bool:
        """True: a half-close is possible."""
        return True

    def write_eof(self) -> None:
        """Send the end of the stream after what was written."""
        if not (self._closing or self._dead):
            self._network.send(self, None)

    def close(self) -> None:
        """Send what was written, then the end of the stream; this end is done."""
        if self._closing or self._dead:
            return
        self._closing = True
        self._network.send(self, None)
        self._network.loop.call_soon(self._lost, None)

    def abort(self) -> None:
        """A reset: the other end gets what is on its way, then the reset."""
        if self._closing or self._dead:
            return
        self._closing = True
        self._network.reset(self)
        self._network.loop.call_soon(self._lost, None)

    def pause_reading(self) -> None:
        """Keep what arrives until :meth:`resume_reading`."""
        self._paused = True

    def resume_reading(self) -> None:
        """Hand over what arrived while paused, in order."""
        if not self._paused:
            return
        self._paused = False
        parked, self._parked = self._parked, []
        for data in parked:
            self._network.loop.call_soon(self.arrive, data, context=self.context)

    def is_reading(self) -> bool:
        """False while paused."""
        return not self._paused

    def get_write_buffer_size(self) -> int:
        """0: writes leave at once."""
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        """(0, 0): there is no write buffer."""
        return (0, 0)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Accepted and ignored: there is no write buffer."""
        pass

    # -- the network's side -------------------------------------------------------

    def arrive(self, data: bytes | None) -> None:
        """Bytes (or, for None, the end of the stream) reach this end."""
        if self._dead:
            return
        if self._paused or self._protocol is None:  # (None: not connected yet here)
            self._parked.append(data)
            return
        if data is None:
            keep_open = getattr(self._protocol, "eof_received", lambda: None)()
            if not keep_open:
                self.close()
            return
        self._protocol.data_received(data)  # type: ignore[attr-defined]

    def arrive_reset(self) -> None:
        """The other end reset the connection."""
        if self._dead:
            return
        if self._protocol is None:  # not connected yet here: the connect fails
            self._reset_early = True
            return
        self._closing = True
        self._lost(ConnectionResetError(errno.ECONNRESET, "connection reset by peer"))

    def connected(self) -> None:
        """This end's protocol is connected: what arrived meanwhile is handed to it."""
        parked, self._parked = self._parked, []
        for data in parked:
            self._network.loop.call_soon(self.arrive, data, context=self.context)

    def kill(self) -> None:
        """This end's process died: nothing reaches its protocol any more."""
        self._closing = True
        self._dead = True

    def _lost(self, exc: BaseException | None) -> None:
        if self._dead:
            return
        self._dead = True
        if self._protocol is not None:
            self._protocol.connection_lost(exc)  # type: ignore[arg-type]


class SimNetwork:
    """Listeners, connections and faults of one simulation (module docstring)."""

    def __init__(self, loop: SimLoop, delay: tuple[float, float] = DELAY_S) -> None:
        self.loop = loop
        self.delay = delay
        self.listeners: dict[tuple[str, int], SimListener] = {}
        #: every connection end made (and not yet crashed); ends closed on both sides
        #: go when the list doubles (a stuck run made one every few steps, for ever)
        self.ends: list[MemoryTransport] = []
        self._prune_at = 64
        #: (from host, to host) pairs cut, and what waits for them to heal
        self.cut: set[tuple[str, str]] = set()
        self._held: list[tuple[MemoryTransport, bytes | None, bool]] = []
        self._next_port = FIRST_FREE_PORT
        self._next_conn = 1
        #: (time, connection, direction, length or -1 for the end, -2 for a reset)
        self.trace: list[tuple[float, int, str, int]] = []
        #: called with each write (its end and bytes; None: the end of the stream) as
        #: it is sent: a scenario's observer (``live_etcd.py``: who answered clients when)
        self.on_send: Callable[[MemoryTransport, bytes | None], None] | None = None

    def _delay(self) -> float:
        low, high = self.delay
        return self.loop.random.uniform(low, high)

    def _port(self) -> int:
        port = self._next_port
        self._next_port += 1
        return port

    # -- listening and connecting ------------------------------------------------

    def listen(self, factory: Callable[[], asyncio.BaseProtocol], host: str,
               port: int) -> SimListener:
        """Listen on (host, port); port 0: a free one."""
        if port == 0:
            port = self._port()
        if (host, port) in self.listeners:
            raise OSError(errno.EADDRINUSE, f"{host}:{port} is in use")
        listener = SimListener(self, factory, host, port)
        self.listeners[(host, port)] = listener
        return listener

    async def connect(self, factory: Callable[[], asyncio.BaseProtocol], host: str,
                      port: int, *, local_host: str | None = None
                      ) -> tuple[MemoryTransport, asyncio.BaseProtocol]:
        """Connect from ``local_host`` (default: :data:`HOST`) to a listener."""
        local = local_host or HOST.get()
        if (local, host) in self.cut or (host, local) in self.cut:
            await self.loop.create_future()  # SYNs lost: the caller's timeout decides
        await asyncio.sleep(self._delay())
        listener = self.listeners.get((host, port))
        if listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED,
                                         f"connect to {host}:{port}: connection refused")
        conn_id = self._next_conn
        self._next_conn += 1
        client_address = (local, self._port())
        client = MemoryTransport(self, conn_id, "c", client_address, (host, port),
                                 contextvars.copy_context())
        server = MemoryTransport(self, conn_id, "s", (host, port), client_address,
                                 listener.context.copy())
        client.peer, server.peer = server, client
        ends = self.ends
        ends.append(client)
        ends.append(server)
        if len(ends) >= self._prune_at:  # (a dead end does nothing more: see crash)
            self.ends = [end for end in ends
                         if not (end._dead and (end.peer is None or end.peer._dead))]
            self._prune_at = 2 * len(self.ends) + 64
        if listener.owner in self.loop.paused:  # a stopped process accepts once continued
            self.loop.call_soon(self._accept, listener, server, context=server.context)
        else:
            server.context.run(self._accept, listener, server)
        await asyncio.sleep(self._delay())
        if client._reset_early or client._dead:  # the listener's process died meanwhile
            client.kill()
            raise ConnectionResetError(errno.ECONNRESET,
                                       f"connect to {host}:{port}: connection reset by peer")
        client_protocol = factory()
        client.set_protocol(client_protocol)
        client_protocol.connection_made(client)
        client.connected()
        return client, client_protocol

    @staticmethod
    def _accept(listener: SimListener, server: MemoryTransport) -> None:
        protocol = listener.factory()
        server.set_protocol(protocol)
        protocol.connection_made(server)
        server.connected()

    # -- carrying bytes ------------------------------------------------------------

    def send(self, source: MemoryTransport, data: bytes | None) -> None:
        """``data`` (None: the end of the stream) from ``source`` to its peer."""
        if self.on_send is not None:
            self.on_send(source, data)
        self._carry(source, data, reset=False)

    def reset(self, source: MemoryTransport) -> None:
        """A reset from ``source``, behind what it already sent."""
        self._carry(source, None, reset=True)

    def _carry(self, source: MemoryTransport, data: bytes | None, *, reset: bool) -> None:
        peer = source.peer
        if peer is None:
            return
        if (source.local[0], peer.local[0]) in self.cut:
            self._held.append((source, data, reset))
            return
        # strictly after the one before: timers due at the same instant have no order
        at = max(self.loop.time() + self._delay(), source.next_arrival + ORDER_STEP_S)
        source.next_arrival = at
        self.loop.call_at(at, self._deliver, source, peer, data, reset,
                          context=peer.context)

    def _deliver(self, source: MemoryTransport, peer: MemoryTransport, data: bytes | None,
                 reset: bool) -> None:
        direction = "c>s" if source.side == "c" else "s>c"
        self.trace.append((round(self.loop.time(), 9), source.conn_id, direction,
                           -2 if reset else -1 if data is None else len(data)))
        if reset:
            peer.arrive_reset()
        else:
            peer.arrive(data)

    # -- faults --------------------------------------------------------------------

    def partition(self, a: str, b: str, *, one_way: bool = False) -> None:
        """Cut a → b (and b → a unless ``one_way``)."""
        self.cut.add((a, b))
        if not one_way:
            self.cut.add((b, a))

    def heal(self) -> None:
        """Every cut is mended; what was held goes on its way, in order."""
        self.cut.clear()
        held, self._held = self._held, []
        for source, data, reset in held:
            self._carry(source, data, reset=reset)

    def crash(self, process: int) -> None:
        """Process ``process`` died: its listeners go, the other end of each of its
        connections gets what was on its way and then a reset (``SimLoop.kill``)."""
        for key, listener in list(self.listeners.items()):
            if listener.owner == process:
                self.listeners.pop(key).close()
        kept = []
        for end in self.ends:
            if end.owner != process:
                kept.append(end)
            elif not end._dead:
                end.kill()
                self.reset(end)
        self.ends = kept

    def trace_hash(self) -> str:
        """SHA-256 of :attr:`trace`: two runs of one seed give the same one."""
        digest = hashlib.sha256()
        for item in self.trace:
            digest.update(repr(item).encode())
        return digest.hexdigest()
