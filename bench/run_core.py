#!/usr/bin/env python3
"""Core benchmarks of issue 2, in one run, on a fresh broker process.

1. Persistent 1 KiB sends (several pipelined producers) and consume + ack,
   ``--reps`` times; medians, syncs per second, messages per sync.
2. Restart time with ``--stored`` messages of 1 KiB in the journal.
3. Broker RSS per stored message (index only: bodies stay on disk).

Usage: ``.venv/bin/python bench/run_core.py [--count 200000] [--stored 1000000]``.
Results go to ``bench/results/core-<timestamp>.json`` and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def bench(url: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "bench", "--url", url, *args],
        check=True, capture_output=True, text=True, cwd=ROOT,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--stored", type=int, default=1_000_000)
    parser.add_argument("--sync", default="fdatasync")
    args = parser.parse_args()
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="txb-bench-") as tmp:
        proc = BrokerProcess(Path(tmp) / "data", "--sync", args.sync).start()
        try:
            sends, consumes = [], []
            for rep in range(args.reps):
                queue = f"bench{rep}"
                s = bench(proc.url, "--queue", queue, "--count", str(args.count), "--phase",
                          "send", "--producers", str(args.producers))["send"]
                c = bench(proc.url, "--queue", queue, "--count", str(args.count), "--phase",
                          "consume", "--consumers", str(args.consumers))["consume"]
                print(f"rep {rep}: send {s['msg_per_s']:,} msg/s ({s['msgs_per_sync']} msg/sync,"
                      f" {s['syncs_per_s']} syncs/s); consume+ack {c['msg_per_s']:,} msg/s",
                      flush=True)
                sends.append(s)
                consumes.append(c)
            report["send_msg_per_s_median"] = statistics.median(s["msg_per_s"] for s in sends)
            report["consume_msg_per_s_median"] = statistics.median(
                c["msg_per_s"] for c in consumes)
            report["send_runs"], report["consume_runs"] = sends, consumes

            assert proc.proc is not None
            empty_rss = rss_bytes(proc.proc.pid)
            print(f"loading {args.stored:,} stored messages …", flush=True)
            bench(proc.url, "--queue", "stored", "--count", str(args.stored), "--phase", "send",
                  "--producers", str(args.producers))
            loaded_rss = rss_bytes(proc.proc.pid)
            proc.kill(signal.SIGTERM)
            started = time.monotonic()
            proc.start(timeout=600)
            ready = time.monotonic() - started
            assert proc.proc is not None
            restarted_rss = rss_bytes(proc.proc.pid)
            report["restart"] = {"stored": args.stored, "ready_seconds": round(ready, 2),
                                 "ready_line": proc.ready_line}
            report["rss"] = {
                "empty": empty_rss,
                "after_load": loaded_rss,
                "after_restart": restarted_rss,
                "bytes_per_message_after_load": round((loaded_rss - empty_rss) / args.stored),
                "bytes_per_message_after_restart": round(
                    (restarted_rss - empty_rss) / args.stored),
            }
            print(json.dumps({k: report[k] for k in ("restart", "rss")}, indent=2))
        finally:
            proc.kill()
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"core-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"send median {report['send_msg_per_s_median']:,} msg/s; consume+ack median "
          f"{report['consume_msg_per_s_median']:,} msg/s; written to {path}")
    os.sync()


if __name__ == "__main__":
    main()
