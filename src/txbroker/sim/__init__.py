"""A deterministic simulation of txbroker (issue 27, first slice).

The real core (``txbroker.core.Broker`` and its router) runs in one thread under one
seed, over a simulated clock, disk and network (``txbroker/sim/world.py``,
``txbroker/sim/node.py``); scenarios drive it with simulated producers, consumers,
router clients and partition servers, crash it, and check what every actor was told
against what happened (docs/simulation.md). Nothing here reads the wall clock,
starts a thread or draws from global randomness: a seed and a commit replay a run
exactly. Run it with ``python -m txbroker.sim``.
"""

from __future__ import annotations

from txbroker.sim.plants import PLANTS, Plant
from txbroker.sim.runner import SCENARIOS, SeedResult, run_seed, run_seeds
from txbroker.sim.world import World

__all__ = ["PLANTS", "SCENARIOS", "Plant", "SeedResult", "World", "run_seed", "run_seeds"]
