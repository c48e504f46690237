"""Hosts that refuse ``hello`` because they are a standby (or stopping), and the
``failover_timeout`` option: the client moves on to the next address at once, in the
first connect and when failing over; a refusal is never fatal."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from fakeserver import FakeBroker, FakeServer, run

import txbroker.aio
from txbroker.client.options import DEFAULT_FAILOVER_TIMEOUT, ConnectOptions
from txbroker.errors import ConnectionLost, ErrorCode

pytestmark = pytest.mark.timeout(30)

#: How a refusing server says it: answering hello, or before it (request id 0).
WAYS = ["refuse_hello", "refuse_at_open"]


async def servers(count: int) -> tuple[FakeBroker, list[FakeServer]]:
    """``count`` listeners on one FakeBroker (one shared store)."""
    broker = FakeBroker()
    return broker, [await FakeServer(broker).start() for _ in range(count)]


def refuse(server: FakeServer, way: str, code: ErrorCode | None = ErrorCode.STANDBY) -> None:
    setattr(server, way, code)


async def until(condition: object, what: str) -> None:
    """Wait (bounded: 10 s) until ``condition()`` is true."""
    for _ in range(2000):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


@pytest.mark.parametrize("way", WAYS)
def test_connect_moves_past_a_standby_at_once(way: str) -> None:
    async def main() -> None:
        _, (standby, active) = await servers(2)
        refuse(standby, way)
        async with txbroker.aio.connect(f"txb://{standby.address},{active.address}") as conn:
            assert conn.host == active.address
            assert standby.refusals == 1  # asked once, then the next address
            await conn.ping()  # the refusal is not left over for a later call
            await conn.send("q", b"x")
            assert len(active.hellos) == 1

    run(main())


@pytest.mark.parametrize("way", WAYS)
def test_connect_error_names_the_standby_refusal(way: str) -> None:
    async def main() -> None:
        _, (standby, stopping, dead) = await servers(3)
        refuse(standby, way)
        refuse(stopping, way, ErrorCode.SHUTTING_DOWN)
        await dead.kill()
        url = f"txb://{standby.address},{stopping.address},{dead.address}"
        with pytest.raises(ConnectionLost) as info:
            await txbroker.aio.connect(url, timeout=5)
        text = str(info.value)
        assert f"{standby.address}: refused: it is a standby" in text
        assert f"{stopping.address}: refused: it is shutting down" in text
        assert dead.address in text

    run(main())


def test_failover_skips_a_standby_for_the_next_active_host() -> None:
    async def main() -> None:
        broker, (a, standby, b) = await servers(3)
        refuse(standby, "refuse_hello")
        moves: list[tuple[str, str]] = []
        url = f"txb://{a.address},{standby.address},{b.address}"
        async with txbroker.aio.connect(
            url, on_failover=lambda old, new: moves.append((old, new))
        ) as conn:
            sub = await conn.subscribe("work")
            await conn.send("work", b"1")
            first = await sub.get(timeout=2)
            assert first is not None
            await a.kill()
            await conn.ping()  # waits through the failover
            assert conn.host == b.address
            assert moves == [(a.address, b.address)]
            assert standby.refusals == 1
            again = await sub.get(timeout=2)
            assert again is not None and (again.body, again.redelivered) == (b"1", True)
            await again.ack(wait=True)
            assert broker.in_flight("work") == 0

    run(main())


@pytest.mark.parametrize("way", WAYS)
def test_failover_waits_for_the_standby_to_take_over(way: str) -> None:
    async def main() -> None:
        _, (active, standby) = await servers(2)
        refuse(standby, way)
        moves: list[tuple[str, str]] = []
        async with txbroker.aio.connect(
            f"txb://{active.address},{standby.address}", failover_timeout=20,
            on_failover=lambda old, new: moves.append((old, new)),
        ) as conn:
            await conn.send("q", b"stored", message_id="m1")
            await active.kill()
            # the client goes round the list (with back-off) while the standby refuses
            await until(lambda: standby.refusals >= 3, "three refusals")
            assert conn.host is None
            refuse(standby, way, None)  # the standby took over
            await asyncio.wait_for(conn.ping(), 10)
            assert moves == [(active.address, standby.address)]
            message = await conn.receive("q", timeout=1)
            assert message is not None and message.body == b"stored"

    run(main())


def test_failover_timeout_error_names_the_standby() -> None:
    async def main() -> None:
        _, (active, standby) = await servers(2)
        refuse(standby, "refuse_hello")
        async with txbroker.aio.connect(
            f"txb://{active.address},{standby.address}", failover_timeout=0.3
        ) as conn:
            await active.kill()
            with pytest.raises(ConnectionLost) as info:
                await asyncio.wait_for(conn.receive("q"), 5)
            text = str(info.value)
            assert "within 0.3 s" in text
            assert f"{standby.address}: refused: it is a standby" in text
            assert active.address in text
            assert standby.refusals >= 1

    run(main())


def test_failover_timeout_option_and_its_deprecated_alias() -> None:
    assert ConnectOptions().failover_timeout == DEFAULT_FAILOVER_TIMEOUT == 60.0
    options = ConnectOptions.from_kwargs({"failover_timeout": 5})
    assert options.failover_timeout == options.reconnect_timeout == 5
    with pytest.warns(DeprecationWarning, match="use 'failover_timeout'"):
        options = ConnectOptions.from_kwargs({"reconnect_timeout": 7})
    assert options.failover_timeout == 7
    with pytest.raises(TypeError, match="not both"), warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning
        ConnectOptions.from_kwargs({"failover_timeout": 5, "reconnect_timeout": 7})
    with pytest.raises(ValueError, match="failover_timeout"):
        ConnectOptions.from_kwargs({"failover_timeout": -1})
    with pytest.raises(ValueError, match="failover_timeout"), \
            pytest.warns(DeprecationWarning):
        ConnectOptions.from_kwargs({"reconnect_timeout": float("nan")})
    with pytest.raises(TypeError, match="not both"):
        txbroker.aio.connect("txb://127.0.0.1:1", failover_timeout=1, reconnect_timeout=1)
    with pytest.raises(TypeError, match="not both"):
        txbroker.connect("txb://127.0.0.1:1", failover_timeout=1, reconnect_timeout=1)


def test_deprecated_alias_still_bounds_the_failover() -> None:
    async def main() -> None:
        _, (only,) = await servers(1)
        with pytest.warns(DeprecationWarning):
            pending = txbroker.aio.connect(f"txb://{only.address}", reconnect_timeout=0.2)
        async with pending as conn:
            await only.kill()
            with pytest.raises(ConnectionLost, match=r"within 0\.2 s"):
                await asyncio.wait_for(conn.receive("q"), 5)

    run(main())
