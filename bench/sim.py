"""Benchmark: seeds per second of each simulation scenario (docs/simulation.md).

    python bench/sim.py [--seeds 100] [--first-seed 0] [--scenarios a,b]

Runs ``--seeds`` seeds of every scenario of ``txbroker.sim`` in this process (one
thread: the simulator is single-threaded by design) and writes seeds/second,
violations and the failing seeds per scenario to bench/results/sim-<time>.json, with
the process's CPU seconds beside the wall seconds and the load average before each
scenario (seeds per CPU second is the figure that a busy machine distorts least).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from txbroker import _build
from txbroker.sim import SCENARIOS, run_seeds

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    """Run the benchmark and write its result file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--scenarios", default=None,
                        help="comma-separated names (default: every scenario)")
    args = parser.parse_args()
    names = sorted(SCENARIOS) if args.scenarios is None else args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; try {sorted(SCENARIOS)}")
    load = round(os.getloadavg()[0], 2)  # the machine is shared: say how busy it was
    scenarios = {}
    for name in names:
        load_before = round(os.getloadavg()[0], 2)
        started, cpu_started = time.perf_counter(), time.process_time()
        results = run_seeds(name, args.seeds, args.first_seed)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        failing = [r.seed for r in results if r.violations]
        scenarios[name] = {"seeds": args.seeds, "seconds": round(seconds, 3),
                           "seeds_per_second": round(args.seeds / seconds, 2),
                           "cpu_seconds": round(cpu, 3),
                           "seeds_per_cpu_second": round(args.seeds / cpu, 2),
                           "load_average_1m_before": load_before,
                           "violations": sum(len(r.violations) for r in results),
                           "failing_seeds": failing}
        print(f"{name}: {args.seeds} seeds in {seconds:.1f} s "
              f"({args.seeds / seconds:.1f} seeds/s, {args.seeds / cpu:.1f} per CPU s), "
              f"failing {failing}", flush=True)
    result = {"bench": "sim", "first_seed": args.first_seed, "build": _build.MODE,
              "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "load_average_1m_before": load,
              "scenarios": scenarios}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"sim-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
