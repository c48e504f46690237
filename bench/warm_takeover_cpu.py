#!/usr/bin/env python3
"""Where a shared-store takeover's CPU goes, warm standby against cold (issue 29).

Usage: ``.venv/bin/python bench/warm_takeover_cpu.py [--stored 100000] [--churn 20000]
[--reps 2]``. A broker in this process stores ``--stored`` 1 KiB messages (batches of
1,000), then sends and consumes ``--churn`` more through another queue, and is
killed (its store abandoned, not closed: the head keeps its pre-allocated zeros).
Then, on a copy of its data directory each time, alternately:

* **warm**: a ``WarmStandby`` follows the journal to its end (as a standby does
  while it waits), then takes the lock and recovers through ``takeover_server``;
* **cold**: a plain recovery of the whole journal.

For each, the CPU seconds (``time.process_time``: wall time on a shared machine
says more about the neighbours) of the takeover's phases: the follower's checks,
opening the store and replaying what it reads, the core's finish (live messages
into their queues), the effects (releases), ``malloc_trim``. Results go to
``bench/results/warm_takeover_cpu-<timestamp>.json`` and a summary to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import txbroker.aio as aio
from txbroker.core.broker import Broker
from txbroker.server import app as app_mod
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.ha.warm import WarmStandby, takeover_server
from txbroker.server.stores import store_lock_path
from txbroker.storage.journal import JournalStore
from txbroker.storage.journal_follow import JournalFollower
from txbroker.storage.store_lock import StoreLock

RESULTS = Path(__file__).resolve().parent / "results"
PHASES: dict[str, float] = {}


def _timed(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            PHASES[label] = PHASES.get(label, 0.0) + time.process_time() - started

    setattr(owner, name, wrapper)


def _instrument() -> None:
    _timed(JournalFollower, "resume_point", "follower checks")
    _timed(BrokerServer, "open_store", "store open + replay")
    _timed(Broker, "finish_recovery", "core finish")
    _timed(BrokerServer, "run_effects", "effects (releases)")
    _timed(app_mod, "release_free_memory", "malloc_trim")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def fill(data: Path, stored: int, churn: int) -> None:
    """Store and churn through an in-process broker, then abandon it (a kill)."""
    config = ServerConfig(data=data, port=_free_port(), stomp_port=0, amqp_port=0)
    server = BrokerServer(config)
    await server.recover()
    await server.open_listeners()
    async with aio.connect(f"txb://127.0.0.1:{config.port}") as conn:
        for first in range(0, stored, 1000):
            await conn.send_batch("stored", [b"x" * 1024] * min(1000, stored - first))
        for first in range(0, churn, 1000):
            await conn.send_batch("churn", [b"y" * 1024] * min(1000, churn - first))
            for _ in range(min(1000, churn - first)):
                message = await conn.receive("churn", timeout=5)
                assert message is not None
                await message.ack()
    assert isinstance(server.store, JournalStore)
    server.store.flush(30)
    # a kill: the store is abandoned as it is (the runs use copies of its directory)


async def takeover(data: Path, warm: bool) -> dict[str, Any]:
    config = ServerConfig(data=data, port=0, stomp_port=0, amqp_port=0)
    standby = None
    follow_s = 0.0
    if warm:
        standby = WarmStandby(config)
        started = time.process_time()
        while standby.step():
            pass
        follow_s = time.process_time() - started
    lock = StoreLock.try_acquire(store_lock_path(config), "bench")
    assert lock is not None
    PHASES.clear()
    started = time.process_time()
    server = await takeover_server(standby, config, lock)
    await server.recover()
    total = time.process_time() - started
    assert server.store is not None
    stats = server.store.stats()
    result = {"mode": "warm" if warm else "cold", "cpu_s": round(total, 4),
              "phases_cpu_s": {k: round(v, 4) for k, v in PHASES.items()},
              "followed_cpu_s": round(follow_s, 3),
              "recovered_entries": stats.recovered_entries,
              "recovered_bytes": stats.recovered_bytes,
              "messages": len(server.broker.messages)}
    await server.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stored", type=int, default=100_000)
    parser.add_argument("--churn", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    import logging

    logging.getLogger("txbroker").setLevel(logging.ERROR)
    _instrument()
    tmp = Path(tempfile.mkdtemp(prefix="warm_takeover-"))
    try:
        source = tmp / "source"
        asyncio.run(fill(source, args.stored, args.churn))
        runs = []
        for rep in range(args.reps):
            for warm in (True, False):
                copy = tmp / f"copy-{rep}-{warm}"
                shutil.copytree(source, copy)
                runs.append(asyncio.run(takeover(copy, warm)))
                print(json.dumps(runs[-1]))
                shutil.rmtree(copy)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": vars(args),
              "load": os.getloadavg(), "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"warm_takeover_cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("results:", out)


if __name__ == "__main__":
    main()
