"""Users and ACLs over STOMP (issue 16), with stomp.py against a real broker: the
same check as the native path (``tests/server/test_acl.py``), each refusal an
ERROR frame (``message:forbidden …``, body ``FORBIDDEN: …``) and then the close,
as every STOMP refusal; nothing changes in the broker, and the audit lines say
``"protocol": "stomp"``.

STOMP has no browse and no admin frames: those permissions are checked on the
native path (and HTTP); here a browse-only user cannot SUBSCRIBE.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import stomp

import txbroker
from tests.server.test_acl import ACL, PASSWORD, Audit, event, forbidden, users_toml
from tests.stomp.support import StompEvents
from tests.support import BrokerProcess, free_port
from txbroker.errors import NotFound

pytestmark = pytest.mark.timeout(120)
WAIT = 10.0


class Collector(StompEvents):
    """Every event on one queue: ("connected"|"message"|"receipt"|"error"|…, frame)."""

    def next(self) -> tuple[str, Any]:
        """The next event (heart-beat-free)."""
        return self.events.get(timeout=WAIT)


class Broker:
    """The broker process, its STOMP port and audit file."""

    def __init__(self, proc: BrokerProcess, stomp_port: int, audit: Audit) -> None:
        self.proc = proc
        self.stomp_port = stomp_port
        self.audit = audit

    def connect(self, user: str, password: str = PASSWORD) -> tuple[stomp.Connection12,
                                                                     Collector]:
        conn = stomp.Connection12([("127.0.0.1", self.stomp_port)], reconnect_attempts_max=1,
                                  timeout=5, auto_decode=False)
        listener = Collector()
        conn.set_listener("collector", listener)
        conn.connect(user, password, wait=False)
        return conn, listener

    def native(self) -> txbroker.Connection:
        return txbroker.connect(f"txb://root:{PASSWORD}@127.0.0.1:{self.proc.port}",
                                reconnect=False)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    base = tmp_path_factory.mktemp("acl-stomp")
    audit_path = base / "audit.jsonl"
    config = base / "broker.toml"
    config.write_text(f'[server]\naudit_log = "{audit_path}"\n\n' + users_toml() + ACL)
    stomp_port = free_port()
    with BrokerProcess(base / "data", "--config", str(config), "--stomp-port",
                       str(stomp_port)) as proc:
        yield Broker(proc, stomp_port, Audit(audit_path))


@pytest.fixture
def audit(broker: Broker) -> Audit:
    broker.audit.take()
    return broker.audit


def name(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


def expect_connected(listener: Collector) -> None:
    kind, frame = listener.next()
    assert kind == "connected", (kind, frame and frame.headers)


def expect_forbidden(listener: Collector, message: str, receipt: str | None = None) -> None:
    """ERROR with that message (and receipt-id), body ``FORBIDDEN: …``, then close."""
    kind, frame = listener.next()
    assert kind == "error", (kind, frame and frame.headers)
    assert frame.headers["message"] == message
    assert frame.headers.get("receipt-id") == receipt
    assert frame.body == f"FORBIDDEN: {message}\n".encode()
    kind, _ = listener.next()
    assert kind == "disconnected"


def expect_receipt(listener: Collector, receipt: str) -> None:
    kind, frame = listener.next()
    assert (kind, frame.headers.get("receipt-id")) == ("receipt", receipt)


def test_send(broker: Broker, audit: Audit) -> None:
    allowed, refused = name("orders"), name("billing")
    conn, listener = broker.connect("alice")
    expect_connected(listener)
    conn.send(f"/queue/{allowed}", b"ok", headers={"persistent": "true", "receipt": "r1"})
    expect_receipt(listener, "r1")
    conn.send(f"/queue/{refused}", b"no", headers={"persistent": "true", "receipt": "r2"})
    expect_forbidden(listener, forbidden("alice", "send", repr(refused), "send"), "r2")
    conn, listener = broker.connect("carol")  # matching pattern, no send permission
    expect_connected(listener)
    conn.send(f"/queue/{allowed}", b"no")
    expect_forbidden(listener, forbidden("carol", "send", repr(allowed), "send"))
    with broker.native() as root:
        assert root.queue_info(allowed)["depth"] == 1
        with pytest.raises(NotFound):
            root.queue_info(refused)
    assert audit.take() == [event("alice", "send", "send", refused, "denied", "stomp"),
                            event("carol", "send", "send", allowed, "denied", "stomp")]


def test_send_to_a_new_topic(broker: Broker, audit: Audit) -> None:
    """A topic made on first SEND needs send on it, not admin; a refused one is not made."""
    allowed, refused = name("orders"), name("billing")
    conn, listener = broker.connect("alice")
    expect_connected(listener)
    conn.send(f"/topic/{allowed}", b"ok", headers={"receipt": "t1"})
    expect_receipt(listener, "t1")
    conn.send(f"/topic/{refused}", b"no", headers={"receipt": "t2"})
    expect_forbidden(listener, forbidden("alice", "send", repr(refused), "declare_topic"), "t2")
    with broker.native() as root:
        assert root.queue_info(allowed)["kind"] == "topic"
        with pytest.raises(NotFound):
            root.queue_info(refused)
    assert audit.take() == [
        event("alice", "send", "declare_topic", refused, "denied", "stomp")]


def test_subscribe(broker: Broker, audit: Audit) -> None:
    allowed, refused = name("orders"), name("billing")
    with broker.native() as root:
        root.send(allowed, b"m1")
        root.send(refused, b"m2")
    conn, listener = broker.connect("carol")
    expect_connected(listener)
    conn.subscribe(f"/queue/{allowed}", id="s1", ack="client-individual")
    kind, frame = listener.next()
    assert (kind, frame.body) == ("message", b"m1")
    conn.ack(frame.headers["ack"], receipt="a1")
    expect_receipt(listener, "a1")
    conn.subscribe(f"/queue/{refused}", id="s2", headers={"receipt": "s2"})
    expect_forbidden(listener, forbidden("carol", "consume", repr(refused), "subscribe"), "s2")
    for user in ("alice", "bob"):  # send, browse on orders.*: no consume
        conn, listener = broker.connect(user)
        expect_connected(listener)
        conn.subscribe(f"/queue/{allowed}", id="s")
        expect_forbidden(listener, forbidden(user, "consume", repr(allowed), "subscribe"))
    with broker.native() as root:
        assert root.queue_info(refused)["depth"] == 1
        info = root.queue_info(allowed)  # acked (the receipt came once durable)
        assert (info["depth"], info["in_flight"]) == (0, 0)
    assert audit.take() == [
        event("carol", "consume", "subscribe", refused, "denied", "stomp"),
        event("alice", "consume", "subscribe", allowed, "denied", "stomp"),
        event("bob", "consume", "subscribe", allowed, "denied", "stomp")]


def test_topic_subscriptions(broker: Broker, audit: Audit) -> None:
    allowed, refused = name("orders"), name("billing")
    conn, listener = broker.connect("carol")
    expect_connected(listener)
    conn.subscribe(f"/topic/{allowed}", id="t1", headers={"receipt": "t1"})
    expect_receipt(listener, "t1")
    conn.subscribe(f"/topic/{allowed}", id="t2",
                   headers={"durable-subscription-name": "d", "receipt": "t2"})
    expect_receipt(listener, "t2")
    conn.unsubscribe("t2", headers={"durable-subscription-name": "d", "receipt": "u2"})
    expect_receipt(listener, "u2")
    conn.subscribe(f"/topic/{refused}", id="t3", headers={"receipt": "t3"})
    expect_forbidden(listener, forbidden("carol", "consume", repr(refused), "declare_topic"),
                     "t3")
    with broker.native() as root:
        with pytest.raises(NotFound):
            root.queue_info(refused)
        with pytest.raises(NotFound):  # the durable subscription was deleted by its owner
            root.queue_info(f"{allowed}::d")
    assert audit.take() == [
        event("carol", "consume", "declare_topic", refused, "denied", "stomp")]


def test_wrong_password(broker: Broker, audit: Audit) -> None:
    _, listener = broker.connect("alice", "wrong")
    kind, frame = listener.next()
    assert kind == "error"
    assert frame.headers["message"] == "wrong user or password"
    assert frame.body == b"AUTHENTICATION_FAILED: wrong user or password\n"
    assert audit.take() == [event("alice", "login", "authenticate", None, "denied", "stomp")]

