"""The bank example as real processes: a broker, servers and clients, killed by pid.

:class:`BankRig` starts ``examples/bank/server.py`` and ``client.py`` as child
processes against a :class:`~tests.support.BrokerProcess` and the session's
PostgreSQL, reads their logs, and stops every process it started in
:meth:`BankRig.close`. Waits are bounded and on conditions (a log line, a
process exit), never plain sleeps.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from examples.bank import bank
from examples.bank.check import Report, check
from tests.support import ROOT, BrokerProcess

#: Seconds a server or client may take to start (import, connect, register).
START_TIMEOUT = 30.0
#: Seconds a load of a few hundred transfers may take, kills and restarts included.
LOAD_TIMEOUT = 120.0
#: How often a bounded wait looks at its condition again.
POLL = 0.02


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Return once ``condition()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL)


class Child:
    """One example process (server or client) with its log file."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.cmd, self.log, self.env = name, cmd, log, env
        self.proc: subprocess.Popen[str] | None = None
        self.stderr = log.with_suffix(".stderr")

    def start(self, ready: str | None) -> Child:
        """Start the process; with ``ready``, wait for that line on its stdout."""
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, **self.env}
        err = open(self.stderr, "a")  # noqa: SIM115 - kept open for the child
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                     cwd=ROOT, env=env)
        if ready is not None:
            assert self.proc.stdout is not None
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline:
                line = self.proc.stdout.readline()
                if line.startswith(ready):
                    return self
                if not line and self.proc.poll() is not None:
                    raise AssertionError(f"{self.name} exited with {self.proc.returncode}: "
                                         f"{self.stderr.read_text()[-3000:]}")
            raise AssertionError(f"{self.name} did not print {ready!r} in time")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL by pid (if still running) and reap."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit on its own; its return code."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout} s; log tail: "
                                 f"{self.lines()[-5:]}; stderr: "
                                 f"{self.stderr.read_text()[-2000:]}") from None

    def lines(self) -> list[list[str]]:
        """The log, split into words."""
        if not self.log.exists():
            return []
        return [line.split() for line in self.log.read_text().splitlines() if line]


class BankRig:
    """The bank's processes around one broker; :meth:`close` kills them all."""

    def __init__(self, tmp_path: Path, broker: BrokerProcess, dsn: str) -> None:
        self.tmp, self.broker, self.dsn = tmp_path, broker, dsn
        self.children: list[Child] = []
        self.serial = collections.Counter[str]()
        bank.setup_databases(dsn)
        bank.define_facility(broker.url)

    def _child(self, kind: str, name: str, args: list[str], env: dict[str, str] | None,
               log: Path | None = None) -> Child:
        self.serial[name] += 1
        log = log or self.tmp / f"{name}.{self.serial[name]}.log"
        cmd = [sys.executable, "-m", f"examples.bank.{kind}", "--url", self.broker.url,
               "--log", str(log), *args]
        child = Child(f"{name}#{self.serial[name]}", cmd, log, env or {})
        self.children.append(child)
        return child

    def server(self, partition: str, name: str | None = None, *, role: str = "primary",
               explicit_prepare: bool = False, handler: bool = False,
               env: dict[str, str] | None = None) -> Child:
        """Start a server of ``partition`` and wait until it is registered."""
        name = name or f"server-{partition}"
        args = ["--partition", partition, "--dsn", self.dsn, "--role", role, "--name", name]
        args += ["--explicit-prepare"] * explicit_prepare + ["--handler"] * handler
        return self._child("server", name, args, env).start(ready="bank server ready")

    def servers_b(self, n: int, *, explicit_prepare: bool = False, handler: bool = False
                  ) -> list[Child]:
        """``n`` concurrent servers of partition B. With one server per partition, two
        cross-partition transactions can each hold one partition's only server while
        waiting for the other's (the router presents one transaction at a time to a
        server): they wait for the vote timeout. As many B servers as transactions in
        flight break every such cycle while A keeps a single server for the tests'
        deterministic kills."""
        return [self.server("B", f"server-B{i}", role="concurrent",
                            explicit_prepare=explicit_prepare, handler=handler)
                for i in range(n)]

    def client(self, name: str, count: int, seed: int, *, args: list[str] | None = None,
               env: dict[str, str] | None = None) -> Child:
        """Start a client issuing ``count`` transfers (not waited for)."""
        child = self._child("client", name, ["--count", str(count), "--seed", str(seed),
                                             *(args or [])], env)
        return child.start(ready=None)

    def client_logs(self) -> list[Path]:
        return [c.log for c in self.children if c.cmd[2] == "examples.bank.client"
                and c.log.exists()]

    def outcomes(self, child: Child) -> int:
        """How many outcomes ``child`` (a client) has logged so far."""
        return sum(1 for words in child.lines() if words[0] == "OUTCOME")

    def check(self, committed: frozenset[str] = frozenset()) -> Report:
        """The invariants over every client log of this rig."""
        return check(self.broker.url, self.dsn, self.client_logs(), committed=committed)

    @contextmanager
    def supervised(self, servers: list[Child], restart: Callable[[Child], Child]
                   ) -> Iterator[list[Child]]:
        """Restart any of ``servers`` that dies (as an operator's process monitor
        would); yields the list of the processes that died."""
        died: list[Child] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def watch() -> None:
            try:
                while not stop.is_set():
                    for i, child in enumerate(servers):
                        if not child.alive():
                            died.append(child)
                            servers[i] = restart(child)
                    stop.wait(POLL)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield died
        finally:
            stop.set()
            thread.join(timeout=60)
        if errors:
            raise errors[0]

    def close(self) -> None:
        for child in self.children:
            child.kill()


def accounts(k: int, n: int) -> list[str]:
    """Client arguments: the accounts ``k`` modulo ``n`` (clients of one test touch
    disjoint accounts, so that two servers of B never wait for one row lock)."""
    return ["--accounts", f"0-1999/{n}+{k}"]


def begun(child: Child) -> list[str]:
    """The tids a server's log says it began (or died receiving), in order."""
    tids = []
    for words in child.lines():
        if words[0] == "BEGIN" or (words[0] == "CRASH" and words[1] == "after_receive"):
            tids.append(words[2] if words[0] == "CRASH" else words[1])
    return tids


def crash_line(child: Child) -> list[str]:
    """The CRASH line of a server that killed itself (``CRASH point tid``)."""
    lines = [words for words in child.lines() if words[0] == "CRASH"]
    assert len(lines) == 1, f"{child.name}: {lines}"
    return lines[0]
