"""What survives a broker restart, and a kill -9: exchanges, bindings and durable
queues (stored as the broker's own durable state), confirmed and committed messages."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

import txbroker
from tests.amqp.support import AmqpBroker
from tests.amqp.total_queue import TotalQueue
from tests.support import RawClient

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def connect(broker: AmqpBroker) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(broker.amqp_url))


def test_definitions_survive_a_restart_and_transient_ones_do_not(tmp_path: Path) -> None:
    broker = AmqpBroker(tmp_path / "data").start()
    try:
        conn = connect(broker)
        ch = conn.channel()
        ch.exchange_declare("orders", "topic", durable=True)
        ch.exchange_declare("scratch", "fanout", durable=False)
        ch.queue_declare("eu-orders", durable=True, arguments={"x-max-length": 100})
        ch.queue_declare("temp", durable=False)
        ch.queue_bind("eu-orders", "orders", "eu.#")
        ch.queue_bind("eu-orders", "orders", "gone.*")
        ch.queue_unbind("eu-orders", "orders", "gone.*")
        ch.confirm_delivery()
        ch.basic_publish("orders", "eu.fr.paris", b"kept", PERSISTENT)
        conn.close()
        broker.stop()
        broker.start()
        conn = connect(broker)
        ch = conn.channel()
        ch.exchange_declare("orders", "topic", passive=True)
        ok = ch.queue_declare("eu-orders", passive=True).method
        assert ok.message_count == 1
        # the same declaration is still equivalent (arguments were kept) ...
        ch.queue_declare("eu-orders", durable=True, arguments={"x-max-length": 100})
        # ... and the binding routes, the unbound key does not
        ch.confirm_delivery()
        ch.basic_publish("orders", "eu.de", b"routed", PERSISTENT)
        ch.basic_publish("orders", "gone.x", b"unrouted", PERSISTENT)
        assert [ch.basic_get("eu-orders", auto_ack=True)[2] for _ in range(3)] == \
            [b"kept", b"routed", None]
        for gone in (lambda c: c.exchange_declare("scratch", "fanout", passive=True),
                     lambda c: c.queue_declare("temp", passive=True)):
            with pytest.raises(ChannelClosedByBroker) as caught:
                gone(ch)
            assert caught.value.reply_code == 404
            ch = conn.channel()
        conn.close()
    finally:
        broker.kill()


def test_kill9_with_confirms_and_transactions_loses_nothing(tmp_path: Path) -> None:
    """Publishers with confirms and with tx.commit, and a consumer that acks in
    transactions and moves what it takes to another queue in the same transaction,
    run while the broker is killed with SIGKILL, three times; afterwards every
    confirmed or committed message is in exactly one place: 0 lost, 0 duplicated,
    0 unexpected, and each transaction whole (``total_queue.py``)."""
    broker = AmqpBroker(tmp_path / "data").start()
    work = TotalQueue()
    work.declare(broker.amqp_url)
    for cycle in range(3):
        work.cycle(broker.amqp_url, f"c{cycle}", 150 * (cycle + 1),
                   lambda: broker.kill(signal.SIGKILL))
        broker.start()
    tally = work.drain(broker.amqp_url)
    broker.kill()
    print(f"kill -9 via AMQP: {tally}")
    assert tally.confirmed, "nothing was confirmed: the test did not test"
    assert tally.moved, "the mover moved nothing: its transactions were not tested"
    assert (tally.lost, tally.duplicated, tally.unexpected) == (0, 0, 0)
    assert tally.broken_transactions == []  # a committed transaction is all there or none


def test_definitions_session_closed_by_an_administrator_comes_back(tmp_path: Path) -> None:
    """The broker's own session that stores the definitions is listed among the
    connections; closing it (an admin action) loses nothing: the next change opens a
    new one, and the definitions survive a restart."""
    broker = AmqpBroker(tmp_path / "data").start()
    try:
        raw = RawClient(broker.port)
        assert raw.call(1, "hello", version=1)[0] == 1
        listed = raw.call(2, "conn_list")[3]
        (internal,) = [c for c in listed if c["protocol"] == "amqp-definitions"]
        raw.call(3, "conn_close", id=internal["id"])
        conn = connect(broker)
        ch = conn.channel()
        ch.exchange_declare("after-close", "fanout", durable=True)
        conn.close()
        assert "the definitions session was closed; opened session" in \
            broker.log_path.read_text()
        broker.stop()
        broker.start()
        conn = connect(broker)
        conn.channel().exchange_declare("after-close", "fanout", passive=True)
        conn.close()
    finally:
        broker.kill()


def test_the_definitions_queue_is_guarded(tmp_path: Path) -> None:
    """AMQP clients cannot publish to the definitions queue; what another protocol
    sends there is dropped, and the definitions survive a restart."""
    broker = AmqpBroker(tmp_path / "data").start()
    try:
        conn = connect(broker)
        ch = conn.channel()
        ch.exchange_declare("guarded", "fanout", durable=True)
        with pytest.raises(ChannelClosedByBroker) as caught:
            ch.confirm_delivery()
            ch.basic_publish("", "$amqp.definitions", b"{}")
        assert caught.value.reply_code == 403
        conn.close()
        with txbroker.connect(broker.url, timeout=10) as native:
            native.send("$amqp.definitions", b"not a snapshot")
        broker.stop()
        broker.start()
        conn = connect(broker)
        conn.channel().exchange_declare("guarded", "fanout", passive=True)
        conn.close()
        assert "not a definitions snapshot" in broker.log_path.read_text()
    finally:
        broker.kill()


def test_dead_letter_exchange_survives_a_restart(tmp_path: Path) -> None:
    """A dead letter waiting in its queue's internal dead-letter queue when the broker
    is killed is routed after the restart; later ones too."""
    broker = AmqpBroker(tmp_path / "data").start()
    try:
        conn = connect(broker)
        ch = conn.channel()
        ch.exchange_declare("dlx", "fanout", durable=True)
        ch.queue_declare("parked", durable=True)
        ch.queue_bind("parked", "dlx")
        ch.queue_declare("work", durable=True, arguments={"x-dead-letter-exchange": "dlx"})
        ch.confirm_delivery()
        ch.basic_publish("", "work", b"one", PERSISTENT)
        method, _, _ = ch.basic_get("work")
        ch.basic_reject(method.delivery_tag, requeue=False)
        ch.basic_publish("", "work", b"two", PERSISTENT)  # a barrier for the reject
        conn.close()
        broker.kill(signal.SIGKILL)
        broker.start()
        conn = connect(broker)
        ch = conn.channel()
        method, _, _ = ch.basic_get("work")
        ch.basic_reject(method.delivery_tag, requeue=False)
        bodies = []
        for method, _, body in ch.consume("parked", auto_ack=True, inactivity_timeout=10):
            assert method is not None, f"dead-lettered: {bodies}"
            bodies.append(body)
            if len(bodies) == 2:
                break
        ch.cancel()
        assert sorted(bodies) == [b"one", b"two"]
        conn.close()
    finally:
        broker.kill()


def test_a_dead_letter_that_cannot_be_routed_in_is_dropped(tmp_path: Path) -> None:
    """A dead letter whose target queue is full (x-max-length, reject-publish) is
    dropped with a log line, once: the dead letters after it still flow."""
    broker = AmqpBroker(tmp_path / "data").start()
    try:
        conn = connect(broker)
        ch = conn.channel()
        ch.queue_declare("full", durable=True, arguments={"x-max-length": 1,
                                                          "x-overflow": "reject-publish"})
        ch.queue_declare("work", durable=True, arguments={
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "full"})
        ch.confirm_delivery()
        ch.basic_publish("", "full", b"occupant", PERSISTENT)
        for body in (b"lost", b"kept"):
            ch.basic_publish("", "work", body, PERSISTENT)
        method, _, body = ch.basic_get("work")
        assert body == b"lost"
        ch.basic_reject(method.delivery_tag, requeue=False)
        deadline = time.monotonic() + 10
        while "dead letter of queue 'work' dropped" not in broker.log_path.read_text():
            assert time.monotonic() < deadline, "the dead letter was not dropped"
            conn.sleep(0.05)
        assert ch.basic_get("full", auto_ack=True)[2] == b"occupant"  # room again
        method, _, body = ch.basic_get("work")
        assert body == b"kept"
        ch.basic_reject(method.delivery_tag, requeue=False)
        got = next(ch.consume("full", auto_ack=True, inactivity_timeout=10))
        ch.cancel()
        assert got[2] == b"kept"
        assert broker.log_path.read_text().count("dead letter of queue 'work' dropped") == 1
        conn.close()
    finally:
        broker.kill()


def test_drop_head_survives_a_restart_and_older_queues_take_it(tmp_path: Path) -> None:
    """A queue's overflow (drop-head, RabbitMQ's default) is durable; a queue stored
    before the edge did drop-head (core overflow "reject", no .maxlen dead-letter
    queue) takes what its arguments ask for at the next start."""
    broker = AmqpBroker(tmp_path / "data").start()
    try:
        conn = connect(broker)
        ch = conn.channel()
        ch.queue_declare("newer", durable=True, arguments={"x-max-length": 2})
        ch.queue_declare("older", durable=True, arguments={
            "x-max-length": 1, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dead"})
        ch.queue_declare("dead", durable=True)
        conn.close()
        with txbroker.connect(broker.url, reconnect=False) as native:  # as stored before
            native.update_queue("older", overflow="reject", overflow_queue="")
            assert native.queue_info("older")["settings"]["overflow"] == "reject"
        broker.stop()
        broker.start()
        with txbroker.connect(broker.url, reconnect=False) as native:
            for queue, queue_name_end in (("newer", ""), ("older", ".maxlen")):
                settings = native.queue_info(queue)["settings"]
                assert settings["overflow"] == "drop_head"
                assert settings["overflow_queue"].endswith(queue_name_end)
        conn = connect(broker)
        ch = conn.channel()
        ch.confirm_delivery()
        for body in (b"1", b"2", b"3"):
            ch.basic_publish("", "newer", body, PERSISTENT)
            ch.basic_publish("", "older", body, PERSISTENT)
        assert [ch.basic_get("newer", auto_ack=True)[2] for _ in range(3)] == [b"2", b"3", None]
        assert ch.basic_get("older", auto_ack=True)[2] == b"3"
        dead: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(dead) < 2:
            assert time.monotonic() < deadline, dead
            method, props, body = ch.basic_get("dead", auto_ack=True)
            if method is None:
                conn.sleep(0.05)
                continue
            assert props.headers["x-death"][0]["reason"] == "maxlen"
            dead.append(body)
        assert dead == [b"1", b"2"]
        conn.close()
    finally:
        broker.kill()
