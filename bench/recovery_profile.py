#!/usr/bin/env python3
"""Where a restart's recovery time goes, phase by phase (issue 29), one command.

Loads ``--stored`` persistent 1 KiB messages into a broker started as users start it
(``txbroker serve``, journal store, ``recovery_index`` as asked), stops it with kill -9
(so there is no checkpoint: the log is replayed), then ``--reps`` times recovers that
data directory *in this process*, phase by phase, as ``server/app.py`` does:

* ``read``: the journal's ``recover()`` iterator run to its end (segments, or their
  recovery indexes, read and decoded; the writer thread started);
* ``replay``: ``Broker.replay`` of every entry;
* ``finish``: ``Broker.finish_recovery`` (every surviving message into its queue).

``--cold`` evicts the data directory from the page cache before each rep.
``--profile`` runs one more rep under ``cProfile`` and prints the top functions by
cumulative time (compiled functions show as one call each). The recovered count is
checked against ``--stored`` every rep. Results: ``bench/results/recovery-profile-
<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from restart_bench import evict, load  # noqa: E402
from tests.support import BrokerProcess  # noqa: E402

from txbroker import _build  # noqa: E402
from txbroker.core import Broker  # noqa: E402
from txbroker.storage.journal import JournalStore  # noqa: E402


def recover_once(data: Path, recovery_index: bool) -> dict[str, Any]:
    """One in-process recovery of ``data`` (a copy: recovery may write): seconds per phase."""
    broker = Broker()
    store = JournalStore(data, snapshot_provider=broker.snapshot,
                         recovery_index=recovery_index)
    broker.body_size_of = store.body_size
    gc.disable()  # (as the server does during recovery: server/process.py gc_paused)
    try:
        started = time.perf_counter()
        entries = list(store.recover())
        read = time.perf_counter()
        replay = broker.replay
        for entry in entries:
            replay(entry)
        replayed = time.perf_counter()
        broker.finish_recovery(0)
        finished = time.perf_counter()
    finally:
        gc.enable()
        store.close()
    stats = store.stats()
    return {"read": round(read - started, 3), "replay": round(replayed - read, 3),
            "finish": round(finished - replayed, 3), "total": round(finished - started, 3),
            "entries": len(entries), "messages": len(broker.messages),
            "recovered_bytes": stats.recovered_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stored", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--loaders", type=int, default=3)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--recovery-index", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                              "build": _build.MODE, "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="txb-recprof-") as tmp:
        config = Path(tmp) / "broker.toml"
        config.write_text(f"[server]\nrecovery_index = {str(args.recovery_index).lower()}\n")
        data = Path(tmp) / "data"
        proc = BrokerProcess(data, "--config", str(config)).start()
        try:
            print(f"loading {args.stored:,} messages …", flush=True)
            report["load_seconds"] = round(load(proc.url, "stored", args.stored,
                                                args.loaders, 2), 2)
        finally:
            proc.kill(signal.SIGKILL)
        work = Path(tmp) / "work"
        runs = []
        for rep in range(-1, args.reps):  # (rep -1: a warm-up, not counted)
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(data, work)
            if args.cold:
                evict(work)
            run = recover_once(work, args.recovery_index)
            run["rep"] = rep
            print(json.dumps(run), flush=True)
            if run["messages"] != args.stored:
                raise SystemExit(f"recovered {run['messages']}, expected {args.stored}")
            if rep >= 0:
                runs.append(run)
        report["runs"] = runs
        report["median"] = {key: statistics.median(r[key] for r in runs)
                            for key in ("read", "replay", "finish", "total")}
        report["min_max"] = {key: [min(r[key] for r in runs), max(r[key] for r in runs)]
                             for key in ("read", "replay", "finish", "total")}
        if args.profile:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(data, work)
            if args.cold:
                evict(work)
            profiler = cProfile.Profile()
            profiler.runcall(recover_once, work, args.recovery_index)
            stats = pstats.Stats(profiler)
            stats.sort_stats("cumulative").print_stats(25)
            stats.sort_stats("tottime").print_stats(15)
    report["loadavg_end"] = os.getloadavg()
    out = ROOT / "bench" / "results"
    label = f"-{args.label}" if args.label else ""
    path = out / f"recovery-profile-{time.strftime('%Y%m%d-%H%M%S')}{label}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"median": report["median"], "min_max": report["min_max"]}, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
