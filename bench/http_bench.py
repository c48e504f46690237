#!/usr/bin/env python3
"""HTTP figures (issue 16): ``/metrics`` scrape time and ``GET /api/queues`` time
with 10,000 queues.

Usage: ``.venv/bin/python bench/http_bench.py [--queues 10000] [--runs 3]``.
Results go to ``bench/results/http-<timestamp>.json`` and a summary to stdout.

A ``txbroker serve`` process (journal store, fdatasync, uvloop as always) with
``--http-port`` gets ``--queues`` queues, one 100-byte persistent message in
each (declared and sent pipelined through the async client). Then, over one
keep-alive HTTP connection, each request is made once to warm up and
``--runs`` times measured (wall time from sending the request to the last byte
of the response, on the client); the median is reported with every run, the
response size and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

import txbroker.aio

ROOT = Path(__file__).resolve().parent.parent
#: Requests in flight while filling the broker (the client pipelines them).
FILL_WINDOW = 500
BODY = b"x" * 100


def free_port() -> int:
    """A port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


async def fill(url: str, queues: int) -> float:
    """Declare ``queues`` queues and send one message to each; seconds taken."""
    started = time.perf_counter()
    conn = await txbroker.aio.connect(url)
    try:
        for first in range(0, queues, FILL_WINDOW):
            names = [f"bench.q{n:05d}" for n in range(first, min(queues, first + FILL_WINDOW))]
            await asyncio.gather(*(conn.declare_queue(name) for name in names))
            await asyncio.gather(*(conn.send(name, BODY) for name in names))
    finally:
        await conn.close()
    return time.perf_counter() - started


def timed(client: httpx.Client, path: str, runs: int) -> dict[str, Any]:
    """Warm up once, then ``runs`` timed GETs of ``path``."""
    warm = client.get(path)
    warm.raise_for_status()
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        response = client.get(path)
        response.raise_for_status()
        _ = response.content
        seconds.append(time.perf_counter() - started)
    return {"median_seconds": round(statistics.median(seconds), 4),
            "runs_seconds": [round(s, 4) for s in seconds], "response_bytes": len(warm.content)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="txb-http-bench-"))
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(data / "d"),
           "--port", str(port), "--stomp-port", "0", "--http-port", str(http_port),
           "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    report: dict[str, Any] = {
        "bench": "http", "queues": args.queues, "runs": args.runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "load_before": loadavg()},
        "broker": {"store": "journal", "sync": "fdatasync", "loop": "uvloop",
                   "http": "starlette + uvicorn H11Protocol on the broker's loop"},
    }
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("txbroker ready"):
            raise SystemExit(f"broker did not start: {line!r}")
        report["fill_seconds"] = round(asyncio.run(fill(f"txb://127.0.0.1:{port}",
                                                        args.queues)), 2)
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120) as client:
            listed = client.get("/api/queues").json()
            assert sum(1 for q in listed if q["name"].startswith("bench.q")) == args.queues
            report["metrics"] = timed(client, "/metrics", args.runs)
            report["api_queues"] = timed(client, "/api/queues", args.runs)
            report["api_overview"] = timed(client, "/api/overview", args.runs)
        report["machine"]["load_after"] = loadavg()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(data, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"http-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    for key in ("metrics", "api_queues", "api_overview"):
        figure = report[key]
        print(f"{key}: median {figure['median_seconds'] * 1000:.1f} ms "
              f"({figure['response_bytes']:,} bytes)")
    print(f"load {report['machine']['load_before']} -> {report['machine']['load_after']}; "
          f"results: {path}")


if __name__ == "__main__":
    main()
