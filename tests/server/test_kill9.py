"""Kill -9 under load: nothing acknowledged is lost, nothing appears from nowhere,
no confirmed ack comes back, no transaction is partly visible.

A real broker process runs on loopback. Producers send with unique message
ids (plain sends and transactions of several sends); consumers receive and
ack; "movers" consume from one queue and send to another in one local
transaction. At a random moment the broker is killed with SIGKILL, restarted,
and the load goes on. At the end every queue is drained and each id checked.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import txbroker
from tests import native_workload as load
from tests.ledger import Ledger, check, join_or_explain, verdict
from tests.support import BrokerProcess
from txbroker.errors import TxBrokerError


def _guard(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
            fn()  # the broker is killed under us: errors are expected

    return run


def _connect(url: str) -> Any:
    return txbroker.connect(url, reconnect=False, timeout=10)


def run_cycles(tmp_path: Path, cycles: int, seed: int, store: str = "journal",
               *, clean_every: int = 0, checkpoint_interval: float = 0.0) -> dict[str, Any]:
    """``cycles`` of load then kill -9 (every ``clean_every``-th cycle a SIGTERM
    instead: a clean shutdown under load, whose checkpoint the next start reads; with
    ``checkpoint_interval``, each kill comes after the running broker wrote one, and
    the next start reads it and the log after it)."""
    rng = random.Random(seed)
    ledger = Ledger()
    # small segments and a fast maintenance tick: segments are deleted and live
    # messages relocated while the kills happen
    config = tmp_path / "broker.toml"
    checkpoints = bool(clean_every or checkpoint_interval)
    config.write_text("[server]\nsegment_size = 131072\nmaintain_interval = 0.2\n"
                      f"recovery_checkpoint = {'true' if checkpoints else 'false'}\n"
                      f"checkpoint_interval = {checkpoint_interval}\n")
    checkpoint = tmp_path / "data" / "journal" / "checkpoint"
    suffixes: list[int] = []
    extra = ["--store", "dir", "--dir-flags", "FDATASYNC,DSYNC"] if store == "dir" else []
    proc = BrokerProcess(tmp_path / "data", "--config", str(config), *extra).start()
    try:
        for cycle in range(cycles):
            stop = threading.Event()
            url = proc.url
            workers: list[Callable[[], None]] = [
                partial(load.producer, _connect, url, f"c{cycle}p0", ledger, stop, 0),
                partial(load.producer, _connect, url, f"c{cycle}p1", ledger, stop, 0),
                partial(load.producer, _connect, url, f"c{cycle}t0", ledger, stop, 5),
                partial(load.feeder, _connect, url, f"c{cycle}f0", ledger, stop),
                partial(load.consumer, _connect, url, ledger, stop),
                partial(load.consumer, _connect, url, ledger, stop),
                partial(load.mover, _connect, url, ledger, stop),
            ]
            threads = [threading.Thread(target=_guard(w), daemon=True) for w in workers]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.3, 1.2))
            if checkpoint_interval:  # (the start deleted the one it read)
                _wait_for(checkpoint.exists, timeout=60)
                time.sleep(rng.uniform(0.05, 0.5))  # the log goes on after it
            clean = bool(clean_every) and cycle % clean_every == clean_every - 1
            proc.kill(signal.SIGTERM if clean else signal.SIGKILL)
            if clean:  # exited by itself (0), leaving its checkpoint
                assert proc.proc is not None and proc.proc.returncode == 0
                assert checkpoint.exists()
            stop.set()
            for t in threads:
                join_or_explain(t, timeout=60)
            proc.start()
            if clean or checkpoint_interval:
                with _connect(proc.url) as conn:
                    stats = conn.stats()["store"]
                assert stats["recovered_from_checkpoint"]
                if clean:  # it read the checkpoint alone, not the log
                    assert stats["recovered_entries"] == 1
                else:  # the checkpoint, then the log after it
                    suffixes.append(stats["recovered_entries"] - 1)
        plain, txin, txout = (load.drain(_connect, proc.url, q) for q in ("plain", "txin",
                                                                          "txout"))
    finally:
        proc.kill()

    report = verdict(ledger, plain, txin, txout, store=store, cycles=cycles)
    if checkpoint_interval:
        report["entries_after_checkpoints"] = suffixes
    print("kill -9 report:", report)
    return report


@pytest.mark.parametrize("store", ["journal", "dir"])
def test_kill9_cycles(tmp_path: Path, store: str) -> None:
    check(run_cycles(tmp_path, cycles=10, seed=20261122, store=store))


def test_kill9_and_clean_stops_under_load(tmp_path: Path) -> None:
    """Every other restart reads a checkpoint written while clients were busy
    (docs/storage.md, "Recovery checkpoint"): nothing lost, nothing twice."""
    check(run_cycles(tmp_path, cycles=10, seed=20261128, clean_every=2))


def test_kill9_after_running_checkpoints(tmp_path: Path) -> None:
    """Every kill -9 comes after the running broker wrote a checkpoint with clients
    busy (docs/storage.md, "Running checkpoints"), and load went on after it: each
    start reads the checkpoint and replays the log after it. Nothing lost, nothing
    twice."""
    report = run_cycles(tmp_path, cycles=8, seed=20261129, checkpoint_interval=0.1)
    check(report)
    assert sum(report["entries_after_checkpoints"]) > 0  # (logs did follow them)


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 60 cycles take 5-10 minutes on 2 cores
def test_kill9_soak(tmp_path: Path) -> None:
    check(run_cycles(tmp_path, cycles=60, seed=7))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 40 cycles take 2 minutes on 2 cores
@pytest.mark.parametrize(("seed", "clean_every"), [(424242, 0), (777, 3)])
def test_kill9_soak_after_running_checkpoints(tmp_path: Path, seed: int,
                                              clean_every: int) -> None:
    """40 kills after running checkpoints (every third a SIGTERM with ``clean_every``
    3); 2026-11-28: 0 lost, 0 twice, each start read a checkpoint and 8-770 entries."""
    report = run_cycles(tmp_path, cycles=40, seed=seed, checkpoint_interval=0.1,
                        clean_every=clean_every)
    check(report)
