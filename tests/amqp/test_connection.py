"""The AMQP handshake and connection-level refusals, by hand (tests/amqp/support.py's
raw client) and with pika: protocol header, SASL PLAIN against the broker's users,
tune, vhost, channels, close codes; garbage never crashes the broker."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from pamqp import body, commands, frame, header
from pamqp.exceptions import PAMQPException

from tests.amqp.support import AmqpBroker, RawAmqp
from txbroker.protocol.amqp import PROTOCOL_HEADER
from txbroker.server.security.auth import hash_password


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AmqpBroker]:
    """A broker with one user, alice / wonderland."""
    root = tmp_path_factory.mktemp("amqp-users")
    config = root / "broker.toml"
    config.write_text(f'[users]\nalice = "{hash_password("wonderland")}"\n')
    broker = AmqpBroker(root / "data", "--config", str(config))
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def raw(amqp_broker: AmqpBroker) -> Iterator[RawAmqp]:
    client = RawAmqp(amqp_broker.amqp_port)
    yield client
    client.close()


def close_of(client: RawAmqp) -> tuple[int, str]:
    """The connection.close the broker sends; the socket closes after close-ok."""
    close = client.expect("Connection.Close")
    client.method(0, commands.Connection.CloseOk())
    assert client.closed()
    return close.reply_code, close.reply_text


def test_start_tune_open(raw: RawAmqp) -> None:
    raw.send(PROTOCOL_HEADER)
    start = raw.expect("Connection.Start")
    assert (start.version_major, start.version_minor) == (0, 9)
    assert start.mechanisms == "PLAIN AMQPLAIN"
    assert start.server_properties["product"] == "txbroker"
    assert start.server_properties["capabilities"]["publisher_confirms"] is True
    raw.method(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                              response="\0guest\0guest", locale="en_US"))
    tune = raw.expect("Connection.Tune")
    assert (tune.channel_max, tune.frame_max, tune.heartbeat) == (2047, 131072, 60)
    raw.method(0, commands.Connection.TuneOk(10, 65536, 0))
    raw.method(0, commands.Connection.Open(virtual_host="/"))
    raw.expect("Connection.OpenOk")
    raw.method(1, commands.Channel.Open())
    raw.expect("Channel.OpenOk")
    raw.method(0, commands.Connection.Close(200, "bye", 0, 0))
    raw.expect("Connection.CloseOk")
    assert raw.closed()


def test_wrong_protocol_header_gets_ours(raw: RawAmqp) -> None:
    raw.send(b"AMQP\x00\x00\x08\x00")
    assert raw.read() == (0, PROTOCOL_HEADER)
    assert raw.closed()


def test_http_on_the_amqp_port(raw: RawAmqp) -> None:
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.read() == (0, PROTOCOL_HEADER)
    assert raw.closed()


def test_other_vhost_is_530(raw: RawAmqp) -> None:
    raw.handshake(vhost="/prod")
    assert close_of(raw) == (530, "NOT_ALLOWED - vhost /prod not found")


def test_frame_above_frame_max_is_501(raw: RawAmqp) -> None:
    raw.handshake()
    raw.expect("Connection.OpenOk")
    raw.send(struct.pack(">BHI", 3, 1, 200_000))
    code, text = close_of(raw)
    assert (code, text) == (501, "FRAME_ERROR - frame of 200008 bytes exceeds frame_max "
                                 "131072")


def test_method_on_unopened_channel_is_504(raw: RawAmqp) -> None:
    raw.handshake()
    raw.expect("Connection.OpenOk")
    raw.method(3, commands.Basic.Qos(0, 10, False))
    code, text = close_of(raw)
    assert code == 504 and "expected 'channel.open' on channel 3" in text


def test_channel_above_channel_max_is_530(raw: RawAmqp) -> None:
    raw.send(PROTOCOL_HEADER)
    raw.expect("Connection.Start")
    raw.method(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                              response="\0g\0g", locale="en_US"))
    raw.expect("Connection.Tune")
    raw.method(0, commands.Connection.TuneOk(2, 131072, 0))
    raw.method(0, commands.Connection.Open(virtual_host="/"))
    raw.expect("Connection.OpenOk")
    raw.method(3, commands.Channel.Open())
    assert close_of(raw)[0] == 530


def test_second_channel_open_is_504(raw: RawAmqp) -> None:
    raw.handshake()
    raw.expect("Connection.OpenOk")
    raw.method(1, commands.Channel.Open())
    raw.expect("Channel.OpenOk")
    raw.method(1, commands.Channel.Open())
    assert close_of(raw)[0] == 504


def test_method_before_open_is_505(raw: RawAmqp) -> None:
    raw.send(PROTOCOL_HEADER)
    raw.expect("Connection.Start")
    raw.method(1, commands.Channel.Open())
    assert close_of(raw)[0] == 505


def test_channel_error_keeps_the_connection(raw: RawAmqp) -> None:
    raw.handshake()
    raw.expect("Connection.OpenOk")
    raw.method(1, commands.Channel.Open())
    raw.expect("Channel.OpenOk")
    raw.method(1, commands.Queue.Declare(queue="nope", passive=True))
    close = raw.read()
    assert close is not None and close[1].name == "Channel.Close"
    assert (close[1].reply_code, close[1].class_id, close[1].method_id) == (404, 50, 10)
    raw.method(1, commands.Queue.Declare(queue="ignored-while-closing"))
    raw.method(1, commands.Channel.CloseOk())
    raw.method(1, commands.Channel.Open())
    raw.expect("Channel.OpenOk")


def test_unsupported_method_is_540(raw: RawAmqp) -> None:
    raw.handshake()
    raw.expect("Connection.OpenOk")
    raw.method(1, commands.Channel.Open())
    raw.expect("Channel.OpenOk")
    raw.method(1, commands.Exchange.Bind(destination="a", source="b"))
    assert close_of(raw)[0] == 540


def test_login_with_the_brokers_users(secured: AmqpBroker) -> None:
    url = f"amqp://alice:wonderland@127.0.0.1:{secured.amqp_port}/"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    assert conn.channel().queue_declare("", exclusive=True).method.queue
    conn.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as caught:
        pika.BlockingConnection(pika.URLParameters(
            f"amqp://alice:wrong@127.0.0.1:{secured.amqp_port}/"))
    assert "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN" in \
        str(caught.value)


def test_bad_sasl_response_is_403(secured: AmqpBroker) -> None:
    raw = RawAmqp(secured.amqp_port)
    try:
        raw.send(PROTOCOL_HEADER)
        raw.expect("Connection.Start")
        raw.method(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                                  response="no-nuls", locale="en_US"))
        code, text = close_of(raw)
        assert code == 403 and "malformed response" in text
    finally:
        raw.close()


def test_amqplain_login(secured: AmqpBroker) -> None:
    from pamqp import encode

    raw = RawAmqp(secured.amqp_port)
    try:
        raw.send(PROTOCOL_HEADER)
        raw.expect("Connection.Start")
        table = encode.field_table({"LOGIN": "alice", "PASSWORD": "wonderland"})[4:]
        raw.method(0, commands.Connection.StartOk(client_properties={}, mechanism="AMQPLAIN",
                                                  response=table.decode("latin-1"),
                                                  locale="en_US"))
        raw.expect("Connection.Tune")
    finally:
        raw.close()


def test_heartbeats_are_sent(amqp_broker: AmqpBroker) -> None:
    raw = RawAmqp(amqp_broker.amqp_port)
    try:
        raw.handshake(heartbeat=1)
        raw.expect("Connection.OpenOk")
        got = raw.read()  # nothing else is sent: the next frame is a heartbeat
        assert got is not None and type(got[1]).__name__ == "Heartbeat"
    finally:
        raw.close()


def test_garbage_never_crashes_the_broker(amqp_broker: AmqpBroker) -> None:
    """Random bytes, before and after a valid handshake, and valid frames with
    flipped bytes: each connection is closed, the broker serves the next client."""
    rng = random.Random(31)
    valid = PROTOCOL_HEADER + frame.marshal(commands.Connection.StartOk(
        client_properties={}, mechanism="PLAIN", response="\0g\0g", locale="en_US"), 0)
    for i in range(60):
        raw = RawAmqp(amqp_broker.amqp_port)
        try:
            if i % 3 == 0:
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
            elif i % 3 == 1:
                data = PROTOCOL_HEADER + bytes(rng.randrange(256) for _ in range(300))
            else:
                data = bytearray(valid)
                for _ in range(rng.randrange(1, 6)):
                    data[rng.randrange(8, len(data))] = rng.randrange(256)
                data = bytes(data)
            raw.send(data)
            raw.sock.shutdown(socket.SHUT_WR)  # an incomplete frame would wait for more
            with contextlib.suppress(ValueError, struct.error, PAMQPException):
                while raw.read() is not None:  # whatever the broker says, then EOF
                    pass
        finally:
            raw.close()
    conn = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, b"still here")
    assert ch.basic_get(q, auto_ack=True)[2] == b"still here"
    conn.close()
    assert amqp_broker.proc is not None and amqp_broker.proc.poll() is None


def test_silent_client_is_dropped_after_two_heartbeat_intervals(
        amqp_broker: AmqpBroker) -> None:
    raw = RawAmqp(amqp_broker.amqp_port)
    try:
        raw.handshake(heartbeat=1)
        raw.expect("Connection.OpenOk")
        started = time.monotonic()
        assert raw.closed()  # heartbeats come, then the broker closes the socket
        assert 1.5 <= time.monotonic() - started <= 6
    finally:
        raw.close()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AmqpBroker]:
    """Users with [acl] rules: alice administers everything, bob may only send to and
    consume from ``jobs``."""
    root = tmp_path_factory.mktemp("amqp-acl")
    config = root / "broker.toml"
    config.write_text(
        f'[users]\nalice = "{hash_password("a-pass")}"\nbob = "{hash_password("b-pass")}"\n'
        '[[acl.rules]]\nuser = "alice"\npattern = "#"\n'
        'permissions = ["send", "consume", "browse", "admin"]\n'
        '[[acl.rules]]\nuser = "bob"\npattern = "jobs"\npermissions = ["send", "consume"]\n')
    broker = AmqpBroker(root / "data", "--config", str(config))
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


def test_acl_declares_need_admin_and_publish_needs_send(guarded: AmqpBroker) -> None:
    def connect(user: str, password: str) -> pika.BlockingConnection:
        return pika.BlockingConnection(pika.URLParameters(
            f"amqp://{user}:{password}@127.0.0.1:{guarded.amqp_port}/"))

    alice = connect("alice", "a-pass")
    alice.channel().queue_declare("jobs", durable=True)
    alice.channel().queue_declare("payroll", durable=True)
    bob = connect("bob", "b-pass")
    try:
        ch = bob.channel()
        ch.queue_declare("jobs", durable=True)  # exists, same flags: no change, allowed
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            ch.queue_declare("bobs-own", durable=True)
        assert caught.value.reply_code == 403
        assert "has no admin permission on 'bobs-own'" in caught.value.reply_text
        ch = bob.channel()
        ch.confirm_delivery()
        ch.basic_publish("", "jobs", b"allowed")
        assert ch.basic_get("jobs", auto_ack=True)[2] == b"allowed"
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            ch.basic_publish("", "payroll", b"not allowed")  # waits for its confirm
        assert caught.value.reply_code == 403
        assert "has no send permission on 'payroll'" in caught.value.reply_text
    finally:
        bob.close()
        alice.close()


def test_back_pressure_is_told_with_connection_blocked(tmp_path: Path) -> None:
    """A client that says it understands connection.blocked is told when the broker
    stops reading it (too many publishes waiting for the store) and when it reads
    again; every publish is still confirmed."""
    config = tmp_path / "broker.toml"
    config.write_text("[server]\nmax_pending_requests = 4\n")
    broker = AmqpBroker(tmp_path / "data", "--config", str(config)).start()
    raw = RawAmqp(broker.amqp_port)
    try:
        raw.send(PROTOCOL_HEADER)
        raw.expect("Connection.Start")
        raw.method(0, commands.Connection.StartOk(
            client_properties={"capabilities": {"connection.blocked": True}},
            mechanism="PLAIN", response="\0g\0g", locale="en_US"))
        tune = raw.expect("Connection.Tune")
        raw.method(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        raw.method(0, commands.Connection.Open(virtual_host="/"))
        raw.expect("Connection.OpenOk")
        raw.method(1, commands.Channel.Open())
        raw.expect("Channel.OpenOk")
        raw.method(1, commands.Queue.Declare(queue="bp", durable=True))
        raw.expect("Queue.DeclareOk")
        raw.method(1, commands.Confirm.Select())
        raw.expect("Confirm.SelectOk")
        publish = b"".join(
            frame.marshal(commands.Basic.Publish(exchange="", routing_key="bp"), 1)
            + frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties(
                delivery_mode=2)), 1)
            + frame.marshal(body.ContentBody(b"x"), 1) for _ in range(50))
        raw.send(publish)
        seen: list[str] = []
        acked: set[int] = set()
        while len(acked) < 50 or "Connection.Unblocked" not in seen:
            got = raw.read()
            assert got is not None
            name = got[1].name
            if name == "Basic.Ack":  # (``multiple``: every publish up to its tag)
                tag = got[1].delivery_tag
                acked.update(range(max(acked, default=0) + 1, tag + 1)
                             if got[1].multiple else (tag,))
            else:
                seen.append(name)
        assert seen == ["Connection.Blocked", "Connection.Unblocked"]
        assert acked == set(range(1, 51))
    finally:
        raw.close()
        broker.kill()


#: Client methods the channel fuzzer sends (connection.* aside: they end the test).
FUZZ_METHODS = [
    commands.Exchange.Declare, commands.Exchange.Delete, commands.Exchange.Bind,
    commands.Queue.Declare, commands.Queue.Bind, commands.Queue.Unbind, commands.Queue.Purge,
    commands.Queue.Delete, commands.Basic.Qos, commands.Basic.Consume, commands.Basic.Cancel,
    commands.Basic.Get, commands.Basic.Ack, commands.Basic.Nack, commands.Basic.Reject,
    commands.Basic.Recover, commands.Basic.RecoverAsync, commands.Tx.Select,
    commands.Tx.Commit, commands.Tx.Rollback, commands.Confirm.Select, commands.Channel.Flow,
    commands.Channel.Open, commands.Channel.Close, commands.Basic.Publish,
]
FUZZ_NAMES = ["", "q", "fz", "amq.direct", "amq.x", "$amqp.definitions", "a b", "é", "x" * 200]


def fuzz_value(rng: random.Random, kind: str) -> object:
    if kind == "bit":
        return rng.random() < 0.5
    if kind in ("octet", "short", "long", "longlong"):
        bits = {"octet": 8, "short": 16, "long": 32, "longlong": 63}[kind]
        return rng.choice([0, 1, 2, 5, 2 ** bits - 1, rng.randrange(2 ** bits)])
    if kind == "table":
        return rng.choice([{}, {"x-match": "any", "a": 1}, {"x-max-length": -1},
                           {"x-message-ttl": "soon"}, {"x-dead-letter-exchange": 7},
                           {"x-expires": 10}, {"x-max-priority": 300}, {"x-queue-type": "stream"},
                           {"nested": {"t": [1, "two", None]}}])
    return rng.choice([*FUZZ_NAMES, "direct", "fanout", "topic", "headers", "nope", "#", "*.b"])


def fuzz_frame(rng: random.Random, channel: int) -> bytes:
    from txbroker.protocol.amqp.hot import method_payload as _method_payload

    method = rng.choice(FUZZ_METHODS)()
    for slot in method.__slots__:
        setattr(method, slot, fuzz_value(rng, method.amqp_type(slot)))
    payload = _method_payload(method)
    data = struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"
    if method.name == "Basic.Publish":
        data += frame.marshal(header.ContentHeader(0, 3, commands.Basic.Properties(
            delivery_mode=rng.choice([1, 2]), expiration=rng.choice([None, "1", "x"]))),
            channel) + frame.marshal(body.ContentBody(b"abc"), channel)
    return data


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pamqp on basic.recover-async
def test_random_methods_never_harm_the_broker(amqp_broker: AmqpBroker) -> None:
    """Random channel methods with random arguments (names RabbitMQ or we refuse, huge
    numbers, odd tables): each gets an answer or a channel/connection close, and the
    broker goes on serving; no stored message of another client is touched.
    ``FUZZ_SEED`` and ``FUZZ_ROUNDS`` in the environment run other and longer rounds."""
    rng = random.Random(int(os.environ.get('FUZZ_SEED', '3131')))
    keeper = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    kch = keeper.channel()
    kept = kch.queue_declare("", exclusive=True).method.queue
    kch.confirm_delivery()
    kch.basic_publish("", kept, b"precious", pika.BasicProperties(delivery_mode=2))
    for _ in range(int(os.environ.get("FUZZ_ROUNDS", "40"))):
        raw = RawAmqp(amqp_broker.amqp_port)
        try:
            raw.handshake()
            raw.expect("Connection.OpenOk")
            raw.method(1, commands.Channel.Open())
            raw.expect("Channel.OpenOk")
            raw.send(b"".join(fuzz_frame(rng, rng.choice([1, 1, 1, 2])) for _ in range(6)))
            raw.method(0, commands.Connection.Close(200, "done", 0, 0))
            raw.sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ValueError, struct.error, PAMQPException):
                while raw.read() is not None:
                    pass
        finally:
            raw.close()
    assert kch.queue_declare(kept, passive=True).method.message_count == 1
    assert kch.basic_get(kept, auto_ack=True)[2] == b"precious"
    keeper.close()
    assert amqp_broker.proc is not None and amqp_broker.proc.poll() is None
    assert "Traceback" not in amqp_broker.log_path.read_text()
