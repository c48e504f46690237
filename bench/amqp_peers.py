#!/usr/bin/env python3
"""AMQP 0-9-1 workloads with aio-pika against txbroker and (optionally) RabbitMQ.

The issue's three workloads, 1 KiB persistent messages:

* ``confirm-publish``: publisher confirms with a window of 64 unconfirmed messages;
* ``tx-publish``: 8 publishers, each committing transactions of 10 (``tx.select``);
* ``consume-ack``: one consumer, prefetch 1000, an ack per message.

Each broker runs each workload ``--reps`` times, the brokers alternating; one JSON
line per run goes to stdout and the medians (and txbroker / peer) at the end.
txbroker runs in a child process (``txbroker serve`` on a fresh data directory,
``--sync fdatasync``); peers are given by URL, e.g. RabbitMQ started with
``../shared/bench/start_peers.sh`` (its AMQP listener)::

    .venv/bin/python bench/amqp_peers.py --count 20000 --reps 3 \\
        --peer rabbitmq=amqp://guest:guest@127.0.0.1:5672/
    .venv/bin/python bench/amqp_peers.py --count 50 --reps 1     # a smoke run

The machine should be otherwise idle: figures taken beside other work are noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import aio_pika

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.amqp.support import AmqpBroker  # noqa: E402 - the repository's own launcher

BODY = b"x" * 1024
WINDOW = 64
TX_PUBLISHERS, TX_SIZE = 8, 10
PREFETCH = 1000


def persistent() -> aio_pika.Message:
    return aio_pika.Message(BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)


async def confirm_publish(url: str, count: int) -> float:
    """Messages per second, publishing with confirms, ``WINDOW`` unconfirmed at most."""
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel(publisher_confirms=True)
        queue = await channel.declare_queue(f"bench-{uuid.uuid4().hex}", durable=True)
        window = asyncio.Semaphore(WINDOW)

        async def one() -> None:
            async with window:
                await channel.default_exchange.publish(persistent(), routing_key=queue.name)

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(count)))
        elapsed = time.perf_counter() - started
        await queue.delete(if_unused=False, if_empty=False)
    return count / elapsed


async def tx_publish(url: str, count: int) -> float:
    """Messages per second, ``TX_PUBLISHERS`` connections committing ``TX_SIZE`` each."""
    name = f"bench-{uuid.uuid4().hex}"
    per = max(count // TX_PUBLISHERS // TX_SIZE, 1)

    async def publisher() -> None:
        async with await aio_pika.connect(url) as conn:
            channel = await conn.channel(publisher_confirms=False)
            await channel.declare_queue(name, durable=True)
            tx = channel.transaction()
            await tx.select()
            for _ in range(per):
                for _ in range(TX_SIZE):
                    await channel.default_exchange.publish(persistent(), routing_key=name)
                await tx.commit()

    started = time.perf_counter()
    await asyncio.gather(*(publisher() for _ in range(TX_PUBLISHERS)))
    elapsed = time.perf_counter() - started
    async with await aio_pika.connect(url) as conn:
        await (await conn.channel()).queue_delete(name)
    return per * TX_SIZE * TX_PUBLISHERS / elapsed


async def consume_ack(url: str, count: int) -> float:
    """Messages per second, consuming ``count`` stored messages with acks."""
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel(publisher_confirms=True)
        queue = await channel.declare_queue(f"bench-{uuid.uuid4().hex}", durable=True)
        window = asyncio.Semaphore(WINDOW)

        async def one() -> None:
            async with window:
                await channel.default_exchange.publish(persistent(), routing_key=queue.name)

        await asyncio.gather(*(one() for _ in range(count)))
        await channel.set_qos(prefetch_count=PREFETCH)
        got = 0
        started = time.perf_counter()
        async with queue.iterator() as messages:
            async for message in messages:
                await message.ack()
                got += 1
                if got == count:
                    break
        elapsed = time.perf_counter() - started
        await queue.delete(if_unused=False, if_empty=False)
    return count / elapsed


WORKLOADS: dict[str, Callable[[str, int], Awaitable[float]]] = {
    "confirm-publish": confirm_publish,
    "tx-publish": tx_publish,
    "consume-ack": consume_ack,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    urls: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="amqp-bench-") as root:
        broker = AmqpBroker(Path(root) / "data", "--sync", "fdatasync").start()
        try:
            urls["txbroker"] = broker.amqp_url
            for spec in args.peer:
                name, _, url = spec.partition("=")
                urls[name] = url
            results: dict[tuple[str, str], list[float]] = {}
            for rep in range(args.reps):
                order = list(urls) if rep % 2 == 0 else list(reversed(urls))
                for workload in args.workloads.split(","):
                    for name in order:
                        rate = asyncio.run(WORKLOADS[workload](urls[name], args.count))
                        results.setdefault((workload, name), []).append(rate)
                        print(json.dumps({"broker": name, "workload": workload, "rep": rep,
                                          "count": args.count, "msg_per_s": round(rate, 1)}),
                              flush=True)
        finally:
            broker.kill()
    for workload in args.workloads.split(","):
        medians = {name: statistics.median(results[(workload, name)]) for name in urls}
        line = ", ".join(f"{name} {rate:,.0f} msg/s" for name, rate in medians.items())
        peers = [rate for name, rate in medians.items() if name != "txbroker"]
        ratio = f"; txbroker / best peer {medians['txbroker'] / max(peers):.2f}x" if peers \
            else ""
        print(f"{workload}: {line}{ratio}")


if __name__ == "__main__":
    main()
