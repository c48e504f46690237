"""The simulator's command line (docs/simulation.md)::

    python -m txbroker.sim run --scenario NAME --seeds N [--first-seed S] [--plant BUG]
    python -m txbroker.sim scenarios
    python -m txbroker.sim plants
    python -m txbroker.sim replay --scenario NAME --seed S [--plant BUG]

``run`` prints a progress bar on a terminal and, as its last line, one JSON object
``{"scenario", "seeds", "violations", "failing_seeds", "trace_hash_of_first_seed",
"seconds"}``; it exits 0 when there are no violations. (The CLI measures its own
duration with ``time.perf_counter``: the CLI is not on the simulated path.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from txbroker.sim.plants import PLANTS
from txbroker.sim.runner import SCENARIOS, run_seed, run_seeds


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m txbroker.sim")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run seeds of a scenario")
    run.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    run.add_argument("--seeds", type=int, default=100)
    run.add_argument("--first-seed", type=int, default=0)
    run.add_argument("--plant", choices=sorted(PLANTS))
    commands.add_parser("scenarios", help="the scenarios, one a line")
    commands.add_parser("plants", help="the planted bugs, one a line")
    replay = commands.add_parser("replay", help="print one seed's trace")
    replay.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    replay.add_argument("--seed", type=int, required=True)
    replay.add_argument("--plant", choices=sorted(PLANTS))
    args = parser.parse_args(argv)
    if args.command == "scenarios":
        print("\n".join(sorted(SCENARIOS)))
        return 0
    if args.command == "plants":
        print("\n".join(sorted(PLANTS)))
        return 0
    if args.command == "replay":
        result = run_seed(args.scenario, args.seed, args.plant)
        print("\n".join(result.trace))
        print(f"trace_hash {result.trace_hash}")
        return 1 if result.violations else 0
    if args.plant is not None and not PLANTS[args.plant].applies_to(args.scenario):
        parser.error(f"plant {args.plant} applies to scenario {PLANTS[args.plant].scenario}")
    tty = sys.stderr.isatty()

    def progress(done: int) -> None:
        if tty:
            filled = 40 * done // args.seeds
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (40 - filled)}] {done}/{args.seeds}")
            sys.stderr.flush()

    started = time.perf_counter()
    results = run_seeds(args.scenario, args.seeds, args.first_seed, args.plant, progress)
    seconds = time.perf_counter() - started
    if tty:
        sys.stderr.write("\n")
    failing = [r for r in results if r.violations]
    for result in failing[:5]:
        print(f"seed {result.seed}: {result.violations[0]}"
              + (f" (+{len(result.violations) - 1} more)" if len(result.violations) > 1 else ""))
    print(json.dumps({
        "scenario": args.scenario, "seeds": args.seeds,
        "violations": sum(len(r.violations) for r in results),
        "failing_seeds": [r.seed for r in failing],
        "trace_hash_of_first_seed": results[0].trace_hash if results else None,
        "seconds": round(seconds, 3)}))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
