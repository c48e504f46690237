#!/usr/bin/env python3
"""Issue 12's first row: native persistent 1 KiB sends with 4 producers, compiled vs pure.

For each build (the mypyc-compiled hot path, then ``TXBROKER_PURE=1``) a fresh broker
(journal store, ``--sync fdatasync``) takes ``--count`` persistent 1 KiB sends from
``txbroker bench --phase send --producers 4 --processes 4``: four load-generator
processes, one producer connection each, 256 sends in flight per producer (the
client coalesces the sends of one loop turn into ``send_batch`` requests:
client/_coalesce.py). Then the same messages are consumed and acked. Per rep: msg/s,
messages per fdatasync, and the broker's CPU time per message (from /proc: less
sensitive to a noisy machine than the rate). The builds alternate within each rep;
medians over ``--reps``. Results: ``bench/results/native-send-<time>.json``::

    .venv/bin/python bench/native_send.py --count 300000 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import BrokerProcess  # noqa: E402

BUILDS = {"compiled": "0", "pure": "1"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(url: str, env: dict[str, str], queue: str, count: int, phase: str,
              producers: int, processes: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "bench", "--url", url, "--queue", queue,
         "--count", str(count), "--phase", phase, "--producers", str(producers),
         "--processes", str(processes), "--consumers", "2"],
        check=True, capture_output=True, text=True, cwd=ROOT, env=env).stdout
    result: dict[str, Any] = json.loads(out)[phase]
    return result


def one(build: str, rep: int, args: argparse.Namespace) -> dict[str, Any]:
    os.environ["TXBROKER_PURE"] = BUILDS[build]  # the broker and the clients inherit it
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="txb-native-send-") as tmp:
        proc = BrokerProcess(Path(tmp) / "data", "--sync", "fdatasync").start()
        try:
            assert proc.proc is not None
            pid = proc.proc.pid
            # warm-up: imports, the first segment's pre-allocation
            run_phase(proc.url, env, "warm", 20_000, "send", 4, 4)
            before = cpu_seconds(pid)
            sent = run_phase(proc.url, env, f"q{rep}", args.count, "send", args.producers,
                             args.processes)
            middle = cpu_seconds(pid)
            got = run_phase(proc.url, env, f"q{rep}", args.count, "consume", 1, 1)
            after = cpu_seconds(pid)
        finally:
            proc.kill()
    row = {
        "build": build, "rep": rep, "send_msg_per_s": sent["msg_per_s"],
        "msgs_per_sync": sent["msgs_per_sync"],
        "broker_cpu_us_per_send": round((middle - before) * 1e6 / args.count, 2),
        "consume_msg_per_s": got["msg_per_s"], "received": got["received"],
        "broker_cpu_us_per_consume": round((after - middle) * 1e6 / args.count, 2),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    assert got["received"] == args.count, row
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=300_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--builds", default="compiled,pure")
    args = parser.parse_args()
    builds = args.builds.split(",")
    rows = []
    for rep in range(args.reps):
        for build in builds if rep % 2 == 0 else builds[::-1]:
            row = one(build, rep, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary: dict[str, Any] = {}
    for build in builds:
        mine = [r for r in rows if r["build"] == build]
        summary[build] = {key: statistics.median(r[key] for r in mine) for key in (
            "send_msg_per_s", "msgs_per_sync", "broker_cpu_us_per_send",
            "consume_msg_per_s", "broker_cpu_us_per_consume")}
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
              "cores": os.cpu_count(), "runs": rows, "median": summary}
    out = ROOT / "bench" / "results" / f"native-send-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    for build, figures in summary.items():
        print(f"{build:9s} " + "  ".join(f"{k} {v:,}" for k, v in figures.items()))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
