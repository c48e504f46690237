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
response size and the machine's load average before and after. For
``/metrics`` and ``/api/queues`` the bench also reports the longest native
``ping`` round trip while the request runs ``--runs`` times, against the same
with no HTTP request: how long one request holds the broker's loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Iterator
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


def stall_during(client: httpx.Client, path: str, url: str, runs: int) -> dict[str, Any]:
    """The longest native ``ping`` round trip while ``path`` is fetched ``runs``
    times, and without any HTTP request (how long a request holds the loop)."""
    import threading

    import txbroker

    def longest(stop: threading.Event, found: list[float]) -> None:
        with txbroker.connect(url) as conn:
            while not stop.is_set():
                started = time.perf_counter()
                conn.ping()
                found.append(time.perf_counter() - started)

    result: dict[str, Any] = {}
    for label, requests in (("idle", 0), ("during", runs)):
        stop, found = threading.Event(), []
        pinger = threading.Thread(target=longest, args=(stop, found))
        pinger.start()
        time.sleep(0.5)
        if requests:
            for _ in range(requests):
                client.get(path).raise_for_status()
        else:
            time.sleep(1.0)
        stop.set()
        pinger.join()
        result[f"max_ping_seconds_{label}"] = round(max(found), 4)
        result[f"pings_{label}"] = len(found)
    return result


def parse_args(doc: str) -> argparse.Namespace:
    """``--queues``, ``--runs``, ``--out``: the options of the HTTP and console benches."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--queues", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return parser.parse_args()


def machine() -> dict[str, Any]:
    """The machine's description and its load before the run."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_before": loadavg()}


@contextlib.contextmanager
def http_broker(prefix: str, queues: int) -> Iterator[tuple[int, int, float]]:
    """A broker process (journal, fdatasync, HTTP on) filled with ``queues`` queues:
    ``(native port, http port, seconds the fill took)``; stopped and removed after."""
    data = Path(tempfile.mkdtemp(prefix=prefix))
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(data / "d"),
           "--port", str(port), "--stomp-port", "0",
           "--amqp-port", "0", "--http-port", str(http_port),
           "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("txbroker ready"):
            raise SystemExit(f"broker did not start: {line!r}")
        filled = asyncio.run(fill(f"txb://127.0.0.1:{port}", queues))
        yield port, http_port, round(filled, 2)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    args = parse_args(__doc__ or "")
    report: dict[str, Any] = {
        "bench": "http", "queues": args.queues, "runs": args.runs, "machine": machine(),
        "broker": {"store": "journal", "sync": "fdatasync", "loop": "uvloop",
                   "http": "starlette + uvicorn H11Protocol on the broker's loop"},
    }
    with http_broker("txb-http-bench-", args.queues) as (port, http_port, filled):
        report["fill_seconds"] = filled
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120) as client:
            listed = client.get("/api/queues").json()
            assert sum(1 for q in listed if q["name"].startswith("bench.q")) == args.queues
            report["metrics"] = timed(client, "/metrics", args.runs)
            report["api_queues"] = timed(client, "/api/queues", args.runs)
            report["api_overview"] = timed(client, "/api/overview", args.runs)
            url = f"txb://127.0.0.1:{port}"
            report["metrics"]["loop"] = stall_during(client, "/metrics", url, args.runs)
            report["api_queues"]["loop"] = stall_during(client, "/api/queues", url, args.runs)
        report["machine"]["load_after"] = loadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"http-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    for key in ("metrics", "api_queues", "api_overview"):
        figure = report[key]
        loop = figure.get("loop", {})
        held = (f"; longest native ping {loop['max_ping_seconds_during'] * 1000:.0f} ms "
                f"during, {loop['max_ping_seconds_idle'] * 1000:.0f} ms idle") if loop else ""
        print(f"{key}: median {figure['median_seconds'] * 1000:.1f} ms "
              f"({figure['response_bytes']:,} bytes){held}")
    print(f"load {report['machine']['load_before']} -> {report['machine']['load_after']}; "
          f"results: {path}")


if __name__ == "__main__":
    main()
