"""AMQP in HA: on a shared-store pair and a replicated group only the active broker
(the primary) listens on the AMQP port; after a kill -9 of it, the standby (a
promoted backup) opens its port, and the exchanges, bindings and confirmed messages
are there (and, replicated, a drop-head queue's overflow setting and drops)."""

from __future__ import annotations

import functools
import socket
from pathlib import Path

import pika
import pytest

from tests.amqp.total_queue import TotalQueue
from tests.ha_support import READY_PREFIX, HaPair
from tests.replicated_support import Group
from tests.support import free_port

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def test_failover_keeps_definitions_and_confirmed_messages(tmp_path: Path) -> None:
    amqp_port = free_port()
    url = f"amqp://guest:guest@127.0.0.1:{amqp_port}/"
    # the same AMQP port on both nodes (the later --amqp-port wins): a standby that
    # opened it would fail to start, as the active holds it; the standby opens it only
    # when it takes over, as with every client port
    with HaPair(tmp_path, "--amqp-port", str(amqp_port)) as pair:
        first = pair.active()
        assert any(line.startswith(READY_PREFIX) and f"AMQP {amqp_port}" in line
                   for line in first.lines())
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        ch.exchange_declare("ha-x", "direct", durable=True)
        ch.queue_declare("ha-q", durable=True)
        ch.queue_bind("ha-q", "ha-x", "k")
        ch.confirm_delivery()
        for i in range(10):
            ch.basic_publish("ha-x", "k", b"%d" % i, PERSISTENT)
        pair.kill9(first)
        new = pair.active()
        assert new is not first
        assert any(line.startswith(READY_PREFIX) and f"AMQP {amqp_port}" in line
                   for line in new.lines())
        conn2 = pika.BlockingConnection(pika.URLParameters(url))
        ch2 = conn2.channel()
        ch2.exchange_declare("ha-x", "direct", passive=True)
        ch2.confirm_delivery()
        ch2.basic_publish("ha-x", "k", b"after", PERSISTENT)
        got = [ch2.basic_get("ha-q", auto_ack=True)[2] for _ in range(12)]
        assert got == [b"%d" % i for i in range(10)] + [b"after", None]
        conn2.close()
        # the old active comes back as the standby while the new active holds the port
        pair.restart(first)
        assert pair.standby() is first


def test_replicated_backup_refuses_then_serves_after_promotion(tmp_path: Path) -> None:
    """A replicated group of two, each with its own AMQP port: the backup's port is
    closed (a client with several hosts moves on); definitions and confirmed
    messages written through the primary are on the backup when it is promoted."""
    ports = {"a": free_port(), "b": free_port()}
    group = Group(tmp_path / "group", 2,
                  node_args={name: ["--amqp-port", str(port)] for name, port in ports.items()})
    with group:
        a, b = group.nodes
        assert group.primary() is a
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", ports["b"]), timeout=5)
        conn = pika.BlockingConnection(pika.URLParameters(
            f"amqp://guest:guest@127.0.0.1:{ports['a']}/"))
        ch = conn.channel()
        ch.exchange_declare("rep-x", "topic", durable=True)
        ch.queue_declare("rep-q", durable=True)
        ch.queue_bind("rep-q", "rep-x", "orders.#")
        ch.queue_declare("rep-cap", durable=True, arguments={"x-max-length": 3})  # drop-head
        ch.confirm_delivery()
        for i in range(10):
            ch.basic_publish("rep-x", "orders.eu", b"%d" % i, PERSISTENT)
        for i in range(5):
            ch.basic_publish("", "rep-cap", b"c%d" % i, PERSISTENT)
        group.kill9(a)
        ready = group.promote(b)
        assert f"AMQP {ports['b']}" in ready
        conn2 = pika.BlockingConnection(pika.URLParameters(
            f"amqp://guest:guest@127.0.0.1:{ports['b']}/"))
        ch2 = conn2.channel()
        ch2.confirm_delivery()
        ch2.basic_publish("rep-x", "orders.us", b"after", PERSISTENT)
        got = [ch2.basic_get("rep-q", auto_ack=True)[2] for _ in range(12)]
        assert got == [b"%d" % i for i in range(10)] + [b"after", None]
        # the overflow setting and the drops were replicated: the backup drops the head
        ch2.basic_publish("", "rep-cap", b"after", PERSISTENT)
        assert [ch2.basic_get("rep-cap", auto_ack=True)[2] for _ in range(4)] == \
            [b"c3", b"c4", b"after", None]
        conn2.close()


def test_kill9_of_the_active_under_amqp_load_loses_nothing(tmp_path: Path) -> None:
    """The total-queue workload (``total_queue.py``: confirms, tx.commit, a mover
    that acks and republishes in one transaction) on a shared-store pair, the active
    killed with SIGKILL three times; the standby takes over on the same AMQP port and
    the killed node comes back as the standby. Every confirmed or committed message
    is then in exactly one place."""
    amqp_port = free_port()
    url = f"amqp://guest:guest@127.0.0.1:{amqp_port}/"
    work = TotalQueue()
    with HaPair(tmp_path, "--amqp-port", str(amqp_port)) as pair:
        work.declare(url)
        for cycle in range(3):
            active = pair.active()
            work.cycle(url, f"s{cycle}", 150 * (cycle + 1), functools.partial(pair.kill9, active))
            assert pair.active() is not active
            pair.restart(active)
        tally = work.drain(url)
    print(f"kill -9 of the active via AMQP: {tally}")
    assert tally.confirmed and tally.moved
    assert (tally.lost, tally.duplicated, tally.unexpected) == (0, 0, 0)
    assert tally.broken_transactions == []


def test_kill9_of_the_primary_under_amqp_load_loses_nothing(tmp_path: Path) -> None:
    """The same workload on a replicated group of three, each node with its own AMQP
    port: the primary killed with SIGKILL twice, a ready backup promoted, the killed
    node restarted as a backup; the workers of each round use the primary's port."""
    names = ("a", "b", "c")
    ports = {name: free_port() for name in names}
    group = Group(tmp_path / "group", 3,
                  node_args={name: ["--amqp-port", str(port)] for name, port in ports.items()})
    work = TotalQueue()

    def url(node_name: str) -> str:
        return f"amqp://guest:guest@127.0.0.1:{ports[node_name]}/"

    with group:
        primary = group.primary()
        work.declare(url(primary.name))
        for cycle in range(2):
            primary = group.primary()
            group.wait_ready_backups(2, primary=primary)  # every backup promotable
            work.cycle(url(primary.name), f"r{cycle}", 150 * (cycle + 1),
                       functools.partial(group.kill9, primary))
            successor = next(n for n in group.nodes if n is not primary)
            group.promote(successor)
            group.restart(primary)
        tally = work.drain(url(group.primary().name))
    print(f"kill -9 of the primary via AMQP: {tally}")
    assert tally.confirmed and tally.moved
    assert (tally.lost, tally.duplicated, tally.unexpected) == (0, 0, 0)
    assert tally.broken_transactions == []
