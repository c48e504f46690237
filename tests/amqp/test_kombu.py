"""kombu (over py-amqp, Celery's transport), unchanged, against the AMQP edge."""

from __future__ import annotations

import uuid

import kombu
from kombu import Connection, Exchange, Producer, Queue

from tests.amqp.support import AmqpBroker


def test_simple_queue(amqp_broker: AmqpBroker) -> None:
    name = f"kombu-{uuid.uuid4().hex[:8]}"
    with Connection(amqp_broker.amqp_url) as conn:
        queue = conn.SimpleQueue(name)
        queue.put({"hello": "world"})
        message = queue.get(block=True, timeout=10)
        assert message.payload == {"hello": "world"}
        message.ack()
        assert queue.qsize() == 0
        queue.close()


def test_exchange_producer_consumer_with_late_acks(amqp_broker: AmqpBroker) -> None:
    """Celery's shape: a direct exchange, a durable queue, persistent JSON messages,
    a consumer that acks after the work (acks_late); a message it rejects with
    requeue comes back redelivered."""
    suffix = uuid.uuid4().hex[:8]
    exchange = Exchange(f"tasks-{suffix}", type="direct", durable=True)
    queue = Queue(f"celery-{suffix}", exchange, routing_key="celery", durable=True)
    with Connection(amqp_broker.amqp_url) as conn:
        producer = Producer(conn, exchange=exchange, serializer="json")
        for i in range(5):
            producer.publish({"task": "add", "args": [i, i]}, routing_key="celery",
                             declare=[queue], delivery_mode=2, retry=True)
        done: list[int] = []
        redelivered: list[bool] = []

        def work(body: dict[str, object], message: kombu.Message) -> None:
            args = body["args"]
            assert isinstance(args, list)
            if args[0] == 2 and not message.delivery_info["redelivered"]:
                message.requeue()  # the worker died mid-task: back to the queue
                return
            done.append(args[0] + args[1])
            redelivered.append(bool(message.delivery_info["redelivered"]))
            message.ack()

        with conn.Consumer(queue, callbacks=[work], prefetch_count=2):
            while len(done) < 5:
                conn.drain_events(timeout=10)
    assert sorted(done) == [0, 2, 4, 6, 8]
    assert redelivered.count(True) == 1


def test_py_amqp_basic_get_and_properties(amqp_broker: AmqpBroker) -> None:
    name = f"kombu-get-{uuid.uuid4().hex[:8]}"
    with Connection(amqp_broker.amqp_url) as conn:
        channel = conn.default_channel
        channel.queue_declare(name, durable=True, auto_delete=False)
        Producer(channel).publish(b"raw", routing_key=name, content_type="application/x",
                                  headers={"h": "v"}, correlation_id="c-1")
        message = channel.basic_get(name, no_ack=True)
        assert message.body == b"raw"
        assert message.properties["content_type"] == "application/x"
        assert message.properties["application_headers"] == {"h": "v"}
        assert message.properties["correlation_id"] == "c-1"
        assert channel.queue_delete(name) == 0
