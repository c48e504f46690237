"""Test support: real broker processes on loopback, free ports, raw frames."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

import msgpack

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: The queue :func:`durability_barrier` sends its marker to.
BARRIER_QUEUE = "test-durability-barrier"


def durability_barrier(conn: Any, queue: str = BARRIER_QUEUE) -> None:
    """Return once every record the broker wrote for this connection's earlier requests
    is durable, so that a kill -9 right after cannot undo them.

    Some requests are answered before their record is durable (``nack``, a pipelined
    ``ack``, ``stream_close``; docs/protocol.md). This sends one persistent message
    and waits for its reply, which the broker sends only once that message's record
    is durable. The broker handles one connection's requests in order and appends
    their records to the store in that order; the store's single writer thread
    writes and completes them in log order (group commit), so the marker's record
    being durable means every record appended before it is too. The marker stays
    in ``queue``; keep that queue out of what a test counts."""
    conn.send(queue, b"durability barrier", persistent=True)


#: ``txbroker serve`` arguments per store, for tests that run on either (issue 17):
#: the journal (the default), and the dir store with the flags that promise the
#: journal's durability (docs/dirstore.md).
STORE_ARGS: dict[str, tuple[str, ...]] = {
    "journal": (),
    "dir": ("--store", "dir", "--dir-flags", "FDATASYNC,DSYNC"),
}
#: The stores, as pytest parameters (ids ``journal`` and ``dir``).
STORES = list(STORE_ARGS)


def store_args(store: str) -> list[str]:
    """The ``txbroker serve`` arguments that run a broker on ``store``."""
    return list(STORE_ARGS[store])


class BrokerProcess:
    """``txbroker serve`` in a child process; stopped by pid."""

    def __init__(self, data: Path, *args: str, port: int | None = None) -> None:
        self.data = data
        self.args = list(args)
        self.port = port or free_port()
        self.proc: subprocess.Popen[str] | None = None
        self.log_path = data.parent / f"{data.name}-broker.log"

    @property
    def url(self) -> str:
        return f"txb://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The child's command line (subclasses start other launchers)."""
        cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(self.data),
               "--port", str(self.port), "--log-level", "WARNING", *self.args]
        if "--stomp-port" not in self.args:
            cmd += ["--stomp-port", "0"]
        if "--amqp-port" not in self.args:  # 5672 by default: tests run side by side
            cmd += ["--amqp-port", "0"]
        return cmd

    def start(self, timeout: float = 60.0) -> Self:
        """Start the child and wait for its "txbroker ready" line."""
        cmd = self.command()
        log = open(self.log_path, "a")  # noqa: SIM115 - kept open for the child
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                     cwd=ROOT)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("txbroker ready"):
                self.ready_line = line.strip()
                return self
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
        self.kill()
        raise RuntimeError("broker did not become ready in time")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        """SIGTERM (clean shutdown); returns the exit code."""
        self.kill(signal.SIGTERM)
        return None if self.proc is None else self.proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()


class RawClient:
    """Frames by hand, for protocol-abuse tests."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.unpacker_buf = b""

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, rid: int, op: str, args: dict[str, Any]) -> None:
        payload = msgpack.packb([0, rid, op, args], use_bin_type=True)
        self.send_raw(len(payload).to_bytes(4, "big") + payload)

    def read_frame(self) -> list[Any] | None:
        while True:
            if len(self.unpacker_buf) >= 4:
                n = int.from_bytes(self.unpacker_buf[:4], "big")
                if len(self.unpacker_buf) >= 4 + n:
                    frame = self.unpacker_buf[4:4 + n]
                    self.unpacker_buf = self.unpacker_buf[4 + n:]
                    return list(msgpack.unpackb(frame, raw=False))
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.unpacker_buf += chunk

    def call(self, rid: int, op: str, **args: Any) -> list[Any]:
        self.request(rid, op, args)
        while True:
            frame = self.read_frame()
            assert frame is not None, "connection closed"
            if frame[0] in (1, 2) and frame[1] == rid:
                return frame

    def close(self) -> None:
        self.sock.close()
