#!/usr/bin/env python3
"""Incremental catch-up of a replicated backup (issue 29, "backup down 10 s under
load, rejoin → ready"), in one run.

Usage: ``.venv/bin/python bench/ha_catchup.py [--stored 100000] [--away 10]
[--body 1024] [--runs 5]`` (``--help`` for every setting). Results go to
``bench/results/ha_catchup-<timestamp>.json`` and a summary to stdout.

Theory of operation
-------------------
A primary ``a`` and a backup ``b`` (``--ha replicated``) on 127.0.0.1, ``b``
reaching ``a``'s HA port through a TCP proxy in this process. ``a`` stores
``--stored`` persistent messages of ``--body`` bytes (transactions of 500), ``b``
follows. ``--producers`` producers (each one native connection, one persistent
send at a time, ``--rate`` a second together: a load that does not vary with the
machine) then run throughout:

1. **Link cut** (incremental catch-up): the proxy cuts ``b``'s link and swallows
   its attempts to rejoin for ``--away`` seconds (``a`` drops ``b`` and acknowledges
   without it), then lets them through. Measured: from letting them through to
   ``b`` ready on ``a``'s status; the entries written while ``b`` was away (``a``'s
   LSN); what ``a`` shipped for the rejoin (``replication.catchup``: suffix entries
   and bytes — the entries missed until the rejoin itself —, or a dump).
2. **Process restart**: ``--steady`` seconds after it is ready again, ``b`` is killed
   (-9), stays down ``--away`` seconds and is started again on its data directory: it
   recovers its own store, whose log says which LSN it holds, and asks for the suffix
   (``server/ha/replica.py``, "Resuming from the disk"). Measured: from the start to
   ``b`` ready (its recovery included); the same shipping figures (a suffix, or a dump
   when ``a`` no longer holds it); what its recovery read (from its log: a checkpoint
   and how many entries after it, with ``--recovery-checkpoint``) and how long from the
   process's start until it had its copy back (before it joins).

Each part runs ``--runs`` times (the first run of each is the warm-up, reported but
left out of min/median/max).

Every process is started in its own session and stopped by its pid on the way out.
The producer's own rate is reported (it is the load, not a figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
HOST: Final = "127.0.0.1"
READY_PREFIX: Final = "txbroker ready on"
BACKUP_PREFIX: Final = "txbroker backup on HA"
#: Polls of a status (s).
POLL: Final = 0.02


def say(text: str) -> None:
    print(text, flush=True)


def free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            value = condition()
            if value:
                return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(POLL)


class Node:
    """One ``txbroker serve --ha replicated`` process."""

    def __init__(self, name: str, root: Path, peer: str, config: Path | None = None) -> None:
        self.name, self.root, self.peer, self.config = name, root, peer, config
        self.port, self.ha_port = free_ports(2)
        self.data = root / f"{name}-data"
        self.log = root / f"{name}.log"
        self.out = root / f"{name}.out"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_mark = 0  #: the log's size when the process last started
        self.started_at = 0.0  #: when it last started (wall clock, as its log's times)

    def start(self) -> None:
        self.log_mark = self.log.stat().st_size if self.log.exists() else 0
        self.started_at = time.time()
        cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(self.data),
               "--host", HOST, "--port", str(self.port), "--stomp-port", "0",
               "--ha", "replicated", "--ha-port", str(self.ha_port), "--ha-node", self.name,
               "--ha-peers", self.peer, "--backup-timeout", "1", "--log-level", "INFO",
               *(["--config", str(self.config)] if self.config is not None else [])]
        out: IO[bytes] = open(self.out, "wb")  # noqa: SIM115 - the child keeps it
        log: IO[bytes] = open(self.log, "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=log, cwd=ROOT,
                                         start_new_session=True)
        finally:
            out.close()
            log.close()
        wait_for(lambda: BACKUP_PREFIX in self.out.read_text(), 60, f"{self.name} to start")

    def recovered(self) -> dict[str, Any]:
        """What the last start of this node read (from its log): a checkpoint and the
        entries after it, or the whole log; and the seconds from its start to the copy
        kept (its own recovery, before it joins)."""
        with open(self.log, "rb") as file:
            file.seek(self.log_mark)
            last = file.read().decode(errors="replace")
        found = re.search(r"read a checkpoint, then the (\d+) entries logged after it", last)
        kept = re.search(r"^(\S+ \S+) .*kept the copy on disk", last, re.MULTILINE)
        at = None if kept is None else datetime.strptime(kept.group(1), "%Y-%m-%d %H:%M:%S,%f")
        return {"from_checkpoint": found is not None,
                "entries_after_checkpoint": int(found.group(1)) if found else None,
                "start_to_copy_kept_s": None if at is None else
                round(at.timestamp() - self.started_at, 3)}

    def status(self) -> dict[str, Any]:
        from txbroker.cli.ha_commands import probe
        from txbroker.client.url import HostPort

        return dict(probe(HostPort(HOST, self.port), None, None)["ha"])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


class Proxy:
    """A TCP proxy to one HA port; ``cut()`` closes the link and swallows new ones
    until ``restore()``."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_ports(1)[0]
        self.blocked = False
        self.loop = asyncio.new_event_loop()
        self._writers: list[asyncio.StreamWriter] = []
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._on_client, HOST, self.port))
        ready.set()
        self.loop.run_forever()

    async def _on_client(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if self.blocked:
            return  # accepted, never answered
        up_reader, up_writer = await asyncio.open_connection(HOST, self.target)
        self._writers.append(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 20):
            writer.write(data)
            await writer.drain()
        writer.close()

    def _close_all(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    def cut(self) -> None:
        def run() -> None:
            self.blocked = True
            self._close_all()

        self.loop.call_soon_threadsafe(run)

    def restore(self) -> None:
        """Let the next attempt through (the one swallowed now fails at once)."""
        def run() -> None:
            self.blocked = False
            self._close_all()

        self.loop.call_soon_threadsafe(run)


class Producer:
    """One connection, one persistent send at a time, at most ``rate`` a second (0: as
    fast as it goes), until closed."""

    def __init__(self, url: str, body: bytes, rate: float = 0.0) -> None:
        self.url, self.body, self.rate = url, body, rate
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import txbroker

        with txbroker.connect(self.url, timeout=30, reconnect=False) as conn:
            gap = 1.0 / self.rate if self.rate else 0.0
            next_at = time.monotonic()
            while not self.stop.is_set():
                conn.send("bench.load", self.body)
                self.sent += 1
                if gap:
                    next_at += gap
                    wait = next_at - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def catchup(a: Node) -> dict[str, int]:
    return dict(a.status()["replication"]["catchup"])


def ready_backups(a: Node) -> list[str]:
    return [b["node"] for b in a.status()["replication"]["backups"] if b["state"] == "ready"]


def rejoin(a: Node, before: dict[str, int], started: float, lsn_away: int,
           ) -> dict[str, Any]:
    wait_for(lambda: ready_backups(a) == ["b"], 600, "b ready again")
    ready = time.monotonic() - started
    after = catchup(a)
    return {"rejoin_to_ready_s": round(ready, 3), "entries_missed": lsn_away,
            **{key: after[key] - before[key] for key in after
               if key in ("dumps", "dump_entries", "dump_bytes", "suffixes", "suffix_entries",
                          "suffix_bytes")}}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run, and min/median/max of the time to ready over the runs after the first."""
    times = sorted(run["rejoin_to_ready_s"] for run in runs[1:]) or \
        [runs[0]["rejoin_to_ready_s"]]
    return {"runs": runs, "rejoin_to_ready_s": {"min": times[0],
                                                 "median": statistics.median(times),
                                                 "max": times[-1]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stored", type=int, default=100_000, help="messages stored first")
    parser.add_argument("--body", type=int, default=1024, help="body bytes")
    parser.add_argument("--away", type=float, default=10.0, help="seconds b is cut off")
    parser.add_argument("--producers", type=int, default=4, help="producer connections")
    parser.add_argument("--rate", type=float, default=3500.0,
                        help="the producers' sends a second, together (0: as fast as they "
                        "go, which varies with the machine; 3,500 is what they reached here "
                        "on 2026-11-28 at 0b1ea8e)")
    parser.add_argument("--steady", type=float, default=3.0,
                        help="seconds b follows, ready, between the link's return and the "
                        "kill (0: the kill right after the catch-up, before any checkpoint "
                        "can cover it)")
    parser.add_argument("--runs", type=int, default=6, help="runs of each part (the first: "
                        "warm-up)")
    parser.add_argument("--label", default="", help="a word for the result file's name")
    parser.add_argument("--recovery-checkpoint", action=argparse.BooleanOptionalAction,
                        default=False, help="run both nodes with recovery_checkpoint = true: "
                        "the backup checkpoints its copy (docs/replication.md)")
    parser.add_argument("--checkpoint-interval", type=float, default=None,
                        help="with --recovery-checkpoint: checkpoint_interval (s; default: "
                        "the broker's, 60)")
    args = parser.parse_args()
    import txbroker

    work = Path(tempfile.mkdtemp(prefix="ha_catchup-"))
    config: Path | None = None
    if args.recovery_checkpoint:
        config = work / "broker.toml"
        interval = "" if args.checkpoint_interval is None else \
            f"checkpoint_interval = {args.checkpoint_interval}\n"
        config.write_text(f"[server]\nrecovery_checkpoint = true\n{interval}")
    a = Node("a", work, "", config)
    b = Node("b", work, "", config)
    proxy = Proxy(a.ha_port)
    a.peer, b.peer = f"{HOST}:{b.ha_port}", f"{HOST}:{proxy.port}"
    body = b"x" * args.body
    result: dict[str, Any] = {"stored": args.stored, "body": args.body, "away_s": args.away,
                              "rate": args.rate, "steady_s": args.steady,
                              "recovery_checkpoint": args.recovery_checkpoint,
                              "checkpoint_interval": args.checkpoint_interval,
                              "loadavg_at_start": os.getloadavg(),
                              "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                    cwd=ROOT, capture_output=True,
                                                    text=True).stdout.strip()}
    producers: list[Producer] = []
    try:
        a.start()
        b.start()
        from txbroker.cli.ha_commands import probe
        from txbroker.client.url import HostPort

        probe(HostPort(HOST, a.port), None, None, op="ha_promote")
        wait_for(lambda: ready_backups(a) == ["b"], 120, "b ready")
        with txbroker.connect(f"txb://{HOST}:{a.port}", timeout=60) as conn:
            for first in range(0, args.stored, 500):
                with conn.transaction() as tx:
                    for _ in range(first, min(args.stored, first + 500)):
                        tx.send("bench.stored", body)
        say(f"stored {args.stored} messages of {args.body} bytes")
        producers = [Producer(f"txb://{HOST}:{a.port}", body, args.rate / args.producers)
                     for _ in range(args.producers)]
        time.sleep(2.0)  # the load runs with b attached

        cuts: list[dict[str, Any]] = []
        restarts: list[dict[str, Any]] = []
        for run in range(args.runs):
            # 1. the link is cut for --away seconds
            before, lsn_cut = catchup(a), a.status()["replication"]["lsn"]
            sent_before = sum(p.sent for p in producers)
            proxy.cut()
            time.sleep(args.away)
            lsn_back = a.status()["replication"]["lsn"]
            started = time.monotonic()
            proxy.restore()
            cut = rejoin(a, before, started, lsn_back - lsn_cut)
            cut["load_msgs_per_s"] = round(
                (sum(p.sent for p in producers) - sent_before)
                / (time.monotonic() - started + args.away), 1)
            cuts.append(cut)
            say(f"run {run}: link cut {args.away:g} s: {cut}")

            # 2. the process is killed, stays down --away seconds, and starts again
            time.sleep(args.steady)
            before = catchup(a)
            b.stop(signal.SIGKILL)
            lsn_killed = a.status()["replication"]["lsn"]
            time.sleep(args.away)
            started = time.monotonic()
            b.start()
            restart = rejoin(a, before, started,
                             a.status()["replication"]["lsn"] - lsn_killed)
            restart.update(b.recovered())
            restarts.append(restart)
            say(f"run {run}: process down {args.away:g} s and restarted: {restart}")
        result["link_cut"] = summary(cuts)
        result["process_restart"] = summary(restarts)
        result["loadavg_at_end"] = os.getloadavg()
    finally:
        for producer in producers:
            producer.close()
        result["producers_sent"] = sum(p.sent for p in producers)
        b.stop()
        a.stop()
        shutil.rmtree(work, ignore_errors=True)
    label = f"-{args.label}" if args.label else ""
    out = ROOT / "bench" / "results" / f"ha_catchup-{time.strftime('%Y%m%d-%H%M%S')}{label}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    say(f"results: {out}")


if __name__ == "__main__":
    main()
