"""AMQP test support: a ``txbroker serve`` process with the AMQP listener, and a
raw AMQP client speaking through pamqp over a plain socket (for abuse tests)."""

from __future__ import annotations

import socket
import struct
from pathlib import Path
from typing import Any

from pamqp import commands, frame

from tests.support import BrokerProcess, free_port
from txbroker.protocol.amqp import PROTOCOL_HEADER

#: How long a test waits for the broker's answer (s).
WAIT = 10.0


class AmqpBroker(BrokerProcess):
    """A broker process with an AMQP listener on a free port."""

    def __init__(self, data: Path, *args: str, amqp_port: int | None = None,
                 port: int | None = None) -> None:
        self.amqp_port = amqp_port or free_port()
        super().__init__(data, "--amqp-port", str(self.amqp_port), *args, port=port)

    @property
    def amqp_url(self) -> str:
        """The URL pika, aio-pika and kombu take."""
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"


class RawAmqp:
    """Frames by hand: the protocol header, methods, and reading what comes back."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def method(self, channel: int, method: Any) -> None:
        self.send(frame.marshal(method, channel))

    def read(self) -> tuple[int, Any] | None:
        """The next frame (channel, pamqp object); None when the broker closed."""
        while True:
            if len(self.buffer) >= 7:
                if self.buffer[:4] == b"AMQP":
                    value, self.buffer = self.buffer[:8], self.buffer[8:]
                    return 0, value
                size = struct.unpack(">I", self.buffer[3:7])[0]
                if len(self.buffer) >= size + 8:
                    used, channel, value = frame.unmarshal(self.buffer[:size + 8])
                    self.buffer = self.buffer[used:]
                    return channel, value
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.buffer += chunk

    def expect(self, name: str) -> Any:
        """Read frames until a method called ``name`` (heartbeats skipped)."""
        while True:
            got = self.read()
            assert got is not None, f"connection closed while waiting for {name}"
            _, value = got
            if getattr(value, "name", None) == name:
                return value
            if getattr(value, "name", None) in ("Connection.Close", "Channel.Close"):
                raise AssertionError(f"got {value.name} {value.reply_code} {value.reply_text!r}"
                                     f" while waiting for {name}")

    def handshake(self, user: str = "guest", password: str = "guest", vhost: str = "/",
                  heartbeat: int = 0) -> None:
        """Protocol header to open-ok."""
        self.send(PROTOCOL_HEADER)
        self.expect("Connection.Start")
        self.method(0, commands.Connection.StartOk(
            client_properties={}, mechanism="PLAIN", response=f"\0{user}\0{password}",
            locale="en_US"))
        tune = self.expect("Connection.Tune")
        self.method(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, heartbeat))
        self.method(0, commands.Connection.Open(virtual_host=vhost))

    def closed(self) -> bool:
        """True once the broker closed the socket (frames before that are skipped)."""
        while True:
            if self.read() is None:
                return True

    def close(self) -> None:
        self.sock.close()
