"""Hypothesis against a live STOMP listener: whatever a client sends, the broker
answers with valid frames (an ERROR closes the connection), stays up, and
what is stored is not harmed."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.stomp.support import StompBroker, StompClient
from txbroker.protocol.stomp import Role, StompConnection, StompProtocolError

pytestmark = pytest.mark.timeout(120)

COMMANDS = [b"SEND", b"SUBSCRIBE", b"UNSUBSCRIBE", b"ACK", b"NACK", b"BEGIN", b"COMMIT",
            b"ABORT", b"DISCONNECT", b"CONNECT", b"STOMP", b"MESSAGE", b"BOGUS", b""]
HEADERS = [b"destination:/queue/fz-a", b"destination:/topic/fz-t", b"destination:/fz",
           b"destination:/queue/", b"id:1", b"id:2", b"ack:client", b"ack:client-individual",
           b"ack:auto", b"ack:bad", b"transaction:t1", b"transaction:t2", b"receipt:r",
           b"content-length:3", b"content-length:x", b"persistent:true", b"prefetch-count:1",
           b"prefetch-count:0", b"x:a\\cb", b"x:\\q", b"durable-subscription-name:fz",
           b"message-id:1", b"heart-beat:10,10", b"noval", b":", b"\xff:\xfe"]

frame = st.builds(
    lambda command, headers, body, crlf, terminator: (
        command + (b"\r\n" if crlf else b"\n") + b"".join(h + b"\n" for h in headers) + b"\n"
        + body + terminator),
    st.sampled_from(COMMANDS),
    st.lists(st.sampled_from(HEADERS), max_size=5),
    st.sampled_from([b"", b"abc", b"a\x00c", b"\n", bytes(range(8))]),
    st.booleans(),
    st.sampled_from([b"\x00", b"\x00\n", b"", b"\x00\x00"]),
)
chunk = st.one_of(frame, st.binary(max_size=40), st.just(b"\n"))


def read_until_quiet(sock: socket.socket, quiet: float = 0.15, limit: float = 3.0) -> bytes:
    """Everything the server sends until it is quiet or closes."""
    data = b""
    deadline = time.monotonic() + limit
    sock.settimeout(quiet)
    while time.monotonic() < deadline:
        try:
            chunk_ = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk_:
            break
        data += chunk_
    return data


@pytest.fixture(scope="module")
def canary(stomp_broker: StompBroker) -> str:
    """A persistent message stored before the fuzzing starts."""
    queue = f"/queue/canary-{uuid.uuid4().hex}"
    with StompClient(stomp_broker.stomp_port) as client:
        client.connect()
        client.call("SEND", {"destination": queue, "persistent": "true"}, b"must survive")
        client.disconnect()
    return queue


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(connect_first=st.booleans(), chunks=st.lists(chunk, min_size=1, max_size=6),
       split=st.integers(min_value=1, max_value=64))
def test_fuzz_live_listener(stomp_broker: StompBroker, canary: str, connect_first: bool,
                            chunks: list[bytes], split: int) -> None:
    data = b"".join(chunks)
    if connect_first:
        data = b"CONNECT\naccept-version:1.2\nhost:fuzz\n\n\x00" + data
    with socket.create_connection(("127.0.0.1", stomp_broker.stomp_port), timeout=5) as sock:
        try:
            for start in range(0, len(data), split):
                sock.sendall(data[start:start + split])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server already answered with ERROR and closed
        reply = read_until_quiet(sock)
    codec = StompConnection(Role.CLIENT)
    codec.receive_data(reply)
    frames = []
    try:
        while batch := codec.drain():
            frames += batch
    except StompProtocolError as exc:  # only a CONNECTED-less reply to a non-CONNECT
        assert not frames and reply.startswith(b"ERROR"), (exc, reply[:200])
        return
    for index, each in enumerate(frames):
        assert each.command in ("CONNECTED", "RECEIPT", "MESSAGE", "ERROR")
        if each.command == "ERROR":
            assert each.headers["message"]
            assert index == len(frames) - 1, "nothing may follow an ERROR"
    assert stomp_broker.alive()


def test_after_the_fuzz(stomp_broker: StompBroker, canary: str) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        client.connect()
        client.call("SUBSCRIBE", {"destination": canary, "id": "c", "ack": "client-individual"})
        message = client.messages(1)[0]
        assert message.body == b"must survive"
        client.call("ACK", {"id": message.headers["ack"]})
        client.disconnect()
