"""The trace hashes of a few seeds of each scenario, to show that a change to the
simulator leaves every run as it was (docs/simulation.md, "Bounded runs").

    python bench/sim_traces.py [--seeds 5] [--first-seed 0] [--scenarios a,b] [--out FILE]

Prints one line a seed — ``scenario seed trace_hash steps`` (the event loop's steps,
``-`` for a scenario that has no loop or a build whose loop does not count them) —
and writes the lines to ``--out`` if given. Two files made on two commits compare with
``diff`` (ignore the steps column when one commit does not count them).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from txbroker.sim import SCENARIOS, run_seed
from txbroker.sim.loop import SimLoop


def main() -> None:
    """Run the seeds and print (and write) their hashes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--scenarios", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    names = sorted(SCENARIOS) if args.scenarios is None else args.scenarios.split(",")
    steps: list[int] = []
    original = SimLoop.run

    def counting(self: SimLoop, main: Any) -> Any:  # note each loop's steps at its end
        try:
            return original(self, main)
        finally:
            steps.append(getattr(self, "steps", -1))

    SimLoop.run = counting  # type: ignore[method-assign]
    lines = []
    for name in names:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            steps.clear()
            result = run_seed(name, seed)
            counted = str(max(steps)) if steps and max(steps) >= 0 else "-"
            lines.append(f"{name} {seed} {result.trace_hash} {counted}")
            print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
