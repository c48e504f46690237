"""Bounded runs (docs/simulation.md, "Bounded runs"): a run past its cap of loop steps
ends with the stuck verdict instead of running (and growing) for ever, and while the
cyclic collector is off the loop collects at fixed step counts."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import subprocess
import sys

import pytest

from txbroker.sim import SCENARIOS, World, run_seed
from txbroker.sim import loop as sim_loop
from txbroker.sim.loop import SimLoop, SimulationStuck

STUCK = r"^stuck: \d+ steps / \d+\.\d{3} virtual seconds, and the run is not over$"


def test_a_loop_that_retries_for_ever_is_stuck_at_its_cap_and_closes() -> None:
    loop = SimLoop(1, max_steps=1000)
    tries: list[float] = []

    async def main() -> None:
        while True:  # an actor retrying for ever: virtual time goes on
            tries.append(loop.time())
            await asyncio.sleep(0.01)

    with pytest.raises(SimulationStuck, match=r"^stuck: 1001 steps / 5\.000 virtual "):
        loop.run(main())
    assert len(tries) == 501  # two steps a try: the timer's, then the task's
    assert loop.is_closed()


def test_a_run_that_only_sleeps_takes_few_steps() -> None:
    loop = SimLoop(1, max_steps=12)

    async def main() -> None:
        for _ in range(5):
            await asyncio.sleep(3600)

    loop.run(main())  # two steps a sleep, one to start, one to stop: within the cap
    assert loop.time() == 5 * 3600.0
    assert loop.steps == 16  # and four of the shutdown, which may go past it


def test_the_loop_collects_every_so_many_steps_while_the_collector_is_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_loop, "COLLECT_EVERY_STEPS", 100)
    collections: list[int] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            collections.append(1)

    async def main(loop: SimLoop) -> None:
        for _ in range(1000):
            await asyncio.sleep(0.001)

    gc.callbacks.append(counted)
    enabled = gc.isenabled()
    try:
        gc.disable()
        loop = SimLoop(1)
        loop.run(main(loop))
        steps = loop.steps
    finally:
        gc.callbacks.remove(counted)
        if enabled:
            gc.enable()
    assert 2000 <= steps < 2100  # two a sleep, and the shutdown's
    assert len(collections) == steps // 100


def test_the_runner_reports_a_stuck_run_as_the_seeds_violation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_loop, "MAX_STEPS", 3000)  # a queue-live seed takes more
    result = run_seed("queue-live", 1)
    assert len(result.violations) == 1 and re.match(STUCK, result.violations[0])
    assert result.violations[0].startswith("stuck: 3001 steps / ")
    assert result.trace[-1].endswith(f" VIOLATION {result.violations[0]}")
    assert run_seed("queue-live", 1).trace_hash == result.trace_hash  # it replays


#: A replicated-live run whose operator promotes nobody never finishes (no primary:
#: the clients retry for ever) and keeps the collector off. With the cap and the
#: collection interval below, its resident memory grows by less than GROWTH_BOUND_MB
#: (measured: 114 MB); without the loop's collections it grew by 164 MB, and at the
#: real cap (MAX_STEPS, collections every COLLECT_EVERY_STEPS) by 349 MB
#: (docs/simulation.md, "Bounded runs").
STUCK_STEPS = 150_000
COLLECT_STEPS = 50_000
GROWTH_BOUND_MB = 150

_STUCK_RUN = f"""
import json, resource
from txbroker.sim import loop
loop.MAX_STEPS, loop.COLLECT_EVERY_STEPS = {STUCK_STEPS}, {COLLECT_STEPS}
from txbroker.sim.live_replicated import run_replicated_live
from txbroker.sim.world import World
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    run_replicated_live(World(1), frozenset(), promotes=False)
    verdict = None
except loop.SimulationStuck as exc:
    verdict = str(exc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"verdict": verdict, "growth_mb": (after - before) / 1024}}))
"""


def test_a_run_that_can_never_finish_ends_stuck_within_bounded_memory() -> None:
    done = subprocess.run([sys.executable, "-c", _STUCK_RUN], capture_output=True,
                          text=True, check=True)
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert outcome["verdict"] is not None and re.match(STUCK, outcome["verdict"])
    assert outcome["verdict"].startswith(f"stuck: {STUCK_STEPS + 1} steps / ")
    assert outcome["growth_mb"] < GROWTH_BOUND_MB


def test_the_runner_reports_a_stalled_run_as_the_seeds_violation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def stalls(world: World, plants: frozenset[str]) -> list[str]:
        loop = SimLoop(world.rng.getrandbits(63))
        loop.run(loop.create_future())  # waits for nothing that will come
        return []

    monkeypatch.setitem(SCENARIOS, "queue", stalls)
    result = run_seed("queue", 1)
    assert len(result.violations) == 1
    assert result.violations[0].startswith("at virtual time 0.000000 s nothing is ready")
