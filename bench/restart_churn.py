#!/usr/bin/env python3
"""Restart after churn, and disk use vs live data (issue 29, rows 1-2), one command.

A broker runs as users start it (``txbroker serve``, journal store, ``--sync
fdatasync``, default segment size unless ``--segment-size``). Then:

1. **no churn**: ``--live`` persistent messages of ``--size`` bytes are loaded
   into queue ``live`` (``--loaders`` parallel ``txbroker bench --phase send``
   processes); one warm-up restart, then ``--reps`` kill -9 restarts, each timed
   from the spawn of ``txbroker serve`` to its ready line and to the first
   answered request on a new connection (CLI start-up included);
2. **churn**: ``--churn`` messages are sent and consumed through queue ``churn``
   in rounds of ``--round`` (send the round, then consume and ack it), so the
   live messages stay the oldest; the broker then gets up to ``--settle`` s to
   finish compacting (until its journal stops shrinking); the same warm-up and
   ``--reps`` kill -9 restarts. One more kill -9 restart right after the churn,
   before that idle time, is recorded apart (``right_after_churn``), with the
   data directory's size at that moment.

Recorded per restart: seconds to ready and to the first answer, the messages
recovered and the bytes recovery says it replayed (``stats()["store"]
["recovered_bytes"]``); per phase: min/median/max, the data directory's size
(bytes allocated, ``du``) against the live bytes (``--live`` × ``--size``), and
the load average before and after. At the end ``live`` is drained and counted.

Run under the bench lock: ``flock /tmp/txb-bench.lock .venv/bin/python
bench/restart_churn.py`` (defaults: 100k live 1 KiB, 1M churn, 5 reps). Results:
``bench/results/restart-churn-<timestamp>[-label].json``.
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


def client_bench(url: str, queue: str, count: int, size: int, phase: str,
                 **counts: int) -> dict[str, Any]:
    """One ``txbroker bench`` run (its JSON summary)."""
    extra = [arg for name, value in counts.items() for arg in (f"--{name}", str(value))]
    out = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "bench", "--url", url, "--queue", queue,
         "--count", str(count), "--size", str(size), "--phase", phase, *extra],
        capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"txbroker bench failed: {out.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def load(url: str, queue: str, count: int, size: int, loaders: int) -> float:
    """Send ``count`` persistent messages with ``loaders`` processes; seconds taken."""
    started = time.monotonic()
    shares = [count // loaders + (1 if i < count % loaders else 0) for i in range(loaders)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "txbroker.cli", "bench", "--url", url, "--queue", queue,
         "--count", str(share), "--size", str(size), "--phase", "send", "--producers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for share in shares if share]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"loader failed: {err[-2000:]}")
    return time.monotonic() - started


def stats(url: str) -> dict[str, Any]:
    from txbroker.client.sync import connect

    with connect(url, reconnect=False, timeout=30) as conn:
        result: dict[str, Any] = conn.stats()
        return result


def first_answer(url: str, deadline: float) -> None:
    """Wait until a new connection gets an answer (a ping)."""
    from txbroker.client.sync import connect

    while True:
        try:
            with connect(url, reconnect=False, timeout=5) as conn:
                conn.ping()
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def rss_bytes(proc: BrokerProcess) -> int:
    """The broker's resident memory now."""
    assert proc.proc is not None
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def dir_bytes(path: Path) -> dict[str, int]:
    """The data directory's size: bytes allocated (``du``) and apparent."""
    allocated = apparent = 0
    for item in path.rglob("*"):
        if item.is_file():
            status = item.stat()
            allocated += status.st_blocks * 512
            apparent += status.st_size
    return {"allocated": allocated, "apparent": apparent}


def restart(proc: BrokerProcess) -> dict[str, Any]:
    """kill -9, start again: seconds to the ready line and to the first answer."""
    proc.kill(signal.SIGKILL)
    started = time.monotonic()
    proc.start(timeout=600)
    ready = time.monotonic() - started
    first_answer(proc.url, started + 600)
    answered = time.monotonic() - started
    store = stats(proc.url)["store"]
    return {"ready_seconds": round(ready, 3), "first_answer_seconds": round(answered, 3),
            "ready_line": proc.ready_line,
            "recovered_bytes": store["recovered_bytes"],
            "recovered_segments": store["recovered_segments"]}


def restarts(proc: BrokerProcess, reps: int, phase: str) -> dict[str, Any]:
    """One warm-up restart (kept apart as ``first``: right after the load or the
    churn, before compaction has had idle time), then ``reps`` timed ones;
    min/median/max."""
    first = restart(proc)
    print(phase, "first", json.dumps(first), flush=True)
    runs = []
    for rep in range(reps):
        run = restart(proc)
        run["rep"] = rep
        print(phase, json.dumps(run), flush=True)
        runs.append(run)
    summary: dict[str, Any] = {"first": first, "runs": runs}
    for key in ("ready_seconds", "first_answer_seconds"):
        values = [run[key] for run in runs]
        summary[key] = {"min": min(values), "median": statistics.median(values),
                        "max": max(values)}
    summary["recovered_bytes"] = statistics.median(run["recovered_bytes"] for run in runs)
    return summary


def settle(url: str, seconds: float) -> dict[str, Any]:
    """Wait until the journal stops shrinking (compaction done) or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    last, still = None, 0
    while time.monotonic() < deadline:
        disk = stats(url)["store"]["disk_bytes"]
        still = still + 1 if disk == last else 0
        if still >= 5:  # unchanged over 5 polls (the maintain tick is 1 s)
            break
        last = disk
        time.sleep(1.0)
    return dict(stats(url)["store"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live", type=int, default=100_000)
    parser.add_argument("--churn", type=int, default=1_000_000)
    parser.add_argument("--round", type=int, default=100_000, help="churn sent, then consumed")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--loaders", type=int, default=3)
    parser.add_argument("--sync", default="fdatasync")
    parser.add_argument("--segment-size", type=int, default=0, help="0: the broker's default")
    parser.add_argument("--compact-live-fraction", type=float, default=None,
                        help="the broker's compact_live_fraction (default: its default)")
    parser.add_argument("--settle", type=float, default=120.0)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                              "loadavg_start": os.getloadavg(), "cpus": os.cpu_count()}
    live_bytes = args.live * args.size
    with tempfile.TemporaryDirectory(prefix="txb-churn-") as tmp:
        settings = ["[server]"]
        if args.segment_size:
            settings.append(f"segment_size = {args.segment_size}")
        if args.compact_live_fraction is not None:
            settings.append(f"compact_live_fraction = {args.compact_live_fraction}")
        config = Path(tmp) / "broker.toml"
        config.write_text("\n".join(settings) + "\n")
        data = Path(tmp) / "data"
        proc = BrokerProcess(data, "--sync", args.sync, "--config", str(config)).start()
        try:
            print(f"loading {args.live:,} live messages …", flush=True)
            seconds = load(proc.url, "live", args.live, args.size, args.loaders)
            report["load_seconds"] = round(seconds, 2)
            report["rss_after_load"] = rss_bytes(proc)
            report["no_churn"] = {"loadavg": os.getloadavg(), "data_dir": dir_bytes(data),
                                  "store": settle(proc.url, 10)}
            report["no_churn"].update(restarts(proc, args.reps, "no churn"))
            print(f"churning {args.churn:,} through another queue …", flush=True)
            started, left = time.monotonic(), args.churn
            while left:
                count = min(args.round, left)
                client_bench(proc.url, "churn", count, args.size, "both",
                             producers=2, consumers=2)
                left -= count
            report["churn_seconds"] = round(time.monotonic() - started, 2)
            report["right_after_churn"] = {"data_dir": dir_bytes(data),
                                           "store": stats(proc.url)["store"],
                                           "rss": rss_bytes(proc)}
            first = restart(proc)  # the restart before compaction had idle time
            print("right after churn", json.dumps(first), flush=True)
            report["right_after_churn"]["restart"] = first
            started = time.monotonic()
            store = settle(proc.url, args.settle)
            churned = {"loadavg": os.getloadavg(), "data_dir": dir_bytes(data), "store": store,
                       "settle_seconds": round(time.monotonic() - started, 1)}
            churned.update(restarts(proc, args.reps, "after churn"))
            report["churn"] = churned
            drained = client_bench(proc.url, "live", args.live, args.size, "consume",
                                   consumers=2)
            report["drained"] = drained["consume"]["received"]
        finally:
            proc.kill()
    report["loadavg_end"] = os.getloadavg()
    base, churn = report["no_churn"], report["churn"]
    report["summary"] = {
        "live_bytes": live_bytes,
        "restart_ratio_first_answer": round(churn["first_answer_seconds"]["median"]
                                            / base["first_answer_seconds"]["median"], 3),
        "restart_ratio_ready": round(churn["ready_seconds"]["median"]
                                     / base["ready_seconds"]["median"], 3),
        "data_dir_vs_live_no_churn": round(base["data_dir"]["allocated"] / live_bytes, 3),
        "data_dir_vs_live_after_churn": round(churn["data_dir"]["allocated"] / live_bytes, 3),
        "data_dir_vs_live_right_after_churn": round(
            report["right_after_churn"]["data_dir"]["allocated"] / live_bytes, 3),
        "settle_seconds": churn["settle_seconds"],
        "restart_right_after_churn_vs_no_churn_median": round(
            report["right_after_churn"]["restart"]["first_answer_seconds"]
            / base["first_answer_seconds"]["median"], 3),
        "recovered_bytes_no_churn": base["recovered_bytes"],
        "recovered_bytes_after_churn": churn["recovered_bytes"],
        "drained_exactly": report["drained"] == args.live,
    }
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    path = out_dir / f"restart-churn-{time.strftime('%Y%m%d-%H%M%S')}{label}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
