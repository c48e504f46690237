"""Interop with a real client, unchanged: stomp.py 9 (threaded).

Every wait is bounded: stomp.py's ``connect(wait=True)`` and
``disconnect(receipt=…)`` can block forever (shared/NOTES.md), so the tests
wait on their own queues with timeouts.
"""

from __future__ import annotations

import contextlib
import queue
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import stomp
from stomp.exception import ConnectFailedException

from tests.stomp.support import StompBroker, StompEvents

pytestmark = pytest.mark.timeout(60)
WAIT = 10.0


class Collector(StompEvents):
    """Puts every event on one queue: ("message"|"receipt"|"error"|…, frame)."""

    def next(self, kind: str, timeout: float = WAIT) -> Any:
        """The next event of ``kind`` (others before it are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind} event")
            got, frame = self.events.get(timeout=left)
            if got == kind:
                return frame
            if got == "error" and kind != "error":
                raise AssertionError(f"ERROR frame: {frame.headers} {frame.body!r}")

    def messages(self, count: int) -> list[Any]:
        return [self.next("message") for _ in range(count)]

    def nothing(self, kind: str = "message", wait: float = 0.3) -> None:
        with contextlib.suppress(TimeoutError, queue.Empty):
            frame = self.next(kind, wait)
            raise AssertionError(f"unexpected {kind}: {frame}")


Conn = tuple[stomp.Connection12, Collector]


@pytest.fixture
def open_conn(stomp_broker: StompBroker) -> Iterator[Any]:
    made: list[stomp.Connection12] = []

    def make(ports: list[int] | None = None, **options: Any) -> Conn:
        hosts = [("127.0.0.1", p) for p in (ports or [stomp_broker.stomp_port])]
        connect_headers = options.pop("connect_headers", None)
        conn = stomp.Connection12(hosts, reconnect_attempts_max=1, timeout=5, **options)
        listener = Collector()
        conn.set_listener("collector", listener)
        conn.connect(wait=False, headers=connect_headers)
        listener.next("connected")
        made.append(conn)
        return conn, listener

    yield make
    for conn in made:
        with contextlib.suppress(Exception):
            conn.disconnect()


def dest() -> str:
    return f"/queue/py-{uuid.uuid4().hex[:10]}"


def send_with_receipt(conn: Conn, destination: str, body: str | bytes, **headers: str) -> None:
    connection, listener = conn
    receipt = uuid.uuid4().hex
    connection.send(destination, body, headers={"persistent": "true", "receipt": receipt,
                                                **headers})
    assert listener.next("receipt").headers["receipt-id"] == receipt


def test_send_receive_and_receipts(open_conn: Any) -> None:
    queue_name = dest()
    producer = open_conn()
    send_with_receipt(producer, queue_name, "hello from stomp.py", **{"x-trace": "a:b"})
    consumer, events = open_conn()
    consumer.subscribe(queue_name, id="s1", ack="auto")
    message = events.next("message")
    assert message.body == "hello from stomp.py"
    assert message.headers["destination"] == queue_name
    assert message.headers["subscription"] == "s1"
    assert message.headers["x-trace"] == "a:b"


def test_binary_bodies(open_conn: Any) -> None:
    queue_name = dest()
    body = bytes(range(256)) + b"\x00\x00tail"
    producer = open_conn(auto_decode=False)
    send_with_receipt(producer, queue_name, body)
    consumer, events = open_conn(auto_decode=False)
    consumer.subscribe(queue_name, id="b", ack="client-individual")
    message = events.next("message")
    assert message.body == body
    consumer.ack(message.headers["ack"])


def test_client_individual_and_cumulative_ack(open_conn: Any) -> None:
    queue_name = dest()
    producer = open_conn()
    for i in range(6):
        send_with_receipt(producer, queue_name, f"m{i}")
    consumer, events = open_conn()
    consumer.subscribe(queue_name, id="c", ack="client-individual")
    messages = events.messages(3)  # m0..m2 first, then ...
    consumer.ack(messages[1].headers["ack"])  # only m1
    rest = events.messages(3)
    consumer.unsubscribe("c")  # m0, m2, m3.. come back
    consumer.subscribe(queue_name, id="d", ack="client")
    back = events.messages(5)
    assert sorted(m.body for m in back) == ["m0", "m2", "m3", "m4", "m5"]
    assert all(m.headers.get("redelivered") == "true" for m in back)
    last = max(back, key=lambda m: int(m.headers["ack"].rsplit("-", 1)[1]))  # prefix-tag
    receipt = uuid.uuid4().hex
    consumer.ack(last.headers["ack"], receipt=receipt)  # cumulative: all five
    assert events.next("receipt").headers["receipt-id"] == receipt
    del rest
    consumer.disconnect()
    checker, check_events = open_conn()
    checker.subscribe(queue_name, id="e", ack="auto")
    check_events.nothing()


def test_nack_and_redelivery(open_conn: Any) -> None:
    queue_name = dest()
    conn = open_conn()
    send_with_receipt(conn, queue_name, "retry me")
    consumer, events = conn
    consumer.subscribe(queue_name, id="n", ack="client-individual")
    first = events.next("message")
    consumer.nack(first.headers["ack"])
    second = events.next("message")
    assert second.body == "retry me"
    assert second.headers["redelivered"] == "true"
    consumer.ack(second.headers["ack"])


def test_transactions_with_sends_and_acks(open_conn: Any) -> None:
    queue_name, out_name = dest(), dest()
    producer, producer_events = open_conn()
    tx = producer.begin()
    producer.send(queue_name, "a", transaction=tx, headers={"persistent": "true"})
    producer.send(queue_name, "b", transaction=tx, headers={"persistent": "true"})
    consumer, events = open_conn()
    consumer.subscribe(queue_name, id="t", ack="client-individual")
    events.nothing()  # not visible before COMMIT
    producer.commit(tx, headers={"receipt": "c1"})
    assert producer_events.next("receipt").headers["receipt-id"] == "c1"
    a, b = events.messages(2)
    aborted = producer.begin()
    producer.send(queue_name, "never", transaction=aborted)
    producer.abort(aborted)
    # consume a and b in a transaction that also sends: abort, then commit
    tx2 = consumer.begin()
    consumer.ack(a.headers["ack"], transaction=tx2)
    consumer.abort(tx2)
    again = events.next("message")
    assert again.body == "a" and again.headers["redelivered"] == "true"
    tx3 = consumer.begin()
    consumer.ack(again.headers["ack"], transaction=tx3)
    consumer.ack(b.headers["ack"], transaction=tx3)
    consumer.send(out_name, "derived", transaction=tx3, headers={"persistent": "true"})
    consumer.commit(tx3, headers={"receipt": "c3"})
    assert events.next("receipt").headers["receipt-id"] == "c3"
    events.nothing()  # "never" was aborted, a and b are acknowledged
    reader, reader_events = open_conn()
    reader.subscribe(out_name, id="o", ack="auto")
    assert reader_events.next("message").body == "derived"


def test_heartbeats_keep_the_connection(open_conn: Any) -> None:
    conn, events = open_conn(heartbeats=(150, 150))
    time.sleep(1.2)  # idle: both sides beat
    assert events.heartbeats >= 4
    assert events.heartbeat_timeouts == 0
    send_with_receipt((conn, events), dest(), "alive")


def test_silent_client_is_dropped_after_grace(open_conn: Any) -> None:
    # the client promises beats every 150 ms but its own heart-beating is off
    _conn, events = open_conn(connect_headers={"heart-beat": "150,0"})
    started = time.monotonic()
    error = events.next("error", timeout=5)
    assert "no heart-beat" in error.headers["message"]
    events.next("disconnected", timeout=5)
    assert time.monotonic() - started < 3


def test_host_and_ports_failover(tmp_path: Path) -> None:
    first = StompBroker(tmp_path / "a").start()
    second = StompBroker(tmp_path / "b").start()
    conns: list[stomp.Connection12] = []
    try:
        hosts = [("127.0.0.1", first.stomp_port), ("127.0.0.1", second.stomp_port)]
        conn = stomp.Connection12(hosts, reconnect_attempts_max=2, reconnect_sleep_initial=0.05,
                                  timeout=3)
        conns.append(conn)
        events = Collector()
        conn.set_listener("c", events)
        conn.connect(wait=False)
        events.next("connected")
        assert conn.transport.current_host_and_port[1] == first.stomp_port
        first.kill()  # the broker dies under the client
        events.next("disconnected")
        # stomp.py does not reconnect by itself: the application connects again
        deadline = time.monotonic() + WAIT
        while True:
            try:
                conn.connect(wait=False)
                events.next("connected", timeout=3)
                break
            except (ConnectFailedException, TimeoutError):
                if time.monotonic() > deadline:
                    raise
        assert conn.transport.current_host_and_port[1] == second.stomp_port
        queue_name = dest()
        conn.subscribe(queue_name, id="f", ack="client-individual")
        producer = stomp.Connection12([("127.0.0.1", second.stomp_port)], timeout=3)
        conns.append(producer)
        producer_events = Collector()
        producer.set_listener("p", producer_events)
        producer.connect(wait=False)
        producer_events.next("connected")
        send_with_receipt((producer, producer_events), queue_name, "via the second broker")
        message = events.next("message")
        assert message.body == "via the second broker"
        conn.ack(message.headers["ack"])
    finally:
        for each in conns:
            with contextlib.suppress(Exception):
                each.disconnect()
        first.kill()
        second.kill()
