"""A private etcd for tests, and a TCP link that can be cut.

``EtcdServer().start()`` runs Debian's ``etcd`` (``make etcd`` installs it) as a
one-member cluster in a temp dir, client and peer URLs on free 127.0.0.1 ports, and
waits until ``/health`` answers; ``stop()`` kills it by pid and removes the
directory. ``pause()`` / ``resume()`` send SIGSTOP / SIGCONT (etcd stops answering
everyone, its clock keeps running).

``LinkProxy`` forwards a loopback port to etcd inside the test's event loop;
``block()`` cuts *one* node's link (bytes are swallowed, new connections hang) while
etcd keeps serving the others — a partition of that node from etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support import free_port


def etcd_binary() -> str | None:
    """The etcd server binary, or None when it is not installed."""
    return shutil.which("etcd")


class EtcdServer:
    """One throw-away etcd member on 127.0.0.1."""

    def __init__(self, election_ms: int | None = None) -> None:
        """``election_ms``: etcd's election timeout (its heartbeat a tenth of it; None:
        etcd's defaults, 1,000 and 100 ms). Its smallest lease is 1.5 of it."""
        self.election_ms = election_ms
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed: `make etcd` installs it")
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="txb-etcd-"))
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        """Start etcd and wait until it answers ``/health``."""
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.root / "log", "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--name", "n1", "--data-dir", str(self.root / "data"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"n1={peer}", "--log-level", "warn",
                 *([] if self.election_ms is None else
                   ["--election-timeout", str(self.election_ms),
                    "--heartbeat-interval", str(max(10, self.election_ms // 10))])],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: "
                                   f"{(self.root / 'log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as reply:
                    if b'"true"' in reply.read():
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not answer on {self.url} within {timeout} s")
            time.sleep(0.05)

    def pause(self) -> None:
        """SIGSTOP: etcd answers nobody until ``resume``."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill etcd by pid and remove its directory."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)


class LinkProxy:
    """A TCP forwarder 127.0.0.1:``port`` → ``target_port``, run in the current loop."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.blocked = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """The client URL through the link."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> LinkProxy:
        """Listen on a free port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def block(self) -> None:
        """Cut the link: nothing passes any more in either direction."""
        self.blocked = True

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if self.blocked:
                await reader.read()  # swallow until the peer gives up
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(up_writer)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except OSError:
            pass
        finally:
            writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.blocked:
                    continue  # swallowed: a black hole, not a reset
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
