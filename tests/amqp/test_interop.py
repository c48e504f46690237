"""AMQP and the other protocols on the same queues: a message sent with the native
client reaches an AMQP consumer with properties made from what it has; a message
published over AMQP reaches a native consumer with its body and headers."""

from __future__ import annotations

import pika

import txbroker
from tests.amqp.support import AmqpBroker


def test_native_to_amqp_and_back(amqp_broker: AmqpBroker, queue_name: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_broker.amqp_url))
    ch = conn.channel()
    ch.queue_declare(queue_name, durable=True)
    with txbroker.connect(amqp_broker.url, timeout=10) as native:
        native.send(queue_name, b"from native", headers={"region": "eu"},
                    message_id="n-1")
        method, props, body = ch.basic_get(queue_name, auto_ack=True)
        assert body == b"from native"
        assert (method.exchange, method.routing_key) == ("", queue_name)
        assert props.headers == {"region": "eu"}
        assert (props.message_id, props.delivery_mode) == ("n-1", 2)

        ch.confirm_delivery()
        ch.basic_publish("", queue_name, b"from amqp",
                         pika.BasicProperties(delivery_mode=2, headers={
                             "k": "v", "n": 7, "yes": True, "table": {"x": 1}}))
        message = native.receive(queue_name, timeout=10)
        assert message is not None and message.body == b"from amqp"
        assert (message.headers["k"], message.headers["n"], message.headers["yes"]) == \
            ("v", "7", "true")
        assert "table" not in message.headers
        assert message.headers["amqp-exchange"] == ""
        assert message.headers["amqp-routing-key"] == queue_name
        message.ack()
    conn.close()
