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
from dataclasses import dataclass, field

from txbroker.client.aio import AsyncConnection
from txbroker.errors import NotFound, TxBrokerError
from txbroker.sim.live import (
    SimDisk,
    captured_logs,
    connect_retrying,
    run_broker,
    seed_client_jitter,
)
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World

BROKER = "127.0.0.10"
PORT = 5445
#: The broker's URL (other scenarios give their clients a failover list instead).
URL = f"txb://{BROKER}:{PORT}"
QUEUE = "orders"
#: Virtual lengths of the fault phase and of the healed phase (s).
FAULT_S = 2.0
HEAL_S = 6.0
#: Mean time between broker kills in the fault phase, and the restart pause (s).
MEAN_KILL_GAP_S = 0.5
RESTART_S = (0.001, 0.06)
PRODUCERS = 2
CONSUMERS = 2
#: Pause between a producer's sends (s, uniform).
SEND_GAP_S = (0.0, 0.01)
#: How long a failing-over client keeps trying (s): longer than any outage here.
FAILOVER_TIMEOUT_S = 30.0


@dataclass
class Record:
    """What the clients were told, and what they saw."""

    #: message id -> "ok" (the send or its commit was answered) or "unknown"
    sent: dict[str, str] = field(default_factory=dict)
    #: transaction number -> its two message ids, and whether its commit was answered
    transactions: dict[int, tuple[list[str], bool]] = field(default_factory=dict)
    #: deliveries: (virtual time, message id, redelivered)
    delivered: list[tuple[float, str, bool]] = field(default_factory=list)
    #: message id -> virtual time its ack was answered
    acked: dict[str, float] = field(default_factory=dict)
    #: what went wrong outside the checkers' view (a client that raised)
    failures: list[str] = field(default_factory=list)


async def _connect(loop: SimLoop, url: str) -> AsyncConnection:
    return await connect_retrying(loop, url,
                                  failover_timeout=FAILOVER_TIMEOUT_S, timeout=5.0)


async def _producer(loop: SimLoop, world: World, number: int, record: Record,
                    until: float, *, url: str = URL) -> None:
    conn = await _connect(loop, url)
    count = 0
    while loop.time() < until:
        count += 1
        if count % 4 == 0:
            tx_number = number * 1_000_000 + count
            ids = [f"p{number}-{count}-a", f"p{number}-{count}-b"]
            for message_id in ids:
                record.sent[message_id] = "unknown"
            record.transactions[tx_number] = (ids, False)
            try:
                tx = conn.transaction()
                for message_id in ids:
                    await tx.send(QUEUE, message_id.encode(), message_id=message_id)
                await tx.commit()
            except (TxBrokerError, TimeoutError):  # the outcome is unknown
                continue
            record.transactions[tx_number] = (ids, True)
            for message_id in ids:
                record.sent[message_id] = "ok"
            world.log(f"{loop.time():.6f} commit {ids}")
        else:
            message_id = f"p{number}-{count}"
            record.sent[message_id] = "unknown"
            try:
                await conn.send(QUEUE, message_id.encode(), message_id=message_id)
            except (TxBrokerError, TimeoutError):  # the outcome is unknown
                continue
            record.sent[message_id] = "ok"
            world.log(f"{loop.time():.6f} sent {message_id}")
        await asyncio.sleep(loop.random.uniform(*SEND_GAP_S))
    await conn.close()


async def _consumer(loop: SimLoop, world: World, record: Record, until: float, *,
                    url: str = URL) -> None:
    conn = await _connect(loop, url)
    while loop.time() < until:
        try:
            message = await conn.receive(QUEUE, timeout=0.1)
        except (TxBrokerError, TimeoutError):
            continue
        if message is None:
            continue
        message_id = message.body.decode()
        record.delivered.append((loop.time(), message_id, message.redelivered))
        world.log(f"{loop.time():.6f} delivered {message_id} {message.redelivered}")
        try:
            await message.ack(wait=True)
        except (TxBrokerError, TimeoutError):
            continue
        record.acked[message_id] = loop.time()
    await conn.close()


async def _left_in_queue(loop: SimLoop, *, url: str = URL) -> int:
    conn = await _connect(loop, url)
    try:
        info = await conn.queue_info(QUEUE)
    except NotFound:  # never made (nothing was sent): nothing left
        return 0
    finally:
        await conn.close()
    return int(info["messages"])


def run_queue_live(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``queue-live``; returns the violations."""
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    disk = SimDisk(loop)
    record = Record()
    left: list[int] = []

    async def main() -> None:
        process, _ = loop.spawn(BROKER, run_broker(loop, disk, BROKER, PORT))
        await asyncio.sleep(0.01)
        fault_end = loop.time() + FAULT_S
        end = fault_end + HEAL_S
        clients = [loop.spawn(f"127.0.1.{n + 1}", _producer(loop, world, n, record,
                                                              fault_end))[1]
                   for n in range(PRODUCERS)]
        clients += [loop.spawn(f"127.0.2.{n + 1}", _consumer(loop, world, record, end))[1]
                    for n in range(CONSUMERS)]
        while True:
            await asyncio.sleep(loop.random.expovariate(1 / MEAN_KILL_GAP_S))
            if loop.time() >= fault_end:
                break
            loop.kill(process)
            disk.crash(lying="live-fsync-lies" in plants)
            world.log(f"{loop.time():.6f} broker killed")
            await asyncio.sleep(loop.random.uniform(*RESTART_S))
            process, _ = loop.spawn(BROKER, run_broker(loop, disk, BROKER, PORT))
            world.log(f"{loop.time():.6f} broker started")
        for client in clients:
            try:
                await client
            except Exception as exc:  # a client that died is a finding
                record.failures.append(f"a client raised {exc!r}")
        _, counting = loop.spawn("127.0.3.1", _left_in_queue(loop))
        left.append(await counting)

    with captured_logs(world, loop):
        loop.run(main())
    world.log(f"network {loop.network.trace_hash()}")
    violations = [f"unhandled in the event loop: {error}" for error in loop.errors]
    return violations + _check(record, left[0])


def _check(record: Record, left: int) -> list[str]:
    violations: list[str] = list(record.failures)
    if not any(outcome == "ok" for outcome in record.sent.values()):
        violations.append("no send was answered: the run tested nothing")
    first: dict[str, float] = {}
    for at, message_id, redelivered in record.delivered:
        if message_id in first and not redelivered:
            violations.append(f"{message_id} delivered again at {at:.6f} without the "
                              "redelivered flag (a duplicate, or a lost delivery mark)")
        first.setdefault(message_id, at)
        acked_at = record.acked.get(message_id)
        if acked_at is not None and at > acked_at:
            violations.append(f"{message_id} delivered at {at:.6f} after its ack was "
                              f"answered at {acked_at:.6f}")
    for message_id, outcome in record.sent.items():
        if outcome == "ok" and message_id not in first:
            violations.append(f"{message_id}: its send was answered but it was never "
                              "delivered (lost)")
    violations.extend(f"{message_id} delivered but never sent"
                      for message_id in first if message_id not in record.sent)
    for number, (ids, committed) in record.transactions.items():
        seen = [message_id in first for message_id in ids]
        if any(seen) and not all(seen):
            violations.append(f"transaction {number}: only part of it was delivered: "
                              f"{dict(zip(ids, seen, strict=True))}")
        if committed and not all(seen):
            violations.append(f"transaction {number}: committed but not delivered")
    if left:
        violations.append(f"{left} messages left in the queue after the healed phase")
    return violations
