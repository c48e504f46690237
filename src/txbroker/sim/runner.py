"""Running scenarios: one seed (with its trace), or many (with a summary)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from txbroker.sim.bank_scenario import run_bank, run_bank_failing_fsync, run_bank_resets
from txbroker.sim.live_bank import run_bank_live
from txbroker.sim.live_bank_replicated import run_bank_replicated_live
from txbroker.sim.live_bank_sites import run_bank_sites_live
from txbroker.sim.live_etcd import run_replicated_etcd_live
from txbroker.sim.live_queue import run_queue_live, run_queue_live_checkpoints
from txbroker.sim.live_replicated import run_replicated_live, run_replicated_live_checkpoints
from txbroker.sim.live_shared_store import run_shared_store_live
from txbroker.sim.live_xa import run_xa_live
from txbroker.sim.loop import SimulationStalled, SimulationStuck
from txbroker.sim.plants import PLANTS
from txbroker.sim.queue_scenario import run_queue, run_queue_failing_fsync
from txbroker.sim.world import World

#: Scenario name -> its run function (world, plants) -> violations.
SCENARIOS: Final[dict[str, Callable[[World, frozenset[str]], list[str]]]] = {
    "queue": run_queue,
    "queue-failing-fsync": run_queue_failing_fsync,
    "queue-live": run_queue_live,
    "queue-live-checkpoints": run_queue_live_checkpoints,
    "router-bank": run_bank,
    "router-bank-failing-fsync": run_bank_failing_fsync,
    "router-bank-resets": run_bank_resets,
    "router-bank-live": run_bank_live,
    "router-bank-sites-live": run_bank_sites_live,
    "router-bank-replicated-live": run_bank_replicated_live,
    "xa-live": run_xa_live,
    "replicated-live": run_replicated_live,
    "replicated-live-checkpoints": run_replicated_live_checkpoints,
    "replicated-etcd-live": run_replicated_etcd_live,
    "shared-store-live": run_shared_store_live,
}


@dataclass
class SeedResult:
    """One seed's run: its violations, trace and trace hash."""

    scenario: str
    seed: int
    violations: list[str]
    trace: list[str] = field(repr=False)
    trace_hash: str


def run_seed(scenario: str, seed: int, plant: str | None = None) -> SeedResult:
    """Run one seed of a scenario (with a planted bug, if named)."""
    run = SCENARIOS.get(scenario)
    if run is None:
        raise ValueError(f"unknown scenario {scenario!r}; try one of {sorted(SCENARIOS)}")
    plants: frozenset[str] = frozenset()
    if plant is not None:
        found = PLANTS.get(plant)
        if found is None:
            raise ValueError(f"unknown plant {plant!r}; try one of {sorted(PLANTS)}")
        if not found.applies_to(scenario):
            raise ValueError(f"plant {plant!r} applies to scenario {found.scenario!r}")
        plants = frozenset({plant})
    world = World(seed)
    world.log(f"scenario {scenario} seed {seed} plant {plant}")
    try:
        violations = run(world, plants)
    except (SimulationStalled, SimulationStuck) as exc:  # the run's verdict, not a crash
        violations = [str(exc)]
    for violation in violations:
        world.log(f"VIOLATION {violation}")
    return SeedResult(scenario, seed, violations, world.trace, world.trace_hash)


def run_seeds(scenario: str, seeds: int, first_seed: int = 0, plant: str | None = None,
              progress: Callable[[int], None] | None = None) -> list[SeedResult]:
    """Run ``seeds`` consecutive seeds from ``first_seed``."""
    results = []
    for n in range(seeds):
        results.append(run_seed(scenario, first_seed + n, plant))
        if progress is not None:
            progress(n + 1)
    return results
