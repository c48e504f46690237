#!/usr/bin/env python3
"""Replicated HA figures (issue 14, "Figures"), in one run.

Usage: ``.venv/bin/python bench/ha_replicated.py [--runs 3] [-n 5000] [--kills 5]
[--stored 20000] [--no-rabbitmq]`` (``--help`` for every setting). Results go to
``bench/results/ha_replicated-<timestamp>.json`` and a summary to stdout.

Theory of operation
-------------------
1. **Cost of replication.** The same STOMP harness as the peers
   (``../shared/bench/stompbench.py``, run as a subprocess) measures
   ``send-receipt`` (1 connection, ``--window`` receipts outstanding, 1 KiB
   persistent bodies) and ``tx-send`` (8 connections, BEGIN + ``--tx-size`` SENDs +
   COMMIT with receipt) against txbroker's STOMP port with 0 backups (a plain
   single broker, no ``--ha``), 1 backup and 2 backups (a ``--ha replicated``
   group, primary promoted with ``ha_promote``, every backup ready). Each of
   ``--runs`` rounds starts every configuration afresh, in turn (0, 1, 2), so a
   drift of the machine hits them alike; the figure is the median of the rounds
   (throughput, and the p99 of receipt / commit latency), with the ratio to 0
   backups. stompbench verifies afterwards that every message arrived once.
2. **Promotion.** A three-broker group, a native producer (sync client, one
   persistent send at a time, failover URL of all three) running; ``--kills``
   times: kill -9 the primary, run ``txbroker ha promote --url`` on the next
   node (what a cluster manager calls: the CLI's start is part of the figure),
   and time from the kill (the killed process reaped) to the first send the
   producer gets confirmed after it; also the CLI's own wall time and the
   promoted broker's "promoted in" log figure. The killed node is restarted and
   waited for (ready) before the next kill.
3. **Catch-up.** A primary alone holding ``--stored`` persistent 1 KiB messages;
   a new backup is started; from its log, the time from "following … from its
   dump" to "copy … is whole" is the dump's copy time (messages/s, MB/s of
   bodies, and of the backup's data directory), and the time to "ready" on the
   primary's status.
4. **Anchor.** RabbitMQ 3.10 (Debian package) as a three-node cluster on
   loopback (``../shared/bench/rabbitmq/cluster.sh``): the same two stompbench
   workloads on a classic queue (not replicated: the 0-backup figure) and on a
   quorum queue (Raft, three members: the 2-backup figure), both on node 1,
   median of ``--runs``. Needs root (the nodes run as the ``rabbitmq`` user)
   and the fixed ports of cluster.sh (STOMP 61721–61723, epmd 4369); skipped
   with the reason otherwise, or with ``--no-rabbitmq``. stompbench carries no
   queue arguments, so a small shim adds ``x-queue-type:quorum`` to its SEND and
   SUBSCRIBE frames.

Every process is started in its own session on 127.0.0.1 and stopped by its pid
(RabbitMQ: its process group) on the way out, errors included. The run waits
while a ``pytest`` process runs (the suite would distort the figures).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent


def _peers_dir() -> Path:
    """../shared/bench next to the checkout (a git worktree: next to the main one)."""
    here = ROOT.parent / "shared" / "bench"
    if here.exists():
        return here
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute",
                                 "--git-common-dir"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        return Path(common).parent.parent / "shared" / "bench"
    return here


PEERS_DIR: Final = _peers_dir()
RESULTS: Final = ROOT / "bench" / "results"
HOST: Final = "127.0.0.1"
READY_PREFIX: Final = "txbroker ready on"
BACKUP_PREFIX: Final = "txbroker backup on HA"
START_TIMEOUT: Final = 60.0
RMQ_STOMP: Final = {1: 61721, 2: 61722, 3: 61723}
#: stompbench run as a module, with an optional x-queue-type header on SEND/SUBSCRIBE
SHIM: Final = """
import os, sys
sys.path.insert(0, sys.argv.pop(1))
import stompbench as sb
qtype = os.environ.get("HA_BENCH_QUEUE_TYPE")
if qtype:
    _prefix, _frame = sb.send_prefix, sb.build_frame
    def send_prefix(*a, **k):
        return _prefix(*a, **k).replace(b"SEND\\n", b"SEND\\nx-queue-type:" + qtype.encode()
                                        + b"\\ndurable:true\\n", 1)
    def build_frame(cmd, headers=None, body=b""):
        if cmd == "SUBSCRIBE":
            headers = {**(headers or {}), "x-queue-type": qtype, "durable": "true"}
        return _frame(cmd, headers, body)
    sb.send_prefix, sb.build_frame = send_prefix, build_frame
sys.exit(sb.main())
"""


# ============================================================== helpers
def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]


def pytest_running() -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if "pytest" in cmd and str(os.getpid()) != proc.name:
                    found.append(f"{proc.name}: {cmd[:80]}")
    return found


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def git(*args: str) -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    return ""


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ============================================================== txbroker processes
@functools.cache
def knows_amqp(python: str) -> bool:
    """Does this install's ``serve`` have an AMQP port to turn off (an older commit's
    may predate the AMQP edge)?"""
    done = subprocess.run([python, "-m", "txbroker.cli", "serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    return "--amqp-port" in done.stdout


class Node:
    """One ``txbroker serve`` process (own session, stopped by pid)."""

    def __init__(self, name: str, root: Path, python: str = sys.executable) -> None:
        self.name, self.root = name, root
        #: the Python of the txbroker install this node runs (``--install``)
        self.python = python
        self.port, self.stomp_port, self.ha_port, self.http_port = free_ports(4)
        self.data = root / f"{name}-data"
        self.proc: subprocess.Popen[bytes] | None = None
        self.out = root / f"{name}.out"
        self.log = root / f"{name}.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"txb://{HOST}:{self.port}"

    def start(self, args: list[str]) -> None:
        self.starts += 1
        self.out = self.root / f"{self.name}-{self.starts}.out"
        cmd = [self.python, "-m", "txbroker.cli", "serve", "--data", str(self.data),
               "--host", HOST, "--port", str(self.port), "--stomp-port", str(self.stomp_port),
               *(["--amqp-port", "0"] if knows_amqp(self.python) else []),
               *args]
        out: IO[bytes] = open(self.out, "wb")  # noqa: SIM115 - the child keeps it
        log: IO[bytes] = open(self.log, "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=log, cwd=ROOT,
                                         start_new_session=True)
        finally:
            out.close()
            log.close()

    def lines(self) -> list[str]:
        try:
            return self.out.read_text().splitlines()
        except FileNotFoundError:
            return []

    def wait_line(self, prefix: str, timeout: float = START_TIMEOUT) -> str:
        def found() -> str | None:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            return next((line for line in self.lines() if line.startswith(prefix)), None)

        return str(wait_for(found, timeout, f"{self.name}: {prefix}"))

    def status(self) -> dict[str, Any]:
        from txbroker.cli.ha_commands import probe
        from txbroker.client.url import HostPort

        return dict(probe(HostPort(HOST, self.port), None, None)["ha"])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


class Cluster:
    """``n`` replicated brokers (n = 0: one plain broker)."""

    def __init__(self, root: Path, backups: int | None, backup_timeout: float = 5.0,
                 extra: list[str] | None = None, python: str = sys.executable) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.plain = backups is None
        count = 1 if backups is None else backups + 1
        self.nodes = [Node("abc"[i], root, python) for i in range(count)]
        self.backup_timeout = backup_timeout
        #: more ``serve`` arguments for every node (etcd's)
        self.extra = extra or []

    def args(self, node: Node) -> list[str]:
        if self.plain:
            return ["--log-level", "WARNING"]
        peers = ",".join(f"{HOST}:{n.ha_port}" for n in self.nodes if n is not node)
        return ["--ha", "replicated", "--ha-port", str(node.ha_port), "--ha-node", node.name,
                "--ha-peers", peers or f"{HOST}:{free_ports(1)[0]}",
                "--http-port", str(node.http_port),
                "--backup-timeout", str(self.backup_timeout), "--log-level", "INFO",
                *self.extra]

    def start_node(self, node: Node) -> None:
        node.start(self.args(node))
        node.wait_line(READY_PREFIX if self.plain else BACKUP_PREFIX)

    def start(self, count: int | None = None) -> Cluster:
        for node in self.nodes[:count]:
            self.start_node(node)
        if not self.plain:
            self.promote(self.nodes[0], cli=False)
            self.wait_ready(self.nodes[0], len(self.nodes[:count]) - 1)
        return self

    def promote(self, node: Node, cli: bool, http: bool = False) -> float:
        """Promote ``node``: ``txbroker ha promote`` (``cli``), ``POST /api/ha/promote``
        (``http``) or the native probe op; the seconds the request took."""
        started = time.monotonic()
        if http:
            import urllib.request

            request = urllib.request.Request(
                f"http://{HOST}:{node.http_port}/api/ha/promote", data=b"{}", method="POST",
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                reply.read()
        elif cli:
            subprocess.run([sys.executable, "-m", "txbroker.cli", "ha", "promote", "--url",
                            node.url], cwd=ROOT, check=True, capture_output=True, timeout=60)
        else:
            from txbroker.cli.ha_commands import probe
            from txbroker.client.url import HostPort

            probe(HostPort(HOST, node.port), None, None, op="ha_promote")
        return time.monotonic() - started

    def wait_ready(self, primary: Node, n: int, timeout: float = 120.0) -> None:
        def ready() -> bool:
            with contextlib.suppress(Exception):
                backups = primary.status()["replication"]["backups"]
                return sum(1 for b in backups if b["state"] == "ready") == n
            return False

        wait_for(ready, timeout, f"{n} ready backups")

    @property
    def url(self) -> str:
        return "txb://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGTERM)


@contextlib.contextmanager
def cluster(root: Path, backups: int | None, **kwargs: Any) -> Iterator[Cluster]:
    c = Cluster(root, backups, **kwargs)
    try:
        yield c.start()
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


# ============================================================== stompbench
def stompbench(workload: str, port: int, args: argparse.Namespace, label: str,
               queue_type: str = "", pid: int | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-c", SHIM, str(PEERS_DIR), workload, "--port", str(port),
           "-n", str(args.n), "-b", str(args.body), "--label", label,
           "--queue-prefix", f"hab{int(time.time() * 1000) % 10**8}", "--disk-path", "/tmp"]
    if workload == "send-receipt":
        cmd += ["-w", str(args.window)]
    else:
        cmd += ["-k", str(args.tx_size), "-c", str(args.tx_connections)]
    if pid is not None:
        cmd += ["--broker-pid", str(pid)]
    env = {**os.environ, "HA_BENCH_QUEUE_TYPE": queue_type}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"stompbench gave no result: {run.stderr[-2000:]}")
    result = dict(json.loads(lines[-1]))
    if "msgs_per_s" not in result:
        raise RuntimeError(f"stompbench {workload} {label} failed: {result.get('error')}")
    return result  # ok false: its check afterwards failed (kept: "verify" in the figure)


def figure(result: dict[str, Any]) -> dict[str, Any]:
    lat = result.get("receipt_lat_ms") or result.get("commit_lat_ms") or {}
    return {"msgs_per_s": result["msgs_per_s"], "p99_ms": lat.get("p99"),
            "p50_ms": lat.get("p50"), "loadavg_start": result.get("loadavg_start"),
            "verified": bool(result.get("ok")),
            **({} if result.get("ok") else {"verify": result.get("verify"),
                                            "error": result.get("error")})}


def summarise(runs: dict[str, list[dict[str, Any]]], base: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config, figures in runs.items():
        out[config] = {"msgs_per_s": median([f["msgs_per_s"] for f in figures]),
                       "p99_ms": median([f["p99_ms"] for f in figures]),
                       "runs": figures}
    for config in out:
        b = out[base]
        out[config]["throughput_ratio"] = round(out[config]["msgs_per_s"] / b["msgs_per_s"], 3)
        out[config]["p99_ratio"] = round(out[config]["p99_ms"] / b["p99_ms"], 3)
    return out


def part_cost(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Replication's cost: 0, 1 and 2 backups, each round in turn (and, with
    ``--install``, each install in turn within a configuration, its order alternating
    by round: a before/after comparison in one run)."""
    base = {"0 backups (plain broker)": None, "1 backup": 1, "2 backups": 2}
    installs: dict[str, str] = args.installs or {"": sys.executable}
    configs = {(f"{name} {label}" if name else label): (backups, python)
               for label, backups in base.items() for name, python in installs.items()}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {c: [] for c in configs} for w in ("send-receipt", "tx-send")}
    for rnd in range(args.runs):
        order = list(configs.items())
        if rnd % 2 and len(installs) > 1:  # alternate the installs' order inside each config
            order = [item for i in range(0, len(order), len(installs))
                     for item in reversed(order[i:i + len(installs)])]
        for label, (backups, python) in order:
            with cluster(work / f"cost-{rnd}-{backups}-{len(label)}", backups,
                         python=python) as c:
                primary = c.nodes[0]
                assert primary.proc is not None
                for workload in runs:
                    result = stompbench(workload, primary.stomp_port, args, f"txbroker {label}",
                                        pid=primary.proc.pid)
                    runs[workload][label].append(figure(result))
                    say(f"round {rnd + 1} {label} {workload}: {result['msgs_per_s']} msg/s, "
                        f"p99 {figure(result)['p99_ms']} ms")
    first = next(iter(configs))
    return {w: summarise(r, first) for w, r in runs.items()}


# ============================================================== promotion
class Producer:
    """Persistent sends, one at a time, through the failover URL; ack times kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.acks: list[float] = []
        #: when each acknowledged send was started (same order as ``acks``)
        self.started: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import txbroker

        n = 0
        try:
            with txbroker.connect(self.url, timeout=15, failover_timeout=60) as conn:
                while not self.stop.is_set():
                    started = time.monotonic()
                    try:
                        conn.send("bench.promote", b"x" * 1024, message_id=f"m-{n}")
                    except (txbroker.ConnectionLost, txbroker.TxBrokerError):
                        continue
                    n += 1
                    self.started.append(started)
                    self.acks.append(time.monotonic())
        except BaseException as exc:  # reported by the bench
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)

    def first_ack_after(self, moment: float) -> float | None:
        """The first ack of a send started after ``moment`` (a send started before it
        may have been answered by the old primary just before it died)."""
        count = min(len(self.started), len(self.acks))  # the thread appends to both
        first = max(0, count - 1000)
        found = [ack for start, ack in zip(self.started[first:count], self.acks[first:count],
                                           strict=True) if start > moment]
        return min(found) if found else None


def part_promotion(args: argparse.Namespace, work: Path, http: bool = False
                   ) -> dict[str, Any]:
    """Kill the primary, promote the next node by hand: ``txbroker ha promote`` (its
    start-up included), or ``POST /api/ha/promote`` (``http``)."""
    c = Cluster(work / "promote", 2)
    kills: list[dict[str, Any]] = []
    producer: Producer | None = None
    how = "POST /api/ha/promote" if http else "ha promote CLI"
    try:
        c.start()
        producer = Producer(c.url)
        primary = c.nodes[0]
        for k in range(args.kills):
            wait_for(lambda: len(producer.acks) > 200 * (k + 1), 60,  # noqa: B023
                     "sends before the kill")
            target = c.nodes[(c.nodes.index(primary) + 1) % 3]
            primary.kill()  # SIGKILL, reaped: no reply can come from it after this
            killed_at = time.monotonic()
            cli = c.promote(target, cli=True, http=http)
            target.wait_line(READY_PREFIX)
            first = wait_for(lambda: producer.first_ack_after(killed_at),  # noqa: B023
                             60, "a send after the kill")
            promoted = re.findall(r"promoted in ([\d.]+) s", target.log.read_text())
            kills.append({"kill_to_first_send_s": round(first - killed_at, 3),
                          "ha_promote_cli_s": round(cli, 3),
                          "broker_promotion_s": float(promoted[-1]) if promoted else None})
            say(f"kill {k + 1}: first send {first - killed_at:.3f} s after the kill "
                f"({how} {cli:.3f} s)")
            c.start_node(primary)
            c.wait_ready(target, 2)
            primary = target
    finally:
        if producer is not None:
            producer.close()
        c.stop()
        shutil.rmtree(work / "promote", ignore_errors=True)
    values = [k["kill_to_first_send_s"] for k in kills]
    return {"how": how, "kills": kills, "median_s": median(values), "max_s": max(values),
            "cli_median_s": median([k["ha_promote_cli_s"] for k in kills]),
            "error": repr(producer.error) if producer and producer.error else None,
            "loadavg_end": loadavg()}


# ============================================================== etcd promotion
def part_etcd(args: argparse.Namespace, work: Path, ttl: int) -> dict[str, Any]:
    """A trio promoted by etcd (lease ``ttl``): kill -9 the primary, time the first send
    confirmed after it, and from the new primary's log when it took the key and when
    it served (wall clock of the kill vs the log's millisecond stamps)."""
    sys.path.insert(0, str(ROOT))
    from tests.etcd_support import EtcdServer

    etcd = EtcdServer(args.etcd_election_ms).start()
    extra = ["--ha-etcd", etcd.url, "--ha-cluster", f"bench{time.time_ns()}",
             "--ha-lease-ttl", str(ttl)]
    c = Cluster(work / f"etcd-{ttl}", 2, backup_timeout=2.0, extra=extra)
    kills: list[dict[str, Any]] = []
    producer: Producer | None = None
    load_start = loadavg()
    try:
        c.start()
        producer = Producer(c.url)
        primary = c.nodes[0]
        for k in range(args.kills):
            wait_for(lambda: len(producer.acks) > 200 * (k + 1), 60,  # noqa: B023
                     "sends before the kill")
            primary.kill()  # SIGKILL, reaped
            killed_at, killed_wall = time.monotonic(), time.time()
            first = wait_for(lambda: producer.first_ack_after(killed_at),  # noqa: B023
                             120, "a send after the kill")
            new = wait_for(lambda: next((n for n in c.nodes if n is not primary  # noqa: B023
                                         and any(line.startswith(READY_PREFIX)
                                                 for line in n.lines())), None),
                           60, "the new primary's ready line")
            text = new.log.read_text()
            record = {"kill_to_first_send_s": round(first - killed_at, 3),
                      "kill_to_key_taken_s": round(log_time(text, "took the primary key")
                                                   - killed_wall, 3),
                      "kill_to_primary_s": round(log_time(text, "is the primary (promoted")
                                                 - killed_wall, 3),
                      "new_primary": new.name, "loadavg": loadavg(),
                      # the new primary's log from the kill to serving: where the time went
                      "log": [line[11:160] for line in text.splitlines()
                              if (m := LOG_TIME.match(line)) and line_time(m) >= killed_wall
                              and line_time(m) <= killed_wall + record_end(text, killed_wall)
                              ][:40]}
            kills.append(record)
            say(f"etcd TTL {ttl} s, kill {k + 1}: first send {record['kill_to_first_send_s']}"
                f" s after the kill (key taken {record['kill_to_key_taken_s']} s, "
                f"serving {record['kill_to_primary_s']} s; {new.name})")
            c.start_node(primary)
            c.wait_ready(new, 2)
            primary = new
    finally:
        if producer is not None:
            producer.close()
        c.stop()
        etcd.stop()
        shutil.rmtree(work / f"etcd-{ttl}", ignore_errors=True)
    values = [k["kill_to_first_send_s"] for k in kills]
    middle = median(values)
    return {"lease_ttl_s": ttl, "etcd_election_ms": args.etcd_election_ms,
            "kills": kills, "median_s": middle,
            "max_s": max(values) if values else None,
            "median_minus_ttl_s": round(middle - ttl, 3) if middle is not None else None,
            "key_taken_median_s": median([k["kill_to_key_taken_s"] for k in kills]),
            "primary_median_s": median([k["kill_to_primary_s"] for k in kills]),
            "error": repr(producer.error) if producer and producer.error else None,
            "loadavg_start": load_start, "loadavg_end": loadavg()}


# ============================================================== catch-up
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*")


def line_time(match: re.Match[str]) -> float:
    """The wall-clock time of a log line (``LOG_TIME``'s match)."""
    stamp, ms = match.group(1).split(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def record_end(text: str, since: float) -> float:
    """Seconds from ``since`` to the log's "is the primary" line (+ a little)."""
    return log_time(text, "is the primary (promoted") - since + 0.05


def log_time(log: str, text: str) -> float:
    for line in reversed(log.splitlines()):
        if text in line and (m := LOG_TIME.match(line)):
            stamp, ms = m.group(1).split(",")
            return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    raise RuntimeError(f"no log line with {text!r}")


def part_catchup(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import txbroker

    c = Cluster(work / "catchup", 1)
    results: list[dict[str, Any]] = []
    try:
        c.start(count=1)
        a, b = c.nodes
        with txbroker.connect(a.url, timeout=30) as conn:
            body = b"x" * args.body
            for first in range(0, args.stored, 500):
                with conn.transaction() as tx:
                    for i in range(first, min(args.stored, first + 500)):
                        tx.send("bench.stored", body, message_id=f"s-{i}")
        for rnd in range(args.runs):
            if b.proc is not None:
                b.kill()
                shutil.rmtree(b.data, ignore_errors=True)
            spawned = time.monotonic()
            c.start_node(b)
            c.wait_ready(a, 1, timeout=600)
            ready = time.monotonic() - spawned
            log = b.log.read_text()  # every start's: the newest lines count
            start = log_time(log, "replication: following a from its dump")
            whole = log_time(log, "replication: copy of a is whole")
            copy = max(whole - start, 0.001)
            size = dir_bytes(b.data)
            results.append({"copy_s": round(copy, 3), "spawn_to_ready_s": round(ready, 3),
                            "msgs_per_s": round(args.stored / copy, 1),
                            "body_mb_per_s": round(args.stored * args.body / copy / 1e6, 2),
                            "data_dir_mb": round(size / 1e6, 2),
                            "data_dir_mb_per_s": round(size / copy / 1e6, 2)})
            say(f"catch-up {rnd + 1}: {args.stored} messages copied in {copy:.3f} s "
                f"({args.stored / copy:.0f} msg/s), ready {ready:.2f} s after the spawn")
    finally:
        c.stop()
        shutil.rmtree(work / "catchup", ignore_errors=True)
    return {"stored": args.stored, "body": args.body, "runs": results,
            "median_msgs_per_s": median([r["msgs_per_s"] for r in results]),
            "median_body_mb_per_s": median([r["body_mb_per_s"] for r in results]),
            "median_copy_s": median([r["copy_s"] for r in results])}


# ============================================================== RabbitMQ anchor
def rabbitmq_unavailable() -> str | None:
    script = PEERS_DIR / "rabbitmq" / "cluster.sh"
    if not script.exists():
        return f"{script} is missing"
    if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
        return "RabbitMQ (Debian rabbitmq-server) is not installed"
    if os.geteuid() != 0:
        return "cluster.sh runs the nodes as the rabbitmq user: needs root"
    busy = []
    for port in (4369, *RMQ_STOMP.values()):
        with socket.socket() as sock:
            if sock.connect_ex((HOST, port)) == 0:
                busy.append(port)
    if busy:
        return f"ports {busy} are in use (another RabbitMQ or epmd runs)"
    return None


def part_rabbitmq(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    why = rabbitmq_unavailable()
    if why is not None:
        return {"measured": False, "reason": why}
    script = str(PEERS_DIR / "rabbitmq" / "cluster.sh")
    procs: list[subprocess.Popen[bytes]] = []
    logs = work / "rabbitmq"
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(what: str) -> None:
        with open(logs / f"{what}.out", "wb") as out:
            procs.append(subprocess.Popen([script, what], stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))

    def ready() -> bool:
        return subprocess.run([script, "ready"], capture_output=True, timeout=120).returncode == 0

    try:
        subprocess.run([script, "prep"], check=True, capture_output=True, timeout=60)
        spawn("epmd")
        wait_for(lambda: socket.socket().connect_ex((HOST, 4369)) == 0, 30, "epmd")
        for n in (1, 2, 3):
            spawn(str(n))
            wait_for(lambda n=n: _port_open(RMQ_STOMP[n]), 180, f"RabbitMQ node {n}")
        wait_for(ready, 180, "the RabbitMQ cluster (3 nodes running)")
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            w: {"classic (not replicated)": [], "quorum (3 members)": []}
            for w in ("send-receipt", "tx-send")}
        for rnd in range(args.runs):
            for label, qtype in (("classic (not replicated)", ""),
                                 ("quorum (3 members)", "quorum")):
                for workload in runs:
                    result = stompbench(workload, RMQ_STOMP[1], args, f"rabbitmq {label}",
                                        queue_type=qtype)
                    runs[workload][label].append(figure(result))
                    say(f"round {rnd + 1} RabbitMQ {label} {workload}: "
                        f"{result['msgs_per_s']} msg/s, p99 {figure(result)['p99_ms']} ms")
        return {"measured": True, "version": _rabbit_version(script),
                **{w: summarise(r, "classic (not replicated)") for w, r in runs.items()}}
    except (subprocess.SubprocessError, TimeoutError, RuntimeError, OSError) as exc:
        return {"measured": False, "reason": f"the cluster did not run: {exc!r}"}
    finally:
        for proc in reversed(procs):  # nodes first, epmd last; each its own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((HOST, port)) == 0


def _rabbit_version(script: str) -> str:
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        run = subprocess.run([script, "ctl", "1", "version"], capture_output=True, text=True,
                             timeout=60)
        return run.stdout.strip()
    return ""


# ============================================================== main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="rounds (medians over them)")
    ap.add_argument("-n", type=int, default=5000, help="messages per stompbench run")
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--window", type=int, default=64, help="send-receipt: receipts outstanding")
    ap.add_argument("--tx-size", type=int, default=10)
    ap.add_argument("--tx-connections", type=int, default=8)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--stored", type=int, default=100000, help="catch-up: stored messages")
    ap.add_argument("--no-rabbitmq", action="store_true")
    ap.add_argument("--parts", default="cost,promotion,catchup,rabbitmq",
                    help="also: http-promotion, etcd")
    ap.add_argument("--etcd-ttls", default="3,2",
                    help="etcd part: lease TTLs (s) to run, one trio each (2: etcd's smallest "
                    "with its default election timeout)")
    ap.add_argument("--etcd-election-ms", type=int, default=None,
                    help="etcd part: etcd's election timeout (ms; its heartbeat a tenth; "
                    "default etcd's, 1000): its smallest lease is 1.5 of it (500: TTL 1 s)")
    ap.add_argument("--label", default="", help="added to the result file's name")
    ap.add_argument("--install", action="append", default=[], metavar="NAME=PYTHON",
                    help="cost part: run every configuration on this install too (its "
                         "Python, e.g. before=/work/before/.venv/bin/python, an older "
                         "commit's install) beside 'after' (this Python); repeatable")
    ap.add_argument("--no-wait", action="store_true",
                    help="do not wait for a running pytest (its presence is recorded)")
    args = ap.parse_args()
    args.installs = {}
    if args.install:
        args.installs = {"after": sys.executable}
        for spec in args.install:
            name, _, python = spec.partition("=")
            if not name or not Path(python).is_file():
                ap.error(f"--install {spec!r}: want NAME=PYTHON (an installed interpreter)")
            args.installs[name] = python
    while not args.no_wait and (busy := pytest_running()):
        say(f"waiting: pytest runs ({busy[0]})")
        time.sleep(10)
    parts = args.parts.split(",")
    report: dict[str, Any] = {
        "bench": "ha_replicated", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": git("rev-parse", "--short", "HEAD"), "cpus": os.cpu_count(),
        "loadavg_start": loadavg(), "pytest_running_at_start": pytest_running(),
        "settings": vars(args)}
    work = Path(tempfile.mkdtemp(prefix="ha-replicated-bench-"))
    try:
        if "cost" in parts:
            report["cost"] = part_cost(args, work)
            report["loadavg_after_cost"] = loadavg()
        if "promotion" in parts:
            report["promotion"] = part_promotion(args, work)
        if "http-promotion" in parts:
            report["http_promotion"] = part_promotion(args, work, http=True)
        if "etcd" in parts:
            report["etcd"] = [part_etcd(args, work, int(ttl))
                              for ttl in args.etcd_ttls.split(",")]
        if "catchup" in parts:
            report["catchup"] = part_catchup(args, work)
        if "rabbitmq" in parts:
            report["rabbitmq"] = ({"measured": False, "reason": "--no-rabbitmq"}
                                  if args.no_rabbitmq else part_rabbitmq(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["loadavg_end"] = loadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    path = RESULTS / f"ha_replicated-{time.strftime('%Y%m%d-%H%M%S')}{label}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1)[:6000])
    say(f"results: {path}")


if __name__ == "__main__":
    main()
