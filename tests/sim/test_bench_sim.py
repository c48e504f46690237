"""``bench/sim.py`` (docs/simulation.md, "Bounded runs, and 10,000 seeds"): seeds in
child processes, aggregated into one result file; a seed that breaks its child's
address-space limit is a failing seed with its reason, not a crash of the bench."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).parents[2] / "bench" / "sim.py"


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, str(BENCH), *args, "--out", str(out)], check=True,
                   capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_chunks_of_seeds_in_child_processes_add_up(tmp_path: Path) -> None:
    result = _bench(tmp_path, "--scenarios", "queue,router-bank", "--seeds", "7",
                    "--first-seed", "20", "--procs", "2", "--chunk", "3")
    assert (result["procs"], result["chunk"]) == (2, 3)
    for name in ("queue", "router-bank"):
        scenario = result["scenarios"][name]
        assert scenario["seeds"] == 7 and scenario["seed_range"] == [20, 26]
        assert scenario["violations"] == 0 and scenario["failing_seeds"] == []
        assert scenario["cpu_seconds"] > 0  # the children's


#: A child that runs seeds as bench/sim.py's does, but dies at seed 1 (SIGKILL, as
#: the kernel's OOM killer would) and reports seed 3 over its memory limit.
_FAKE_CHILD = """
import json, os, signal, sys
first, count = int(sys.argv[1]), int(sys.argv[2])
for seed in range(first, first + count):
    if seed == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if seed == 3:
        print(json.dumps({"seed": 3, "violations": 1, "first": "MemoryError: over"}))
        sys.exit(0)
    print(json.dumps({"seed": seed, "violations": 0, "first": None}), flush=True)
"""


def test_a_seed_that_breaks_its_child_fails_with_its_reason(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_sim", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_sim", bench)  # (its dataclass looks it up)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "_child_command", lambda scenario, first, count, memory_mb:
                        [sys.executable, "-c", _FAKE_CHILD, str(first), str(count)])
    progress = tmp_path / "run.seeds.jsonl"
    outcomes = bench._run_chunk("queue", 0, 5, 100, bench.Progress(progress))
    assert [(o.seed, o.violations) for o in outcomes] == [(0, 0), (1, 1), (2, 0), (3, 1),
                                                         (4, 0)]
    assert outcomes[1].first == ("the child process died running this seed (killed by "
                                 "signal 9; address-space limit 100 MB)")
    assert outcomes[3].first == "MemoryError: over"
    # every outcome went to the progress file as it came; a stopped run is summarized
    lines = [json.loads(line) for line in progress.read_text().splitlines()]
    assert [(x["scenario"], x["seed"], x["violations"]) for x in lines] == [
        ("queue", 0, 0), ("queue", 1, 1), ("queue", 2, 0), ("queue", 3, 1), ("queue", 4, 0)]


def test_a_stopped_run_is_summarized_from_its_progress_file(tmp_path: Path) -> None:
    """Two chunks ran at once and the run stopped: seeds 20-22 and 30-31 of 20-39 ran."""
    progress = tmp_path / "stopped.seeds.jsonl"
    seeds = [20, 30, 21, 31, 22]
    progress.write_text("".join(json.dumps(
        {"scenario": "queue-live", "seed": seed, "violations": int(seed == 31),
         "first": "lost" if seed == 31 else None}) + "\n" for seed in seeds))
    out = tmp_path / "summary.json"
    subprocess.run([sys.executable, str(BENCH), "--summarize", str(progress), "--out",
                    str(out)], check=True, capture_output=True, text=True)
    scenario = json.loads(out.read_text())["scenarios"]["queue-live"]
    assert (scenario["seeds"], scenario["violations"], scenario["failing_seeds"]) == (
        5, 1, [31])
    assert scenario["interrupted"] is True
    assert scenario["seeds_that_ran"] == [[20, 22], [30, 31]]
    assert scenario["first_violation_of_failing_seeds"] == {"31": "lost"}
