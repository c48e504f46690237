"""Replicated HA with etcd (docs/replication.md, docs/etcd.md): real brokers and a real
etcd. A killed primary is replaced by the best ready backup with nothing acknowledged
lost; a primary cut off from etcd stops serving before a backup can take its key."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import txbroker
from tests.etcd_support import EtcdServer, LinkProxy
from tests.ha_support import free_ports
from tests.support import ROOT
from txbroker.server.ha.etcd import EtcdClient

HOST = "127.0.0.1"
TTL = 2  #: etcd's smallest lease: the primary fences itself after 2 - 2/3 s of silence
DEADLINE = 60.0


class Node:
    """One ``txbroker serve --ha replicated --ha-etcd`` process."""

    def __init__(self, root: Path, name: str, ports: tuple[int, int], peers: list[str],
                 etcd_url: str, cluster: str) -> None:
        self.name, self.port, self.ha_port = name, ports[0], ports[1]
        self.data = root / name
        self.out = root / f"{name}.out"
        self.log = root / f"{name}.log"
        self.cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(self.data),
                    "--port", str(self.port), "--stomp-port", "0",
                    "--amqp-port", "0", "--ha", "replicated",
                    "--ha-port", str(self.ha_port), "--ha-peers", ",".join(peers),
                    "--ha-etcd", etcd_url, "--ha-cluster", cluster,
                    "--ha-lease-ttl", str(TTL), "--backup-timeout", "2",
                    "--log-level", "INFO"]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def node(self) -> str:
        return f"{HOST}:{self.ha_port}"

    def start(self) -> Node:
        self.out.write_text("")
        with open(self.out, "ab") as out, open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=log, cwd=ROOT)
        self.wait_line("txbroker backup on HA")
        return self

    def wait_line(self, prefix: str, timeout: float = DEADLINE) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith(prefix) for line in self.out.read_text().splitlines()):
                return
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.02)
        raise AssertionError(f"{self.name}: no {prefix!r} line: {self.log.read_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "txbroker.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def status(nodes: list[Node]) -> dict[str, Any]:
    url = "txb://" + ",".join(f"{HOST}:{n.port}" for n in nodes)
    done = cli("ha", "status", "--url", url, "--json")
    return json.loads(done.stdout) if done.stdout else {}


def wait_for(check: Any, what: str, timeout: float = DEADLINE) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Background:
    """An event loop on a thread (the etcd link proxies run there)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def group(tmp_path: Path, etcd: EtcdServer, request: pytest.FixtureRequest
          ) -> Iterator[tuple[list[Node], list[LinkProxy], Background, str]]:
    """Three replicated brokers, each reaching etcd through its own link proxy."""
    background = Background()
    etcd_port = int(etcd.url.rsplit(":", 1)[1])
    proxies = [background.run(LinkProxy(etcd_port).start()) for _ in range(3)]
    ports = free_ports(6)
    pairs = [(ports[i], ports[i + 3]) for i in range(3)]
    ha = [f"{HOST}:{p[1]}" for p in pairs]
    cluster = f"t{time.time_ns()}"
    nodes = [Node(tmp_path, f"n{i}", pairs[i], [a for j, a in enumerate(ha) if j != i],
                  proxies[i].url, cluster) for i in range(3)]
    try:
        for node in nodes:
            node.start()
        yield nodes, proxies, background, cluster
    finally:
        for node in nodes:
            node.kill9()
        for proxy in proxies:
            background.run(proxy.close())
        background.close()


def primary_key_holder(etcd: EtcdServer, cluster: str) -> str | None:
    async def read() -> str | None:
        async with EtcdClient([etcd.url], timeout=2.0) as client:
            kv = await client.get(f"/txbroker/{cluster}/primary")
            return kv.value.decode() if kv is not None else None
    return asyncio.run(read())


def successor(nodes: list[Node], etcd: EtcdServer, cluster: str, old: Node) -> Node:
    """The node that takes the primary key after ``old`` (waiting for it)."""
    holder = wait_for(lambda: (h := primary_key_holder(etcd, cluster)) not in (None, old.node)
                      and h, "a backup to take the key")
    return next(n for n in nodes if n.node == holder)


def log_time(path: Path, text: str) -> datetime | None:
    """The time of the first log line of ``path`` that contains ``text``."""
    for line in path.read_text().splitlines():
        if text in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return None


def ready_backups(nodes: list[Node], primary: Node) -> int:
    found = status([primary]).get(f"{HOST}:{primary.port}", {})
    backups = (found.get("replication") or {}).get("backups", [])
    return sum(1 for b in backups if b["state"] == "ready")


def test_etcd_replaces_a_killed_primary_and_nothing_acknowledged_is_lost(
        group: tuple[list[Node], list[LinkProxy], Background, str], etcd: EtcdServer) -> None:
    nodes, _, _, cluster = group
    first = nodes[0]
    assert cli("ha", "promote", "--url", f"txb://{HOST}:{first.port}").returncode == 0
    first.wait_line("txbroker ready on")
    assert wait_for(lambda: primary_key_holder(etcd, cluster) == first.node, "the key")
    wait_for(lambda: ready_backups(nodes, first) == 2, "two ready backups")
    url = "txb://" + ",".join(f"{HOST}:{n.port}" for n in nodes)
    with txbroker.connect(url, failover_timeout=60) as conn:
        for i in range(200):
            conn.send("orders", f"m{i}".encode())  # returns once on every ready backup
    first.kill9()
    killed = time.monotonic()
    new = successor(nodes, etcd, cluster, first)
    new.wait_line("txbroker ready on")
    assert time.monotonic() - killed < 30  # lease (2 s) + a poll + promotion, loaded CI
    with txbroker.connect(url, failover_timeout=60) as conn:
        got = []
        while (message := conn.receive("orders", timeout=2)) is not None:
            got.append(message.body)
            message.ack()
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(200))
    first.start()  # the old primary comes back as a backup of the new one
    wait_for(lambda: ready_backups(nodes, new) == 2, "the old primary to rejoin")


def test_a_primary_cut_off_from_etcd_stops_before_a_backup_takes_over(
        group: tuple[list[Node], list[LinkProxy], Background, str], etcd: EtcdServer) -> None:
    nodes, proxies, _, cluster = group
    first = nodes[0]
    assert cli("ha", "promote", "--url", f"txb://{HOST}:{first.port}").returncode == 0
    first.wait_line("txbroker ready on")
    wait_for(lambda: ready_backups(nodes, first) == 2, "two ready backups")
    alone = f"txb://{HOST}:{first.port}"
    with txbroker.connect(alone) as conn:
        conn.send("orders", b"before")
    proxies[0].block()  # the primary can no longer reach etcd; everything else can
    cut = time.monotonic()

    def serving() -> bool:
        try:
            with txbroker.connect(alone, failover_timeout=0.5) as conn:
                conn.send("probe", b"x")
            return True
        except (txbroker.TxBrokerError, OSError):
            return False

    stopped = wait_for(lambda: not serving() and time.monotonic(), "the old primary to stop")
    assert stopped - cut < 10  # fenced at TTL - TTL/3 after its last renewal (+ probes)
    new = successor(nodes, etcd, cluster, first)
    # the order, from the brokers' own log lines (one machine, one clock): the old
    # primary fenced itself before the new one held the key
    fenced_at = log_time(first.log, "fencing")
    taken_at = wait_for(lambda: log_time(new.log, "took the primary key"), "the take line")
    assert fenced_at < taken_at, "two primaries could have accepted writes"
    new.wait_line("txbroker ready on")
    url = "txb://" + ",".join(f"{HOST}:{n.port}" for n in nodes[1:])
    with txbroker.connect(url, failover_timeout=60) as conn:
        message = conn.receive("orders", timeout=10)
        assert message is not None and message.body == b"before"


def ready_set(etcd: EtcdServer, cluster: str) -> list[str] | None:
    async def read() -> list[str] | None:
        async with EtcdClient([etcd.url], timeout=2.0) as client:
            kv = await client.get(f"/txbroker/{cluster}/ready")
            return None if kv is None else list(json.loads(kv.value)["ready"])
    return asyncio.run(read())


def test_after_a_whole_group_loss_only_a_backup_of_the_recorded_ready_set_takes_over(
        group: tuple[list[Node], list[LinkProxy], Background, str], etcd: EtcdServer) -> None:
    """A backup frozen while the primary dropped it from the ready set still believes
    it is ready; the ready set the primary recorded in etcd before it stopped waiting
    for it is what decides after everybody died."""
    nodes, _, _, cluster = group
    first, good, frozen = nodes
    assert cli("ha", "promote", "--url", f"txb://{HOST}:{first.port}").returncode == 0
    first.wait_line("txbroker ready on")
    wait_for(lambda: ready_backups(nodes, first) == 2, "two ready backups")
    assert sorted(ready_set(etcd, cluster) or []) == sorted([good.node, frozen.node])
    assert frozen.proc is not None
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    with txbroker.connect(f"txb://{HOST}:{first.port}") as conn:
        conn.send("orders", b"while frozen")  # waits backup_timeout (2 s), then goes on
    assert ready_set(etcd, cluster) == [good.node]
    for node in nodes:
        node.kill9()
    for node in nodes:
        node.start()
    # (the dead primary's key lives until its lease expires: wait for the next holder)
    assert successor(nodes, etcd, cluster, first) is good
    good.wait_line("txbroker ready on")
    url = "txb://" + ",".join(f"{HOST}:{n.port}" for n in nodes)
    with txbroker.connect(url, failover_timeout=60) as conn:
        message = conn.receive("orders", timeout=10)
        assert message is not None and message.body == b"while frozen"


def test_ten_etcd_failovers_under_load_lose_nothing_acknowledged(
        group: tuple[list[Node], list[LinkProxy], Background, str], etcd: EtcdServer) -> None:
    """Ten rounds: persistent sends and local transactions through the failover URL,
    kill -9 of whoever holds the key, etcd promotes a ready backup, the killed broker
    comes back as a backup and becomes ready. Every acknowledged message is there once,
    every committed transaction whole."""
    nodes, _, _, cluster = group
    primary = nodes[0]
    assert cli("ha", "promote", "--url", f"txb://{HOST}:{primary.port}").returncode == 0
    primary.wait_line("txbroker ready on")
    url = "txb://" + ",".join(f"{HOST}:{n.port}" for n in nodes)
    acknowledged: list[bytes] = []
    for round_ in range(10):
        wait_for(lambda p=primary: ready_backups(nodes, p) == 2, "two ready backups")
        with txbroker.connect(url, failover_timeout=60) as conn:
            for i in range(10):
                body = f"r{round_}-m{i}".encode()
                conn.send("orders", body)
                acknowledged.append(body)
            with conn.transaction() as tx:
                for i in range(3):
                    tx.send("orders", f"r{round_}-tx{i}".encode())
            acknowledged.extend(f"r{round_}-tx{i}".encode() for i in range(3))
        primary.kill9()
        new = successor(nodes, etcd, cluster, primary)
        new.wait_line("txbroker ready on")
        primary.start()  # back as a backup of the new primary
        primary = new
    with txbroker.connect(url, failover_timeout=60) as conn:
        got = []
        while (message := conn.receive("orders", timeout=2)) is not None:
            got.append(message.body)
            message.ack()
    assert sorted(got) == sorted(acknowledged)
