"""Interop with a real client, unchanged: stompman (asyncio, STOMP 1.2 only)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import stompman

from tests.stomp.support import StompBroker

pytestmark = pytest.mark.timeout(60)
WAIT = 10.0


def params(*ports: int) -> list[stompman.ConnectionParameters]:
    return [stompman.ConnectionParameters(host="127.0.0.1", port=port, login="guest",
                                          passcode="guest") for port in ports]


def client_for(*ports: int, **options: Any) -> stompman.Client:
    options.setdefault("heartbeat", stompman.Heartbeat(500, 500))
    return stompman.Client(params(*ports), connect_retry_interval=1, connect_timeout=2,
                           **options)


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro_fn(), timeout=40)

    asyncio.run(bounded())


def dest() -> str:
    return f"/queue/sm-{uuid.uuid4().hex[:10]}"


def ignore(exc: Exception, frame: stompman.MessageFrame) -> None:
    """Handler exceptions are part of the test (nack); nothing to report."""


def test_send_with_receipt_and_receive(stomp_broker: StompBroker) -> None:
    queue = dest()

    async def scenario() -> None:
        got: asyncio.Queue[stompman.MessageFrame] = asyncio.Queue()

        async def handler(frame: stompman.MessageFrame) -> None:
            await got.put(frame)

        async with client_for(stomp_broker.stomp_port) as client:
            await client.send(b"hello stompman", queue, content_type="text/plain",
                              headers={"persistent": "true", "x-k": "v:1"}, receipt_timeout=5)
            sub = await client.subscribe(queue, handler, on_suppressed_exception=ignore,
                                         receipt_timeout=5)
            frame = await asyncio.wait_for(got.get(), WAIT)
            assert frame.body == b"hello stompman"
            assert frame.headers["x-k"] == "v:1"  # type: ignore[typeddict-item]
            assert frame.headers["content-type"] == "text/plain"  # type: ignore[typeddict-item]
            await sub.unsubscribe()

    run(scenario)


def test_binary_body_and_auto_ack_mode(stomp_broker: StompBroker) -> None:
    queue = dest()
    body = bytes(range(256)) * 3 + b"\x00"

    async def scenario() -> None:
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def handler(frame: stompman.MessageFrame) -> None:
            await got.put(frame.body)

        async with client_for(stomp_broker.stomp_port) as client:
            sub = await client.subscribe(queue, handler, ack="auto",
                                         on_suppressed_exception=ignore, receipt_timeout=5)
            await client.send(body, queue, headers={"persistent": "true"}, receipt_timeout=5)
            assert await asyncio.wait_for(got.get(), WAIT) == body
            await sub.unsubscribe()

    run(scenario)


def test_nack_redelivers_then_ack(stomp_broker: StompBroker) -> None:
    queue = dest()

    async def scenario() -> None:
        seen: list[stompman.AckableMessageFrame] = []
        done = asyncio.Event()

        async def handler(frame: stompman.AckableMessageFrame) -> None:
            seen.append(frame)
            if len(seen) == 1:
                await frame.nack()
            else:
                await frame.ack()
                done.set()

        async with client_for(stomp_broker.stomp_port) as client:
            await client.send(b"twice", queue, headers={"persistent": "true"}, receipt_timeout=5)
            sub = await client.subscribe_with_manual_ack(queue, handler, receipt_timeout=5)
            await asyncio.wait_for(done.wait(), WAIT)
            assert [f.body for f in seen] == [b"twice", b"twice"]
            assert "redelivered" not in seen[0].headers
            assert seen[1].headers["redelivered"] == "true"  # type: ignore[typeddict-item]
            await sub.unsubscribe()

    run(scenario)


def test_handler_failure_nacks(stomp_broker: StompBroker) -> None:
    queue = dest()

    async def scenario() -> None:
        calls: list[bytes] = []
        done = asyncio.Event()

        async def handler(frame: stompman.MessageFrame) -> None:
            calls.append(frame.body)
            if len(calls) == 1:
                raise RuntimeError("first attempt fails")
            done.set()

        async with client_for(stomp_broker.stomp_port) as client:
            sub = await client.subscribe(queue, handler, on_suppressed_exception=ignore,
                                         receipt_timeout=5)
            await client.send(b"flaky", queue, headers={"persistent": "true"}, receipt_timeout=5)
            await asyncio.wait_for(done.wait(), WAIT)
            assert calls == [b"flaky", b"flaky"]
            await sub.unsubscribe()

    run(scenario)


def test_transactions_commit_and_abort(stomp_broker: StompBroker) -> None:
    queue = dest()

    async def scenario() -> None:
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def handler(frame: stompman.MessageFrame) -> None:
            await got.put(frame.body)

        async with client_for(stomp_broker.stomp_port) as client:
            sub = await client.subscribe(queue, handler, on_suppressed_exception=ignore,
                                         receipt_timeout=5)
            async with client.begin() as tx:
                await tx.send(b"one", queue, headers={"persistent": "true"})
                await tx.send(b"two", queue, headers={"persistent": "true"})
                await asyncio.sleep(0.2)
                assert got.empty()  # nothing visible before COMMIT
            assert {await asyncio.wait_for(got.get(), WAIT) for _ in range(2)} == {b"one", b"two"}
            with pytest.raises(RuntimeError):
                async with client.begin() as tx:
                    await tx.send(b"aborted", queue)
                    raise RuntimeError("abort it")
            await client.send(b"marker", queue, receipt_timeout=5)
            assert await asyncio.wait_for(got.get(), WAIT) == b"marker"  # not "aborted"
            await sub.unsubscribe()

    run(scenario)


def test_heartbeats_keep_the_connection(stomp_broker: StompBroker) -> None:
    async def scenario() -> None:
        async with client_for(stomp_broker.stomp_port,
                              heartbeat=stompman.Heartbeat(150, 150)) as client:
            await asyncio.sleep(1.2)
            assert client.is_alive()
            await client.send(b"still alive", dest(), receipt_timeout=5)

    run(scenario)


def test_server_list_failover(tmp_path: Path) -> None:
    first = StompBroker(tmp_path / "a").start()
    second = StompBroker(tmp_path / "b").start()
    queue = dest()

    async def scenario() -> None:
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def handler(frame: stompman.MessageFrame) -> None:
            await got.put(frame.body)

        async with client_for(first.stomp_port, second.stomp_port,
                              heartbeat=stompman.Heartbeat(200, 200)) as client:
            sub = await client.subscribe(queue, handler, on_suppressed_exception=ignore,
                                         receipt_timeout=5)
            await client.send(b"on the first", queue, receipt_timeout=5)
            assert await asyncio.wait_for(got.get(), WAIT) == b"on the first"
            first.kill()  # stompman notices, walks its list, resubscribes
            deadline = asyncio.get_running_loop().time() + WAIT
            while True:
                try:
                    await client.send(b"on the second", queue, receipt_timeout=2)
                    break
                except (stompman.SendReceiptError, stompman.FailedAllConnectAttemptsError,
                        stompman.ConnectionLostError):
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            assert await asyncio.wait_for(got.get(), WAIT) == b"on the second"
            await sub.unsubscribe()

    try:
        run(scenario)
    finally:
        first.kill()
        second.kill()
