#!/usr/bin/env python3
"""Shared-store failover figures (issue 13, "Figures"), in one run.

Usage: ``.venv/bin/python bench/ha_failover.py [--kills 20] [--stored 100000] ...``
(``--help`` for every setting). Results go to
``bench/results/ha_failover-<timestamp>.json`` and a summary to stdout.

Theory of operation
-------------------
Two ``txbroker serve --ha shared-store`` processes share one temporary data
directory holding ``--stored`` persistent 1 KiB messages (queue ``ha.stored``);
each part below starts on a fresh directory filled that way.
A producer sends persistent messages (each with a ``message_id``) to
``ha.produce`` through the failover URL ``txb://A,B`` with ``--window`` sends
outstanding. Each *cycle*:

1. the producer runs for :data:`STEADY_BEFORE_KILL` seconds;
2. the active's process gets SIGKILL (the size of the data directory, which
   the next recovery replays, is noted first); we time, from the kill, the standby's
   log lines (link broke, holding the lock), its ``txbroker ready on``
   line (with the recovery it reports) and the first acknowledged send whose
   connection is on the new active -- that last one is "the takeover";
3. the producer runs :data:`AFTER_TAKEOVER` seconds more, is paused, and
   ``ha.produce`` is drained from the new active: every acknowledged id must
   come back (0 lost), a duplicate is counted (it may only be a redelivery);
4. the killed broker is restarted and we wait for its standby line (role
   reversal); the next cycle kills the other one.

Parts: (1) ``--kills`` cycles over the native client; (1s) ``--stomp-kills``
cycles with a raw STOMP 1.2 client (receipted SENDs, same retry rule as for
ActiveMQ) against the pair's STOMP ports; (2) heartbeat loss: a new pair with
``--hb-heartbeat``/``--hb-activation`` (default 1 s / 3 s) whose HA links go
through an asyncio TCP proxy; the proxy is blocked (data held, nothing
closed: a partition), we time the standby's "no heartbeat ... trying the
lock" line, check for ``--hb-hold`` seconds that it does not take over while
the active keeps acknowledging sends, then kill -9 the active with the link
still blocked and time the takeover; (3) the messages/s lost follow from the
acknowledged-send rate in the second before each kill and the gap; (4) the
anchor, ActiveMQ 5.17 shared-file master/slave
(``../shared/bench/activemq/shared-store.sh``), measured the same way over
STOMP when it is installed and we are root, else the figures of
``../shared/bench/README.md`` are quoted (``activemq.measured`` false).

Every process is started in its own session, bound to 127.0.0.1 on free ports,
and stopped by its pid (ActiveMQ: its process group) on the way out, errors
included. The run waits while a ``pytest`` process is running (the suite
would distort the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
#: ../shared/bench of the project (the peers' scripts and README).
PEERS_DIR: Final = ROOT.parent / "shared" / "bench"

#: Seconds of sending before each kill (the rate "in the second before" is its last second).
STEADY_BEFORE_KILL: Final = 1.5
#: Seconds of sending after the first acknowledged send on the new active.
AFTER_TAKEOVER: Final = 1.0
#: Seconds to wait for a takeover, a standby line, a broker start (ActiveMQ's JVM: ~3 s).
TAKEOVER_TIMEOUT: Final = 60.0
START_TIMEOUT: Final = 90.0
#: The raw STOMP client's pause after a full round of its host list found no broker
#: (the same for txbroker and ActiveMQ; stomp.py's own back-off starts at 0.1 s).
STOMP_RETRY_PAUSE: Final = 0.05
#: STOMP drain: stop after this long without a MESSAGE (what is left is drained next time).
STOMP_DRAIN_IDLE: Final = 1.0
#: Messages per send_batch while filling the store.
FILL_BATCH: Final = 1000
#: The README's ActiveMQ figures (../shared/bench/README.md, "Failover peer"), quoted
#: when ActiveMQ cannot be run here.
AMQ_README_FIGURES: Final = {
    "source": "../shared/bench/README.md, 'Failover peer: ActiveMQ shared-file master/slave'",
    "takeover_median_s": [0.8, 1.5], "takeover_max_s": 2.5, "kills": 36,
}

READY_RE: Final = re.compile(r"txbroker ready on .*recovered (\d+) messages in ([\d.]+) s")
STANDBY_RE: Final = re.compile(r"txbroker standby on HA")
LINK_BROKE_RE: Final = re.compile(r"HA: the connection to the active .* broke")
NO_HEARTBEAT_RE: Final = re.compile(r"HA: no heartbeat from the active")
HOLDING_RE: Final = re.compile(r"HA: holding the lock")
FOLLOWING_RE: Final = re.compile(r"HA: standby of the active")
AMQ_READY_RE: Final = re.compile(r"Apache ActiveMQ [\d.]+ \(\w+, .*\) started")
AMQ_SLAVE_RE: Final = re.compile(r"This broker is now in slave mode")


# ============================================================== small helpers

def now() -> float:
    """The one clock of the run (monotonic seconds)."""
    return time.monotonic()


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound to port 0 together)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def ports_free(ports: Iterable[int]) -> bool:
    """True if every port can be bound on 127.0.0.1 now."""
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def summary(values: list[float]) -> dict[str, Any]:
    """n, median, min, max of ``values`` (rounded to ms), or n=0."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 3),
            "min": round(min(values), 3), "max": round(max(values), 3)}


def dir_mib(path: Path) -> int:
    """MiB of the files under ``path``."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(folder, name))
    return total >> 20


def loadavg() -> list[float]:
    """The 1/5/15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def git(*args: str) -> str:
    """Output of a git command in the repository ('' if it fails)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def pytest_running() -> list[str]:
    """Command lines of running pytest processes (not this one)."""
    out = subprocess.run(["pgrep", "-af", "pytest"], capture_output=True, text=True).stdout
    mine = {str(os.getpid()), str(os.getppid())}
    return [line for line in out.splitlines()
            if line.split(" ", 1)[0] not in mine and "pgrep" not in line]


def say(text: str) -> None:
    """Progress line on stdout."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# ============================================================== processes

@dataclass
class Proc:
    """A child process whose output lines we keep, timestamped when read."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    group: bool = False  #: stop the whole process group (ActiveMQ: a JVM with threads)
    proc: asyncio.subprocess.Process | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    started: float = 0.0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _readers: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> Proc:
        self.started = now()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=self.env, start_new_session=True, cwd=ROOT)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [asyncio.create_task(self._read(s))
                         for s in (self.proc.stdout, self.proc.stderr)]
        LIVE.append(self)
        return self

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.lines.append((now(), line.decode("utf-8", "replace").rstrip()))
            self._changed.set()
        self._changed.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait_line(self, pattern: re.Pattern[str], after: float,
                        timeout: float) -> tuple[float, re.Match[str]]:
        """The first line at or after ``after`` matching ``pattern``: (time, match)."""
        deadline = now() + timeout
        seen = 0
        while True:
            for t, text in self.lines[seen:]:
                if t >= after and (m := pattern.search(text)):
                    return t, m
            seen = len(self.lines)
            if not self.alive and self.proc is not None and all(r.done() for r in self._readers):
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) while "
                                   f"waiting for {pattern.pattern!r}:\n{self.tail()}")
            self._changed.clear()
            remaining = deadline - now()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: no {pattern.pattern!r} within {timeout} s:\n"
                                   f"{self.tail()}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, 0.5)):
                    await self._changed.wait()

    def matched(self, pattern: re.Pattern[str], after: float) -> list[float]:
        """Times of the lines at or after ``after`` matching ``pattern``."""
        return [t for t, text in self.lines if t >= after and pattern.search(text)]

    def tail(self, count: int = 15) -> str:
        return "\n".join(f"  {self.name}| {text}" for _, text in self.lines[-count:])

    def kill9(self) -> float:
        """SIGKILL (the group for ActiveMQ); the time of the kill."""
        t = now()
        if self.group:
            os.killpg(self.pid, signal.SIGKILL)
        else:
            os.kill(self.pid, signal.SIGKILL)
        return t

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; reap."""
        if self.proc is None:
            return
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                if self.group:
                    os.killpg(self.pid, signal.SIGTERM)
                else:
                    os.kill(self.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace):
                    await self.proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    if self.group:
                        os.killpg(self.pid, signal.SIGKILL)
                    else:
                        os.kill(self.pid, signal.SIGKILL)
        await self.proc.wait()
        for reader in self._readers:
            with contextlib.suppress(Exception):
                await reader
        if self in LIVE:
            LIVE.remove(self)


#: Every process started and not yet reaped (stopped on the way out, errors included).
LIVE: list[Proc] = []


async def stop_all() -> None:
    """Stop every process we started, by pid (ActiveMQ by process group)."""
    for proc in list(LIVE):
        with contextlib.suppress(Exception):
            await proc.stop(grace=5.0)


# ============================================================== txbroker pair

@dataclass
class BrokerSpec:
    """One broker of a shared-store pair: its ports and how it reaches its peer."""

    name: str
    port: int
    stomp_port: int
    ha_port: int
    peer: str  #: HOST:PORT of the peer's HA port (or of a proxy in front of it)
    data: Path
    heartbeat: float
    activation: float
    sync: str

    @property
    def native(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(self.data),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--stomp-port", str(self.stomp_port), "--amqp-port", "0", "--sync", self.sync,
                "--ha", "shared-store", "--ha-port", str(self.ha_port), "--ha-peer", self.peer,
                "--heartbeat-interval", str(self.heartbeat),
                "--activation-interval", str(self.activation),
                # INFO: the HA lines ("holding the lock" …) time the phases of a takeover
                "--log-level", "INFO"]


class Pair:
    """Two txbroker processes on one data directory; which one is active."""

    def __init__(self, specs: list[BrokerSpec]) -> None:
        self.specs = specs
        self.names = [spec.name for spec in specs]
        self.procs: list[Proc | None] = [None, None]
        self.active = 0

    async def start(self) -> None:
        """Start broker 0 (it becomes active), then broker 1 (standby)."""
        first = await Proc(self.specs[0].name, self.specs[0].argv()).start()
        self.procs[0] = first
        await first.wait_line(READY_RE, first.started, START_TIMEOUT)
        await self.restart(1)
        self.active = 0

    async def restart(self, index: int) -> float:
        """(Re)start broker ``index`` and wait for its standby line; seconds it took."""
        old = self.procs[index]
        if old is not None:
            await old.stop()
        spec = self.specs[index]
        proc = await Proc(spec.name, spec.argv()).start()
        self.procs[index] = proc
        t, _ = await proc.wait_line(STANDBY_RE, proc.started, START_TIMEOUT)
        return t - proc.started

    def proc(self, index: int) -> Proc:
        proc = self.procs[index]
        assert proc is not None
        return proc

    @property
    def url(self) -> str:
        return "txb://" + ",".join(spec.native for spec in self.specs)

    @property
    def stomp_hosts(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", spec.stomp_port) for spec in self.specs]

    async def takeover(self, t_kill: float) -> dict[str, Any]:
        """Wait for the standby's ready line after the kill; the phases of its takeover."""
        new = 1 - self.active
        proc = self.proc(new)
        t_ready, m = await proc.wait_line(READY_RE, t_kill, TAKEOVER_TIMEOUT)
        self.active = new
        detect = proc.matched(LINK_BROKE_RE, t_kill) + proc.matched(NO_HEARTBEAT_RE, t_kill)
        holding = proc.matched(HOLDING_RE, t_kill)
        return {"new_active": self.specs[new].name,
                "detected_s": round(min(detect) - t_kill, 3) if detect else None,
                "lock_s": round(holding[0] - t_kill, 3) if holding else None,
                "ready_s": round(t_ready - t_kill, 3),
                "recovered_messages": int(m.group(1)),
                "recovery_reported_s": float(m.group(2))}

    def journal_mib(self) -> int:
        """MiB in the data directory (the journal the next takeover replays)."""
        return dir_mib(self.specs[0].data)

    async def stop(self) -> None:
        """Stop the standby first (else it would take over), then the active."""
        for index in (1 - self.active, self.active):
            proc = self.procs[index]
            if proc is not None:
                await proc.stop()


def make_pair(data: Path, heartbeat: float, activation: float, sync: str,
              ha: list[int] | None = None, dial: list[int] | None = None) -> Pair:
    """A pair on free ports (``ha``: its HA ports, if chosen already); ``dial``: the
    port each one dials as its HA peer (default: the other's HA port; or a proxy)."""
    ports = free_ports(4 if ha else 6)
    ha = ha or [ports[4], ports[5]]
    dial = dial or [ha[1], ha[0]]
    return Pair([BrokerSpec(name, ports[2 * i], ports[2 * i + 1], ha[i],
                            f"127.0.0.1:{dial[i]}", data, heartbeat, activation, sync)
                 for i, name in enumerate(("A", "B"))])


# ============================================================== native producer

class NativeProducer:
    """``window`` tasks, each sending one persistent message with an id at a time
    through the failover URL; every acknowledgement is timed with its host."""

    def __init__(self, conn: Any, queue: str, window: int, body: bytes, prefix: str) -> None:
        self.conn = conn
        self.prefix = prefix  #: ids are unique per part (the broker's duplicate window
        #: outlives a part: an id sent again would be dropped as a duplicate)
        self.queue = queue
        self.body = body
        self.acks: list[tuple[float, str]] = []
        self.acked_ids: set[str] = set()
        self.errors: list[str] = []
        self.in_doubt: set[str] = set()  #: sends that raised: stored or not
        self._seq = 0
        self._running = asyncio.Event()
        self._idle = [asyncio.Event() for _ in range(window)]
        self._tasks = [asyncio.create_task(self._work(i)) for i in range(window)]

    async def _work(self, index: int) -> None:
        idle = self._idle[index]
        while True:
            idle.set()
            await self._running.wait()
            idle.clear()
            self._seq += 1
            mid = f"{self.prefix}{self._seq:09d}"
            try:
                await self.conn.send(self.queue, self.body, message_id=mid)
            except Exception as exc:  # counted, the run goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.in_doubt.add(mid)
                await asyncio.sleep(0.05)
                continue
            self.acks.append((now(), str(self.conn.host)))
            self.acked_ids.add(mid)

    def resume(self) -> None:
        self._running.set()

    async def pause(self) -> None:
        """Stop sending and wait until no send is outstanding."""
        self._running.clear()
        for idle in self._idle:
            await idle.wait()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def acks_between(acks: list[tuple[float, str]], start: float, end: float) -> int:
    return sum(1 for t, _ in acks if start <= t < end)


def first_ack_on(acks: list[tuple[float, str]], after: float, host: str) -> float | None:
    """Time of the first acknowledgement after ``after`` received from ``host``."""
    return next((t for t, h in acks if t > after and h == host), None)


async def wait_first_ack(acks: list[tuple[float, str]], after: float, host: str,
                         timeout: float = TAKEOVER_TIMEOUT) -> float:
    deadline = now() + timeout
    while (t := first_ack_on(acks, after, host)) is None:
        if now() > deadline:
            raise TimeoutError(f"no acknowledged send on {host} within {timeout} s")
        await asyncio.sleep(0.005)
    return t


async def drain_native(conn: Any, queue: str) -> tuple[list[str], int]:
    """Take every message of ``queue``: (their ids, how many were flagged redelivered)."""
    ids: list[str] = []
    redelivered = 0
    async with conn.subscribe(queue, prefetch=1000, ack="auto") as sub:
        while True:
            batch = await sub.get_batch(1000, timeout=0.5)
            if not batch:
                info = await conn.queue_info(queue)
                if info.get("depth", 0) == 0 and not info.get("in_flight"):
                    break
                continue
            ids += [str(m.message_id) for m in batch]
            redelivered += sum(1 for m in batch if m.redelivered)
    return ids, redelivered


class Ledger:
    """Acknowledged ids against drained ids: lost, duplicates, unexpected."""

    def __init__(self) -> None:
        self.drained: dict[str, int] = {}
        self.redelivered = 0

    def add(self, ids: Iterable[str], redelivered: int = 0) -> None:
        for mid in ids:
            self.drained[mid] = self.drained.get(mid, 0) + 1
        self.redelivered += redelivered

    def verdict(self, acked: set[str], in_doubt: set[str] | None = None) -> dict[str, Any]:
        lost = acked - self.drained.keys()
        extra = self.drained.keys() - acked
        doubt = extra & (in_doubt or set())
        return {"acknowledged": len(acked), "drained": sum(self.drained.values()),
                "lost": len(lost), "lost_sample": sorted(lost)[:10],
                "duplicates": sum(n - 1 for n in self.drained.values() if n > 1),
                "flagged_redelivered": self.redelivered,
                "stored_unacknowledged_in_doubt": len(doubt),
                "unexpected": len(extra - doubt)}


# ============================================================== raw STOMP client

class StompConnection:
    """A minimal STOMP 1.2 client on asyncio streams (the same one for every broker)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 address: str) -> None:
        self.reader, self.writer, self.address = reader, writer, address
        self.receipts: dict[str, asyncio.Future[None]] = {}
        self.messages: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self.broken: BaseException | None = None
        self._next = 0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, host: str, port: int, timeout: float = 5.0) -> StompConnection:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            conn = cls(reader, writer, f"{host}:{port}")
            try:
                conn._write("CONNECT", {"accept-version": "1.2", "host": "localhost",
                                        "heart-beat": "0,0"})
                command, headers, _ = await conn._frame()
            except BaseException:
                writer.close()
                raise
        if command != "CONNECTED":
            writer.close()
            raise ConnectionError(f"{conn.address}: {command} {headers.get('message', '')}")
        conn._task = asyncio.create_task(conn._run())
        return conn

    def _write(self, command: str, headers: dict[str, str], body: bytes = b"") -> None:
        head = "".join(f"{k}:{v}\n" for k, v in headers.items())
        self.writer.write(f"{command}\n{head}\n".encode() + body + b"\0")

    async def _frame(self) -> tuple[str, dict[str, str], bytes]:
        line = b"\n"
        while line in (b"\n", b"\r\n"):
            line = await self.reader.readline()
            if not line:
                raise ConnectionResetError(f"{self.address} closed the connection")
        command = line.decode().strip()
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\n", b"\r\n"):
            if not line:
                raise ConnectionResetError(f"{self.address} closed the connection")
            key, _, value = line.decode().rstrip("\r\n").partition(":")
            headers.setdefault(key, value)
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]) + 1)
            body = body[:-1]
        else:
            body = (await self.reader.readuntil(b"\0"))[:-1]
        return command, headers, body

    async def _run(self) -> None:
        try:
            while True:
                command, headers, _ = await self._frame()
                if command == "RECEIPT":
                    future = self.receipts.pop(headers.get("receipt-id", ""), None)
                    if future is not None and not future.done():
                        future.set_result(None)
                elif command == "MESSAGE":
                    self.messages.put_nowait(headers)
                elif command == "ERROR":
                    raise ConnectionError(f"{self.address}: ERROR {headers.get('message')}")
        except (OSError, asyncio.IncompleteReadError, ConnectionError) as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.broken = exc
        for future in self.receipts.values():
            if not future.done():
                future.set_exception(ConnectionError(str(exc)))
        self.receipts.clear()
        self.writer.close()

    def send(self, dest: str, body: bytes, headers: dict[str, str],
             receipt: bool = True) -> asyncio.Future[None] | None:
        """A persistent SEND; its receipt's future (None without a receipt)."""
        if self.broken is not None:
            raise ConnectionError(str(self.broken))
        all_headers = {"destination": dest, "persistent": "true",
                       "content-length": str(len(body)), **headers}
        future: asyncio.Future[None] | None = None
        if receipt:
            self._next += 1
            rid = f"r{self._next}"
            all_headers["receipt"] = rid
            future = asyncio.get_running_loop().create_future()
            self.receipts[rid] = future
        self._write("SEND", all_headers, body)
        return future

    async def disconnect(self, timeout: float = 10.0) -> None:
        """DISCONNECT with a receipt: everything sent before (acks too) was handled."""
        future = asyncio.get_running_loop().create_future()
        self.receipts["bye"] = future
        self._write("DISCONNECT", {"receipt": "bye"})
        async with asyncio.timeout(timeout):
            await future

    def subscribe(self, dest: str) -> None:
        self._write("SUBSCRIBE", {"destination": dest, "id": "1", "ack": "auto",
                                  "activemq.prefetchSize": "1000"})

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def stomp_connect_any(hosts: list[tuple[str, int]], start: int = 0,
                            timeout: float = TAKEOVER_TIMEOUT) -> tuple[StompConnection, int]:
    """Walk ``hosts`` from ``start`` until one accepts CONNECT (a pause of
    :data:`STOMP_RETRY_PAUSE` after each full round): the connection and its index."""
    deadline = now() + timeout
    index = start
    tried = 0
    last: BaseException | None = None
    while now() < deadline:
        host, port = hosts[index]
        try:
            return await StompConnection.open(host, port), index
        except (OSError, TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            last = exc
        index = (index + 1) % len(hosts)
        tried += 1
        if tried % len(hosts) == 0:
            await asyncio.sleep(STOMP_RETRY_PAUSE)
    raise TimeoutError(f"no STOMP broker of {hosts} within {timeout} s (last: {last})")


class StompProducer:
    """Receipted persistent SENDs, ``window`` outstanding, over a host list; a lost
    connection sends nothing again (an unreceipted SEND is "in doubt")."""

    def __init__(self, hosts: list[tuple[str, int]], dest: str, window: int,
                 body: bytes) -> None:
        self.hosts, self.dest, self.window, self.body = hosts, dest, window, body
        self.acks: list[tuple[float, str]] = []
        self.acked_ids: set[str] = set()
        self.in_doubt: set[str] = set()
        self.reconnects = 0
        self._seq = 0
        self._running = asyncio.Event()
        self._idle = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        index = 0
        while True:
            self._idle.set()
            await self._running.wait()
            self._idle.clear()
            conn, index = await stomp_connect_any(self.hosts, index)
            try:
                outcomes = await asyncio.gather(*(self._work(conn) for _ in range(self.window)),
                                                return_exceptions=True)
            finally:
                await conn.close()
            failures = [o for o in outcomes if isinstance(o, BaseException)]
            if any(not isinstance(o, ConnectionError | OSError) for o in failures):
                raise failures[0]
            self.reconnects += bool(failures)

    async def _work(self, conn: StompConnection) -> None:
        while self._running.is_set():
            self._seq += 1
            mid = f"s{self._seq:09d}"
            self.in_doubt.add(mid)
            future = conn.send(self.dest, self.body, {"bench-id": mid})
            assert future is not None
            await future
            self.in_doubt.discard(mid)
            self.acks.append((now(), conn.address))
            self.acked_ids.add(mid)

    def resume(self) -> None:
        self._running.set()

    async def pause(self) -> None:
        self._running.clear()
        await self._idle.wait()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task


async def stomp_drain(hosts: list[tuple[str, int]], dest: str,
                      idle: float = STOMP_DRAIN_IDLE) -> list[str]:
    """Consume (ack auto) until ``idle`` seconds pass without a MESSAGE: the bench ids."""
    conn, _ = await stomp_connect_any(hosts)
    ids: list[str] = []
    try:
        conn.subscribe(dest)
        while True:
            try:
                async with asyncio.timeout(idle):
                    headers = await conn.messages.get()
            except TimeoutError:
                break
            ids.append(headers.get("bench-id", "?"))
        await conn.disconnect()
    finally:
        await conn.close()
    return ids


async def stomp_fill(hosts: list[tuple[str, int]], dest: str, count: int, body: bytes) -> float:
    """Store ``count`` persistent messages (a receipt every :data:`FILL_BATCH`): seconds."""
    start = now()
    conn, _ = await stomp_connect_any(hosts)
    try:
        for first in range(0, count, FILL_BATCH):
            end = min(count, first + FILL_BATCH)
            for n in range(first, end):  # a receipt on the batch's last SEND
                last = conn.send(dest, body, {}, receipt=n == end - 1)
            await conn.writer.drain()
            assert last is not None
            async with asyncio.timeout(120):
                await last
    finally:
        await conn.close()
    return now() - start


# ============================================================== one kill cycle

async def kill_cycle(pair: Pair, producer: NativeProducer | StompProducer,
                     drain: Callable[[], Any], hosts: list[str]) -> dict[str, Any]:
    """Steady sending, kill -9 of the active, takeover, drain, restart as standby."""
    producer.resume()
    await asyncio.sleep(STEADY_BEFORE_KILL)
    old = pair.active
    journal_mib = pair.journal_mib()
    t_kill = pair.proc(old).kill9()
    record = await pair.takeover(t_kill)
    record["journal_mib"] = journal_mib
    t_first = await wait_first_ack(producer.acks, t_kill, hosts[pair.active])
    record["killed"] = pair.names[old]
    record["takeover_s"] = round(t_first - t_kill, 3)
    await asyncio.sleep(AFTER_TAKEOVER)
    await producer.pause()
    before = acks_between(producer.acks, t_kill - 1.0, t_kill)
    record["rate_before_msg_s"] = before
    record["rate_after_msg_s"] = acks_between(producer.acks, t_first, t_first + 1.0)
    record["not_sent_during_gap"] = round(before * (t_first - t_kill))
    record["drained"], record["drained_redelivered"] = await drain()
    record["restart_as_standby_s"] = round(await pair.restart(old), 3)
    return record


def describe_cycle(part: str, i: int, r: dict[str, Any]) -> str:
    return (f"{part} kill {i + 1}: {r['killed']} killed -> {r['new_active']} ready "
            f"{r['ready_s']:.3f} s (recovered {r['recovered_messages']} msgs in "
            f"{r['recovery_reported_s']:.2f} s), first ack {r['takeover_s']:.3f} s; "
            f"{r['rate_before_msg_s']} msg/s before")


def cycle_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and maxima of a part's kill cycles."""
    def col(key: str) -> list[float]:
        return [r[key] for r in records if r.get(key) is not None]

    return {name: summary(col(key)) for name, key in (
        ("takeover_first_ack_s", "takeover_s"), ("ready_line_s", "ready_s"),
        ("detected_s", "detected_s"), ("lock_taken_s", "lock_s"),
        ("recovery_reported_s", "recovery_reported_s"),
        ("rate_before_msg_s", "rate_before_msg_s"), ("rate_after_msg_s", "rate_after_msg_s"),
        ("not_sent_during_gap", "not_sent_during_gap"),
        ("restart_as_standby_s", "restart_as_standby_s"), ("journal_mib", "journal_mib"))}


# ============================================================== part 1 (native and STOMP)

async def fill_store(aio: Any, url: str, args: argparse.Namespace) -> float:
    """Store ``--stored`` persistent messages in ``ha.stored``: seconds it took."""
    body = b"x" * args.body
    t0 = now()
    async with aio.connect(url) as admin:
        for first in range(0, args.stored, FILL_BATCH):
            await admin.send_batch("ha.stored", [body] * min(FILL_BATCH, args.stored - first))
    return round(now() - t0, 2)


async def started_pair(args: argparse.Namespace, data: Path, aio: Any, heartbeat: float,
                       activation: float, ha: list[int] | None = None,
                       dial: list[int] | None = None) -> tuple[Pair, float]:
    """A started pair on a fresh, filled data directory (every part starts from the
    same store: the journal of one part would slow the next one's recovery)."""
    pair = make_pair(data, heartbeat, activation, args.sync, ha, dial)
    await pair.start()
    try:
        fill_s = await fill_store(aio, pair.url, args)
    except BaseException:
        await pair.stop()
        raise
    say(f"stored {args.stored:,} x {args.body} B in {fill_s} s")
    return pair, fill_s


async def part_native(args: argparse.Namespace, data: Path, aio: Any) -> dict[str, Any]:
    """Part 1: kill -9 cycles with the native client."""
    result: dict[str, Any] = {"load_before": loadavg()}
    pair, result["fill_s"] = await started_pair(args, data, aio, args.heartbeat_interval,
                                                args.activation_interval)
    body = b"x" * args.body
    try:
        async with aio.connect(pair.url) as admin, aio.connect(pair.url) as conn:
            producer = NativeProducer(conn, "ha.produce", args.window, body, "k")
            ledger = Ledger()

            async def drain() -> list[int]:
                ids, redelivered = await drain_native(admin, "ha.produce")
                ledger.add(ids, redelivered)
                return [len(ids), redelivered]

            hosts = [spec.native for spec in pair.specs]
            records = []
            for i in range(args.kills):
                record = await kill_cycle(pair, producer, drain, hosts)
                records.append(record)
                say(describe_cycle("native", i, record))
            await producer.close()
            result.update({"cycles": records, "summary": cycle_summary(records),
                           "send_errors": producer.errors[:20],
                           "send_error_count": len(producer.errors),
                           "ledger": ledger.verdict(producer.acked_ids, producer.in_doubt)})
            result["stored_depth_after"] = (await admin.queue_info("ha.stored")).get("depth")
    finally:
        await pair.stop()
    result["load_after"] = loadavg()
    return result


async def part_stomp(args: argparse.Namespace, data: Path, aio: Any) -> dict[str, Any]:
    """Part 1s: kill -9 cycles with receipted STOMP SENDs to the pair's STOMP ports."""
    result: dict[str, Any] = {"load_before": loadavg()}
    pair, result["fill_s"] = await started_pair(args, data, aio, args.heartbeat_interval,
                                                args.activation_interval)
    try:
        result.update(await stomp_kills(args, pair, b"x" * args.body))
    finally:
        await pair.stop()
    result["load_after"] = loadavg()
    return result


async def stomp_kills(args: argparse.Namespace, pair: Pair, body: bytes) -> dict[str, Any]:
    """Part 1s: the same cycles with receipted STOMP SENDs to the pair's STOMP ports."""
    hosts = pair.stomp_hosts
    producer = StompProducer(hosts, "/queue/ha.stomp", args.window, body)
    ledger = Ledger()

    async def drain() -> list[int]:
        ids = await stomp_drain(hosts, "/queue/ha.stomp")
        ledger.add(ids)
        return [len(ids), 0]

    names = [f"{h}:{p}" for h, p in hosts]
    records = []
    try:
        for i in range(args.stomp_kills):
            record = await kill_cycle(pair, producer, drain, names)
            records.append(record)
            say(describe_cycle("txbroker STOMP", i, record))
    finally:
        await producer.close()
    ledger.add(await stomp_drain(hosts, "/queue/ha.stomp", idle=3.0))
    return {"cycles": records, "summary": cycle_summary(records),
            "ledger": ledger.verdict(producer.acked_ids, producer.in_doubt)}


# ============================================================== part 2: heartbeat loss

class LinkProxy:
    """A TCP forwarder for one HA link; blocked: data is held back and nothing is
    closed, new connections are accepted and left hanging (a partition)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.blocked = False
        self.port = 0
        self.server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self.blocked:
            await self._hold(reader)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst, (writer, up_writer)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _hold(self, reader: asyncio.StreamReader) -> None:
        while await reader.read(4096):
            pass

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    both: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        try:
            while data := await src.read(65536):
                if not self.blocked:
                    dst.write(data)
            if self.blocked:  # a partition does not carry the FIN either
                await asyncio.Event().wait()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in both:
                w.close()

    def block(self) -> None:
        self.blocked = True

    def unblock(self) -> None:
        """Open the link again: every held connection is closed (the peers reconnect)."""
        self.blocked = False
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def close(self) -> None:
        self.unblock()
        if self.server is not None:
            self.server.close()


async def part_heartbeat_loss(args: argparse.Namespace, data: Path, aio: Any) -> dict[str, Any]:
    """Part 2: block the HA link, see the standby act but not take over, then kill."""
    result: dict[str, Any] = {"load_before": loadavg(), "heartbeat_interval": args.hb_heartbeat,
                              "activation_interval": args.hb_activation,
                              "hold_s": args.hb_hold}
    ha_ports = free_ports(2)
    proxies = [LinkProxy(ha_ports[1]), LinkProxy(ha_ports[0])]  # A dials B, B dials A
    dial = [await proxy.start() for proxy in proxies]
    pair, result["fill_s"] = await started_pair(args, data, aio, args.hb_heartbeat,
                                                args.hb_activation, ha_ports, dial)
    body = b"x" * args.body
    records = []
    try:
        async with aio.connect(pair.url) as admin, aio.connect(pair.url) as conn:
            producer = NativeProducer(conn, "ha.produce", args.window, body, "h")
            ledger = Ledger()
            hosts = [spec.native for spec in pair.specs]
            for i in range(args.hb_kills):
                records.append(await heartbeat_round(args, pair, proxies, producer, admin,
                                                     ledger, hosts))
                r = records[-1]
                say(f"heartbeat loss {i + 1}: standby acted after {r['acted_after_block_s']} s, "
                    f"took over while blocked: {r['took_over_while_active_lived']}, "
                    f"{r['acks_while_blocked']} acked sends while blocked; after the kill: "
                    f"ready {r['ready_s']} s, first ack {r['takeover_s']} s")
            await producer.close()
            result["ledger"] = ledger.verdict(producer.acked_ids, producer.in_doubt)
            result["send_errors"] = producer.errors[:20]
    finally:
        await pair.stop()
        for proxy in proxies:
            await proxy.close()
    result["rounds"] = records
    result["summary"] = {
        "acted_after_block_s": summary([r["acted_after_block_s"] for r in records]),
        "takeover_first_ack_s": summary([r["takeover_s"] for r in records]),
        "ready_line_s": summary([r["ready_s"] for r in records]),
        "lock_taken_s": summary([r["lock_s"] for r in records if r["lock_s"] is not None]),
        "split_brain_rounds": sum(r["took_over_while_active_lived"] for r in records)}
    result["load_after"] = loadavg()
    return result


async def heartbeat_round(args: argparse.Namespace, pair: Pair, proxies: list[LinkProxy],
                          producer: NativeProducer, admin: Any, ledger: Ledger,
                          hosts: list[str]) -> dict[str, Any]:
    """One round: link up and followed, block, watch, kill the active, unblock."""
    active, standby = pair.active, 1 - pair.active
    sproc = pair.proc(standby)
    await sproc.wait_line(FOLLOWING_RE, sproc.started, START_TIMEOUT)
    producer.resume()
    await asyncio.sleep(STEADY_BEFORE_KILL)
    t_block = now()
    for proxy in proxies:
        proxy.block()
    t_acted, _ = await sproc.wait_line(NO_HEARTBEAT_RE, t_block, 4 * args.hb_activation)
    await asyncio.sleep(args.hb_hold)
    t_end = now()
    acks_blocked = [(t, h) for t, h in producer.acks if t_block <= t < t_end]
    took_over = bool(sproc.matched(READY_RE, t_block))
    record: dict[str, Any] = {
        "active": pair.names[active],
        "acted_after_block_s": round(t_acted - t_block, 3),
        "took_over_while_active_lived": took_over,
        "active_still_alive": pair.proc(active).alive,
        "acks_while_blocked": len(acks_blocked),
        "acks_while_blocked_all_on_active": all(h == hosts[active] for _, h in acks_blocked),
        "rate_while_blocked_msg_s": round(len(acks_blocked) / (t_end - t_block)),
    }
    record["journal_mib"] = pair.journal_mib()
    t_kill = pair.proc(active).kill9()
    record.update(await pair.takeover(t_kill))
    t_first = await wait_first_ack(producer.acks, t_kill, hosts[pair.active])
    record["takeover_s"] = round(t_first - t_kill, 3)
    before = acks_between(producer.acks, t_kill - 1.0, t_kill)
    record["rate_before_msg_s"] = before
    await asyncio.sleep(AFTER_TAKEOVER)
    await producer.pause()
    for proxy in proxies:
        proxy.unblock()
    ids, redelivered = await drain_native(admin, "ha.produce")
    ledger.add(ids, redelivered)
    record["drained"], record["drained_redelivered"] = len(ids), redelivered
    record["restart_as_standby_s"] = round(await pair.restart(active), 3)
    return record


# ============================================================== part 4: ActiveMQ

def activemq_available(peers: Path) -> str | None:
    """Why ActiveMQ cannot be measured here (None: it can)."""
    script = peers / "activemq" / "shared-store.sh"
    if not script.exists():
        return f"{script} not found"
    if os.geteuid() != 0:
        return "not root (shared-store.sh runs the JVM as user activemq via setpriv)"
    if subprocess.run(["dpkg", "-s", "activemq"], capture_output=True).returncode != 0:
        return "the Debian package activemq is not installed (../shared/bench/install_peers.sh)"
    if shutil.which("java") is None:
        return "no java"
    return None


class AmqPair:
    """Two ActiveMQ instances (A, B) on one KahaDB directory, via shared-store.sh."""

    def __init__(self, peers: Path, base: Path) -> None:
        self.script = str(peers / "activemq" / "shared-store.sh")
        self.base = base
        for _ in range(100):
            port_base = int.from_bytes(os.urandom(2), "big") % 40000 + 20000
            ports = [port_base + n for n in (1, 2, 11, 12)]
            if ports_free(ports):
                break
        self.port_base = port_base
        self.names = ["A", "B"]
        self.procs: list[Proc | None] = [None, None]
        self.active = 0

    @property
    def hosts(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", self.port_base + 1), ("127.0.0.1", self.port_base + 2)]

    async def launch(self, index: int, pattern: re.Pattern[str]) -> float:
        env = {**os.environ, "AMQSS_BASE": str(self.base),
               "AMQSS_PORT_BASE": str(self.port_base)}
        proc = await Proc(f"amq-{self.names[index]}", [self.script, self.names[index]],
                          env=env, group=True).start()
        self.procs[index] = proc
        t, _ = await proc.wait_line(pattern, proc.started, START_TIMEOUT)
        return t - proc.started

    async def start(self) -> None:
        await self.launch(0, AMQ_READY_RE)
        await self.launch(1, AMQ_SLAVE_RE)
        self.active = 0

    async def restart(self, index: int) -> float:
        old = self.procs[index]
        if old is not None:
            await old.stop()
        return await self.launch(index, AMQ_SLAVE_RE)

    def proc(self, index: int) -> Proc:
        proc = self.procs[index]
        assert proc is not None
        return proc

    async def takeover(self, t_kill: float) -> dict[str, Any]:
        new = 1 - self.active
        t_ready, _ = await self.proc(new).wait_line(AMQ_READY_RE, t_kill, TAKEOVER_TIMEOUT)
        self.active = new
        return {"new_active": self.names[new], "ready_s": round(t_ready - t_kill, 3),
                "detected_s": None, "lock_s": None,
                "recovered_messages": None, "recovery_reported_s": None}

    def journal_mib(self) -> int:
        return dir_mib(self.base / "kahadb")

    async def stop(self) -> None:
        for index in (1 - self.active, self.active):
            proc = self.procs[index]
            if proc is not None:
                await proc.stop()


async def part_activemq(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Part 4: ActiveMQ shared-file master/slave, the same cycles over STOMP."""
    why_not = activemq_available(args.peers_dir)
    if why_not is not None or args.no_activemq:
        return {"measured": False, "why_not": why_not or "--no-activemq",
                "quoted": AMQ_README_FIGURES}
    result: dict[str, Any] = {"measured": True, "load_before": loadavg(),
                              "version": subprocess.run(
                                  ["dpkg-query", "-W", "-f=${Version}", "activemq"],
                                  capture_output=True, text=True).stdout}
    base = tmp / "amq"
    base.mkdir()
    tmp.chmod(0o711)  # the JVM runs as user activemq: it must reach its directory
    pair = AmqPair(args.peers_dir, base)
    body = b"x" * args.body
    records: list[dict[str, Any]] = []
    try:
        await pair.start()
        stored = args.stored if args.amq_stored is None else args.amq_stored
        result["stored"] = stored
        result["fill_s"] = round(await stomp_fill(pair.hosts, "/queue/ha.stored", stored, body), 2)
        say(f"ActiveMQ: stored {stored:,} x {args.body} B in {result['fill_s']} s")
        producer = StompProducer(pair.hosts, "/queue/ha.stomp", args.window, body)
        ledger = Ledger()

        async def drain() -> list[int]:
            ids = await stomp_drain(pair.hosts, "/queue/ha.stomp")
            ledger.add(ids)
            return [len(ids), 0]

        names = [f"{h}:{p}" for h, p in pair.hosts]
        try:
            for i in range(args.amq_kills):
                record = await kill_cycle(pair, producer, drain, names)  # type: ignore[arg-type]
                records.append(record)
                say(f"ActiveMQ kill {i + 1}: {record['killed']} killed -> "
                    f"{record['new_active']} started {record['ready_s']:.3f} s, first receipt "
                    f"{record['takeover_s']:.3f} s; {record['rate_before_msg_s']} msg/s before")
        finally:
            await producer.close()
        ledger.add(await stomp_drain(pair.hosts, "/queue/ha.stomp", idle=3.0))
        result["ledger"] = ledger.verdict(producer.acked_ids, producer.in_doubt)
    finally:
        await pair.stop()
    result["cycles"] = records
    result["summary"] = cycle_summary(records)
    result["load_after"] = loadavg()
    return result


# ============================================================== main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="native kill -9 cycles")
    parser.add_argument("--stored", type=int, default=100_000, help="messages in the store")
    parser.add_argument("--body", type=int, default=1024, help="message size (bytes)")
    parser.add_argument("--window", type=int, default=8, help="sends outstanding")
    parser.add_argument("--sync", default="fdatasync", help="txbroker serve --sync")
    parser.add_argument("--heartbeat-interval", type=float, default=3.0,
                        help="part 1's pair (the server default)")
    parser.add_argument("--activation-interval", type=float, default=10.0,
                        help="part 1's pair (the server default)")
    parser.add_argument("--stomp-kills", type=int, default=5,
                        help="kill -9 cycles with txbroker's STOMP port")
    parser.add_argument("--hb-kills", type=int, default=3, help="heartbeat-loss rounds")
    parser.add_argument("--hb-heartbeat", type=float, default=1.0,
                        help="heartbeat interval of the heartbeat-loss pair")
    parser.add_argument("--hb-activation", type=float, default=3.0,
                        help="activation interval of the heartbeat-loss pair")
    parser.add_argument("--hb-hold", type=float, default=None,
                        help="seconds the link stays blocked after the standby acted, "
                             "before the kill (default: 2 x --hb-activation)")
    parser.add_argument("--amq-kills", type=int, default=10, help="ActiveMQ kill -9 cycles")
    parser.add_argument("--amq-stored", type=int, default=None,
                        help="messages stored in ActiveMQ (default: --stored)")
    parser.add_argument("--no-activemq", action="store_true", help="quote, do not measure")
    parser.add_argument("--parts", default="kill9,heartbeat,activemq",
                        help="which parts to run (comma-separated; kill9 includes STOMP)")
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    parser.add_argument("--head", action="store_true",
                        help="run brokers and client from `git archive HEAD` (not the "
                             "working tree, which others may be editing)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--ignore-pytest", action="store_true",
                        help="do not wait for running pytest processes")
    args = parser.parse_args()
    if args.hb_hold is None:
        args.hb_hold = 2 * args.hb_activation
    return args


#: Seconds without any pytest process before the run starts (suites come in bursts).
QUIET_BEFORE_START: Final = 60.0


async def wait_for_pytest(args: argparse.Namespace) -> int:
    """Wait (up to two hours) until no pytest ran for :data:`QUIET_BEFORE_START`
    seconds; seconds waited."""
    start = quiet_since = now()
    said = 0.0
    while not args.ignore_pytest and now() - quiet_since < QUIET_BEFORE_START:
        if running := pytest_running():
            quiet_since = now()
            if now() - start > 7200:
                raise SystemExit(f"pytest still running after two hours: {running[0]}")
            if now() - said > 60:
                say(f"pytest is running ({len(running)} processes): waiting")
                said = now()
        await asyncio.sleep(5)
    return round(now() - start)


def use_head(tmp: Path) -> str:
    """Extract HEAD's src/ into ``tmp`` and run everything from it; the commit."""
    commit = git("rev-parse", "HEAD")
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    tmp.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    src = str(tmp / "src")
    sys.path.insert(0, src)
    os.environ["PYTHONPATH"] = src + os.pathsep + os.environ.get("PYTHONPATH", "")
    return commit


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "constants": {"steady_before_kill_s": STEADY_BEFORE_KILL,
                      "after_takeover_s": AFTER_TAKEOVER,
                      "stomp_retry_pause_s": STOMP_RETRY_PAUSE},
        "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())},
    }
    report["waited_for_pytest_s"] = await wait_for_pytest(args)
    report["machine"]["load_before"] = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="ha_failover-"))
    try:
        dirty = git("status", "--porcelain", "--", "src")
        report["git"] = {"commit": git("rev-parse", "HEAD"),
                         "src_dirty": dirty.splitlines() if not args.head else [],
                         "ran_from": "git archive HEAD" if args.head else "working tree"}
        if args.head:
            use_head(tmp / "head")
        import txbroker.aio as aio  # after use_head: the source under test
        report["git"]["txbroker_module"] = str(Path(aio.__file__).parent)
        parts = args.parts.split(",")
        report["pytest_seen"] = {}
        report["kill9"] = {}
        if "kill9" in parts:
            say(f"part 1: {args.kills} kill -9 cycles (native client)")
            report["kill9"]["native"] = await part_native(args, tmp / "native", aio)
            shutil.rmtree(tmp / "native", ignore_errors=True)
            say(f"part 1s: {args.stomp_kills} kill -9 cycles (STOMP client)")
            report["kill9"]["stomp"] = await part_stomp(args, tmp / "stomp", aio)
            shutil.rmtree(tmp / "stomp", ignore_errors=True)
            report["pytest_seen"]["after_kill9"] = pytest_running()
        if "heartbeat" in parts:
            say(f"part 2: heartbeat loss, {args.hb_kills} rounds "
                f"(heartbeat {args.hb_heartbeat} s, activation {args.hb_activation} s)")
            report["heartbeat_loss"] = await part_heartbeat_loss(args, tmp / "heartbeat", aio)
            report["pytest_seen"]["after_heartbeat"] = pytest_running()
        if "activemq" in parts:
            say(f"part 4: ActiveMQ, {args.amq_kills} kill -9 cycles over STOMP")
            report["activemq"] = await part_activemq(args, tmp)
            report["pytest_seen"]["after_activemq"] = pytest_running()
    finally:
        await stop_all()
        report["machine"]["load_after"] = loadavg()
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return report


def headline(report: dict[str, Any]) -> list[str]:
    """The figures, as lines for stdout."""
    lines = []
    k = report.get("kill9", {})
    for part, label in (("native", "native client"), ("stomp", "STOMP client")):
        if part not in k:
            continue
        s = k[part]["summary"]
        led = k[part]["ledger"]
        lines.append(
            f"txbroker kill -9, {label}: first ack median {s['takeover_first_ack_s'].get('median')}"
            f" s, max {s['takeover_first_ack_s'].get('max')} s (lock taken median "
            f"{s['lock_taken_s'].get('median')} s, ready line median "
            f"{s['ready_line_s'].get('median')} s; recovery median "
            f"{s['recovery_reported_s'].get('median')} s); rate before "
            f"{s['rate_before_msg_s'].get('median')} msg/s, not sent in the gap median "
            f"{s['not_sent_during_gap'].get('median')}; journal {s['journal_mib'].get('min')}"
            f"-{s['journal_mib'].get('max')} MiB; lost {led['lost']}, "
            f"duplicates {led['duplicates']}")
    h = report.get("heartbeat_loss", {}).get("summary")
    if h is not None:
        lines.append(f"heartbeat loss: acted after median {h['acted_after_block_s'].get('median')}"
                     f" s; split brain rounds {h['split_brain_rounds']}; kill while blocked: "
                     f"first ack median {h['takeover_first_ack_s'].get('median')} s, max "
                     f"{h['takeover_first_ack_s'].get('max')} s")
    a = report.get("activemq", {"measured": False, "why_not": "not run", "quoted": "-"})
    if a["measured"]:
        s = a["summary"]
        lines.append(f"ActiveMQ kill -9 (STOMP): first receipt median "
                     f"{s['takeover_first_ack_s'].get('median')} s, max "
                     f"{s['takeover_first_ack_s'].get('max')} s; lost {a['ledger']['lost']}")
    else:
        lines.append(f"ActiveMQ not measured ({a['why_not']}): quoted {a['quoted']}")
    return lines


def main() -> None:
    args = parse_args()
    # the client's "failing over" warnings, twice per kill, would bury the progress lines
    logging.getLogger("txbroker").setLevel(logging.ERROR)
    loop_task: asyncio.Task[dict[str, Any]] | None = None

    async def guarded() -> dict[str, Any]:
        nonlocal loop_task
        loop_task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, loop_task.cancel)  # type: ignore[union-attr]
        return await run(args)

    report = asyncio.run(guarded())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ha_failover-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    for line in headline(report):
        print(line)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
