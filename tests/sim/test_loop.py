"""The deterministic event loop (``txbroker/sim/loop.py``) and its network
(``memnet.py``): virtual time, no threads, no real I/O — and the real broker server
and the real client library running on it, unchanged, reproducibly."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from txbroker.aio import connect
from txbroker.errors import ConnectionLost
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.sim.loop import SimLoop, SimulationError, SimulationStalled
from txbroker.sim.memnet import HOST
from txbroker.storage.memory import MemoryState, MemoryStore

BROKER = "127.0.0.10"
#: The virtual clock's epoch for the broker's wall clock (ms): 2026-01-01.
EPOCH_MS = 1_767_225_600_000


def test_an_hour_of_timers_takes_no_wall_time() -> None:
    loop = SimLoop(1)
    woke: list[float] = []

    async def main() -> None:
        for delay in (3600, 0.25, 60):
            await asyncio.sleep(delay)
            woke.append(loop.time())
        async with asyncio.timeout(5):
            await asyncio.sleep(4.5)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.sleep(6)

    started = time.monotonic()
    loop.run(main())
    assert time.monotonic() - started < 1.0
    assert woke == [3600.0, 3600.25, 3660.25]


def test_a_run_that_waits_for_nothing_says_it_is_stalled() -> None:
    loop = SimLoop(1)

    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # never set

    with pytest.raises(SimulationStalled, match="nothing is ready and nothing is scheduled"):
        loop.run(main())


def test_threads_and_real_io_are_not_given() -> None:
    loop = SimLoop(1)
    order: list[str] = []

    async def main() -> None:
        running = asyncio.get_running_loop()
        future = running.run_in_executor(None, order.append, "inline")
        assert future.done()  # ran at once, on this thread
        order.append("after")
        running.call_soon_threadsafe(order.append, "soon")
        await asyncio.sleep(0)
        with pytest.raises(SimulationError, match="real I/O"):
            running.add_reader(0, print)
        with pytest.raises(SimulationError, match="real I/O"):
            await running.getaddrinfo("example.com", 80)
        with pytest.raises(SimulationError, match="TLS"):
            await asyncio.open_connection(BROKER, 1, ssl=True)

    loop.run(main())
    assert order == ["inline", "after", "soon"]


def test_bytes_arrive_in_order_are_held_by_a_partition_and_reset_by_a_crash() -> None:
    loop = SimLoop(7)
    got: list[bytes] = []

    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(100):
                writer.write(data.upper())

        async def serve() -> int:
            server = await asyncio.start_server(echo, BROKER, 0)
            return int(server.sockets[0].getsockname()[1])

        echo_process, started = loop.spawn(BROKER, serve())
        port = await started
        HOST.set("127.0.0.20")
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(BROKER, port + 1)
        reader, writer = await asyncio.open_connection(BROKER, port)
        for word in (b"a", b"b", b"c"):
            writer.write(word)
        while len(got) < 3:
            got.append(await reader.readexactly(1))
        loop.network.partition("127.0.0.20", BROKER, one_way=True)
        seen = len(loop.network.trace)
        writer.write(b"held")
        await asyncio.sleep(10)
        assert loop.network.trace[seen:] == []  # nothing delivered while cut
        loop.network.heal()
        got.append(await reader.readexactly(4))
        loop.kill(echo_process)
        with pytest.raises(ConnectionResetError):
            await reader.read(10)
        with pytest.raises(ConnectionRefusedError):  # its listener died with it
            await asyncio.open_connection(BROKER, port)

    loop.run(main())
    assert got == [b"A", b"B", b"C", b"HELD"]


def test_connections_closed_on_both_sides_are_let_go() -> None:
    """A run that connects for ever (a stuck replicated run retries its links) keeps
    only the ends still open, not every end it ever made (24 KB a step before)."""
    loop = SimLoop(3)
    kept: list[int] = []

    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()
            writer.close()

        async def serve() -> int:
            server = await asyncio.start_server(echo, BROKER, 0)
            return int(server.sockets[0].getsockname()[1])

        _, started = loop.spawn(BROKER, serve())
        port = await started
        HOST.set("127.0.0.20")
        _, open_writer = await asyncio.open_connection(BROKER, port)  # stays open
        for _ in range(500):
            reader, writer = await asyncio.open_connection(BROKER, port)
            writer.close()
            await reader.read()
            await asyncio.sleep(0.01)
        kept.append(len(loop.network.ends))
        assert not open_writer.is_closing()

    loop.run(main())
    assert 2 <= kept[0] <= 70  # the open pair, and at most a round's worth of closed ones


def _memory_store(state: MemoryState) -> Callable[..., Any]:
    """A ``BrokerServer`` store opener: a MemoryStore over ``state``."""
    def opener(dispatch: Callable[[Callable[[], None]], None], snapshot: Any,
               lock: Any = None) -> MemoryStore:
        return MemoryStore(state, dispatch=dispatch, snapshot_provider=snapshot)

    return opener


def _run_real_broker_and_client(seed: int, monkeypatch: pytest.MonkeyPatch
                                ) -> tuple[list[bytes], str, float]:
    """The real BrokerServer (its native edge, operation layer and core, over a memory
    store) and the real async client library, on one SimLoop: 50 sends, then
    receives and acks. Returns what was received, the network trace's hash and the
    virtual time it took."""
    loop = SimLoop(seed)
    state = MemoryState()
    received: list[bytes] = []

    async def main() -> None:
        HOST.set(BROKER)
        server = BrokerServer(ServerConfig(host=BROKER, port=5445, stomp_port=0,
                                           amqp_port=0), store_opener=_memory_store(state))
        server.clock = lambda: EPOCH_MS + int(loop.time() * 1000)
        await server.start()
        HOST.set("127.0.0.20")
        async with connect(f"txb://{BROKER}:{server.port}") as conn:
            await asyncio.gather(*(conn.send("orders", f"m{i}".encode())
                                   for i in range(50)))
            while len(received) < 50:
                message = await conn.receive("orders", timeout=5)
                assert message is not None
                received.append(message.body)
                await message.ack()
        await server.stop()

    with monkeypatch.context() as patched:  # the simulated path reads no real clock
        for module, name in ((time, "time_ns"), (uuid, "uuid4"), (os, "urandom"),
                             (random, "random"), (random, "uniform")):
            patched.setattr(module, name, _forbidden(f"{module.__name__}.{name}"))
        loop.run(main())
    return received, loop.network.trace_hash(), loop.time()


def _forbidden(name: str) -> Callable[..., Any]:
    def called(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} called on the simulated path")

    return called


def test_the_real_server_and_client_run_on_it_and_one_seed_replays_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first, first_hash, first_time = _run_real_broker_and_client(3, monkeypatch)
    again, again_hash, again_time = _run_real_broker_and_client(3, monkeypatch)
    other, other_hash, _ = _run_real_broker_and_client(4, monkeypatch)
    assert first == again == other == [f"m{i}".encode() for i in range(50)]
    assert first_hash == again_hash and first_time == again_time
    assert other_hash != first_hash  # another seed: other delays


def test_a_client_sees_a_crashed_broker_as_a_lost_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loop = SimLoop(5)

    async def broker() -> None:
        server = BrokerServer(ServerConfig(host=BROKER, port=5445, stomp_port=0, amqp_port=0),
                              store_opener=_memory_store(MemoryState()))
        await server.start()
        await server.serve_forever()

    async def main() -> None:
        process, _ = loop.spawn(BROKER, broker())
        await asyncio.sleep(0.01)
        HOST.set("127.0.0.20")
        conn = await connect(f"txb://{BROKER}:5445", reconnect=False)
        await conn.send("q", b"one")
        loop.kill(process)
        with pytest.raises(ConnectionLost):
            for _ in range(100):
                await conn.ping()
                await asyncio.sleep(0.01)
        await conn.close()

    loop.run(main())
