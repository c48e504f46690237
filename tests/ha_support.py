"""A shared-store HA pair of real broker processes, for the failover tests.

:class:`HaPair` starts two ``txbroker serve --ha shared-store`` processes on one
data directory (``server/ha/shared_store.py``), on free loopback ports, and follows their
roles by the lines they print — nothing else:

* ``txbroker ready on …`` — the node is the active (at start, or after a
  takeover);
* ``txbroker standby on HA …`` — the node is the standby.

Each start of a node writes its stdout to a fresh file
(``<root>/<name>-<n>.out``), so that a node's role is the last of those lines
in its current file; stderr (the broker's log) is appended to
``<root>/<name>.log`` across restarts. Every wait polls those files against a
deadline and fails with the tail of both nodes' output and logs: no fixed
sleeps.

Typical use::

    with HaPair(tmp_path) as pair:          # A active, B standby
        hosts = pair.stomp_hosts            # [(host, A's STOMP port), (host, B's)]
        old = pair.kill9(pair.active())     # SIGKILL, reaped
        new = pair.active()                 # waits for B's "ready" line
        pair.restart(old)                   # waits for A's first role line
        assert pair.standby() is old

The API, kept small on purpose (``tests/stomp/test_ha_stomp.py`` and
``tests/server/test_ha.py`` share it):

``HaPair(root, *extra_args, heartbeat_interval=0.5, activation_interval=1.5)``
    ``extra_args`` go to both nodes' ``serve`` command line.
``start()`` / ``stop()``
    A first (waits for its ready line), then B (waits for its standby line);
    ``stop()`` sends SIGTERM by pid to each live node, SIGKILL after a bound.
``active(timeout)`` / ``standby(timeout)``
    The live node in that role, waiting for it; two live actives fail at once.
``kill9(which)`` / ``restart(which, timeout)``
    ``which``: a :class:`HaNode` or its name (``"a"``, ``"b"``).
``node.role``, ``node.pid``, ``node.port``, ``node.stomp_port``, ``node.ha_port``,
``node.wait_line(prefix)``, ``node.status()``, ``node.log_has(text)``,
``node.send_signal(sig)``, ``node.stop()``, ``node.peer_address`` (set before a
start to point ``--ha-peer`` elsewhere), ``pair.url``, ``pair.stomp_hosts``,
``pair.describe()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Self

from tests.support import ROOT

HOST = "127.0.0.1"
#: The first line of an active node (``cli/server_commands.py``).
READY_PREFIX = "txbroker ready on"
#: The first line of a standby node.
STANDBY_PREFIX = "txbroker standby on HA"
#: Seconds a node may take to print its first line: a cold Python start of the
#: CLI takes about 1 s on a 2-core machine, recovery of a small store much less.
START_TIMEOUT = 30.0
#: Seconds a SIGTERMed node may take to stop before it is killed.
STOP_TIMEOUT = 10.0
#: Poll period of the waits (s): a wait sees a new line at most this late.
POLL = 0.02


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago on HOST (all held open
    while choosing, so that no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class BrokerNode:
    """One broker process of an HA harness (shared-store here, replicated in
    tests/replicated_support.py): its native port, fixed across restarts, its output
    (one file per start) and log, its role from the last role line, process control
    by pid. Subclasses build the command line and name the roles."""

    #: ``(first-line prefix, role)``: the last such line the process printed wins
    ROLES: tuple[tuple[str, str], ...] = ()

    def __init__(self, name: str, root: Path, port: int) -> None:
        self.name = name
        self.root = root
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.out_path = root / f"{name}-0.out"
        self.log_path = root / f"{name}.log"
        self._cursor = 0  # wait_line's position in the current output

    @property
    def pid(self) -> int:
        """The pid of the current process (started at least once)."""
        assert self.proc is not None, f"node {self.name} was never started"
        return self.proc.pid

    @property
    def address(self) -> str:
        """``host:port`` of the native port."""
        return f"{HOST}:{self.port}"

    def alive(self) -> bool:
        """The current process runs (a SIGSTOPped one too)."""
        return self.proc is not None and self.proc.poll() is None

    def lines(self) -> list[str]:
        """The complete lines the current process printed so far."""
        try:
            text = self.out_path.read_text()
        except FileNotFoundError:
            return []
        return text.splitlines()[: text.count("\n")]

    @property
    def role(self) -> str:
        """The role of the last role line (:attr:`ROLES`), ``"starting"`` before one,
        ``"dead"`` when the process does not run."""
        if not self.alive():
            return "dead"
        for line in reversed(self.lines()):
            for prefix, role in self.ROLES:
                if line.startswith(prefix):
                    return role
        return "starting"

    def wait_line(self, *prefixes: str, timeout: float = START_TIMEOUT) -> str:
        """The next line of the current process that starts with one of ``prefixes``
        and that no earlier ``wait_line`` returned; fails if the process exits or
        ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.lines()
            for index in range(self._cursor, len(lines)):
                if lines[index].startswith(prefixes):
                    self._cursor = index + 1
                    return lines[index]
            self._cursor = max(self._cursor, len(lines))
            if not self.alive():
                raise AssertionError(f"node {self.name} exited ({self._exit()}) before "
                                     f"printing {prefixes}:\n{self.describe()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"node {self.name} printed none of {prefixes} in "
                                     f"{timeout} s:\n{self.describe()}")
            time.sleep(POLL)

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The node's ``ha`` status (what ``txbroker ha status --json`` prints for it),
        asked on its native port."""
        from txbroker.cli.ha_commands import probe
        from txbroker.client.url import HostPort

        return dict(probe(HostPort(HOST, self.port), None, None, timeout=timeout)["ha"])

    def log_has(self, text: str) -> bool:
        """``text`` is in the node's log (every start of it)."""
        return self.log_path.exists() and text in self.log_path.read_text()

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the current process (SIGSTOP, SIGCONT …) without waiting."""
        os.kill(self.pid, sig)

    def signal_and_wait(self, sig: int, timeout: float = STOP_TIMEOUT) -> None:
        """Send ``sig`` by pid and reap the process (SIGKILL after ``timeout``); a
        SIGTERM is preceded by SIGCONT, since a stopped process must run to stop."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if sig == signal.SIGTERM:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)

    def describe(self, tail: int = 3000) -> str:
        """The current output and the end of the log, for failure messages."""
        log = self.log_path.read_text() if self.log_path.exists() else ""
        return (f"--- {self.name} (pid {self.proc.pid if self.proc else '-'}, {self.role}) "
                f"{self.out_path.name}:\n" + "\n".join(self.lines()) +
                f"\n--- {self.log_path.name} (end):\n{log[-tail:]}")

    def _exit(self) -> str:
        code = self.proc.poll() if self.proc is not None else None
        return "not started" if code is None and self.proc is None else f"exit code {code}"

    def _launch(self, cmd: list[str], env: dict[str, str] | None = None,
                note: str = "") -> None:
        """Start ``cmd`` as this node's next process: stdout to a new output file, stderr
        appended to the log after a line saying what started."""
        assert not self.alive(), f"node {self.name} is running"
        self.starts += 1
        self.out_path = self.root / f"{self.name}-{self.starts}.out"
        self._cursor = 0
        out: IO[bytes] = open(self.out_path, "wb")  # noqa: SIM115 - the child keeps it
        log: IO[bytes] = open(self.log_path, "ab")  # noqa: SIM115
        log.write(f"==== start {self.starts}: {' '.join(cmd[2:])}{note}\n".encode())
        log.flush()
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=log, cwd=ROOT, env=env)
        finally:
            out.close()
            log.close()


class HaNode(BrokerNode):
    """One broker of the pair: its ports (fixed across restarts) and its process."""

    ROLES = ((READY_PREFIX, "active"), (STANDBY_PREFIX, "standby"))

    def __init__(self, name: str, root: Path, ports: list[int]) -> None:
        super().__init__(name, root, ports[0])
        self.stomp_port, self.ha_port = ports[1:]
        #: the ``--ha-peer`` to give instead of the peer node's HA port (a proxy, or
        #: something that is not a txbroker)
        self.peer_address: str | None = None

    def stop(self) -> None:
        """SIGTERM (a clean shutdown, which hands over), then wait."""
        self.signal_and_wait(signal.SIGTERM)

    def spawn(self, peer: HaNode, args: list[str]) -> None:
        """Start the process (``HaPair`` calls this; a test may, for a third broker)."""
        self._launch([sys.executable, "-m", "txbroker.cli", "serve",
                      "--host", HOST, "--port", str(self.port),
                      "--stomp-port", str(self.stomp_port), "--amqp-port", "0",
                      "--ha", "shared-store", "--ha-port", str(self.ha_port),
                      "--ha-peer", self.peer_address or f"{HOST}:{peer.ha_port}", *args])


class HaPair:
    """Two brokers of one shared store on loopback (see the module docstring)."""

    def __init__(self, root: Path, *extra_args: str, heartbeat_interval: float = 0.5,
                 activation_interval: float = 1.5, log_level: str = "INFO") -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.data = root / "data"
        ports = free_ports(6)
        self.a = HaNode("a", root, ports[:3])
        self.b = HaNode("b", root, ports[3:])
        self.args = ["--data", str(self.data),
                     "--heartbeat-interval", str(heartbeat_interval),
                     "--activation-interval", str(activation_interval),
                     "--log-level", log_level, *extra_args]

    @property
    def nodes(self) -> tuple[HaNode, HaNode]:
        """``(a, b)``."""
        return (self.a, self.b)

    @property
    def url(self) -> str:
        """The native failover URL, A first: ``txb://host:A,host:B``."""
        return f"txb://{self.a.address},{self.b.address}"

    @property
    def stomp_hosts(self) -> list[tuple[str, int]]:
        """The STOMP failover list, A first."""
        return [(HOST, self.a.stomp_port), (HOST, self.b.stomp_port)]

    def node(self, which: HaNode | str) -> HaNode:
        """``which`` as a node: a node of this pair, or ``"a"`` / ``"b"``."""
        if isinstance(which, HaNode):
            assert which in self.nodes, f"{which.name} is not a node of this pair"
            return which
        return {"a": self.a, "b": self.b}[which]

    def peer(self, which: HaNode | str) -> HaNode:
        """The other node."""
        return self.b if self.node(which) is self.a else self.a

    # -- lifecycle ---------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Start A and wait for its ready line, then B and wait for its standby line."""
        try:
            self.a.spawn(self.b, self.args)
            self.a.wait_line(READY_PREFIX, timeout=timeout)
            self.b.spawn(self.a, self.args)
            self.b.wait_line(STANDBY_PREFIX, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM each live node by pid (SIGKILL if it does not stop in time)."""
        for node in self.nodes:
            node.signal_and_wait(signal.SIGTERM)

    def kill9(self, which: HaNode | str) -> HaNode:
        """SIGKILL the node and reap it; returns it. Does not wait for a takeover
        (``active()`` does)."""
        node = self.node(which)
        assert node.alive(), f"node {node.name} is not running"
        node.signal_and_wait(signal.SIGKILL)
        return node

    def restart(self, which: HaNode | str, timeout: float = START_TIMEOUT) -> HaNode:
        """Start a stopped node again (same ports, same data) and wait for its first
        role line; returns it (``node.role`` says which role it took)."""
        node = self.node(which)
        node.spawn(self.peer(node), self.args)
        node.wait_line(READY_PREFIX, STANDBY_PREFIX, timeout=timeout)
        return node

    # -- roles -------------------------------------------------------------
    def active(self, timeout: float = START_TIMEOUT) -> HaNode:
        """The live active node, waiting up to ``timeout`` for one; two live actives
        fail at once (split brain)."""
        return self._wait_role("active", timeout)

    def standby(self, timeout: float = START_TIMEOUT) -> HaNode:
        """The live standby node, waiting up to ``timeout`` for one."""
        return self._wait_role("standby", timeout)

    def _wait_role(self, role: str, timeout: float) -> HaNode:
        deadline = time.monotonic() + timeout
        while True:
            roles = {node.name: node.role for node in self.nodes}
            if list(roles.values()).count("active") > 1:
                raise AssertionError(f"two active brokers on one store:\n{self.describe()}")
            found = [node for node in self.nodes if roles[node.name] == role]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {role} node within {timeout} s ({roles}):\n"
                                     f"{self.describe()}")
            time.sleep(POLL)

    def describe(self) -> str:
        """Both nodes' output and log tails (for failure messages)."""
        return "\n".join(node.describe() for node in self.nodes)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
