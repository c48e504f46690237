"""STOMP test support: a broker process with the STOMP listener, a blocking client.

The broker runs ``tests/stomp/launcher.py`` in a child process on free
loopback ports and is stopped by its pid. :class:`StompClient` speaks STOMP
through the sans-IO codec under test (client role) over a plain socket.
"""

from __future__ import annotations

import queue
import socket
import sys
import time
from pathlib import Path
from typing import Any

import stomp

from tests.support import BrokerProcess, free_port
from txbroker.protocol.stomp import Frame, Role, StompConnection, StompProtocolError


class StompEvents(stomp.ConnectionListener):  # type: ignore[misc]
    """A stomp.py listener that puts every event on one queue: ``("connected" |
    "message" | "receipt" | "error" | "disconnected", frame)``; heartbeats are
    counted. Tests subclass it with the waits they need."""

    def __init__(self) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.heartbeats = 0
        self.heartbeat_timeouts = 0

    def on_connected(self, frame: Any) -> None:
        self.events.put(("connected", frame))

    def on_message(self, frame: Any) -> None:
        self.events.put(("message", frame))

    def on_receipt(self, frame: Any) -> None:
        self.events.put(("receipt", frame))

    def on_error(self, frame: Any) -> None:
        self.events.put(("error", frame))

    def on_disconnected(self) -> None:
        self.events.put(("disconnected", None))

    def on_heartbeat(self) -> None:
        self.heartbeats += 1

    def on_heartbeat_timeout(self) -> None:
        self.heartbeat_timeouts += 1


class StompBroker(BrokerProcess):
    """A broker process with a STOMP listener (``tests.stomp.launcher``)."""

    def __init__(self, data: Path, *args: str, stomp_port: int | None = None,
                 port: int | None = None) -> None:
        super().__init__(data, *args, port=port)
        self.stomp_port = stomp_port or free_port()
        self.log_path = data.parent / f"{data.name}-stomp-broker.log"
        self.ready_line = ""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.stomp.launcher", "--data", str(self.data),
                "--port", str(self.port), "--stomp-port", str(self.stomp_port), *self.args]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


class StompClient:
    """A blocking STOMP client on the codec under test (for protocol tests)."""

    def __init__(self, port: int, *, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.codec = StompConnection(Role.CLIENT)
        self.pending: list[Frame] = []
        self.closed = False

    # -- raw I/O ---------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, command: str, headers: dict[str, str] | None = None,
             body: bytes = b"") -> None:
        self.send_raw(self.codec.send(Frame(command, dict(headers or {}), body)))

    def read(self, timeout: float = 10.0) -> Frame | None:
        """The next frame, or None when the server closed the connection."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            frames = self.codec.drain()
            if frames:
                self.pending.extend(frames)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the server in time")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed = True
                return None
            self.codec.receive_data(data)
        return self.pending.pop(0)

    def expect(self, command: str, timeout: float = 10.0) -> Frame:
        frame = self.read(timeout)
        assert frame is not None, f"connection closed while waiting for {command}"
        assert frame.command == command, f"expected {command}, got {frame}"
        return frame

    def expect_closed(self, timeout: float = 10.0) -> None:
        """The server closes the connection (after any frames already queued)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                frame = self.read(max(0.01, deadline - time.monotonic()))
            except StompProtocolError:
                continue
            if frame is None:
                return

    # -- STOMP -----------------------------------------------------------
    def connect(self, version: str = "1.2", **headers: str) -> Frame:
        all_headers = {"accept-version": version, "host": "localhost", **headers}
        self.send("CONNECT", all_headers)
        return self.expect("CONNECTED")

    def call(self, command: str, headers: dict[str, str] | None = None,
             body: bytes = b"", timeout: float = 10.0) -> Frame:
        """Send a frame with a receipt and wait for the RECEIPT (other frames kept)."""
        receipt = f"r-{time.monotonic_ns()}"
        self.send(command, {**(headers or {}), "receipt": receipt}, body)
        deadline = time.monotonic() + timeout
        kept: list[Frame] = []
        try:
            while True:
                frame = self.read(max(0.01, deadline - time.monotonic()))
                assert frame is not None, f"connection closed while waiting for the receipt of " \
                                          f"{command}"
                if frame.command == "RECEIPT" and frame.headers["receipt-id"] == receipt:
                    return frame
                if frame.command == "ERROR":
                    raise AssertionError(f"ERROR instead of a receipt: {frame}")
                kept.append(frame)
        finally:
            self.pending[:0] = kept

    def messages(self, count: int, timeout: float = 10.0) -> list[Frame]:
        """The next ``count`` MESSAGE frames (other frames are dropped)."""
        found: list[Frame] = []
        deadline = time.monotonic() + timeout
        while len(found) < count:
            frame = self.read(max(0.01, deadline - time.monotonic()))
            assert frame is not None, f"connection closed after {len(found)}/{count} messages"
            if frame.command == "MESSAGE":
                found.append(frame)
        return found

    def no_message(self, wait: float = 0.3) -> None:
        """Assert that no MESSAGE arrives within ``wait`` seconds."""
        try:
            frame = self.read(wait)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected frame {frame}")

    def disconnect(self) -> None:
        try:
            self.call("DISCONNECT", timeout=5)
        finally:
            self.close()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> StompClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
