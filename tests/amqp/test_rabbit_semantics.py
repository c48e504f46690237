"""RabbitMQ's semantics where txbroker used to differ (issue 31), with pika,
unchanged: a cancelled consumer's unacked messages stay with the channel, a
``tx.rollback`` keeps rolled-back acks' messages unacked, ``basic.recover`` with
``requeue=false`` is refused as RabbitMQ refuses it, and ``x-max-length`` drops
the head of the queue (``x-overflow: drop-head``, RabbitMQ's default)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker

from tests.amqp.support import AmqpBroker

WAIT = 10
PERSISTENT = pika.BasicProperties(delivery_mode=2)


@pytest.fixture
def connection(amqp_broker: AmqpBroker) -> Iterator[pika.BlockingConnection]:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    yield conn
    if conn.is_open:
        conn.close()


def name() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def ready(channel: BlockingChannel, queue: str) -> int:
    """The queue's ready count (queue.declare-ok's message_count)."""
    return int(channel.queue_declare(queue, passive=True).method.message_count)


def drain(channel: BlockingChannel, queue: str) -> list[tuple[bytes, bool]]:
    """Every ready message, taken with auto-ack: (body, redelivered)."""
    found = []
    while True:
        method, _, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return found
        found.append((body, bool(method.redelivered)))


def closed_with_nothing(channel: BlockingChannel) -> bool:
    """The channel is still open after a round trip."""
    channel.basic_qos(prefetch_count=0)
    return bool(channel.is_open)


def consume(channel: BlockingChannel, queue: str, count: int) -> tuple[str, list[Any]]:
    """A consumer that takes ``count`` messages and leaves them unacked."""
    got: list[Any] = []
    tag = channel.basic_consume(queue, lambda ch, method, props, body: got.append(method))
    deadline = time.monotonic() + WAIT
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} deliveries"
        channel.connection.process_data_events(time_limit=0.1)
    return tag, got


# ---------------------------------------------------------------- basic.cancel
def test_cancel_leaves_unacked_with_the_channel_until_it_closes(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue, durable=True)
    for i in range(5):
        ch.basic_publish("", queue, b"m%d" % i, PERSISTENT)
    ch.basic_qos(prefetch_count=10)
    tag, got = consume(ch, queue, 5)
    ch.basic_cancel(tag)
    assert ready(ch, queue) == 0  # not given back at the cancel
    for method in got[:3]:
        ch.basic_ack(method.delivery_tag)  # acked after the cancel: consumed
    assert ready(ch, queue) == 0
    other = connection.channel()
    assert drain(other, queue) == []
    ch.close()  # the channel closes: the two unacked ones go back, redelivered
    assert drain(other, queue) == [(b"m3", True), (b"m4", True)]
    assert ready(other, queue) == 0


def test_cancel_then_nack_requeue_and_recover_give_back(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue)
    for i in range(3):
        ch.basic_publish("", queue, b"m%d" % i)
    tag, got = consume(ch, queue, 3)
    ch.basic_cancel(tag)
    ch.basic_nack(got[0].delivery_tag, requeue=True)
    assert ready(ch, queue) == 1
    ch.basic_recover(requeue=True)
    assert ready(ch, queue) == 3
    assert sorted(drain(ch, queue)) == [(b"m0", True), (b"m1", True), (b"m2", True)]


def test_acks_after_an_auto_delete_queue_went_with_its_cancel_are_quiet(
        connection: pika.BlockingConnection) -> None:
    """The last consumer's cancel deletes an auto-delete queue, with the messages it
    still had unacked (as RabbitMQ); acking them afterwards is no error."""
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue, auto_delete=True)
    for i in range(3):
        ch.basic_publish("", queue, b"m%d" % i)
    tag, got = consume(ch, queue, 3)
    ch.basic_cancel(tag)
    ch.basic_ack(got[0].delivery_tag)
    ch.basic_recover(requeue=True)  # the other two are gone with their queue: no error
    ch.basic_ack(got[1].delivery_tag)  # given back: nothing to do
    assert closed_with_nothing(ch)
    ch.basic_ack(999)  # a tag never given is still 406
    with pytest.raises(ChannelClosedByBroker) as caught:
        ch.queue_declare(queue, passive=True)
    assert (caught.value.reply_code, caught.value.reply_text) == \
        (406, "PRECONDITION_FAILED - unknown delivery tag 999")


# ---------------------------------------------------------------- tx.rollback
def test_rollback_keeps_the_acked_messages_unacked_on_the_channel(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue, durable=True)
    for body in (b"a", b"b", b"c"):
        ch.basic_publish("", queue, body, PERSISTENT)
    ch.tx_select()
    gets = [ch.basic_get(queue) for _ in range(3)]
    assert [b for _, _, b in gets] == [b"a", b"b", b"c"]
    ch.basic_ack(gets[0][0].delivery_tag)
    ch.basic_reject(gets[1][0].delivery_tag, requeue=True)
    ch.tx_rollback()
    assert ready(ch, queue) == 0  # not requeued: still unacked on the channel
    ch.basic_ack(gets[0][0].delivery_tag)  # the same tag again, in a new transaction
    ch.basic_ack(gets[1][0].delivery_tag)
    ch.tx_commit()
    other = connection.channel()
    assert ready(other, queue) == 0
    ch.close()  # "c" was never acked: it alone comes back
    assert drain(other, queue) == [(b"c", True)]


def test_a_rolled_back_multiple_ack_is_unacked_again_then_given_back_at_close(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue)
    for i in range(4):
        ch.basic_publish("", queue, b"m%d" % i)
    ch.tx_select()
    tags = [ch.basic_get(queue)[0].delivery_tag for _ in range(4)]
    ch.basic_ack(tags[2], multiple=True)
    ch.tx_rollback()
    ch.basic_ack(tags[0])
    ch.tx_commit()
    other = connection.channel()
    assert ready(other, queue) == 0
    ch.close()
    assert sorted(drain(other, queue)) == [(b"m1", True), (b"m2", True), (b"m3", True)]


# ---------------------------------------------------------------- basic.recover
def test_recover_without_requeue_is_540_as_rabbitmq(amqp_broker: AmqpBroker) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    ch = conn.channel()
    queue = name()
    ch.queue_declare(queue)
    ch.basic_publish("", queue, b"x")
    assert ch.basic_get(queue)[2] == b"x"
    with pytest.raises(ConnectionClosedByBroker) as caught:
        ch.basic_recover(requeue=False)
    assert (caught.value.reply_code, caught.value.reply_text) == \
        (540, "NOT_IMPLEMENTED - requeue=false")
    check = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    try:  # the connection's unacked message went back
        assert drain(check.channel(), queue) == [(b"x", True)]
    finally:
        check.close()


# ---------------------------------------------------------------- x-overflow
@pytest.mark.parametrize("arguments", [{"x-max-length": 3},
                                       {"x-max-length": 3, "x-overflow": "drop-head"}])
def test_max_length_drops_the_head(connection: pika.BlockingConnection,
                                   arguments: dict[str, Any]) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue, durable=True, arguments=arguments)
    ch.confirm_delivery()
    for i in range(7):
        ch.basic_publish("", queue, b"m%d" % i, PERSISTENT)  # every one confirmed
    assert ready(ch, queue) == 3
    assert drain(ch, queue) == [(b"m4", False), (b"m5", False), (b"m6", False)]


def test_max_length_bytes_drops_the_head(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue, arguments={"x-max-length-bytes": 10})
    ch.confirm_delivery()
    for body in (b"aaaa", b"bbbb", b"cccc"):
        ch.basic_publish("", queue, body)
    assert drain(ch, queue) == [(b"bbbb", False), (b"cccc", False)]


def test_delivered_messages_do_not_count_and_are_not_dropped(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue, arguments={"x-max-length": 1})
    ch.confirm_delivery()
    ch.basic_publish("", queue, b"taken")
    taken, _, _ = ch.basic_get(queue)
    ch.basic_publish("", queue, b"one")
    ch.basic_publish("", queue, b"two")
    ch.basic_ack(taken.delivery_tag)
    assert drain(ch, queue) == [(b"two", False)]


def test_dropped_heads_are_dead_lettered_with_reason_maxlen(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue, dead = name(), name()
    ch.queue_declare(dead, durable=True)
    ch.queue_declare(queue, durable=True, arguments={
        "x-max-length": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead})
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", queue, b"m%d" % i, PERSISTENT)
    assert drain(ch, queue) == [(b"m3", False), (b"m4", False)]
    got: list[tuple[bytes, dict[str, Any]]] = []
    deadline = time.monotonic() + WAIT
    while len(got) < 3:
        assert time.monotonic() < deadline, f"dead letters: {got}"
        method, props, body = ch.basic_get(dead, auto_ack=True)
        if method is None:
            connection.sleep(0.05)
            continue
        got.append((body, props.headers))
    assert [b for b, _ in got] == [b"m0", b"m1", b"m2"]
    for _, headers in got:
        (death,) = headers["x-death"]
        assert (death["reason"], death["queue"], death["count"]) == ("maxlen", queue, 1)
        assert headers["x-first-death-reason"] == "maxlen"


def test_reject_publish_still_refuses(connection: pika.BlockingConnection) -> None:
    from pika.exceptions import NackError

    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    ch.basic_publish("", queue, b"first")
    with pytest.raises(NackError):
        ch.basic_publish("", queue, b"second")
    assert drain(ch, queue) == [(b"first", False)]


def test_unknown_overflow_is_406(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    with pytest.raises(ChannelClosedByBroker) as caught:
        ch.queue_declare(name(), arguments={"x-max-length": 1,
                                            "x-overflow": "reject-publish-dlx"})
    assert caught.value.reply_code == 406
    assert "x-overflow" in caught.value.reply_text


def test_native_clients_choose_the_overflow_too(amqp_broker: AmqpBroker,
                                               connection: pika.BlockingConnection) -> None:
    """The core's setting, named by a native client; an AMQP publisher sees it."""
    import txbroker

    queue = name()
    with txbroker.connect(amqp_broker.url, reconnect=False) as native:
        info = native.declare_queue(queue, max_messages=2, overflow="drop_head")
        assert info["settings"]["overflow"] == "drop_head"
        for body in (b"n1", b"n2", b"n3"):
            native.send(queue, body)
    ch = connection.channel()
    ch.confirm_delivery()
    ch.basic_publish("", queue, b"a4")
    assert [body for body, _ in drain(ch, queue)] == [b"n3", b"a4"]
