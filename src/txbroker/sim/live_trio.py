"""The replicated trio on the deterministic event loop: three production replicated
nodes (``ReplicatedNode``, ``--ha replicated``), each a simulated process on its own
host with its own simulated disk, and the operator's ``txbroker ha promote``.

What is real and what is a model:

- **Real**: ``ReplicatedNode`` (the role table, following, promotion), ``Follower``
  (joins, dumps, incremental catch-up, acks, votes), ``ReplicationHub`` (LSNs, the
  ready set, replies held until every ready backup has the entry), the replication
  link's bytes, ``BrokerServer`` on each node, the standby port's ``ha_promote``.
- **The disk** (:class:`NodeDisk`): the store is a ``MemoryStore`` over a
  ``MemoryState`` that outlives the node's processes; group syncs take virtual time
  (one in 20 is slow); a kill keeps only what was synced. The node's small files —
  the store lock, ``REPLICA_INCOMPLETE``, ``REPLICA_STATE`` — are real files in a
  temporary data directory (each is written and fsynced at once in production, so a
  kill keeps them all). ``wipe`` empties that directory, and with it the sentinel file
  the disk keeps there: the next store opened on it starts empty, as a wiped store
  directory does.
- **The store lock**: a ``MemoryStore`` does not own it as a journal does (one that
  closes frees it), so the disk frees it when the store opens and the simulation
  frees what a killed process still held (the kernel does that for a real one).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

from txbroker.core.ha.replicated_role import NodeRole
from txbroker.errors import error_for_code
from txbroker.protocol.native import PROTOCOL_VERSION, Err, NativeConnection, Ok, Request, Role
from txbroker.server.app import BrokerServer
from txbroker.server.config import DEFAULT_CHECKPOINT_INTERVAL, ServerConfig
from txbroker.server.ha.replicated import ReplicatedNode
from txbroker.sim.live import EPOCH_MS, SYNC_S
from txbroker.sim.loop import SimLoop
from txbroker.storage.interface import Dispatch, SnapshotProvider, Store
from txbroker.storage.memory import MemoryState, MemoryStore
from txbroker.storage.store_lock import StoreLock

__all__ = ["CLIENT_PORT", "HA_PORT", "NodeDisk", "TrioNode", "probe"]

#: Every node's client port and HA port (each node is on its own host).
CLIENT_PORT: Final = 5445
HA_PORT: Final = 5501
#: ``backup_timeout`` (s): short, so that a partitioned backup leaves the ready set
#: (and replies stop waiting for it) within the fault phase; production's is 5 s.
BACKUP_TIMEOUT_S: Final = 0.5
#: One group sync in this many is slow, taking up to :data:`SLOW_SYNC_S`.
SLOW_SYNC_EVERY: Final = 20
SLOW_SYNC_S: Final = (0.02, 0.12)
#: The file the disk keeps in the data directory; gone: the directory was wiped.
SENTINEL: Final = "SIM_STORE"


class NodeDisk:
    """One node's disk: the store's durable entries (a MemoryState that outlives each
    process), its data directory (real, temporary), the store now open."""

    def __init__(self, loop: SimLoop, data: Path, checkpoints: bool = False) -> None:
        self.loop = loop
        self.data = data
        #: the store keeps recovery checkpoints (``replicated-live-checkpoints``)
        self.checkpoints = checkpoints
        self.state = MemoryState()
        self.store: MemoryStore | None = None
        self.wipes = 0  #: times the store started empty (a new or wiped directory)

    def open(self, dispatch: Dispatch, snapshot: SnapshotProvider,
             lock: StoreLock | None) -> Store:
        """The broker's ``store_opener`` (module docstring)."""
        sentinel = self.data / SENTINEL
        if not sentinel.exists():  # a wiped (or new) directory: an empty store
            self.state = MemoryState()
            self.wipes += 1
            sentinel.write_bytes(b"")
        if lock is not None:
            lock.release()
        loop = self.loop

        def slow_dispatch(work: Any) -> None:  # a group sync takes a while
            slow = loop.random.randrange(SLOW_SYNC_EVERY) == 0
            loop.call_later(loop.random.uniform(*(SLOW_SYNC_S if slow else SYNC_S)),
                            dispatch, work)

        self.store = MemoryStore(self.state, dispatch=slow_dispatch,
                                 snapshot_provider=snapshot, checkpoints=self.checkpoints)
        return self.store

    def crash(self) -> None:
        """The machine lost its page cache: what was not synced is gone."""
        if self.store is not None:
            self.store.crash()
            self.store = None


class TrioNode:
    """One node of the trio: its host, disk and configuration, the process now running
    (if any) and its ``ReplicatedNode``."""

    def __init__(self, loop: SimLoop, index: int, hosts: list[str], root: Path,
                 checkpoint_interval: float = 0.0) -> None:
        self.loop = loop
        self.index = index
        self.host = hosts[index]
        data = root / f"node{index}"
        data.mkdir()
        self.disk = NodeDisk(loop, data, checkpoints=bool(checkpoint_interval))
        self.config = ServerConfig(
            host=self.host, port=CLIENT_PORT, stomp_port=0, amqp_port=0, data=data,
            ha="replicated", ha_port=HA_PORT, ha_node=self.host,
            ha_peers=",".join(f"{h}:{HA_PORT}" for h in hosts if h != self.host),
            backup_timeout=BACKUP_TIMEOUT_S, recovery_checkpoint=bool(checkpoint_interval),
            checkpoint_interval=checkpoint_interval or DEFAULT_CHECKPOINT_INTERVAL)
        self.process: int | None = None
        self.node: ReplicatedNode | None = None
        self.starts = 0

    @property
    def alive(self) -> bool:
        """A process of this node runs."""
        return self.process is not None

    def make_server(self, config: ServerConfig, lock: StoreLock | None) -> BrokerServer:
        """The node's ``make_server``: a broker on its simulated disk, virtual clock."""
        server = BrokerServer(config, lock=lock, store_opener=self.disk.open)
        loop = self.loop
        server.clock = lambda: EPOCH_MS + int(loop.time() * 1000)
        return server

    def start(self, on_role: Callable[[TrioNode, NodeRole, BrokerServer | None], None],
              prepare: Callable[[ReplicatedNode], None],
              on_exit: Callable[[TrioNode], None] | None = None) -> None:
        """Start a process of this node (``txbroker serve --ha replicated``); ``on_exit``:
        its process ended by itself (a fenced or stopped node exits, as ``txbroker
        serve`` does)."""
        loop = self.loop
        node = ReplicatedNode(
            self.config, lambda role, server: on_role(self, role, server),
            make_server=self.make_server,
            clock_ns=lambda: EPOCH_MS * 1_000_000 + int(loop.time() * 1e9))
        prepare(node)
        self.node = node
        self.starts += 1
        self.process, task = loop.spawn(self.host, node.run())
        process = self.process

        def exited(_: object) -> None:
            if self.process == process:  # (a killed process's task never ends)
                self.process = None
                if on_exit is not None:
                    on_exit(self)

        task.add_done_callback(exited)

    def kill(self) -> None:
        """``kill -9``: the process is gone, with what its disk had not synced; the
        kernel frees its store lock."""
        if self.process is None:
            return
        self.loop.kill(self.process)
        self.process = None
        self.disk.crash()
        node = self.node
        if node is not None:
            for lock in (node.lock, node.follower.lock if node.follower else None):
                if lock is not None and lock.held:
                    lock.release()


async def probe(host: str, op: str, timeout: float = 1.0) -> Any:
    """What ``txbroker ha promote`` / ``ha status`` do (``cli/ha_commands.py``
    ``probe``): a probe ``hello`` on a node's client port, then ``op``; its result, or
    the broker's error raised."""
    codec = NativeConnection(Role.CLIENT)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, CLIENT_PORT)
    try:
        async def call(rid: int, name: str, args: dict[str, Any]) -> Any:
            writer.write(codec.send(Request(rid, name, args)))
            while True:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionResetError(f"{host} closed the connection")
                codec.receive_data(data)
                for event in codec.drain():
                    if isinstance(event, Ok) and event.rid == rid:
                        return event.result
                    if isinstance(event, Err) and event.rid in (rid, 0):
                        raise error_for_code(event.code, event.message)

        async with asyncio.timeout(timeout):
            await call(1, "hello", {"version": PROTOCOL_VERSION, "probe": True})
            return await call(2, op, {})
    finally:
        writer.close()


def data_root() -> Path:
    """A fresh directory for a run's nodes' small files (in ``/dev/shm`` when there is
    one: they are fsynced at once)."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="txbroker-sim-", dir=shm if shm.is_dir() else None))


async def cancel_tasks(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` (a scenario's operators) and wait for each to end."""
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
