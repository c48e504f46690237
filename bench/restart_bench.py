#!/usr/bin/env python3
"""Restart time and memory per stored message (issue 12), one command.

Starts a broker (journal store, default settings, ``--sync fdatasync``), loads
``--stored`` persistent 1 KiB messages with ``--loaders`` parallel
``txbroker bench --phase send`` processes (so the client is not what is
measured), then ``--reps`` times: restart after SIGTERM and after kill -9,
timing start → the "txbroker ready" line and reading the recovered count from
that line and the RSS after the restart. RSS per message is (RSS − RSS of the
empty broker) / stored, after the load and after each restart; after the load
also without the body cache (``body_cache_bytes``: the last 32 MiB of bodies sent,
a fixed bound that a restart starts empty). At the end the
queue is drained and counted exactly (every message once).

``--cold`` evicts the data directory's files from the page cache before each
restart (``posix_fadvise`` DONTNEED); ``--recovery-index`` runs the broker with
its recovery index, ``--recovery-checkpoint`` with its recovery checkpoint (a
SIGTERM writes one, the next start reads it instead of the log; each run records
``from_checkpoint``) — both docs/storage.md, off by default. With
``--checkpoint-interval S`` the running broker writes one every S seconds too, and each
kill -9 comes after it (and after ``--suffix N`` messages sent to and consumed from
another queue past it: the log the start replays after the checkpoint). ``--warmup`` rounds
(one by default) run first and are recorded apart, not counted in the medians.

Run under the bench lock: ``flock /tmp/txb-bench.lock .venv/bin/python
bench/restart_bench.py [--stored 1000000]``. Results:
``bench/results/restart-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from txbroker import _build  # noqa: E402

READY = re.compile(r"recovered (\d+) messages in ([0-9.]+) s")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def load(url: str, queue: str, count: int, loaders: int, producers: int) -> float:
    """Send ``count`` persistent 1 KiB messages with ``loaders`` processes; seconds taken."""
    started = time.monotonic()
    shares = [count // loaders + (1 if i < count % loaders else 0) for i in range(loaders)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "txbroker.cli", "bench", "--url", url, "--queue", queue,
         "--count", str(share), "--phase", "send", "--producers", str(producers)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for share in shares if share]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"loader failed: {err[-2000:]}")
    return time.monotonic() - started


def drain(url: str, queue: str, expected: int) -> dict[str, Any]:
    """Consume and ack the whole queue; the count received (``txbroker bench``)."""
    out = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "bench", "--url", url, "--queue", queue,
         "--count", str(expected), "--phase", "consume", "--consumers", "2"],
        capture_output=True, text=True, cwd=ROOT)
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary["consume"]


def evict(directory: Path) -> int:
    """Evict the files under ``directory`` from the page cache (``posix_fadvise``
    DONTNEED after an fsync: a cold journal without dropping every cache on a shared
    machine; the interpreter's and libraries' files stay cached). Bytes evicted."""
    evicted = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                evicted += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return evicted


def restart(proc: BrokerProcess, sig: int, cold: bool = False) -> dict[str, Any]:
    stopping = time.monotonic()
    proc.kill(sig)
    stop_seconds = time.monotonic() - stopping  # (a SIGTERM writes the checkpoint)
    if cold:
        evict(proc.data)
    started = time.monotonic()
    proc.start(timeout=600)
    ready = time.monotonic() - started
    assert proc.proc is not None
    found = READY.search(proc.ready_line)
    from txbroker.client.sync import connect

    with connect(proc.url) as conn:
        store = conn.stats()["store"]
    return {"signal": signal.Signals(sig).name, "ready_seconds": round(ready, 3),
            "stop_seconds": round(stop_seconds, 3),
            "from_checkpoint": store["recovered_from_checkpoint"],
            "recovered_entries": store["recovered_entries"],
            "recovered": int(found.group(1)) if found else None,
            "recovery_seconds": float(found.group(2)) if found else None,
            "rss": rss_bytes(proc.proc.pid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stored", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds (a SIGTERM and a kill -9 restart) run first and not counted")
    parser.add_argument("--loaders", type=int, default=3)
    parser.add_argument("--producers", type=int, default=2, help="connections per loader")
    parser.add_argument("--sync", default="fdatasync")
    parser.add_argument("--label", default="")
    parser.add_argument("--no-drain", action="store_true")
    parser.add_argument("--cold", action="store_true",
                        help="evict the data directory from the page cache before each restart")
    parser.add_argument("--recovery-index", action=argparse.BooleanOptionalAction,
                        default=False, help="run the broker with recovery_index = true "
                        "or false, the default (docs/storage.md)")
    parser.add_argument("--checkpoint-interval", type=float, default=0.0,
                        help="with --recovery-checkpoint: the running broker writes one "
                        "every so many seconds; each kill -9 then comes after one (and "
                        "after --suffix messages sent and consumed past it)")
    parser.add_argument("--suffix", type=int, default=0,
                        help="messages sent to and consumed from another queue after the "
                        "running checkpoint, before each kill -9 (the log a start replays "
                        "after the checkpoint)")
    parser.add_argument("--recovery-checkpoint", action=argparse.BooleanOptionalAction,
                        default=False, help="run the broker with recovery_checkpoint = true "
                        "(a SIGTERM leaves a checkpoint the next start reads) or false, the "
                        "default (docs/storage.md)")
    args = parser.parse_args()
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                              "build": _build.MODE,
                              "loadavg_start": os.getloadavg()}
    queue = "stored"
    with tempfile.TemporaryDirectory(prefix="txb-restart-") as tmp:
        config = Path(tmp) / "broker.toml"
        config.write_text(f"[server]\nrecovery_index = {str(args.recovery_index).lower()}\n"
                          "recovery_checkpoint = "
                          f"{str(args.recovery_checkpoint).lower()}\n"
                          f"checkpoint_interval = {args.checkpoint_interval}\n")
        proc = BrokerProcess(Path(tmp) / "data", "--sync", args.sync,
                             "--config", str(config)).start()
        try:
            assert proc.proc is not None
            empty = rss_bytes(proc.proc.pid)
            print(f"loading {args.stored:,} messages …", flush=True)
            seconds = load(proc.url, queue, args.stored, args.loaders, args.producers)
            loaded = rss_bytes(proc.proc.pid)
            cache = body_cache_bytes(proc.url)
            report["load"] = {"seconds": round(seconds, 2),
                              "msg_per_s": round(args.stored / seconds),
                              "rss_empty": empty, "rss_after_load": loaded,
                              "body_cache_bytes": cache,
                              "bytes_per_message": round((loaded - empty) / args.stored, 1),
                              # the body cache is a fixed bound (32 MiB), not per message
                              "bytes_per_message_without_cache":
                                  round((loaded - empty - cache) / args.stored, 1)}
            print(json.dumps(report["load"]), flush=True)
            runs = []
            warmup = []
            for rep in range(-args.warmup, args.reps):
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    if sig == signal.SIGKILL and args.checkpoint_interval:
                        wait_for_checkpoint(proc.data, args.checkpoint_interval)
                        if args.suffix:
                            load(proc.url, "suffix", args.suffix, 1, args.producers)
                            drain(proc.url, "suffix", args.suffix)
                    checkpoints = checkpoint_stats(proc.url)
                    run = restart(proc, sig, args.cold)
                    if checkpoints:  # the running checkpoints before this restart
                        run["checkpoints"] = checkpoints
                    run["rep"] = rep  # (negative: a warm-up round)
                    run["bytes_per_message"] = round((run["rss"] - empty) / args.stored, 1)
                    print(json.dumps(run), flush=True)
                    (runs if rep >= 0 else warmup).append(run)
            report["warmup_restarts"] = warmup
            report["restarts"] = runs
            for name in ("SIGTERM", "SIGKILL"):
                mine = [r for r in runs if r["signal"] == name]
                report[f"median_{name}"] = {
                    key: statistics.median(r[key] for r in mine)
                    for key in ("ready_seconds", "recovery_seconds", "bytes_per_message",
                                "stop_seconds")}
                pauses = [r["checkpoints"]["last_pause_seconds"] for r in mine
                          if r.get("checkpoints", {}).get("written")]
                if pauses:
                    report[f"checkpoint_pause_before_{name}"] = {
                        "median": statistics.median(pauses), "max": max(pauses)}
                report[f"min_max_{name}"] = {
                    key: [min(r[key] for r in mine), max(r[key] for r in mine)]
                    for key in ("ready_seconds", "recovery_seconds", "stop_seconds")}
            report["all_recovered"] = all(r["recovered"] == args.stored
                                          for r in runs + warmup)
            if not args.no_drain:
                consumed = drain(proc.url, queue, args.stored)
                report["drain"] = consumed
                stats = proc_stats(proc.url)
                report["drain_ok"] = consumed["received"] == args.stored and stats == 0
                print(f"drained {consumed['received']:,} (left in queue: {stats})", flush=True)
        finally:
            proc.kill()
    report["loadavg_end"] = os.getloadavg()
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    path = out_dir / f"restart-{time.strftime('%Y%m%d-%H%M%S')}{label}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith("median")}, indent=2))
    print(f"written to {path}")


def wait_for_checkpoint(data: Path, interval: float) -> None:
    """Until the running broker has written its checkpoint (its start deleted the one
    it read)."""
    deadline = time.monotonic() + 10 * interval + 120
    while not (data / "journal" / "checkpoint").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the running broker wrote no checkpoint")
        time.sleep(0.05)


def checkpoint_stats(url: str) -> dict[str, Any] | None:
    """The running broker's checkpoints: how many, the last one's pause and write
    (``stats()["checkpoints"]``; None when it takes none while running)."""
    from txbroker.client.sync import connect

    with connect(url) as conn:
        found: dict[str, Any] | None = conn.stats().get("checkpoints")
        return found


def body_cache_bytes(url: str) -> int:
    """Bytes of bodies in the broker's body cache now (``stats()["store"]``)."""
    from txbroker.client.sync import connect

    with connect(url) as conn:
        return int(conn.stats()["store"]["body_cache_bytes"])


def proc_stats(url: str) -> int:
    """Messages left in the queue after the drain (0 when every one was consumed)."""
    from txbroker.client.sync import connect

    with connect(url) as conn:
        return int(conn.queue_info("stored")["messages"])


if __name__ == "__main__":
    main()
