"""Scenario ``shared-store-live`` (``sim/live_shared_store.py``) and what it stands on:
``SimLoop.pause``/``resume`` (SIGSTOP, SIGCONT), the model of the store's lock, the
shared disk's writer check — and the production shared-store pair on them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from txbroker.core.ha.shared_store_role import StoreRole
from txbroker.sim import run_seed
from txbroker.sim.live_shared_store import (
    NODES,
    SharedDisk,
    SimLocks,
    run_shared_store_live,
)
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World
from txbroker.storage.memory import MemoryStore
from txbroker.storage.store_lock import StoreLock

LOCK = Path("/shared/txbroker/journal/lock")


def test_a_paused_process_misses_nothing_and_runs_later() -> None:
    loop = SimLoop(1)
    seen: list[tuple[str, float]] = []

    async def ticker(name: str) -> None:
        for _ in range(3):
            await asyncio.sleep(0.1)
            seen.append((name, round(loop.time(), 6)))

    async def main() -> None:
        stopped, stopped_task = loop.spawn("127.0.0.20", ticker("stopped"))
        _, running_task = loop.spawn("127.0.0.21", ticker("running"))
        await asyncio.sleep(0.15)
        loop.pause(stopped)
        assert loop.paused == {stopped}
        await asyncio.sleep(0.3)  # its timers fall due meanwhile: none runs
        assert [name for name, _ in seen] == ["stopped", "running", "running", "running"]
        loop.resume(stopped)
        await asyncio.gather(stopped_task, running_task)

    loop.run(main())
    assert seen == [("stopped", 0.1), ("running", 0.1), ("running", 0.2), ("running", 0.3),
                    ("stopped", 0.45), ("stopped", 0.55)]


def test_bytes_to_a_paused_process_wait_and_a_killed_one_is_not_resumed() -> None:
    loop = SimLoop(2)
    got: list[tuple[bytes, float]] = []

    async def server() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.append((await reader.read(100), round(loop.time(), 3)))

        await asyncio.start_server(handle, "127.0.0.30", 7000)
        await asyncio.sleep(10)

    async def main() -> None:
        process, _ = loop.spawn("127.0.0.30", server())
        await asyncio.sleep(0.01)
        loop.pause(process)
        _, writer = await asyncio.open_connection("127.0.0.30", 7000)  # accepted later
        writer.write(b"hello")
        await asyncio.sleep(0.5)
        assert got == []
        resumed = round(loop.time(), 3)
        loop.resume(process)
        await asyncio.sleep(0.01)
        assert got == [(b"hello", resumed)]  # accepted and read at once
        loop.pause(process)
        loop.kill(process)
        assert loop.paused == set()
        await asyncio.sleep(0.1)

    loop.run(main())


def test_the_lock_model_has_one_holder_released_by_death_not_by_a_stop() -> None:
    loop = SimLoop(3)
    locks = SimLocks(loop, World(3))
    outcomes: dict[str, object] = {}

    async def first() -> None:
        outcomes["first"] = locks.try_acquire(LOCK, "a")
        outcomes["first again"] = locks.try_acquire(LOCK, "a")  # OFD: refused too
        await asyncio.sleep(10)

    async def second() -> None:
        outcomes["second"] = locks.try_acquire(LOCK, "b")
        await asyncio.sleep(0.2)
        outcomes["second while the first is stopped"] = locks.try_acquire(LOCK, "b")
        await asyncio.sleep(0.2)
        outcomes["second after the first died"] = locks.try_acquire(LOCK, "b")

    async def main() -> None:
        holder, _ = loop.spawn("127.0.0.40", first())
        await asyncio.sleep(0.01)
        _, contender = loop.spawn("127.0.0.41", second())
        await asyncio.sleep(0.1)
        loop.pause(holder)
        await asyncio.sleep(0.2)
        taken = outcomes["first"]
        assert isinstance(taken, StoreLock) and taken.held  # a stop keeps it
        loop.kill(holder)
        assert not taken.held  # the kernel drops it with the process
        await contender

    loop.run(main())
    assert outcomes["first again"] is None
    assert outcomes["second"] is None
    assert outcomes["second while the first is stopped"] is None
    assert outcomes["second after the first died"] is not None
    assert locks.epoch == 2
    assert locks.holder(LOCK) == "pid 2 on 127.0.0.41 (b)"


def test_the_shared_disk_names_a_writer_without_the_lock() -> None:
    loop = SimLoop(4)
    locks = SimLocks(loop, World(4))
    disk = SharedDisk(loop, locks, LOCK)

    async def writer(take: bool) -> None:
        if take:
            assert locks.try_acquire(LOCK, "active") is not None
        store = disk.open(lambda work: work(), lambda: (0, b""), None)
        assert isinstance(store, MemoryStore)
        list(store.recover())
        store.append(1, b"meta", [b"body"], lambda error: None)
        await asyncio.sleep(1)

    async def main() -> None:
        loop.spawn("127.0.0.50", writer(take=True))
        await asyncio.sleep(0.1)
        loop.spawn("127.0.0.51", writer(take=False))
        await asyncio.sleep(0.1)

    loop.run(main())
    assert disk.writers == {1: {1, 2}}
    assert disk.violations == ["process 2 appended to the shared store while process 1 "
                               "held its lock (epoch 1): two writers"]


def test_a_seed_is_a_run_of_the_pair() -> None:
    """One seed: the first node takes the lock, the other follows it; faults move the
    role; the checkers find nothing; the trace says who held the lock when."""
    world = World(5)
    assert run_shared_store_live(world, frozenset()) == []
    trace = "\n".join(world.trace)
    assert f"{NODES[0]} {StoreRole.ACTIVE.value}" in trace
    assert f"{NODES[1]} {StoreRole.STANDBY.value}" in trace
    assert "lock epoch 1: process 1" in trace


def test_the_planted_two_writers_are_caught() -> None:
    """Plant ``standby-ignores-lock``: the writer check names the second writer."""
    for seed in range(20):
        found = run_seed("shared-store-live", seed, "standby-ignores-lock").violations
        if any("two writers" in violation for violation in found):
            return
    pytest.fail("standby-ignores-lock: no two writers in 20 seeds")
