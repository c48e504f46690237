"""aio-pika (over aiormq and pamqp), unchanged, against the AMQP edge."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest

from tests.amqp.support import AmqpBroker


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def test_publish_consume_ack_with_confirms(amqp_broker: AmqpBroker) -> None:
    async def main() -> None:
        connection = await aio_pika.connect_robust(amqp_broker.amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            await channel.set_qos(prefetch_count=10)
            exchange = await channel.declare_exchange(f"x-{uuid.uuid4().hex[:8]}",
                                                      aio_pika.ExchangeType.TOPIC)
            queue = await channel.declare_queue(f"q-{uuid.uuid4().hex[:8]}", durable=True)
            await queue.bind(exchange, routing_key="a.*")
            for i in range(20):
                await exchange.publish(
                    aio_pika.Message(f"m{i}".encode(), headers={"n": i},
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key="a.b")
            got = []
            async with queue.iterator() as messages:
                async for message in messages:
                    async with message.process():
                        got.append((message.body, message.headers["n"],
                                    message.routing_key, message.exchange))
                    if len(got) == 20:
                        break
            assert [g[0] for g in got] == [f"m{i}".encode() for i in range(20)]
            assert [g[1] for g in got] == list(range(20))
            assert {(g[2], g[3]) for g in got} == {("a.b", exchange.name)}
            assert (await queue.declare()).message_count == 0

    run(main())


def test_reject_requeue_then_redelivered(amqp_broker: AmqpBroker) -> None:
    async def main() -> None:
        connection = await aio_pika.connect(amqp_broker.amqp_url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(exclusive=True)
            await channel.default_exchange.publish(aio_pika.Message(b"again"),
                                                   routing_key=queue.name)
            first = await queue.get(timeout=5)
            assert first is not None and not first.redelivered
            await first.reject(requeue=True)
            second = await queue.get(timeout=5)
            assert second is not None and second.redelivered and second.body == b"again"
            await second.ack()
            assert await queue.get(fail=False) is None

    run(main())


def test_transaction_commit_and_rollback(amqp_broker: AmqpBroker) -> None:
    async def main() -> None:
        connection = await aio_pika.connect(amqp_broker.amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=False)
            queue = await channel.declare_queue(exclusive=True)
            tx = channel.transaction()
            await tx.select()
            await channel.default_exchange.publish(aio_pika.Message(b"no"),
                                                   routing_key=queue.name)
            await tx.rollback()
            await channel.default_exchange.publish(aio_pika.Message(b"yes"),
                                                   routing_key=queue.name)
            await tx.commit()
            message = await queue.get(timeout=5)
            assert message is not None and message.body == b"yes"
            await message.ack()
            await tx.commit()
            assert await queue.get(fail=False) is None

    run(main())


def test_passive_declare_of_missing_queue(amqp_broker: AmqpBroker) -> None:
    async def main() -> None:
        connection = await aio_pika.connect(amqp_broker.amqp_url)
        async with connection:
            channel = await connection.channel()
            with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
                await channel.declare_queue("missing-" + uuid.uuid4().hex, passive=True)

    run(main())
