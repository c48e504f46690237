"""Scenario ``shared-store-live``: the production shared-store pair (``--ha shared-store``)
on the deterministic event loop, over one simulated shared disk and a model of its lock.

Two :class:`~txbroker.server.ha.shared_store.SharedStoreNode` processes — the code
``txbroker serve --ha shared-store`` runs: contention for the lock, the standby's
heartbeat link with its handshake, the refuser of the standby's native port, the
takeover (recovery of the store, listeners) — on two hosts of a
:class:`~txbroker.sim.loop.SimLoop`, with the clients of ``queue-live`` (failover lists
naming both nodes). What is a model:

- **The shared disk** (:class:`SharedDisk`): one ``MemoryState`` both nodes open (the
  ``store_opener``); group syncs take :data:`~txbroker.sim.live.SYNC_S`; the store of a
  killed node loses what it had not synced. It records, for every append, the process
  that made it and the lock's holder at that moment.
- **The store's lock** (:class:`SimLocks`, the nodes' ``locks``): ``fcntl`` semantics —
  one holder; a second try, even by the holder, is refused; it is released when its
  holder releases it or its process is killed, never because the process is stopped
  (``SIGSTOP``) or cut off; the line the holder wrote stays in the "file".

Faults in the fault phase, one after another, each with a pause before it: kill -9 of
the active (restarted later: it becomes the standby), kill of the standby (restarted
later), a stop (``SimLoop.pause``) of either node for up to :data:`PAUSE_S` — often
past the activation interval — and a partition of the pair link (symmetric or one-way)
for up to :data:`PARTITION_S`, none lasting past the fault phase. Then the healed phase:
every cut mended, every node running; producers send until :data:`HEAL_SEND_S` after
the fault phase, consumers drain.

Checkers: those of ``queue-live`` (no answered send lost, no duplicate without the
redelivered flag, no answered ack undone, transactions all-or-nothing, an empty queue
at the end, no client dead, nothing unhandled in the loop), and

- **at most one writer per lock epoch**: a process that appends to the shared store
  while it does not hold the lock is a violation (two writers);
- **progress in the healed phase**: a send answered after the faults ended, and at the
  end exactly one node active and the other its standby.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from txbroker.core.ha.shared_store_role import StoreRole
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.ha.shared_store import SharedStoreNode
from txbroker.server.stores import store_lock_path
from txbroker.sim.live import EPOCH_MS, SYNC_S, captured_logs, seed_client_jitter
from txbroker.sim.live_clients import Record, check_queue, consumer, left_in_queue, producer
from txbroker.sim.loop import SimLoop
from txbroker.sim.memnet import HOST, PROCESS
from txbroker.sim.world import World
from txbroker.storage.interface import BodyRef, Dispatch, DurableCallback, SnapshotProvider, Store
from txbroker.storage.memory import MemoryState, MemoryStore
from txbroker.storage.store_lock import LockOpener, StoreLock

__all__ = ["SharedDisk", "SimLocks", "run_shared_store_live"]

#: The two nodes' hosts; each listens on PORT (clients) and HA_PORT (the pair link).
NODES = ("127.0.0.10", "127.0.0.11")
PORT = 5445
HA_PORT = 5446
#: Both nodes' data directory (a name only: the disk is :class:`SharedDisk`).
DATA = Path("/shared/txbroker")
#: The clients' failover list: both nodes.
URL = "txb://" + ",".join(f"{host}:{PORT}" for host in NODES)
#: The pair link's timing (s): the active's heartbeat period and the silence after
#: which the standby acts (the configuration's minimum ratio, 2).
HEARTBEAT_S = 0.1
ACTIVATION_S = 0.25
#: The HA link's shared secret (the handshake runs, nonces from the seed).
SECRET = "simulated-shared-store-pair-secret"
#: Virtual lengths of the fault phase, of the healed phase and of the sends in it (s).
FAULT_S = 2.0
HEAL_S = 3.0
HEAL_SEND_S = 0.5
#: Mean pause between two faults; a killed node's restart delay; how long a node
#: stays stopped and the pair link cut (s, uniform).
MEAN_FAULT_GAP_S = 0.3
RESTART_S = (0.01, 0.3)
PAUSE_S = (0.02, 0.8)
PARTITION_S = (0.05, 0.8)
PRODUCERS = 2
CONSUMERS = 2


class _SimLock(StoreLock):
    """One holding of :class:`SimLocks`'s lock (a ``StoreLock``, as the node expects)."""

    def __init__(self, locks: SimLocks, path: Path, process: int, epoch: int) -> None:
        # no file, no descriptor: the model keeps the state (StoreLock's fields for
        # the readers of a StoreLock)
        self.path, self._fd, self.created = path, -1, []
        self.acquired_at = locks.loop.time()
        self._locks = locks
        self.process = process
        self.epoch = epoch
        self._released = False

    @property
    def held(self) -> bool:
        """True until released or its process dies."""
        return not self._released and self.process not in self._locks.loop.dead

    def holder(self) -> str:
        """The line this holder wrote."""
        return self._locks.holder(self.path)

    def release(self) -> None:
        """Unlock. Idempotent."""
        self._released = True


class SimLocks:
    """The store's lock as ``fcntl`` gives it (module docstring); a
    :class:`~txbroker.storage.store_lock.LockOpener`. Each holding is an *epoch*."""

    def __init__(self, loop: SimLoop, world: World) -> None:
        self.loop = loop
        self.world = world
        self._holding: dict[Path, _SimLock] = {}
        self._lines: dict[Path, str] = {}
        self.epoch = 0

    def holding(self, path: Path) -> _SimLock | None:
        """The holding in force on ``path`` (None: free)."""
        lock = self._holding.get(path)
        return lock if lock is not None and lock.held else None

    def try_acquire(self, path: Path, role: str) -> StoreLock | None:
        """The calling process takes the lock, or None if it is held (by anyone)."""
        if self.holding(path) is not None:
            return None
        return self.take(path, role)

    def take(self, path: Path, role: str) -> StoreLock:
        """Take the lock, held or not (planted bugs only)."""
        self.epoch += 1
        process = PROCESS.get()
        lock = _SimLock(self, path, process, self.epoch)
        self._holding[path] = lock
        self._lines[path] = f"pid {process} on {HOST.get()} ({role})"
        self.world.log(f"{self.loop.time():.6f} lock epoch {self.epoch}: process {process}")
        return lock

    def holder(self, path: Path) -> str:
        """The line the last holder wrote ("" if none ever did)."""
        return self._lines.get(path, "")


class _IgnoringLocks:
    """Plant ``standby-ignores-lock``: a node takes the lock, held or not, once it has
    heard no heartbeat for the activation interval."""

    def __init__(self, locks: SimLocks, node: list[SharedStoreNode]) -> None:
        self._locks = locks
        self._node = node

    def try_acquire(self, path: Path, role: str) -> StoreLock | None:
        lock = self._locks.try_acquire(path, role)
        if lock is not None or not self._node:
            return lock
        node = self._node[0]
        heard = node.last_heartbeat
        if node.role is StoreRole.STANDBY and heard is not None and \
                node.clock() / 1000 - heard >= ACTIVATION_S:
            return self._locks.take(path, role)
        return None

    def holder(self, path: Path) -> str:
        return self._locks.holder(path)


class _WatchedStore(MemoryStore):
    """A node's store on the shared disk: each append is checked against the lock."""

    def __init__(self, disk: SharedDisk, process: int, dispatch: Dispatch,
                 snapshot: SnapshotProvider) -> None:
        super().__init__(disk.state, dispatch=dispatch, snapshot_provider=snapshot)
        self._disk = disk
        self._process = process

    def append(self, kind: int, meta: bytes, bodies: Sequence[bytes],
               on_durable: DurableCallback) -> list[BodyRef]:
        """Record the writer, then append."""
        self._disk.wrote(self._process)
        return super().append(kind, meta, bodies, on_durable)


class SharedDisk:
    """The pair's one data directory (module docstring): the nodes' ``store_opener``."""

    def __init__(self, loop: SimLoop, locks: SimLocks, path: Path) -> None:
        self.loop = loop
        self.locks = locks
        self.path = path
        self.state = MemoryState()
        self._stores: dict[int, MemoryStore] = {}
        #: lock epoch -> the processes that appended in it
        self.writers: dict[int, set[int]] = {}
        #: appends by a process that did not hold the lock
        self.violations: list[str] = []

    def open(self, dispatch: Dispatch, snapshot: SnapshotProvider,
             lock: StoreLock | None) -> Store:
        """A store over the shared state for the calling process. The lock model
        decides who may open it, as the journal given a held lock does: the memory
        state's own flag is not a second lock."""
        loop = self.loop
        process = PROCESS.get()

        def slow_dispatch(work: Any) -> None:  # a group sync takes a while
            loop.call_later(loop.random.uniform(*SYNC_S), dispatch, work)

        self.state.locked = False
        store = _WatchedStore(self, process, slow_dispatch, snapshot)
        self._stores[process] = store
        return store

    def crash(self, process: int) -> None:
        """``process`` was killed: what its store had not synced is gone."""
        store = self._stores.pop(process, None)
        if store is not None:
            store.crash()

    def wrote(self, process: int) -> None:
        """``process`` appends: it must hold the lock."""
        holding = self.locks.holding(self.path)
        epoch = holding.epoch if holding is not None else 0
        self.writers.setdefault(epoch, set()).add(process)
        if holding is None or holding.process != process:
            holder = "nobody" if holding is None else f"process {holding.process}"
            text = (f"process {process} appended to the shared store while {holder} "
                    f"held its lock (epoch {epoch}): two writers")
            if text not in self.violations:
                self.violations.append(text)


@dataclass
class _Pair:
    """The two nodes as the supervisor sees them."""

    process: dict[str, int | None] = field(default_factory=dict)
    role: dict[str, StoreRole] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _config(host: str) -> ServerConfig:
    peer = NODES[1 - NODES.index(host)]
    return ServerConfig(host=host, port=PORT, stomp_port=0, amqp_port=0, data=DATA,
                        ha="shared-store", ha_port=HA_PORT, ha_peer=f"{peer}:{HA_PORT}",
                        heartbeat_interval=HEARTBEAT_S, activation_interval=ACTIVATION_S,
                        ha_secret=SECRET)


async def _node(loop: SimLoop, world: World, disk: SharedDisk, pair: _Pair, host: str,
                plants: frozenset[str]) -> None:
    """One node's process: ``txbroker serve --ha shared-store`` on the shared disk."""
    held: list[SharedStoreNode] = []
    locks: LockOpener = (_IgnoringLocks(disk.locks, held)
                         if "standby-ignores-lock" in plants else disk.locks)

    def on_role(role: StoreRole, server: BrokerServer | None) -> None:
        pair.role[host] = role
        world.log(f"{loop.time():.6f} {host} {role.value}")

    node = SharedStoreNode(_config(host), on_role=on_role, store_opener=disk.open,
                           locks=locks, clock=lambda: EPOCH_MS + int(loop.time() * 1000))
    node.security.nonces = loop.random.randbytes
    held.append(node)
    process = PROCESS.get()
    try:
        await node.run()
    except Exception as exc:  # a node that died of an error is a finding
        if process in loop.dead:  # its coroutine closed after the run: no news
            raise
        pair.failures.append(f"node {host} raised {exc!r}")
        world.log(f"{loop.time():.6f} {host} raised {exc!r}")


def run_shared_store_live(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``shared-store-live``; returns the violations."""
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    locks = SimLocks(loop, world)
    disk = SharedDisk(loop, locks, store_lock_path(_config(NODES[0])))
    record = Record()
    pair = _Pair()
    left: list[int] = []
    # sends answered when the healed phase began, and at its end; the roles at its end
    answered: list[int] = []
    final_roles: list[str] = []

    def answered_now() -> int:
        return sum(1 for outcome in record.sent.values() if outcome == "ok")

    def start(host: str) -> None:
        pair.process[host], _ = loop.spawn(host, _node(loop, world, disk, pair, host, plants))
        world.log(f"{loop.time():.6f} {host} started")

    def kill(host: str) -> None:
        process = pair.process[host]
        if process is None:
            return
        loop.kill(process)
        disk.crash(process)
        pair.process[host] = None
        world.log(f"{loop.time():.6f} {host} killed ({pair.role[host].value})")
        pair.role[host] = StoreRole.STOPPED  # until its next process says otherwise

    async def restart_later(host: str) -> None:
        await asyncio.sleep(loop.random.uniform(*RESTART_S))
        if pair.process[host] is None:
            start(host)

    async def fault(restarts: list[asyncio.Task[None]], fault_end: float) -> None:
        running = [host for host in NODES if pair.process[host] is not None]
        kind = loop.random.choice(("kill-active", "kill-standby", "pause", "partition"))
        if kind.startswith("kill"):
            wanted = StoreRole.ACTIVE if kind == "kill-active" else StoreRole.STANDBY
            for host in running:
                if pair.role.get(host) is wanted:
                    kill(host)
                    restarts.append(asyncio.ensure_future(restart_later(host)))
                    return
        elif kind == "pause" and running:
            host = loop.random.choice(running)
            process = pair.process[host]
            assert process is not None
            loop.pause(process)
            stopped = min(loop.random.uniform(*PAUSE_S), fault_end - loop.time())
            world.log(f"{loop.time():.6f} {host} stopped for {stopped:.3f} s")
            await asyncio.sleep(stopped)
            if process not in loop.dead:
                loop.resume(process)
            world.log(f"{loop.time():.6f} {host} continued")
        elif kind == "partition":
            one_way = loop.random.random() < 0.5
            loop.network.partition(NODES[0], NODES[1], one_way=one_way)
            cut = min(loop.random.uniform(*PARTITION_S), fault_end - loop.time())
            world.log(f"{loop.time():.6f} pair link cut ({'one way' if one_way else 'both'})"
                      f" for {cut:.3f} s")
            await asyncio.sleep(cut)
            loop.network.heal()
            world.log(f"{loop.time():.6f} pair link healed")

    async def main() -> None:
        for host in NODES:
            start(host)
            await asyncio.sleep(0.02)  # the first one takes the lock
        await asyncio.sleep(0.05)
        fault_end = loop.time() + FAULT_S
        sends_end = fault_end + HEAL_SEND_S
        end = fault_end + HEAL_S
        clients = [loop.spawn(f"127.0.1.{n + 1}", producer(loop, world, n, record,
                                                             sends_end, url=URL))[1]
                   for n in range(PRODUCERS)]
        clients += [loop.spawn(f"127.0.2.{n + 1}",
                               consumer(loop, world, record, end, url=URL))[1]
                    for n in range(CONSUMERS)]
        restarts: list[asyncio.Task[None]] = []
        while True:
            gap = loop.random.expovariate(1 / MEAN_FAULT_GAP_S)
            await asyncio.sleep(min(gap, fault_end - loop.time()))
            if loop.time() >= fault_end:
                break
            await fault(restarts, fault_end)
        world.log(f"{loop.time():.6f} healed phase")
        await asyncio.gather(*restarts)
        for host in NODES:
            if pair.process[host] is None:
                start(host)
        answered.append(answered_now())
        for client in clients:
            try:
                await client
            except Exception as exc:  # a client that died is a finding
                record.failures.append(f"a client raised {exc!r}")
        answered.append(answered_now())
        final_roles.extend(sorted(pair.role[host].value for host in NODES))
        _, counting = loop.spawn("127.0.3.1", left_in_queue(loop, url=URL))
        left.append(await counting)

    with captured_logs(world, loop):
        loop.run(main())
    world.log(f"network {loop.network.trace_hash()}")
    violations = [f"unhandled in the event loop: {error}" for error in loop.errors]
    violations += pair.failures + disk.violations
    if answered[1] <= answered[0]:
        violations.append("no send was answered in the healed phase (no progress)")
    if final_roles != ["active", "standby"]:
        violations.append(f"at the end of the healed phase the roles are {final_roles}, "
                          "not one active and one standby")
    return violations + check_queue(record, left[0])
