"""Scenario ``queue-live``: the production broker server and the production client
library, on the deterministic event loop, with the broker killed at random points.

Unlike ``queue`` (``queue_scenario.py``), which drives the core and models the edge,
everything here is the code users run: ``BrokerServer`` (the native edge, the
operation layer, the core, the effect loop, group commit), and ``txbroker.aio``
clients with failover — on a :class:`~txbroker.sim.loop.SimLoop` (virtual time, an
in-memory network, each process in its own context). Only the disk is a model: a
``MemoryStore`` whose group syncs complete after a virtual delay and whose crash
keeps the synced entries only (``storage/memory.py``).

- **The broker** is a simulated process on 127.0.0.10:5445. During the fault phase a
  supervisor kills it (as ``kill -9``: none of its callbacks runs again, its
  connections are reset, what it had not synced is lost) and starts a new one on the
  same data and address after a pause.
- **Producers** send persistent messages with message ids (so a send carried over a
  failover is not stored twice: the duplicate window), one in four as a local
  transaction of two sends.
- **Consumers** receive and acknowledge (waiting for the ack's answer), through the
  fault phase and a healed phase in which the queue drains.

(The clients and the checkers are ``sim/live_clients.py``'s, shared with
``shared-store-live``, ``replicated-live`` and ``replicated-etcd-live``.)

Checkers, at the end:

- no acknowledged send lost: every send (and every send of a transaction whose
  commit) the broker answered was delivered;
- no second delivery without the redelivered flag, and no duplicate: a message id is
  delivered once, and again only as a redelivery;
- no answered ack undone: a message whose ack was answered is not delivered after
  that answer;
- local transactions all-or-nothing: of a transaction's two messages both were
  delivered or neither (both, when its commit was answered);
- the queue is empty at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from txbroker.server.app import BrokerServer
from txbroker.sim.live import SimDisk, captured_logs, run_broker, seed_client_jitter
from txbroker.sim.live_clients import Record, check_queue, consumer, left_in_queue, producer
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World

BROKER = "127.0.0.10"
PORT = 5445
#: The broker's URL (other scenarios give their clients a failover list instead).
URL = f"txb://{BROKER}:{PORT}"
#: Virtual lengths of the fault phase and of the healed phase (s).
FAULT_S = 2.0
HEAL_S = 6.0
#: Mean time between broker kills in the fault phase, and the restart pause (s).
MEAN_KILL_GAP_S = 0.5
RESTART_S = (0.001, 0.06)
PRODUCERS = 2
CONSUMERS = 2
#: ``queue-live-checkpoints``: the running broker's checkpoint interval, drawn per seed (s).
CHECKPOINT_INTERVAL_S = (0.02, 0.4)


def run_queue_live(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``queue-live``; returns the violations."""
    return _run(world, plants, checkpoints=False)


def run_queue_live_checkpoints(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``queue-live-checkpoints``: ``queue-live`` with the broker's recovery
    checkpoints on — written while it runs, every interval drawn per seed, and at the
    clean stops (SIGTERM) that one fault in three is instead of a kill — so that its
    starts read a checkpoint and the log after it. The trace says which did."""
    return _run(world, plants, checkpoints=True)


def _run(world: World, plants: frozenset[str], *, checkpoints: bool) -> list[str]:
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    disk = SimDisk(loop, checkpoints=checkpoints)
    record = Record()
    left: list[int] = []
    interval = loop.random.uniform(*CHECKPOINT_INTERVAL_S) if checkpoints else 0.0
    servers: list[BrokerServer] = []

    def broker() -> Coroutine[Any, Any, None]:
        return run_broker(loop, disk, BROKER, PORT, checkpoint_interval=interval,
                          started=servers.append)

    async def main() -> None:
        process, running = loop.spawn(BROKER, broker())
        await asyncio.sleep(0.01)
        fault_end = loop.time() + FAULT_S
        end = fault_end + HEAL_S
        clients = [loop.spawn(f"127.0.1.{n + 1}", producer(loop, world, n, record,
                                                             fault_end, url=URL))[1]
                   for n in range(PRODUCERS)]
        clients += [loop.spawn(f"127.0.2.{n + 1}",
                               consumer(loop, world, record, end, url=URL))[1]
                    for n in range(CONSUMERS)]
        while True:
            await asyncio.sleep(loop.random.expovariate(1 / MEAN_KILL_GAP_S))
            if loop.time() >= fault_end:
                break
            if checkpoints and loop.random.random() < 1 / 3:
                servers[-1].request_stop()  # SIGTERM: it writes its checkpoint at the close
                await running
                world.log(f"{loop.time():.6f} broker stopped")
            else:
                loop.kill(process)
                disk.crash(lying="live-fsync-lies" in plants)
                world.log(f"{loop.time():.6f} broker killed")
            await asyncio.sleep(loop.random.uniform(*RESTART_S))
            process, running = loop.spawn(BROKER, broker())
            world.log(f"{loop.time():.6f} broker started")
            if checkpoints:
                await asyncio.sleep(0)  # (its recovery ran: the start is synchronous)
                stats = disk.store.stats() if disk.store is not None else None
                if stats is not None and stats.recovered_from_checkpoint:
                    world.log(f"{loop.time():.6f} it read a checkpoint and "
                              f"{stats.recovered_entries - 1} entries after it")
        for client in clients:
            try:
                await client
            except Exception as exc:  # a client that died is a finding
                record.failures.append(f"a client raised {exc!r}")
        _, counting = loop.spawn("127.0.3.1", left_in_queue(loop, url=URL))
        left.append(await counting)

    with captured_logs(world, loop):
        loop.run(main())
    world.log(f"network {loop.network.trace_hash()}")
    violations = [f"unhandled in the event loop: {error}" for error in loop.errors]
    return violations + check_queue(record, left[0])
