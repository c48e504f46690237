"""A replicated HA group of real broker processes, for the replicated-HA tests.

:class:`Group` starts N ``txbroker serve --ha replicated`` processes, each on its
own data directory and on free loopback ports (``server/ha/replicated.py``), and
follows their roles by the lines they print:

* ``txbroker backup on HA …`` — the node (re)started as a backup;
* ``txbroker ready on …`` — the node was promoted and serves clients.

As in ``tests/ha_support.py``, each start of a node writes its stdout to a fresh
file (``<root>/<name>-<n>.out``) and appends its log to ``<root>/<name>.log``;
every wait polls a condition (a printed line, the ``ha status`` data) against a
deadline and fails with the nodes' output and log tails. No sleep synchronises
anything.

Typical use::

    with Group(tmp_path) as group:          # a primary, b and c ready backups
        old = group.primary()
        group.kill9(old)
        group.promote(group.b)              # ``txbroker ha promote`` (CLI)
        group.restart(old)                  # rejoins as a backup
        group.wait_ready_backups(2)

``Group(root, n=3, *extra_args, backup_timeout=5.0, node_args={name: [...]},
node_env={name: {...}})``; ``group.url`` is the native failover list of all
nodes (a backup answers ``Standby``: the client moves on).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self, TypeVar

# the node's process handling, the ready line, timeouts and poll period are the
# shared-store harness's
from tests.ha_support import (
    HOST,
    POLL,
    READY_PREFIX,
    START_TIMEOUT,
    BrokerNode,
    free_ports,
)
from tests.support import ROOT, free_port

#: The line of a node that starts as a backup.
BACKUP_PREFIX = "txbroker backup on HA"

T = TypeVar("T")


def wait_for(condition: Callable[[], T | None], timeout: float, what: str,
             explain: Callable[[], str] = lambda: "") -> T:
    """Poll ``condition`` until it returns something true (returned) or fail after
    ``timeout`` seconds saying ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                                 f"{explain()}")
        time.sleep(POLL)


class RNode(BrokerNode):
    """One broker of the group: its ports and data directory (fixed across restarts),
    its process, its own extra arguments and environment."""

    ROLES = ((READY_PREFIX, "primary"), (BACKUP_PREFIX, "backup"))

    def __init__(self, name: str, root: Path, port: int, ha_port: int) -> None:
        super().__init__(name, root, port)
        self.ha_port = ha_port
        self.data = root / f"{name}-data"
        self.args: list[str] = []
        self.env: dict[str, str] = {}
        #: ``{peer name: "host:port"}`` to reach that peer's HA port elsewhere (a proxy)
        self.peer_override: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"RNode({self.name}, port {self.port}, HA {self.ha_port})"

    @property
    def ha_address(self) -> str:
        return f"{HOST}:{self.ha_port}"

    @property
    def url(self) -> str:
        """This node alone (no failover)."""
        return f"txb://{self.address}"

    def try_status(self) -> dict[str, Any] | None:
        """``status()``, or None when the node does not answer."""
        try:
            return self.status(timeout=2.0)
        except Exception:  # a dead, stopped or starting node
            return None

    def log_count(self, text: str) -> int:
        return self.log_path.read_text().count(text) if self.log_path.exists() else 0

    # -- process control -------------------------------------------------
    def spawn(self, peers: Iterable[RNode], common: list[str]) -> None:
        cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(self.data),
               "--host", HOST, "--port", str(self.port), "--stomp-port", "0", "--amqp-port", "0",
               "--ha", "replicated", "--ha-port", str(self.ha_port),
               "--ha-node", self.name,
               "--ha-peers", ",".join(self.peer_override.get(p.name, p.ha_address)
                                      for p in peers), *common, *self.args]
        self._launch(cmd, {**os.environ, **self.env}, f" env {self.env}")


class Group:
    """N replicated brokers on loopback (module docstring)."""

    def __init__(self, root: Path, n: int = 3, *extra_args: str, backup_timeout: float = 5.0,
                 node_args: dict[str, list[str]] | None = None,
                 node_env: dict[str, dict[str, str]] | None = None,
                 log_level: str = "INFO") -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        ports = free_ports(2 * n)
        self.nodes = [RNode("abcdefgh"[i], root, ports[2 * i], ports[2 * i + 1])
                      for i in range(n)]
        for node in self.nodes:
            node.args = list((node_args or {}).get(node.name, []))
            node.env = dict((node_env or {}).get(node.name, {}))
        self.common = ["--backup-timeout", f"{backup_timeout:g}", "--log-level", log_level,
                       *extra_args]

    def __getattr__(self, name: str) -> RNode:
        nodes: list[RNode] = self.__dict__.get("nodes", [])
        for node in nodes:
            if node.name == name:
                return node
        raise AttributeError(name)

    @property
    def url(self) -> str:
        """The native failover list of every node, in order."""
        return "txb://" + ",".join(n.address for n in self.nodes)

    def url_of(self, *nodes: RNode) -> str:
        return "txb://" + ",".join(n.address for n in nodes)

    def peers(self, node: RNode) -> list[RNode]:
        return [n for n in self.nodes if n is not node]

    def describe(self) -> str:
        return "\n".join(node.describe() for node in self.nodes)

    # -- lifecycle ---------------------------------------------------------
    def start(self, primary: RNode | None = None, timeout: float = START_TIMEOUT) -> Self:
        """Start every node (each prints its backup line), promote ``primary`` (the
        first node by default) and wait until every other node is a ready backup."""
        try:
            for node in self.nodes:
                self.spawn(node)
            for node in self.nodes:
                node.wait_line(BACKUP_PREFIX, timeout=timeout)
            self.promote(primary or self.nodes[0], cli=False)
            self.wait_ready_backups(len(self.nodes) - 1)
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self, node: RNode) -> None:
        node.spawn(self.peers(node), self.common)

    def stop(self) -> None:
        """SIGTERM each live node by pid (SIGCONT first, SIGKILL after a bound)."""
        for node in self.nodes:
            node.signal_and_wait(signal.SIGTERM)

    def kill9(self, node: RNode) -> RNode:
        """SIGKILL the node by pid and reap it."""
        assert node.alive(), f"node {node.name} is not running"
        node.signal_and_wait(signal.SIGKILL)
        return node

    def restart(self, node: RNode, timeout: float = START_TIMEOUT) -> RNode:
        """Start a stopped node again (same ports and data) and wait for its backup line."""
        self.spawn(node)
        node.wait_line(BACKUP_PREFIX, timeout=timeout)
        return node

    # -- promotion and roles ----------------------------------------------
    def promote(self, node: RNode, *, cli: bool = True, timeout: float = START_TIMEOUT,
                force: bool = False) -> str:
        """Make ``node`` the primary: ``txbroker ha promote --url`` (``cli``) or the raw
        ``ha_promote`` probe; waits for its ready line and returns it. ``force``: even
        when the peers that answer do not allow it (``--force``)."""
        if cli:
            run = subprocess.run(
                [sys.executable, "-m", "txbroker.cli", "ha", "promote", "--url", node.url,
                 *(["--force"] if force else [])],
                cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, (f"ha promote {node.name} failed:\n{run.stdout}"
                                         f"{run.stderr}\n{self.describe()}")
            assert f"promoting {node.name} to primary" in run.stdout, run.stdout
        else:
            from txbroker.cli.ha_commands import probe
            from txbroker.client.url import HostPort

            probe(HostPort(HOST, node.port), None, None, op="ha_promote",
                  args={"force": True} if force else None)
        return node.wait_line(READY_PREFIX, timeout=timeout)

    def promote_fails(self, node: RNode) -> str:
        """``txbroker ha promote`` on ``node`` that must fail: its output."""
        run = subprocess.run(
            [sys.executable, "-m", "txbroker.cli", "ha", "promote", "--url", node.url],
            cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode != 0, f"ha promote {node.name} succeeded: {run.stdout}"
        return run.stdout + run.stderr

    def primary(self, timeout: float = START_TIMEOUT) -> RNode:
        """The live primary (waiting for one); two live primaries fail at once."""
        def find() -> RNode | None:
            found = [n for n in self.nodes if n.role == "primary"]
            assert len(found) <= 1, f"two primaries: {found}\n{self.describe()}"
            return found[0] if found else None

        return wait_for(find, timeout, "a primary", self.describe)

    def backups(self) -> list[RNode]:
        return [n for n in self.nodes if n.role == "backup"]

    def status(self, node: RNode) -> dict[str, Any]:
        """``txbroker ha status --json`` data of one node."""
        return node.status()

    def status_cli(self) -> dict[str, Any]:
        """``txbroker ha status --url <all> --json``, parsed (every node, by address)."""
        run = subprocess.run(
            [sys.executable, "-m", "txbroker.cli", "ha", "status", "--url", self.url, "--json"],
            cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        return dict(json.loads(run.stdout))

    def backup_states(self, primary: RNode | None = None) -> dict[str, str]:
        """``{backup node: state}`` as the primary's ``ha status`` shows them."""
        status = (primary or self.primary()).try_status()
        if status is None or "replication" not in status:
            return {}
        return {b["node"]: b["state"] for b in status["replication"]["backups"]}

    def wait_ready_backups(self, n: int, timeout: float = 60.0,
                           primary: RNode | None = None) -> dict[str, str]:
        """Wait until the primary counts exactly ``n`` ready backups, each promotable
        (its own status says so); returns the primary's ``{node: state}``."""
        primary = primary or self.primary()

        def ready() -> dict[str, str] | None:
            states = self.backup_states(primary)
            names = [k for k, v in states.items() if v == "ready"]
            if len(names) != n:
                return None
            for name in names:
                status = getattr(self, name).try_status()
                if status is None or not status.get("promotable"):
                    return None
            return states

        return wait_for(ready, timeout, f"{n} ready backups of {primary.name}",
                        lambda: f"states {self.backup_states(primary)}\n{self.describe()}")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LinkProxy:
    """A TCP proxy for one HA link (``RNode.peer_override``). ``blocked``: bytes in
    either direction are swallowed and an end of stream is not passed on — the far
    side looks silent, like a machine cut off by the network; ``sever()`` closes every
    proxied connection (the link breaks); ``stop()`` closes the listener too."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.blocked = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10), "the proxy did not start"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(
            asyncio.start_server(self._on_client, HOST, self.port))
        ready.set()
        self.loop.run_forever()

    async def _on_client(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if self.blocked.is_set():
            return  # accepted, never answered
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.target)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if not self.blocked.is_set():
                writer.write(data)
        if not self.blocked.is_set():
            writer.close()

    def sever(self) -> None:
        """Close every proxied connection (both sides see the link end)."""
        def close() -> None:
            for writer in self._writers:
                writer.close()
            self._writers.clear()

        self.loop.call_soon_threadsafe(close)

    def stop(self) -> None:
        def close() -> None:
            for writer in self._writers:
                writer.close()
            if self._server is not None:
                self._server.close()
            self.loop.stop()

        if self.loop.is_running():
            self.loop.call_soon_threadsafe(close)
            self._thread.join(10)
