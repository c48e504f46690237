"""Benchmark: seeds per second of each simulation scenario (docs/simulation.md).

    python bench/sim.py [--seeds 100] [--first-seed 0] [--scenarios a,b]
                        [--procs N] [--chunk K] [--memory-mb M] [--out FILE]

Runs ``--seeds`` seeds (``--first-seed`` on) of every scenario of ``txbroker.sim`` (or
of those named) and writes, per scenario, the seeds' range, seeds/second, CPU seconds
(seeds per CPU second is the figure that a busy machine distorts least), the load
average before it, the violations and the failing seeds (with each one's first
violation) to bench/results/sim-<time>.json.

``--procs N`` (default: the machine's core count) runs the seeds in N child processes
at a time, each given a chunk of ``--chunk`` consecutive seeds (default: enough chunks
for every process to get four) and an address-space limit of ``--memory-mb`` MB
(``resource.setrlimit(RLIMIT_AS)``). A child reports each seed as it finishes it. A
seed that exceeds the limit (a ``MemoryError``), or during which the child dies, is a
failing seed with that reason — not a crash of the bench; the rest of its chunk runs
in a new child. The CPU seconds are the children's (``RUSAGE_CHILDREN``: imports
included). ``--procs 0`` runs every seed in this process, one after another, as the
benchmark did before (no limit). A seed's trace does not depend on the process that
runs it (``tests/sim/test_sim.py``), so a failing seed replays with ``python -m
txbroker.sim replay --scenario NAME --seed S``.

Each seed's outcome is also appended, as it arrives, to ``<out>.seeds.jsonl`` (one
JSON object a line: scenario, seed, violations, first violation): a run stopped before
its end (a session's end, a reboot) keeps every seed it finished, and

    python bench/sim.py --summarize FILE.seeds.jsonl [--out FILE]

writes the same summary from it, with the seeds that ran (``"interrupted": true`` when
some of the asked seeds did not).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from txbroker import _build
from txbroker.sim import SCENARIOS, run_seed

RESULTS = Path(__file__).parent / "results"
#: A child's address-space limit (MB): address space, not resident memory — a stuck
#: replicated-live run maps ~12 GB by its cap of steps (each connection's msgpack
#: Packer maps 128 KiB; docs/simulation.md, "Bounded runs") while ~0.4 GB is resident.
MEMORY_MB = 16384
#: How many chunks each process gets, by default (smaller chunks: a better balance at
#: the end, more interpreter start-ups).
CHUNKS_PER_PROC = 4


@dataclass
class SeedOutcome:
    """One seed's outcome as a child reported it (or as its death told)."""

    seed: int
    violations: int
    first: str | None  #: its first violation (the reason, for a seed that broke a child)


def _child(scenario: str, first: int, count: int, memory_mb: int) -> int:
    """The child's side: run seeds ``first`` .. ``first + count - 1`` of ``scenario``
    under the address-space limit; one JSON line per seed on stdout. After a
    ``MemoryError`` it reports that seed and stops (its parent starts a new child for
    the rest)."""
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for seed in range(first, first + count):
        try:
            result = run_seed(scenario, seed)
        except MemoryError:
            line = {"seed": seed, "violations": 1,
                    "first": f"MemoryError: over the address-space limit of {memory_mb} MB"}
            print(json.dumps(line), flush=True)
            return 0
        except Exception as exc:  # a defect of the simulation: the seed's verdict
            print(json.dumps({"seed": seed, "violations": 1,
                              "first": f"the run raised {exc!r}"}), flush=True)
            continue
        print(json.dumps({"seed": seed, "violations": len(result.violations),
                          "first": result.violations[0] if result.violations else None}),
              flush=True)
    return 0


def _died(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _child_command(scenario: str, first: int, count: int, memory_mb: int) -> list[str]:
    """The command of a child that runs seeds ``first`` .. ``first + count - 1``."""
    return [sys.executable, str(Path(__file__).resolve()), "--child", scenario, str(first),
            str(count), "--memory-mb", str(memory_mb)]


class Progress:
    """Appends each seed's outcome to a JSON-lines file as it arrives (thread-safe)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def __call__(self, scenario: str, outcome: SeedOutcome) -> None:
        if self.path is None:
            return
        line = json.dumps({"scenario": scenario, "seed": outcome.seed,
                           "violations": outcome.violations, "first": outcome.first})
        with self._lock, self.path.open("a") as file:
            file.write(line + "\n")


def _run_chunk(scenario: str, first: int, count: int, memory_mb: int,
               progress: Progress) -> list[SeedOutcome]:
    """Run a chunk of seeds in child processes (a new one after a seed that broke the
    last); every seed of the chunk gets an outcome (each also to ``progress``)."""
    outcomes: list[SeedOutcome] = []
    end = first + count
    next_seed = first
    while next_seed < end:
        child = subprocess.Popen(_child_command(scenario, next_seed, end - next_seed, memory_mb),
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        for line in child.stdout:
            reported = json.loads(line)
            outcomes.append(SeedOutcome(reported["seed"], reported["violations"],
                                        reported["first"]))
            progress(scenario, outcomes[-1])
            next_seed = reported["seed"] + 1
        returncode = child.wait()
        if next_seed < end and returncode != 0:  # it died running next_seed
            outcomes.append(SeedOutcome(
                next_seed, 1, f"the child process died running this seed ({_died(returncode)}; "
                f"address-space limit {memory_mb} MB)"))
            progress(scenario, outcomes[-1])
            next_seed += 1
    return outcomes


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_scenario(name: str, seeds: int, first_seed: int, procs: int, chunk: int,
                 memory_mb: int, progress: Progress | None = None
                 ) -> tuple[list[SeedOutcome], float]:
    """Run the seeds of one scenario; their outcomes (in seed order) and CPU seconds."""
    if procs == 0:
        cpu_started = time.process_time()
        outcomes = []
        for seed in range(first_seed, first_seed + seeds):
            result = run_seed(name, seed)
            outcomes.append(SeedOutcome(seed, len(result.violations),
                                        result.violations[0] if result.violations else None))
            if progress is not None:
                progress(name, outcomes[-1])
        return outcomes, time.process_time() - cpu_started
    chunks = [(start, min(chunk, first_seed + seeds - start))
              for start in range(first_seed, first_seed + seeds, chunk)]
    cpu_started = _children_cpu()
    lock = threading.Lock()
    done: list[SeedOutcome] = []

    def one(piece: tuple[int, int]) -> None:
        got = _run_chunk(name, piece[0], piece[1], memory_mb, progress or Progress(None))
        with lock:
            done.extend(got)

    with ThreadPoolExecutor(procs) as pool:
        list(pool.map(one, chunks))
    return sorted(done, key=lambda outcome: outcome.seed), _children_cpu() - cpu_started


def summary(outcomes: list[SeedOutcome], asked: int, first_seed: int, seconds: float | None,
            cpu: float | None, load_before: float | None) -> dict[str, Any]:
    """One scenario's part of the result file, from its seeds' outcomes."""
    failing = {o.seed: o.first for o in outcomes if o.violations}
    ran = len(outcomes)
    part: dict[str, Any] = {
        "seeds": ran,
        "seed_range": [first_seed, first_seed + asked - 1],
        "seconds": round(seconds, 3) if seconds is not None else None,
        "seeds_per_second": round(ran / seconds, 2) if seconds else None,
        "cpu_seconds": round(cpu, 3) if cpu is not None else None,
        "seeds_per_cpu_second": round(ran / cpu, 2) if cpu else None,
        "load_average_1m_before": load_before,
        "violations": sum(o.violations for o in outcomes),
        "failing_seeds": sorted(failing),
        "first_violation_of_failing_seeds":
            {str(seed): why for seed, why in sorted(failing.items())[:20]}}
    if ran < asked:
        part["interrupted"] = True
        seeds = sorted(o.seed for o in outcomes)
        part["seeds_that_ran"] = _ranges(seeds)
    return part


def _ranges(seeds: list[int]) -> list[list[int]]:
    """Sorted seeds as ``[first, last]`` runs of consecutive seeds."""
    runs: list[list[int]] = []
    for seed in seeds:
        if runs and seed == runs[-1][1] + 1:
            runs[-1][1] = seed
        else:
            runs.append([seed, seed])
    return runs


def summarize(path: Path) -> dict[str, Any]:
    """The scenarios' summaries from a ``.seeds.jsonl`` progress file (a stopped run)."""
    by_scenario: dict[str, list[SeedOutcome]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            by_scenario.setdefault(item["scenario"], []).append(
                SeedOutcome(item["seed"], item["violations"], item["first"]))
    scenarios = {}
    for name, outcomes in sorted(by_scenario.items()):
        outcomes.sort(key=lambda o: o.seed)
        first, last = outcomes[0].seed, outcomes[-1].seed
        scenarios[name] = summary(outcomes, last - first + 1, first, None, None, None)
    return scenarios


def main() -> None:
    """Run the benchmark and write its result file (or, with ``--child``, be a child)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--scenarios", default=None,
                        help="comma-separated names (default: every scenario)")
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1,
                        help="child processes at a time (default: the core count; "
                             "0: every seed in this process)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="seeds per child (default: four chunks per process)")
    parser.add_argument("--memory-mb", type=int, default=MEMORY_MB,
                        help="each child's address-space limit (MB)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the result file (default: bench/results/sim-<time>.json)")
    parser.add_argument("--summarize", type=Path, default=None, metavar="SEEDS_JSONL",
                        help="write the summary of a stopped run from its progress file")
    parser.add_argument("--child", nargs=3, metavar=("SCENARIO", "FIRST", "COUNT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        scenario, first, count = args.child
        sys.exit(_child(scenario, int(first), int(count), args.memory_mb))
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / f"sim-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    header = {"bench": "sim", "build": _build.MODE, "python": platform.python_version(),
              "machine": platform.machine(), "cpus": os.cpu_count()}
    if args.summarize is not None:
        result = {**header, "summarized_from": args.summarize.name,
                  "scenarios": summarize(args.summarize)}
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return
    names = sorted(SCENARIOS) if args.scenarios is None else args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; try {sorted(SCENARIOS)}")
    if args.seeds < 1 or args.procs < 0:
        parser.error("--seeds must be at least 1 and --procs at least 0")
    chunk = args.chunk or max(1, -(-args.seeds // (max(args.procs, 1) * CHUNKS_PER_PROC)))
    load = round(os.getloadavg()[0], 2)  # the machine is shared: say how busy it was
    progress = Progress(out.with_suffix(".seeds.jsonl"))
    scenarios: dict[str, Any] = {}
    for name in names:
        load_before = round(os.getloadavg()[0], 2)
        started = time.perf_counter()
        outcomes, cpu = run_scenario(name, args.seeds, args.first_seed, args.procs, chunk,
                                     args.memory_mb, progress)
        seconds = time.perf_counter() - started
        scenarios[name] = part = summary(outcomes, args.seeds, args.first_seed, seconds, cpu,
                                         load_before)
        print(f"{name}: {args.seeds} seeds ({args.first_seed}-{args.first_seed + args.seeds - 1})"
              f" in {seconds:.1f} s ({args.seeds / seconds:.1f} seeds/s, "
              f"{cpu:.1f} CPU s), failing {part['failing_seeds']}", flush=True)
    result = {**header, "first_seed": args.first_seed, "procs": args.procs,
              "chunk": chunk if args.procs else None,
              "memory_limit_mb": args.memory_mb if args.procs else None,
              "load_average_1m_before": load, "scenarios": scenarios}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
