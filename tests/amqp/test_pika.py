"""pika's BlockingConnection, unchanged, against the AMQP edge: RabbitMQ's
tutorials with only the URL changed, then each method's exact behaviour."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import ChannelClosedByBroker, NackError, UnroutableError

from tests.amqp.support import AmqpBroker

WAIT = 10


@pytest.fixture
def connection(amqp_broker: AmqpBroker) -> Iterator[pika.BlockingConnection]:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    yield conn
    if conn.is_open:
        conn.close()


@pytest.fixture
def channel(connection: pika.BlockingConnection) -> BlockingChannel:
    return connection.channel()


def name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def get_body(channel: BlockingChannel, queue: str) -> bytes | None:
    method, _, body = channel.basic_get(queue, auto_ack=True)
    return None if method is None else body


# ---------------------------------------------------------------- tutorials 1-5
def test_tutorial_1_hello_world(channel: BlockingChannel, queue_name: str) -> None:
    channel.queue_declare(queue=queue_name)
    channel.basic_publish(exchange="", routing_key=queue_name, body=b"Hello World!")
    method, _properties, body = next(channel.consume(queue_name, auto_ack=True,
                                                    inactivity_timeout=WAIT))
    assert body == b"Hello World!"
    assert (method.exchange, method.routing_key, method.redelivered) == ("", queue_name, False)
    channel.cancel()


def test_tutorial_2_work_queues_with_acks(amqp_broker: AmqpBroker,
                                          channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue=queue, durable=True)
    for i in range(10):
        channel.basic_publish(exchange="", routing_key=queue, body=f"task {i}".encode(),
                              properties=pika.BasicProperties(
                                  delivery_mode=pika.DeliveryMode.Persistent))
    # two workers with prefetch 1: each gets one unacked message at a time
    workers = [pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
               for _ in range(2)]
    try:
        chans = [w.channel() for w in workers]
        for ch in chans:
            ch.basic_qos(prefetch_count=1)
        got: list[bytes] = []
        first = [next(ch.consume(queue, inactivity_timeout=WAIT)) for ch in chans]
        assert all(m is not None for m, _, _ in first)
        # neither gets a second message before acking
        for ch in chans:
            assert next(ch.consume(queue, inactivity_timeout=0.3)) == (None, None, None)
        for ch, (method, _, body) in zip(chans, first, strict=True):
            got.append(body)
            ch.basic_ack(method.delivery_tag)
        while len(got) < 10:
            for ch in chans:
                method, _, body = next(ch.consume(queue, inactivity_timeout=WAIT))
                if method is not None and len(got) < 10:
                    got.append(body)
                    ch.basic_ack(method.delivery_tag)
        assert sorted(got) == sorted(f"task {i}".encode() for i in range(10))
        for ch in chans:
            ch.cancel()
    finally:
        for w in workers:
            w.close()
    assert channel.queue_declare(queue=queue, passive=True).method.message_count == 0


def test_tutorial_3_fanout(channel: BlockingChannel) -> None:
    exchange = name()
    channel.exchange_declare(exchange=exchange, exchange_type="fanout")
    queues = [channel.queue_declare(queue="", exclusive=True).method.queue for _ in range(2)]
    assert all(q.startswith("amq.gen-") for q in queues) and queues[0] != queues[1]
    for q in queues:
        channel.queue_bind(exchange=exchange, queue=q)
    channel.basic_publish(exchange=exchange, routing_key="ignored", body=b"log line")
    assert [get_body(channel, q) for q in queues] == [b"log line", b"log line"]


def test_tutorial_4_direct_routing(channel: BlockingChannel) -> None:
    exchange = name()
    channel.exchange_declare(exchange=exchange, exchange_type="direct")
    errors, infos = name(), name()
    for q in (errors, infos):
        channel.queue_declare(queue=q, exclusive=True)
    channel.queue_bind(exchange=exchange, queue=errors, routing_key="error")
    channel.queue_bind(exchange=exchange, queue=infos, routing_key="info")
    channel.queue_bind(exchange=exchange, queue=infos, routing_key="error")
    channel.basic_publish(exchange=exchange, routing_key="error", body=b"e")
    channel.basic_publish(exchange=exchange, routing_key="info", body=b"i")
    channel.basic_publish(exchange=exchange, routing_key="debug", body=b"d")
    assert [get_body(channel, errors), get_body(channel, errors)] == [b"e", None]
    assert [get_body(channel, infos), get_body(channel, infos),
            get_body(channel, infos)] == [b"e", b"i", None]


@pytest.mark.parametrize(("binding", "matches", "misses"), [
    ("*.orange.*", ["quick.orange.rabbit", "lazy.orange.elephant"],
     ["quick.orange.male.rabbit", "orange", "lazy.brown.fox"]),
    ("lazy.#", ["lazy", "lazy.brown.fox", "lazy.pink.rabbit"], ["quick.brown.fox"]),
    ("#", ["a", "a.b.c", ""], []),
    ("*.*.rabbit", ["quick.orange.rabbit"], ["quick.rabbit", "a.b.c.rabbit"]),
])
def test_tutorial_5_topics(channel: BlockingChannel, binding: str, matches: list[str],
                           misses: list[str]) -> None:
    exchange = name()
    channel.exchange_declare(exchange=exchange, exchange_type="topic")
    queue = channel.queue_declare(queue="", exclusive=True).method.queue
    channel.queue_bind(exchange=exchange, queue=queue, routing_key=binding)
    for key in misses + matches:
        channel.basic_publish(exchange=exchange, routing_key=key, body=key.encode())
    assert [get_body(channel, queue) for _ in range(len(matches) + 1)] == \
        [k.encode() for k in matches] + [None]


def test_tutorial_6_rpc(amqp_broker: AmqpBroker, channel: BlockingChannel) -> None:
    """The RPC pattern: reply_to an exclusive server-named queue, correlation_id."""
    rpc_queue = name()
    channel.queue_declare(queue=rpc_queue)
    callback = channel.queue_declare(queue="", exclusive=True).method.queue
    correlation = str(uuid.uuid4())
    channel.basic_publish(exchange="", routing_key=rpc_queue, body=b"30",
                          properties=pika.BasicProperties(reply_to=callback,
                                                          correlation_id=correlation))
    server = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    try:
        sch = server.channel()
        method, props, body = next(sch.consume(rpc_queue, inactivity_timeout=WAIT))
        sch.basic_publish(exchange="", routing_key=props.reply_to, body=b"832040",
                          properties=pika.BasicProperties(correlation_id=props.correlation_id))
        sch.basic_ack(method.delivery_tag)
        sch.cancel()
    finally:
        server.close()
    method, props, body = next(channel.consume(callback, auto_ack=True,
                                               inactivity_timeout=WAIT))
    assert (body, props.correlation_id) == (b"832040", correlation)
    channel.cancel()


# ---------------------------------------------------------------- exchanges and queues
def test_headers_exchange_all_and_any(channel: BlockingChannel) -> None:
    exchange = name()
    channel.exchange_declare(exchange=exchange, exchange_type="headers")
    q_all = channel.queue_declare(queue="", exclusive=True).method.queue
    q_any = channel.queue_declare(queue="", exclusive=True).method.queue
    channel.queue_bind(q_all, exchange, arguments={"x-match": "all", "a": "1", "b": "2"})
    channel.queue_bind(q_any, exchange, arguments={"x-match": "any", "a": "1", "b": "2"})
    for headers in ({"a": "1", "b": "2"}, {"a": "1"}, {"c": "3"}):
        channel.basic_publish(exchange, "", json_body(headers),
                              pika.BasicProperties(headers=headers))
    assert [get_body(channel, q_all), get_body(channel, q_all)] == \
        [json_body({"a": "1", "b": "2"}), None]
    assert [get_body(channel, q_any), get_body(channel, q_any), get_body(channel, q_any)] == \
        [json_body({"a": "1", "b": "2"}), json_body({"a": "1"}), None]


def json_body(headers: dict[str, str]) -> bytes:
    return repr(sorted(headers.items())).encode()


def test_amq_exchanges_are_predeclared(channel: BlockingChannel) -> None:
    for exchange, kind in (("amq.direct", "direct"), ("amq.fanout", "fanout"),
                           ("amq.topic", "topic"), ("amq.headers", "headers")):
        channel.exchange_declare(exchange, kind, passive=True)
        channel.exchange_declare(exchange, kind, durable=True)
    queue = channel.queue_declare(queue="", exclusive=True).method.queue
    channel.queue_bind(queue, "amq.topic", "a.*")
    channel.basic_publish("amq.topic", "a.b", b"via amq.topic")
    assert get_body(channel, queue) == b"via amq.topic"


def closed_with(channel: BlockingChannel, call: object, *args: object,
                **kwargs: object) -> tuple[int, str]:
    with pytest.raises(ChannelClosedByBroker) as caught:
        call(*args, **kwargs)  # type: ignore[operator]
    assert channel.is_closed
    return caught.value.reply_code, caught.value.reply_text


def test_passive_declares_of_nothing_are_404(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    assert closed_with(ch, ch.exchange_declare, "nope-x", passive=True) == \
        (404, "NOT_FOUND - no exchange 'nope-x' in vhost '/'")
    ch = connection.channel()
    assert closed_with(ch, ch.queue_declare, "nope-q", passive=True) == \
        (404, "NOT_FOUND - no queue 'nope-q' in vhost '/'")
    # the connection goes on
    assert connection.channel().queue_declare("", exclusive=True).method.queue


def test_mismatched_redeclare_is_406(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    exchange, queue = name(), name()
    ch.exchange_declare(exchange, "direct")
    code, text = closed_with(ch, ch.exchange_declare, exchange, "fanout")
    assert code == 406 and "inequivalent arg 'type'" in text
    ch = connection.channel()
    ch.queue_declare(queue, durable=True)
    code, text = closed_with(ch, ch.queue_declare, queue, durable=False)
    assert (code, text) == (406, f"PRECONDITION_FAILED - inequivalent arg 'durable' for queue "
                                 f"'{queue}' in vhost '/': received 'false' but current is "
                                 "'true'")
    ch = connection.channel()
    assert ch.queue_declare(queue, durable=True).method.queue == queue  # same: fine
    ch.queue_delete(queue)


def test_reserved_names_are_403(channel: BlockingChannel) -> None:
    code, text = closed_with(channel, channel.exchange_declare, "amq.mine", "direct")
    assert code == 403 and "reserved prefix 'amq." in text


def test_unknown_exchange_type_closes_the_connection(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as caught:
        ch.exchange_declare(name(), "x-delayed-message")
    assert caught.value.reply_code == 503


def test_publish_to_missing_exchange_is_404(channel: BlockingChannel) -> None:
    channel.basic_publish("no-such-exchange", "k", b"x")
    with pytest.raises(ChannelClosedByBroker) as caught:
        channel.queue_declare("", exclusive=True)
    assert (caught.value.reply_code, caught.value.reply_text) == \
        (404, "NOT_FOUND - no exchange 'no-such-exchange' in vhost '/'")


def test_declare_ok_counts_purge_and_delete(channel: BlockingChannel) -> None:
    queue = name()
    assert channel.queue_declare(queue).method.message_count == 0
    for i in range(5):
        channel.basic_publish("", queue, b"%d" % i)
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"5")
    ok = channel.queue_declare(queue, passive=True).method
    assert (ok.message_count, ok.consumer_count) == (6, 0)
    assert channel.queue_purge(queue).method.message_count == 6
    for i in range(3):
        channel.basic_publish("", queue, b"%d" % i)
    assert channel.queue_delete(queue).method.message_count == 3
    ch_closed = closed_with(channel, channel.queue_declare, queue, passive=True)
    assert ch_closed[0] == 404


def test_exclusive_queue_is_locked_and_goes_with_its_connection(
        amqp_broker: AmqpBroker, channel: BlockingChannel) -> None:
    other = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    queue = other.channel().queue_declare("", exclusive=True).method.queue
    code, text = closed_with(channel, channel.basic_consume, queue, lambda *a: None)
    assert code == 405 and "RESOURCE_LOCKED" in text
    other.close()
    check = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    try:
        ch = check.channel()
        assert closed_with(ch, ch.queue_declare, queue, passive=True)[0] == 404
    finally:
        check.close()


def test_auto_delete_queue_goes_with_its_last_consumer(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue, auto_delete=True)
    tag = channel.basic_consume(queue, lambda *a: None)
    assert channel.queue_declare(queue, passive=True).method.consumer_count == 1
    channel.basic_cancel(tag)
    assert closed_with(channel, channel.queue_declare, queue, passive=True)[0] == 404


# ---------------------------------------------------------------- publishing
def test_mandatory_unroutable_is_returned(channel: BlockingChannel) -> None:
    channel.confirm_delivery()
    with pytest.raises(UnroutableError) as caught:
        channel.basic_publish("", "no-such-queue-" + name(), b"lost?", mandatory=True)
    (returned,) = caught.value.messages
    assert returned.method.reply_code == 312 and returned.method.reply_text == "NO_ROUTE"
    assert returned.body == b"lost?"


def test_confirms_and_properties_round_trip(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    props = pika.BasicProperties(
        content_type="application/json", content_encoding="utf-8",
        headers={"s": "text", "i": 42, "neg": -7, "f": True, "nested": {"x": [1, "two"]},
                 "b": b"bytes"},
        delivery_mode=2, priority=3, correlation_id="corr", reply_to="back",
        expiration="600000", message_id="m-1", timestamp=1_700_000_000, type="kind",
        user_id="guest", app_id="tests")
    channel.basic_publish("", queue, b"{}", props)  # raises NackError if nacked
    _method, got, body = channel.basic_get(queue, auto_ack=True)
    assert body == b"{}"
    for field in ("content_type", "content_encoding", "delivery_mode", "priority",
                  "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                  "type", "user_id", "app_id"):
        assert getattr(got, field) == getattr(props, field), field
    assert got.headers == props.headers


@pytest.mark.parametrize("size", [0, 1, 131072 - 8, 131072, 3 * 1024 * 1024 + 17])
def test_large_bodies_cross_frames(channel: BlockingChannel, size: int) -> None:
    queue = name()
    channel.queue_declare(queue, exclusive=True)
    channel.confirm_delivery()
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    assert get_body(channel, queue) == body


def test_publish_over_max_length_is_nacked(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue, arguments={"x-max-length": 2,
                                            "x-overflow": "reject-publish"})
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"1")
    channel.basic_publish("", queue, b"2")
    with pytest.raises(NackError):
        channel.basic_publish("", queue, b"3")
    assert channel.queue_declare(queue, passive=True).method.message_count == 2


def test_unsupported_queue_argument_is_406(channel: BlockingChannel) -> None:
    code, text = closed_with(channel, channel.queue_declare, name(),
                             arguments={"x-single-active-consumer": True})
    assert (code, text) == (406, "PRECONDITION_FAILED - queue argument "
                                 "'x-single-active-consumer' is not a queue argument "
                                 "txbroker knows (docs/amqp.md)")


# ---------------------------------------------------------------- consuming
def test_nack_requeue_sets_redelivered_and_reject_drops(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue)
    channel.basic_publish("", queue, b"a")
    channel.basic_publish("", queue, b"b")
    m1, _, body1 = channel.basic_get(queue)
    m2, _, body2 = channel.basic_get(queue)
    assert (body1, body2, m1.redelivered) == (b"a", b"b", False)
    channel.basic_nack(m2.delivery_tag, multiple=True, requeue=True)  # both back
    got = [channel.basic_get(queue) for _ in range(2)]
    assert sorted(b for _, _, b in got) == [b"a", b"b"]
    assert all(m.redelivered for m, _, _ in got)
    for m, _, _ in got:
        channel.basic_reject(m.delivery_tag, requeue=False)
    assert channel.basic_get(queue) == (None, None, None)


def test_multiple_ack_and_unknown_tag(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue)
    for i in range(4):
        channel.basic_publish("", queue, b"%d" % i)
    tags = [channel.basic_get(queue)[0].delivery_tag for _ in range(4)]
    assert tags == [1, 2, 3, 4]
    channel.basic_ack(3, multiple=True)
    channel.basic_ack(4)
    assert channel.queue_declare(queue, passive=True).method.message_count == 0
    channel.basic_ack(99)
    with pytest.raises(ChannelClosedByBroker) as caught:
        channel.queue_declare(queue, passive=True)
    assert (caught.value.reply_code, caught.value.reply_text) == \
        (406, "PRECONDITION_FAILED - unknown delivery tag 99")


def test_recover_redelivers_unacked(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue)
    channel.basic_publish("", queue, b"r")
    method, _, _ = channel.basic_get(queue)
    channel.basic_recover(requeue=True)
    again, _, body = channel.basic_get(queue, auto_ack=True)
    assert body == b"r" and again.redelivered
    channel.basic_ack(method.delivery_tag)  # given back: acking it does nothing


def test_cancel_gives_back_unacked_and_channel_close_too(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = name()
    ch.queue_declare(queue)
    for i in range(3):
        ch.basic_publish("", queue, b"%d" % i)
    _method, _, _ = next(ch.consume(queue, inactivity_timeout=WAIT))
    ch.cancel()
    ch.close()
    ch2 = connection.channel()
    got = [ch2.basic_get(queue, auto_ack=True) for _ in range(4)]
    assert sorted(b for m, _, b in got if m is not None) == [b"0", b"1", b"2"]
    assert got[3] == (None, None, None)


def test_get_empty_and_missing_queue(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue)
    assert channel.basic_get(queue) == (None, None, None)
    code, text = closed_with(channel, channel.basic_get, "missing-" + queue)
    assert (code, text) == (404, f"NOT_FOUND - no queue 'missing-{queue}' in vhost '/'")


# ---------------------------------------------------------------- transactions
def test_tx_commit_is_atomic_across_queues_and_rollback_drops(
        channel: BlockingChannel) -> None:
    a, b = name(), name()
    channel.queue_declare(a, durable=True)
    channel.queue_declare(b, durable=True)
    channel.tx_select()
    channel.basic_publish("", a, b"a1", pika.BasicProperties(delivery_mode=2))
    channel.basic_publish("", b, b"b1", pika.BasicProperties(delivery_mode=2))
    assert channel.queue_declare(a, passive=True).method.message_count == 0
    channel.tx_commit()
    assert [channel.queue_declare(q, passive=True).method.message_count
            for q in (a, b)] == [1, 1]
    channel.basic_publish("", a, b"a2")
    channel.tx_rollback()
    channel.tx_commit()
    assert channel.queue_declare(a, passive=True).method.message_count == 1
    # acks in a transaction count at commit; a rolled-back ack leaves the message
    # unacked on the channel (RabbitMQ's tx.rollback), to be acked again
    method, _, _body = channel.basic_get(a)
    channel.basic_ack(method.delivery_tag)
    channel.tx_rollback()
    assert channel.basic_get(a) == (None, None, None)
    channel.basic_ack(method.delivery_tag)
    channel.tx_commit()
    assert channel.queue_declare(a, passive=True).method.message_count == 0


def test_commit_without_select_is_406(channel: BlockingChannel) -> None:
    assert closed_with(channel, channel.tx_commit) == \
        (406, "PRECONDITION_FAILED - channel is not transactional")


def test_publishes_are_seen_by_later_methods_of_the_channel(channel: BlockingChannel) -> None:
    """Without confirms, a persistent publish is in its queue for the basic.get,
    the count and the purge that follow it on the same channel (RabbitMQ's order)."""
    queue = name()
    channel.queue_declare(queue, durable=True)
    for i in range(3):
        channel.basic_publish("", queue, b"%d" % i, pika.BasicProperties(delivery_mode=2))
    assert channel.queue_declare(queue, passive=True).method.message_count == 3
    assert get_body(channel, queue) == b"0"
    channel.basic_publish("", queue, b"3", pika.BasicProperties(delivery_mode=2))
    assert channel.queue_purge(queue).method.message_count == 3
    assert get_body(channel, queue) is None


def test_priority_queue_delivers_higher_priorities_first(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue, arguments={"x-max-priority": 10})
    channel.confirm_delivery()
    for priority in (1, 7, 3, 9, 0):
        channel.basic_publish("", queue, b"%d" % priority,
                              pika.BasicProperties(priority=priority))
    assert [get_body(channel, queue) for _ in range(5)] == [b"9", b"7", b"3", b"1", b"0"]


def test_queue_deleted_under_a_consumer_cancels_it(connection: pika.BlockingConnection,
                                                   channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue)
    cancelled: list[object] = []
    channel.add_on_cancel_callback(cancelled.append)
    channel.basic_consume(queue, lambda *a: None)
    other = connection.channel()
    assert other.queue_delete(queue).method.message_count == 0
    connection.process_data_events(time_limit=1)
    assert len(cancelled) == 1


def test_dead_letter_queue_through_the_default_exchange(channel: BlockingChannel) -> None:
    queue, dlq = name(), name()
    channel.queue_declare(dlq)
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": "",
                                            "x-dead-letter-routing-key": dlq})
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"bad")
    method, _, _ = channel.basic_get(queue)
    channel.basic_reject(method.delivery_tag, requeue=False)
    method, props, body = next(channel.consume(dlq, auto_ack=True, inactivity_timeout=WAIT))
    channel.cancel()
    assert body == b"bad" and (method.exchange, method.routing_key) == ("", dlq)
    (death,) = props.headers["x-death"]
    assert {k: death[k] for k in ("count", "reason", "queue", "exchange", "routing-keys")} \
        == {"count": 1, "reason": "rejected", "queue": queue, "exchange": "",
            "routing-keys": [queue]}
    assert props.headers["x-first-death-reason"] == "rejected"


def test_dead_letter_exchange_routes_rejected_and_expired(channel: BlockingChannel) -> None:
    dlx, parked, queue = name(), name(), name()
    channel.exchange_declare(dlx, "topic")
    channel.queue_declare(parked)
    channel.queue_bind(parked, dlx, "dead.#")
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": dlx,
                                            "x-dead-letter-routing-key": "dead.letters",
                                            "x-message-ttl": 600000})
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"rejected", pika.BasicProperties(headers={"a": 1}))
    channel.basic_publish("", queue, b"expires", pika.BasicProperties(expiration="1"))
    method, _, body = channel.basic_get(queue)
    assert body == b"rejected"
    channel.basic_nack(method.delivery_tag, requeue=False)
    channel.connection.sleep(0.1)  # "expires" outlives its 1 ms TTL
    assert channel.basic_get(queue) == (None, None, None)  # expired on the way
    got = {}
    for method, props, body in channel.consume(parked, auto_ack=True, inactivity_timeout=WAIT):
        assert method is not None, f"only {sorted(got)} dead-lettered"
        got[body] = (method.exchange, method.routing_key, props)
        if len(got) == 2:
            break
    channel.cancel()
    assert {b: g[:2] for b, g in got.items()} == {b"rejected": (dlx, "dead.letters"),
                                                 b"expires": (dlx, "dead.letters")}
    assert got[b"rejected"][2].headers["x-death"][0]["reason"] == "rejected"
    assert got[b"rejected"][2].headers["a"] == 1
    assert got[b"expires"][2].headers["x-death"][0]["reason"] == "expired"
    assert got[b"expires"][2].expiration is None


def test_per_message_expiration(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue)
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"short", pika.BasicProperties(expiration="1"))
    channel.basic_publish("", queue, b"long", pika.BasicProperties(expiration="600000"))
    connection_sleep = channel.connection.sleep
    connection_sleep(0.2)  # the short one's 1 ms TTL has passed
    assert [get_body(channel, queue), get_body(channel, queue)] == [b"long", None]


def test_asyncio_adapter(amqp_broker: AmqpBroker) -> None:
    """pika's AsyncioConnection: callbacks all the way, publish then consume one."""
    import asyncio

    from pika.adapters.asyncio_connection import AsyncioConnection

    queue = name()
    got: list[bytes] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_message(ch: object, method: object, props: object, body: bytes) -> None:
            got.append(body)
            ch.basic_ack(method.delivery_tag)  # type: ignore[attr-defined]
            conn.close()

        def on_declared(frame: object) -> None:
            channel.basic_publish("", queue, b"async hello")
            channel.basic_consume(queue, on_message)

        def on_channel(ch: object) -> None:
            nonlocal channel
            channel = ch
            channel.queue_declare(queue, exclusive=True, callback=on_declared)

        def on_open(c: object) -> None:
            c.channel(on_open_callback=on_channel)  # type: ignore[attr-defined]

        def on_closed(c: object, reason: object) -> None:
            if not done.done():
                done.set_result(reason)

        channel: object = None
        conn = AsyncioConnection(pika.URLParameters(amqp_broker.amqp_url),
                                 on_open_callback=on_open, on_close_callback=on_closed,
                                 custom_ioloop=loop)
        await asyncio.wait_for(done, WAIT)

    asyncio.run(main())
    assert got == [b"async hello"]


def test_exclusive_consumer(amqp_broker: AmqpBroker, connection: pika.BlockingConnection) -> None:
    queue = name()
    ch = connection.channel()
    ch.queue_declare(queue)
    tag = ch.basic_consume(queue, lambda *a: None, exclusive=True)
    other = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    try:
        och = other.channel()
        assert closed_with(och, och.basic_consume, queue, lambda *a: None) == \
            (403, f"ACCESS_REFUSED - queue '{queue}' in vhost '/' in exclusive use")
        ch.basic_cancel(tag)
        och = other.channel()
        shared = och.basic_consume(queue, lambda *a: None)
        # an exclusive consumer cannot join a queue that has consumers
        assert closed_with(ch, ch.basic_consume, queue, lambda *a: None, exclusive=True)[0] \
            == 403
        och.basic_cancel(shared)
    finally:
        other.close()


def test_auto_delete_exchange_goes_with_its_last_binding(
        connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    exchange, queue = name(), name()
    ch.exchange_declare(exchange, "direct", auto_delete=True)
    ch.queue_declare(queue, exclusive=True)
    ch.queue_bind(queue, exchange, "a")
    ch.queue_bind(queue, exchange, "b")
    ch.queue_unbind(queue, exchange, "a")
    ch.exchange_declare(exchange, "direct", passive=True)  # one binding left
    ch.queue_unbind(queue, exchange, "b")
    assert closed_with(ch, ch.exchange_declare, exchange, "direct", passive=True)[0] == 404


def test_priorities_above_x_max_priority_count_as_it(channel: BlockingChannel) -> None:
    queue = name()
    channel.queue_declare(queue, arguments={"x-max-priority": 2})
    channel.confirm_delivery()
    for body, priority in ((b"p9", 9), (b"p2", 2), (b"p1", 1), (b"p5", 5)):
        channel.basic_publish("", queue, body, pika.BasicProperties(priority=priority))
    # 9 and 5 count as 2: FIFO among the three at 2
    assert [get_body(channel, queue) for _ in range(4)] == [b"p9", b"p2", b"p5", b"p1"]


def gone_within(connection: pika.BlockingConnection, queue: str, seconds: float) -> bool:
    """True once a passive declare of ``queue`` is 404 (polled, ``seconds`` at most)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ch = connection.channel()
        try:
            ch.queue_declare(queue, passive=True)
        except ChannelClosedByBroker as exc:
            assert exc.reply_code == 404
            return True
        ch.close()
        connection.sleep(0.05)
    return False


def test_x_expires_deletes_an_unused_queue(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    unused, consumed = name(), name()
    ch.queue_declare(unused, arguments={"x-expires": 300})
    ch.queue_declare(consumed, arguments={"x-expires": 300})
    tag = ch.basic_consume(consumed, lambda *a: None)
    assert gone_within(connection, unused, 10)
    connection.sleep(0.6)  # twice its x-expires: a consumer keeps it
    ch.queue_declare(consumed, passive=True)
    ch.basic_cancel(tag)
    assert gone_within(connection, consumed, 10)


def test_x_expires_must_be_positive(channel: BlockingChannel) -> None:
    assert closed_with(channel, channel.queue_declare, name(),
                       arguments={"x-expires": 0})[0] == 406
