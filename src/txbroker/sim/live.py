"""What the scenarios on the deterministic event loop share (``live_*.py``): a
broker's simulated disk, a broker process, and the broker's logs in the trace."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from txbroker.aio import connect
from txbroker.client._failover import JITTER
from txbroker.client.aio import AsyncConnection
from txbroker.errors import TxBrokerError
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World
from txbroker.storage.interface import Dispatch, SnapshotProvider, Store
from txbroker.storage.memory import MemoryState, MemoryStore
from txbroker.storage.store_lock import StoreLock

__all__ = ["EPOCH_MS", "SYNC_S", "SimDisk", "captured_logs", "connect_retrying",
           "run_broker", "seed_client_jitter"]

#: The broker's wall clock at virtual time 0 (ms): 2026-01-01.
EPOCH_MS = 1_767_225_600_000
#: A group sync's duration (s, uniform).
SYNC_S = (0.0005, 0.008)


class SimDisk:
    """A broker's disk: a MemoryState that outlives each broker process, and the
    store of the process now running (crashed with it)."""

    def __init__(self, loop: SimLoop, *, checkpoints: bool = False) -> None:
        self.loop = loop
        self.state = MemoryState()
        self.store: MemoryStore | None = None
        #: the stores keep recovery checkpoints (``recovery_checkpoint``)
        self.checkpoints = checkpoints

    def open(self, dispatch: Dispatch, snapshot: SnapshotProvider,
             lock: StoreLock | None) -> Store:
        """The broker's ``store_opener``: a MemoryStore over the disk's state whose
        group syncs take :data:`SYNC_S` of virtual time."""
        loop = self.loop

        def slow_dispatch(work: Any) -> None:  # a group sync takes a while
            loop.call_later(loop.random.uniform(*SYNC_S), dispatch, work)

        self.store = MemoryStore(self.state, dispatch=slow_dispatch,
                                 snapshot_provider=snapshot, checkpoints=self.checkpoints)
        return self.store

    def crash(self, *, lying: bool = False) -> None:
        """The machine lost its page cache: what was not synced is gone. ``lying``
        (the ``live-fsync-lies`` plant): the last synced entry is gone too, as on a
        disk that reports a sync done before it is."""
        if self.store is not None:
            self.store.crash()
            self.store = None
        if lying and self.state.entries:
            self.state.entries.pop()


async def run_broker(loop: SimLoop, disk: SimDisk, host: str, port: int,
                     facilities: dict[str, list[dict[str, Any]]] | None = None, *,
                     checkpoint_interval: float = 0.0,
                     started: Callable[[BrokerServer], None] | None = None) -> None:
    """A broker process: ``txbroker serve`` on ``disk``, native port only, the loop's
    virtual clock as its wall clock, ``facilities`` as its configuration file's
    ``[router]`` section; until it is killed, or stopped (``started`` is given the
    server: its ``request_stop`` is SIGTERM). ``checkpoint_interval``: the running
    broker's recovery checkpoints (the disk must keep them)."""
    config = ServerConfig(host=host, port=port, stomp_port=0, amqp_port=0,
                          router_facilities=dict(facilities or {}),
                          recovery_checkpoint=disk.checkpoints,
                          checkpoint_interval=checkpoint_interval)
    server = BrokerServer(config, store_opener=disk.open)
    server.clock = lambda: EPOCH_MS + int(loop.time() * 1000)
    if started is not None:
        started(server)
    await server.start()
    await server.serve_forever()




async def connect_retrying(loop: SimLoop, url: str, **options: Any) -> AsyncConnection:
    """Connect, trying again while the broker is down — as a supervisor restarts a
    program that could not connect at start (the first connect does not fail over)."""
    while True:
        try:
            return await connect(url, **options)
        except (TxBrokerError, TimeoutError, OSError):
            await asyncio.sleep(loop.random.uniform(0.01, 0.05))


def seed_client_jitter(loop: SimLoop) -> None:
    """The client library's one random source (its failover pauses' jitter) drawn from
    the simulation's, so that a seed replays exactly."""
    JITTER.seed(loop.random.getrandbits(64))


class _TraceHandler(logging.Handler):
    def __init__(self, world: World, loop: SimLoop) -> None:
        super().__init__(logging.DEBUG)
        self.world = world
        self.loop = loop

    def emit(self, record: logging.LogRecord) -> None:
        self.world.log(f"{self.loop.time():.6f} log {record.levelname} {record.name}: "
                       f"{record.getMessage()}")


@contextlib.contextmanager
def captured_logs(world: World, loop: SimLoop) -> Iterator[None]:
    """The ``txbroker`` loggers' WARNING and above go to the trace (with virtual time),
    not to stderr, while the run lasts."""
    logger = logging.getLogger("txbroker")
    handler = _TraceHandler(world, loop)
    saved: tuple[int, bool] = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]

