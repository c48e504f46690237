"""The STOMP listener through raw frames: every command, ack mode, error and limit."""

from __future__ import annotations

import socket
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.stomp.support import StompBroker, StompClient
from txbroker.protocol.stomp import Frame
from txbroker.server.security.auth import hash_password

pytestmark = pytest.mark.timeout(60)

Connect = Callable[..., StompClient]


def send_persistent(client: StompClient, queue: str, body: bytes, **headers: str) -> None:
    client.call("SEND", {"destination": queue, "persistent": "true", **headers}, body)


def assert_error(client: StompClient, contains: str, receipt: str | None = None) -> Frame:
    frame = client.expect("ERROR")
    assert contains in frame.headers["message"], frame.headers["message"]
    if receipt is not None:
        assert frame.headers.get("receipt-id") == receipt
    client.expect_closed()
    return frame


def drain(connect: Connect, queue: str, expected: int) -> list[bytes]:
    with connect() as client:
        client.call("SUBSCRIBE", {"destination": queue, "id": "d", "ack": "client-individual"})
        bodies = []
        for _ in range(expected):
            message = client.messages(1)[0]
            bodies.append(message.body)
            client.send("ACK", {"id": message.headers["ack"]})
        client.no_message(0.2)
        client.disconnect()
    return bodies


# ---------------------------------------------------------------- connecting
@pytest.mark.parametrize(("offered", "agreed"), [
    ("1.2", "1.2"), ("1.0,1.1", "1.1"), ("1.1,1.2,2.0", "1.2"), (None, "1.0"),
])
def test_version_negotiation(stomp_broker: StompBroker, offered: str | None, agreed: str) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        headers = {"host": "whatever.example"}
        if offered is not None:
            headers["accept-version"] = offered
        client.send("CONNECT", headers)
        connected = client.expect("CONNECTED")
        assert connected.headers["version"] == agreed
        assert connected.headers["server"].startswith("txbroker/")
        assert connected.headers["session"]
        assert connected.headers["heart-beat"] == "0,0"


def test_stomp_command_and_no_host(stomp_broker: StompBroker) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        client.send("STOMP", {"accept-version": "1.2"})
        assert client.expect("CONNECTED").headers["version"] == "1.2"


def test_unsupported_version_is_refused(stomp_broker: StompBroker) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        client.send("CONNECT", {"accept-version": "2.0,3.1", "host": "x"})
        error = client.expect("ERROR")
        assert error.headers["version"] == "1.0,1.1,1.2"
        assert "Supported protocol versions" in error.headers["message"]
        client.expect_closed()


def test_frame_before_connect(stomp_broker: StompBroker) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        client.send_raw(b"SEND\ndestination:/queue/x\nreceipt:r1\n\nhi\x00")
        assert_error(client, "first frame must be CONNECT", "r1")


def test_connect_timeout(stomp_broker: StompBroker) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        started = time.monotonic()
        assert_error(client, "no CONNECT frame within 2 s")
        assert 1.5 < time.monotonic() - started < 6


def test_wrong_credentials(tmp_path: Path) -> None:
    users = tmp_path / "users.toml"
    users.write_text(f'[users]\nalice = "{hash_password("secret")}"\n')
    broker = StompBroker(tmp_path / "data", "--users", str(users)).start()
    try:
        with StompClient(broker.stomp_port) as bad:
            bad.send("CONNECT", {"accept-version": "1.2", "login": "alice", "passcode": "nope"})
            assert_error(bad, "wrong user or password")
        with StompClient(broker.stomp_port) as anonymous:
            anonymous.send("CONNECT", {"accept-version": "1.2"})
            assert_error(anonymous, "wrong user or password")
        with StompClient(broker.stomp_port) as good:
            good.connect(login="alice", passcode="secret")
            send_persistent(good, "/queue/auth", b"ok")
            good.disconnect()
    finally:
        broker.kill()


# ---------------------------------------------------------------- send / receive
def test_send_receive_headers_and_receipts(connect: Connect, queue: str) -> None:
    producer = connect()
    receipt = producer.call("SEND", {"destination": queue, "persistent": "true",
                                     "content-type": "text/plain", "x-odd": "a:b\nc\\d",
                                     "priority": "7"}, b"hello")
    assert receipt.command == "RECEIPT"
    consumer = connect()
    consumer.call("SUBSCRIBE", {"destination": queue, "id": "s1"})
    message = consumer.messages(1)[0]
    assert message.body == b"hello"
    headers = message.headers
    assert headers["destination"] == queue
    assert headers["subscription"] == "s1"
    assert headers["message-id"]
    assert headers["content-type"] == "text/plain"
    assert headers["x-odd"] == "a:b\nc\\d"  # escaped on the wire, decoded by the codec
    assert headers["priority"] == "7"
    assert headers["content-length"] == "5"
    assert "ack" not in headers and "redelivered" not in headers
    assert "persistent" not in headers and "receipt" not in headers


def test_binary_body_with_nul_bytes(connect: Connect, queue: str) -> None:
    body = bytes(range(256)) * 4 + b"\x00\x00end"
    client = connect()
    send_persistent(client, queue, body)
    client.call("SUBSCRIBE", {"destination": queue, "id": "1"})
    assert client.messages(1)[0].body == body


def test_body_up_to_nul_without_content_length(connect: Connect, queue: str) -> None:
    client = connect()
    client.send_raw(f"SEND\ndestination:{queue}\n\nno length here\x00".encode())
    client.call("SUBSCRIBE", {"destination": queue, "id": "1"})
    message = client.messages(1)[0]
    assert message.body == b"no length here"
    assert message.headers["content-length"] == "14"


def test_repeated_headers_first_wins(connect: Connect, queue: str) -> None:
    client = connect()
    client.send_raw(f"SEND\ndestination:{queue}\ndestination:/queue/elsewhere\n"
                    f"x-h:first\nx-h:second\nreceipt:r\n\nbody\x00".encode())
    client.expect("RECEIPT")
    client.call("SUBSCRIBE", {"destination": queue, "id": "1"})
    assert client.messages(1)[0].headers["x-h"] == "first"


def test_frames_split_across_reads_and_coalesced(connect: Connect, queue: str) -> None:
    client = connect()
    frames = b"".join(
        f"SEND\ndestination:{queue}\ncontent-length:3\n\nm{i:02d}\x00\n".encode()
        for i in range(20))
    client.send_raw(frames)  # many frames in one write
    one = f"SEND\r\ndestination:{queue}\r\nreceipt:slow\r\n\r\nbyte by byte\x00".encode()
    for index in range(len(one)):  # one frame in many writes
        client.send_raw(one[index:index + 1])
        time.sleep(0.001)
    client.expect("RECEIPT")
    client.call("SUBSCRIBE", {"destination": queue, "id": "1"})
    bodies = [m.body for m in client.messages(21)]
    assert bodies == [f"m{i:02d}".encode() for i in range(20)] + [b"byte by byte"]


def test_heartbeat_eols_between_frames_are_ignored(connect: Connect, queue: str) -> None:
    client = connect()
    client.send_raw(b"\n\r\n\n")
    client.send_raw(f"SEND\ndestination:{queue}\nreceipt:r\n\nx\x00\n\n\n".encode())
    client.expect("RECEIPT")


# ---------------------------------------------------------------- acknowledgement
def test_client_individual_ack_and_redelivery(connect: Connect, queue: str) -> None:
    producer = connect()
    for i in range(3):
        send_persistent(producer, queue, f"m{i}".encode())
    consumer = connect()
    consumer.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    messages = consumer.messages(3)
    assert all("ack" in m.headers for m in messages)
    consumer.call("ACK", {"id": messages[1].headers["ack"]})
    consumer.close()  # m0 and m2 were not acknowledged: redelivered
    again = connect()
    again.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    redelivered = again.messages(2)
    assert sorted(m.body for m in redelivered) == [b"m0", b"m2"]
    assert all(m.headers["redelivered"] == "true" for m in redelivered)
    again.no_message()


def test_an_ack_id_of_another_connection_names_nothing(connect: Connect, queue: str) -> None:
    """Tags restart at 1 on every connection: a client that failed over and acks with an
    id of its old connection must get an error, not ack the new connection's message."""
    producer = connect()
    for i in range(2):
        send_persistent(producer, queue, f"m{i}".encode())
    old = connect()
    old.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    stale = old.messages(2)[1].headers["ack"]  # m1's id on the old connection
    old.close()  # both come back
    new = connect()
    new.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    fresh = new.messages(2)
    assert stale.rsplit("-", 1)[1] == fresh[1].headers["ack"].rsplit("-", 1)[1]  # same tag
    assert stale != fresh[1].headers["ack"]
    new.send("ACK", {"id": stale, "receipt": "stale"})
    assert_error(new, f"delivery tag {stale} is not an unacked delivery", "stale")
    assert sorted(drain(connect, queue, 2)) == [b"m0", b"m1"]  # nothing was acked


def test_client_ack_is_cumulative(connect: Connect, queue: str) -> None:
    producer = connect()
    for i in range(4):
        send_persistent(producer, queue, f"m{i}".encode())
    consumer = connect()
    consumer.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client"})
    messages = consumer.messages(4)
    consumer.call("ACK", {"id": messages[2].headers["ack"]})  # acks m0, m1, m2
    # the acked ones are no longer acknowledgeable
    consumer.send("ACK", {"id": messages[0].headers["ack"], "receipt": "late"})
    assert_error(consumer, "delivery tag 1 is not an unacked delivery", "late")
    assert drain(connect, queue, 1) == [b"m3"]


def test_auto_ack(connect: Connect, queue: str) -> None:
    producer = connect()
    for i in range(5):
        send_persistent(producer, queue, f"m{i}".encode())
    consumer = connect()
    consumer.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "auto"})
    assert [m.body for m in consumer.messages(5)] == [f"m{i}".encode() for i in range(5)]
    consumer.disconnect()
    assert drain(connect, queue, 0) == []


def test_nack_redelivers(connect: Connect, queue: str) -> None:
    client = connect()
    send_persistent(client, queue, b"again")
    client.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    first = client.messages(1)[0]
    assert "redelivered" not in first.headers
    client.call("NACK", {"id": first.headers["ack"]})
    second = client.messages(1)[0]
    assert second.body == b"again"
    assert second.headers["redelivered"] == "true"
    assert second.headers["message-id"] == first.headers["message-id"]
    client.call("ACK", {"id": second.headers["ack"]})


def test_prefetch_count_limits_unacked(connect: Connect, queue: str) -> None:
    producer = connect()
    for i in range(5):
        send_persistent(producer, queue, f"m{i}".encode())
    consumer = connect()
    consumer.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual",
                                "prefetch-count": "2"})
    first = consumer.messages(2)
    consumer.no_message()
    consumer.send("ACK", {"id": first[0].headers["ack"]})
    assert consumer.messages(1)[0].body == b"m2"
    consumer.no_message()


def test_stomp_10_and_11_ack_by_message_id(connect: Connect, queue: str) -> None:
    producer = connect()
    for i in range(2):
        send_persistent(producer, queue, f"m{i}".encode())
    old = connect("1.0")
    old.send("SUBSCRIBE", {"destination": queue, "ack": "client"})
    message = old.messages(1)[0]
    old.call("ACK", {"message-id": message.headers["message-id"]})
    old.call("UNSUBSCRIBE", {"destination": queue})
    old.disconnect()
    middle = connect("1.1")
    middle.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    message = middle.messages(1)[0]
    assert message.body == b"m1"
    middle.call("ACK", {"message-id": message.headers["message-id"], "subscription": "s"})
    middle.disconnect()
    assert drain(connect, queue, 0) == []


def test_unsubscribe_returns_unacked(connect: Connect, queue: str) -> None:
    client = connect()
    send_persistent(client, queue, b"x")
    client.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client"})
    client.messages(1)
    client.call("UNSUBSCRIBE", {"id": "s"})
    client.call("SUBSCRIBE", {"destination": queue, "id": "s2", "ack": "client"})
    assert client.messages(1)[0].headers["redelivered"] == "true"


# ---------------------------------------------------------------- transactions
def test_transaction_sends_commit_and_abort(connect: Connect, queue: str) -> None:
    consumer = connect()
    consumer.call("SUBSCRIBE", {"destination": queue, "id": "s"})
    producer = connect()
    producer.call("BEGIN", {"transaction": "t1"})
    for i in range(3):
        producer.send("SEND", {"destination": queue, "transaction": "t1", "persistent": "true"},
                      f"t1-{i}".encode())
    consumer.no_message()  # nothing is visible before COMMIT
    producer.call("COMMIT", {"transaction": "t1"})
    assert [m.body for m in consumer.messages(3)] == [b"t1-0", b"t1-1", b"t1-2"]
    producer.call("BEGIN", {"transaction": "t2"})
    producer.send("SEND", {"destination": queue, "transaction": "t2"}, b"never")
    producer.call("ABORT", {"transaction": "t2"})
    consumer.no_message()
    # a transaction left open when the connection ends is rolled back
    producer.call("BEGIN", {"transaction": "t3"})
    producer.call("SEND", {"destination": queue, "transaction": "t3"}, b"never either")
    producer.disconnect()
    consumer.no_message()


def test_transaction_acks_commit_and_abort(connect: Connect, queue: str) -> None:
    producer = connect()
    for i in range(2):
        send_persistent(producer, queue, f"m{i}".encode())
    consumer = connect()
    consumer.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    first, second = consumer.messages(2)
    consumer.call("BEGIN", {"transaction": "a"})
    consumer.call("ACK", {"id": first.headers["ack"], "transaction": "a"})
    consumer.call("ABORT", {"transaction": "a"})  # the ack is undone: m0 comes again
    again = consumer.messages(1)[0]
    assert again.body == b"m0" and again.headers["redelivered"] == "true"
    consumer.call("BEGIN", {"transaction": "b"})
    consumer.send("ACK", {"id": again.headers["ack"], "transaction": "b"})
    consumer.send("ACK", {"id": second.headers["ack"], "transaction": "b"})
    consumer.send("SEND", {"destination": queue + ".out", "transaction": "b",
                           "persistent": "true"}, b"moved")
    consumer.call("COMMIT", {"transaction": "b"})
    consumer.disconnect()
    assert drain(connect, queue, 0) == []
    assert drain(connect, queue + ".out", 1) == [b"moved"]


# ---------------------------------------------------------------- topics
def test_topic_copies_to_each_subscriber(connect: Connect) -> None:
    topic = f"/topic/news-{uuid.uuid4().hex[:8]}"
    publisher = connect()
    publisher.call("SEND", {"destination": topic}, b"before anyone listens")
    first, second = connect(), connect()
    first.call("SUBSCRIBE", {"destination": topic, "id": "a"})
    second.call("SUBSCRIBE", {"destination": topic, "id": "b", "ack": "client-individual"})
    publisher.call("SEND", {"destination": topic, "persistent": "true"}, b"one")
    one = first.messages(1)[0]
    assert one.body == b"one" and one.headers["destination"] == topic
    two = second.messages(1)[0]
    assert two.body == b"one" and two.headers["subscription"] == "b"
    first.call("UNSUBSCRIBE", {"id": "a"})
    publisher.call("SEND", {"destination": topic}, b"two")
    assert second.messages(1)[0].body == b"two"
    first.no_message()


def test_durable_topic_subscription(connect: Connect) -> None:
    topic = f"/topic/durable-{uuid.uuid4().hex[:8]}"
    subscriber = connect()
    headers = {"destination": topic, "id": "d", "ack": "client-individual",
               "durable-subscription-name": "keeper"}
    subscriber.call("SUBSCRIBE", headers)
    subscriber.disconnect()
    publisher = connect()
    publisher.call("SEND", {"destination": topic, "persistent": "true"}, b"kept for you")
    back = connect()
    back.call("SUBSCRIBE", headers)
    message = back.messages(1)[0]
    assert message.body == b"kept for you"
    back.call("ACK", {"id": message.headers["ack"]})
    back.call("UNSUBSCRIBE", {"id": "d", "durable-subscription-name": "keeper"})  # deleted
    publisher.call("SEND", {"destination": topic, "persistent": "true"}, b"nobody")
    back.call("SUBSCRIBE", {**headers, "id": "e"})
    back.no_message()


def test_queue_and_topic_names_do_not_mix(connect: Connect, queue: str) -> None:
    name = queue.removeprefix("/queue/")
    client = connect()
    send_persistent(client, queue, b"q")
    client.send("SEND", {"destination": f"/topic/{name}", "receipt": "r"}, b"t")
    assert_error(client, "is a queue", "r")


# ---------------------------------------------------------------- errors
ERROR_CASES = [
    # (raw frame after CONNECT, text the ERROR message contains, receipt-id)
    (b"FOO\nreceipt:r1\n\n\x00", "unknown command 'FOO'", None),
    (b"SEND\nreceipt:r2\n\nbody\x00", "missing the required header 'destination'", "r2"),
    (b"SEND\ndestination:/queue/x\nx-bad:a\\tb\nreceipt:r3\n\n\x00", "undefined escape", "r3"),
    (b"SEND\ndestination:/queue/x\ncontent-length:9000000\nreceipt:r4\n\n", "max frame size",
     "r4"),
    (b"UNSUBSCRIBE\nid:nope\nreceipt:r5\n\n\x00", "unknown subscription 'nope'", "r5"),
    (b"ACK\nid:12345\nreceipt:r6\n\n\x00", "delivery tag 12345 is not an unacked delivery",
     "r6"),
    (b"SEND\ndestination:/queue/x\ntransaction:nope\nreceipt:r7\n\nx\x00",
     "unknown transaction 'nope'", "r7"),
    (b"COMMIT\ntransaction:nope\nreceipt:r8\n\n\x00", "unknown transaction 'nope'", "r8"),
    (b"BEGIN\ntransaction:t\n\n\x00BEGIN\ntransaction:t\nreceipt:r9\n\n\x00", "already open",
     "r9"),
    (b"SEND\ndestination:/elsewhere/x\nreceipt:r10\n\n\x00", "unsupported destination", "r10"),
    (b"SUBSCRIBE\ndestination:/queue/x\nid:1\nack:sometimes\nreceipt:r11\n\n\x00",
     "ack must be auto, client or client-individual", "r11"),
    (b"ACK\nid:1\nreceipt:r12\n\nbody\x00", "must not have a body", "r12"),
    (b"CONNECT\naccept-version:1.2\n\n\x00", "already connected", None),
    (b"SEND\ndestination:/queue/x\ncontent-length:2\nreceipt:r13\n\nabc\x00",
     "not followed by NUL", "r13"),
    (b"SEND\ndestination:/queue/\nreceipt:r14\n\n\x00", "empty name", "r14"),
    (b"SUBSCRIBE\ndestination:/queue/x\nid:1\nprefetch-count:lots\n\n\x00",
     "prefetch-count must be a positive integer", None),
    (b"SEND\ndestination:/queue/x\n" + b"".join(b"h%d:v\n" % i for i in range(1001)) + b"\n\x00",
     "max headers", None),
    (b"SEND\ndestination:/queue/x\nbig:" + b"v" * 11000 + b"\n\n\x00", "max header size", None),
    (b"SEND\ndestination:/queue/x\nno colon here\n\n\x00", "malformed header line", None),
]


@pytest.mark.parametrize(("raw", "message", "receipt"), ERROR_CASES,
                         ids=[case[1][:30] for case in ERROR_CASES])
def test_errors_are_precise_and_harmless(connect: Connect, queue: str, raw: bytes, message: str,
                                         receipt: str | None) -> None:
    keeper = connect()
    send_persistent(keeper, queue, b"precious")
    keeper.call("SUBSCRIBE", {"destination": queue, "id": "k", "ack": "client-individual"})
    held = keeper.messages(1)[0]
    bad = connect()
    bad.call("BEGIN", {"transaction": "open"})
    bad.send("SEND", {"destination": queue, "transaction": "open"}, b"never committed")
    bad.send_raw(raw)
    assert_error(bad, message, receipt)
    # nothing stored was harmed: the held message is still ours to ack, the
    # open transaction was rolled back, the broker serves others
    keeper.call("ACK", {"id": held.headers["ack"]})
    send_persistent(keeper, queue, b"after")
    assert keeper.messages(1)[0].body == b"after"


def test_error_after_valid_frames_in_one_read(connect: Connect, queue: str) -> None:
    client = connect()
    client.send_raw(f"SEND\ndestination:{queue}\npersistent:true\nreceipt:ok\n\nfirst\x00"
                    f"BOGUS\n\n\x00".encode())
    frames = [client.read(), client.read()]
    commands = sorted(f.command for f in frames if f is not None)
    assert commands == ["ERROR", "RECEIPT"] or commands == ["ERROR"]
    client.expect_closed()
    assert drain(connect, queue, 1) == [b"first"]  # the valid SEND before it counts


# ---------------------------------------------------------------- disconnect / vanish
def test_disconnect_receipt_means_everything_is_durable(connect: Connect, queue: str,
                                                        stomp_broker: StompBroker) -> None:
    client = connect()
    for i in range(200):
        client.send("SEND", {"destination": queue, "persistent": "true"}, b"%d" % i)
    client.call("DISCONNECT")
    client.expect_closed()
    assert len(drain(connect, queue, 200)) == 200


def test_client_vanishing_mid_frame(connect: Connect, queue: str,
                                    stomp_broker: StompBroker) -> None:
    producer = connect()
    send_persistent(producer, queue, b"in flight")
    doomed = connect()
    doomed.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    doomed.messages(1)
    doomed.call("BEGIN", {"transaction": "t"})
    doomed.send("SEND", {"destination": queue, "transaction": "t"}, b"half-done")
    doomed.send_raw(f"SEND\ndestination:{queue}\ncontent-length:100\n\nonly part".encode())
    doomed.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    doomed.close()  # RST, mid-frame
    other = connect()
    other.call("SUBSCRIBE", {"destination": queue, "id": "s", "ack": "client-individual"})
    message = other.messages(1)[0]
    assert message.body == b"in flight" and message.headers["redelivered"] == "true"
    other.no_message()
    assert stomp_broker.alive()


# ---------------------------------------------------------------- heart-beats
def test_server_sends_heartbeats(stomp_broker: StompBroker) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        connected = client.connect(**{"heart-beat": "0,150"})
        assert connected.headers["heart-beat"] == "150,0"
        client.sock.settimeout(2)
        received = b""
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:
            received += client.sock.recv(100)
        assert 3 <= received.count(b"\n") <= 12, received


def test_silent_client_is_dropped(stomp_broker: StompBroker) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        connected = client.connect(**{"heart-beat": "120,0"})
        assert connected.headers["heart-beat"] == "0,120"
        started = time.monotonic()
        error = client.expect("ERROR", timeout=5)
        assert "no heart-beat from the client" in error.headers["message"]
        client.expect_closed()
        assert 0.2 <= time.monotonic() - started < 2.0  # 120 ms x grace 2.0


def test_client_that_beats_stays_connected(stomp_broker: StompBroker, queue: str) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        client.connect(**{"heart-beat": "100,0"})
        for _ in range(8):
            time.sleep(0.1)
            client.send_raw(b"\n")
        client.call("SEND", {"destination": queue}, b"still here")


def test_heartbeat_floor_applies(stomp_broker: StompBroker) -> None:
    with StompClient(stomp_broker.stomp_port) as client:
        connected = client.connect(**{"heart-beat": "1,1"})
        assert connected.headers["heart-beat"] == "100,100"  # the test broker's floor
        client.disconnect()
