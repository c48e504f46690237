"""The wire side of ``bench/amqpbench.py``: AMQP 0-9-1 frames (pamqp, plus ``struct``
reads of the three frames that arrive once per message), one connection over a
plain socket, and the ``selectors`` loop that drives several connections.

Theory of operation: a ``Connection`` does its setup (protocol header, PLAIN,
``tune``, ``open``, channel 1) with blocking calls, then the ``Loop`` makes every
socket non-blocking. Per readable socket the loop reads once, splits the complete
frames (``split_frames``), hands each to the connection's ``Handler`` — which may
append frames to ``conn.out`` — and writes ``conn.out`` once, keeping what the
socket did not take for the next writable event. Handlers read hot frames with
``method_ids`` / ``ack_fields`` / ``deliver_fields`` / ``body_seq`` and anything
else with ``slow_method`` (pamqp); with ``--decode pamqp`` everything goes through
pamqp. ``tests/amqp/test_amqpbench.py`` checks the fast reads against pamqp.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import struct
import time
from typing import Any

from pamqp import commands, frame, header
from pamqp.body import ContentBody

FRAME_END = 0xCE
#: Frame types (AMQP 0-9-1 section 4.2.3).
METHOD, HEADER, BODY, HEARTBEAT = 1, 2, 3, 8
#: (class id, method id) of the methods read on the hot path.
BASIC_ACK, BASIC_DELIVER, TX_COMMIT_OK = (60, 80), (60, 60), (90, 21)
BASIC_NACK = (60, 120)
#: Body: a 10-digit sequence number and ";", then padding up to --body bytes.
SEQ_LEN = 11
CHANNEL = 1


class BrokerError(Exception):
    """The broker closed the channel or connection, or sent what we did not expect."""


# ---------------------------------------------------------------- frames
def method_ids(buf: bytearray | bytes, start: int) -> tuple[int, int]:
    """(class id, method id) of the method frame payload starting at ``start``."""
    return struct.unpack_from(">HH", buf, start)  # type: ignore[return-value]


def ack_fields(buf: bytearray | bytes, start: int) -> tuple[int, bool]:
    """(delivery tag, multiple) of a ``basic.ack`` / ``basic.nack`` payload."""
    tag, bits = struct.unpack_from(">QB", buf, start + 4)
    return tag, bool(bits & 1)


def deliver_fields(buf: bytearray | bytes, start: int) -> tuple[int, bool]:
    """(delivery tag, redelivered) of a ``basic.deliver`` payload."""
    after_tag = start + 5 + buf[start + 4]  # past the consumer tag (short string)
    tag = struct.unpack_from(">Q", buf, after_tag)[0]
    return tag, bool(buf[after_tag + 8] & 1)


def body_seq(buf: bytearray | bytes, start: int) -> int:
    """The sequence number a body frame's payload starts with."""
    return int(buf[start:start + SEQ_LEN - 1])


def split_frames(buf: bytearray) -> tuple[list[tuple[int, int, int]], int]:
    """Complete frames at the head of ``buf``: [(type, payload start, payload end)] and
    the bytes they take. Channels are not returned: each connection uses one."""
    found = []
    pos, size = 0, len(buf)
    while size - pos >= 8:
        ftype, _, length = struct.unpack_from(">BHI", buf, pos)
        end = pos + 7 + length
        if end >= size:
            break
        if buf[end] != FRAME_END:
            raise BrokerError(f"bad frame end at {end}: {buf[end]!r}")
        found.append((ftype, pos + 7, end))
        pos = end + 1
    return found, pos


def slow_method(buf: bytearray | bytes, start: int, end: int) -> Any:
    """The method frame whose payload is ``buf[start:end]``, decoded by pamqp."""
    return frame.unmarshal(bytes(buf[start - 7:end + 1]))[2]


def check_close(name: str, value: Any) -> None:
    """A ``close`` from the broker ends the run with its reply (``name``: whose)."""
    if value.name in ("Connection.Close", "Channel.Close"):
        raise BrokerError(f"{name}: {value.name} {value.reply_code} {value.reply_text}")


def ack_frame(tag: int) -> bytes:
    """``basic.ack`` (single) on ``CHANNEL``, built by hand: 21 bytes, the hot path."""
    return ACK_HEAD + struct.pack(">Q", tag) + b"\x00\xce"


ACK_HEAD = frame.marshal(commands.Basic.Ack(0), CHANNEL)[:11]
assert frame.marshal(commands.Basic.Ack(7), CHANNEL) == ack_frame(7)


class Publisher:
    """The bytes of one persistent publish to ``queue`` (method, header, body frames)."""

    def __init__(self, queue: str, size: int) -> None:
        props = commands.Basic.Properties(delivery_mode=2)
        self.head = (frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue),
                                   CHANNEL)
                     + frame.marshal(header.ContentHeader(0, size, props), CHANNEL))
        sample = frame.marshal(ContentBody(b"x" * size), CHANNEL)
        self.body_head = sample[:7]
        self.pad = b"x" * (size - SEQ_LEN) + b"\xce"

    def message(self, seq: int) -> bytes:
        """Publish number ``seq``."""
        return self.head + self.body_head + b"%010d;" % seq + self.pad


# ---------------------------------------------------------------- connection
class Connection:
    """One AMQP connection with channel 1 open; blocking during setup, then driven by
    a ``selectors`` loop (``Loop``) with an output buffer written once per read."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        self.name = name
        self.decode_all = args.decode == "pamqp"
        self.sock = socket.create_connection((args.host, args.port),
                                             timeout=args.connect_timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inbuf = bytearray()
        self.out = bytearray()
        self.handshake(args)

    def write_now(self, data: bytes) -> None:
        """Blocking write (setup only)."""
        self.sock.sendall(data)

    def expect(self, name: str) -> Any:
        """Blocking: read until the method ``name`` arrives (setup only)."""
        while True:
            frames, used = split_frames(self.inbuf)
            for index, (ftype, start, end) in enumerate(frames):
                if ftype != METHOD:
                    continue
                value = slow_method(self.inbuf, start, end)
                check_close(self.name, value)
                if value.name == name:
                    del self.inbuf[:frames[index][2] + 1]
                    return value
            del self.inbuf[:used]
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise BrokerError(f"{self.name}: closed while waiting for {name}")
            self.inbuf += chunk

    def call(self, method: Any, reply: str, channel: int = CHANNEL) -> Any:
        """Send ``method`` and wait for ``reply`` (setup and checks only)."""
        self.write_now(frame.marshal(method, channel))
        return self.expect(reply)

    def handshake(self, args: argparse.Namespace) -> None:
        """Protocol header to channel.open-ok, PLAIN, heartbeats off."""
        self.write_now(frame.marshal(header.ProtocolHeader(), 0))
        self.expect("Connection.Start")
        self.write_now(frame.marshal(commands.Connection.StartOk(
            client_properties={"product": "amqpbench"}, mechanism="PLAIN",
            response=f"\0{args.user}\0{args.password}", locale="en_US"), 0))
        tune = self.expect("Connection.Tune")
        self.frame_max = tune.frame_max  # 0: no limit
        self.write_now(frame.marshal(commands.Connection.TuneOk(
            tune.channel_max, tune.frame_max, 0), 0))
        self.write_now(frame.marshal(commands.Connection.Open(virtual_host=args.vhost), 0))
        self.expect("Connection.OpenOk")
        self.call(commands.Channel.Open(), "Channel.OpenOk")
        if self.frame_max and args.body + 8 > self.frame_max:
            raise BrokerError(f"--body {args.body} needs more than one body frame "
                              f"(frame_max {self.frame_max}): not supported")

    def close(self) -> None:
        """Connection.close and wait for close-ok (best effort), then the socket."""
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(5)
            self.write_now(frame.marshal(commands.Connection.Close(200, "bye", 0, 0), 0))
            self.expect("Connection.CloseOk")
        except (OSError, BrokerError):
            pass
        self.sock.close()


class Loop:
    """Drives connections until every handler says it is done: read, split frames,
    hand each to the handler, write what it queued."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.handlers: dict[Connection, Handler] = {}
        self.waiting_write: set[Connection] = set()

    def add(self, conn: Connection, handler: Handler) -> None:
        """Drive ``conn`` with ``handler`` (the socket becomes non-blocking)."""
        conn.sock.setblocking(False)
        self.handlers[conn] = handler
        self.selector.register(conn.sock, selectors.EVENT_READ, conn)

    def flush(self, conn: Connection) -> None:
        """Write what ``conn.out`` holds; wait for writability if the socket is full."""
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except BlockingIOError:
                sent = 0
            del conn.out[:sent]
        if bool(conn.out) != (conn in self.waiting_write):
            if conn.out:
                self.waiting_write.add(conn)
                self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                     conn)
            else:
                self.waiting_write.discard(conn)
                self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def run(self, timeout: float) -> None:
        """Start every handler, then read, handle and write until all are done."""
        for conn, handler in self.handlers.items():
            handler.start(time.perf_counter_ns())
            self.flush(conn)
        deadline = time.monotonic() + timeout
        while not all(h.done for h in self.handlers.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done after {timeout} s")
            for key, mask in self.selector.select(1.0):
                conn = key.data
                if mask & selectors.EVENT_READ:
                    try:
                        chunk = conn.sock.recv(1 << 18)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        raise BrokerError(f"{conn.name}: connection closed by the broker")
                    now = time.perf_counter_ns()
                    buf = conn.inbuf
                    buf += chunk
                    frames, used = split_frames(buf)
                    handler = self.handlers[conn]
                    for ftype, start, end in frames:
                        handler.on_frame(ftype, buf, start, end, now)
                    del buf[:used]
                self.flush(conn)


# ---------------------------------------------------------------- handlers
class Handler:
    """One connection's part of a workload: ``start`` queues the first frames,
    ``on_frame`` answers each frame; ``done`` once its share is finished."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.done = False

    def start(self, now: int) -> None:
        """Queue the first frames."""

    def on_frame(self, ftype: int, buf: bytearray, start: int, end: int, now: int) -> None:
        """Handle one frame whose payload is ``buf[start:end]``."""

    def method(self, ftype: int, buf: bytearray, start: int, end: int) -> Any:
        """A frame the hot path does not read: decoded by pamqp; a close raises."""
        if ftype != METHOD:
            if ftype == HEARTBEAT:
                return None
            raise BrokerError(f"{self.conn.name}: unexpected frame type {ftype}")
        value = slow_method(buf, start, end)
        check_close(self.conn.name, value)
        return value
