#!/usr/bin/env python3
"""The sync client's cost per call, against the async client's (issue 30, round 3).

A user with threads and the sync client (``txbroker.client.connect``) is a user too:
every sync call is handed to the process's client loop thread and back
(client/_portal.py). This bench measures that hand-over alone: one broker started as
users start it (``txbroker serve``, journal store, ``sync fdatasync``), then for each
rep a fresh client process that makes ``--calls`` ``ping`` requests (a round trip
with no store work) on each of ``--threads`` threads, each thread on its own sync
connection; then the same with the async client, ``--threads`` tasks on their own
connections, as the floor the sync client pays its hand-over on top of. Each client
runs a warm-up of 500 calls per thread first. Reported per mode: calls/s, the client
process's CPU per call (µs, from ``getrusage``: the load generator is the thing
measured here) and the wall time of one call per thread; min / median / max over
``--reps`` (≥ 5 by default), the modes alternating within each rep, and the load
average before each run. Results: ``bench/results/sync-calls-<time>.json``::

    .venv/bin/python bench/sync_calls.py --threads 8 --calls 5000 --reps 5

``--client NAME=SRC`` (repeatable) runs the sync mode on another source tree too (its
``src`` directory on ``PYTHONPATH``, e.g. a worktree of an older commit), beside
``this`` (this checkout): the A/B of a change to the client, alternating in one run.
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

#: The client process: argv = mode, url, threads, calls; prints one JSON line.
CHILD = r'''
import asyncio, json, resource, sys, threading, time
mode, url, threads, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
WARM = 500

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def run_sync():
    from txbroker.client import connect
    conns = [connect(url) for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    end = threading.Barrier(threads + 1)

    def work(conn):
        ping = conn.async_connection.ping
        for _ in range(WARM):
            conn.run_async(ping())
        start.wait()
        for _ in range(calls):
            conn.run_async(ping())
        end.wait()

    workers = [threading.Thread(target=work, args=(c,)) for c in conns]
    for w in workers:
        w.start()
    start.wait()
    c0, t0 = cpu(), time.perf_counter()
    end.wait()
    elapsed, used = time.perf_counter() - t0, cpu() - c0
    for w in workers:
        w.join()
    for c in conns:
        c.close()
    return elapsed, used

async def run_async():
    from txbroker.client.aio import open_connection
    conns = [await open_connection(url) for _ in range(threads)]

    async def work(conn, n):
        for _ in range(n):
            await conn.ping()

    await asyncio.gather(*(work(c, WARM) for c in conns))
    c0, t0 = cpu(), time.perf_counter()
    await asyncio.gather(*(work(c, calls) for c in conns))
    elapsed, used = time.perf_counter() - t0, cpu() - c0
    for c in conns:
        await c.close()
    return elapsed, used

if mode == "sync":
    elapsed, used = run_sync()
else:
    import uvloop
    elapsed, used = uvloop.run(run_async())
total = threads * calls
print(json.dumps({"calls_per_s": round(total / elapsed),
                  "client_cpu_us_per_call": round(used * 1e6 / total, 1),
                  "wall_us_per_call": round(elapsed * 1e6 / calls, 1)}))
'''


def run_client(label: str, src: Path, mode: str, url: str, args: argparse.Namespace
               ) -> dict[str, Any]:
    """One client process; its figures with the load average before it."""
    env = dict(os.environ, PYTHONPATH=str(src))
    load = round(os.getloadavg()[0], 2)
    out = subprocess.run([sys.executable, "-c", CHILD, mode, url, str(args.threads),
                          str(args.calls)], check=True, capture_output=True, text=True,
                         env=env, cwd=ROOT).stdout
    row: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    row.update(client=label, mode=mode, loadavg_before=load)
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """min / median / max of each figure."""
    out: dict[str, Any] = {}
    for key in ("calls_per_s", "client_cpu_us_per_call", "wall_us_per_call"):
        values = [row[key] for row in rows]
        out[key] = {"min": min(values), "median": statistics.median(values),
                    "max": max(values)}
    out["loadavg_before"] = [row["loadavg_before"] for row in rows]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--calls", type=int, default=5000, help="calls per thread")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--client", action="append", default=[], metavar="NAME=SRC",
                        help="also run the sync mode with this source tree's src/")
    args = parser.parse_args()
    clients = [("this", ROOT / "src")]
    for spec in args.client:
        name, _, src = spec.partition("=")
        if not name or not src or not (Path(src) / "src" / "txbroker").is_dir():
            parser.error(f"--client {spec!r}: expected NAME=DIR with DIR/src/txbroker")
        clients.append((name, Path(src).resolve() / "src"))
    runs = [(label, src, "sync") for label, src in clients] + [("this", ROOT / "src", "async")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="txb-sync-calls-") as tmp:
        broker = BrokerProcess(Path(tmp) / "data", "--sync", "fdatasync").start()
        try:
            for rep in range(args.reps):
                order = runs if rep % 2 == 0 else list(reversed(runs))
                for label, src, mode in order:
                    row = run_client(label, src, mode, broker.url, args)
                    row["rep"] = rep
                    rows.append(row)
                    print(f"rep {rep} {label:>8} {mode:>5}: {row['calls_per_s']:>8,} calls/s, "
                          f"{row['client_cpu_us_per_call']:6.1f} µs client CPU per call, "
                          f"{row['wall_us_per_call']:7.1f} µs per call per thread "
                          f"(load {row['loadavg_before']})", flush=True)
        finally:
            broker.kill()
    result = {
        "bench": "sync_calls", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "threads": args.threads, "calls_per_thread": args.calls, "reps": args.reps,
        "cpus": os.cpu_count(), "clients": {label: str(src) for label, src in clients},
        "summary": {f"{label}/{mode}": summary([r for r in rows if r["client"] == label
                                                and r["mode"] == mode])
                    for label, _, mode in runs},
        "runs": rows,
    }
    out = ROOT / "bench" / "results" / f"sync-calls-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for key, figures in result["summary"].items():
        print(f"{key:>14}: {figures['calls_per_s']['median']:>8,} calls/s "
              f"[{figures['calls_per_s']['min']:,}–{figures['calls_per_s']['max']:,}], "
              f"{figures['client_cpu_us_per_call']['median']} µs client CPU per call")
    print(f"written {out}")


if __name__ == "__main__":
    main()
