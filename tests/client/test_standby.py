"""Hosts that refuse ``hello`` because they are a standby (or stopping), and the
``failover_timeout`` option: the client moves on to the next address at once, in the
first connect and when failing over; a refusal is never fatal.

The brokers are real ones in memory (tests/inmemory.py): a standby is the real standby
edge (``StandbyConnection``) beside the active on one store, a full broker is a real
broker at ``max_connections``. :class:`StoppingPeer` is the one scripted peer, a test
of the client's wire edge: no broker's native edge refuses ``hello`` with
``ShuttingDown``, but the client must read that refusal as the others."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
from tests.inmemory import InMemoryNetwork, Node, run, until

import txbroker.aio
from txbroker.client.options import DEFAULT_FAILOVER_TIMEOUT, ConnectOptions
from txbroker.errors import ConnectionLost, ErrorCode
from txbroker.protocol.native import Err, NativeConnection, Request, Role

pytestmark = pytest.mark.timeout(30)

#: How a refusing broker says it: a standby answering hello, or a full broker before it
#: (request id 0, ``max_connections``).
WAYS = ["standby", "full"]


def connect(net: InMemoryNetwork, *nodes: Node, **options: Any) -> Any:
    """``txbroker.aio.connect`` to the failover list ``nodes`` over the in-memory network."""
    return txbroker.aio.connect(net.url(*nodes), transport=net, **options)


async def refusing(net: InMemoryNetwork, way: str) -> Node:
    """A node that refuses every client, ``way``: a standby (of its own store) or a full
    broker (``max_connections`` reached: 0)."""
    if way == "standby":
        return net.node().standby()
    return await net.broker(max_connections=0)


#: What each way's refusal reads like in the client's error (``_failover.describe_refusal``).
REFUSAL_TEXT = {"standby": "refused: it is a standby",
                "full": "too many connections (max_connections)"}


class StoppingPeer(asyncio.Protocol):
    """The wire-edge test's peer: refuses ``hello`` with ``ShuttingDown``, then closes."""

    def __init__(self) -> None:
        self.codec = NativeConnection(Role.SERVER)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.codec.receive_data(data)
        for request in self.codec.drain():
            assert isinstance(request, Request)
            self.transport.write(self.codec.send(Err(request.rid, ErrorCode.SHUTTING_DOWN,
                                                     "the broker is shutting down")))
            self.transport.close()


@pytest.mark.parametrize("way", WAYS)
def test_connect_moves_past_a_standby_at_once(way: str) -> None:
    async def main(net: InMemoryNetwork) -> None:
        standby, active = await refusing(net, way), await net.broker()
        async with connect(net, standby, active) as conn:
            assert conn.host == active.address
            assert standby.log.refusals == 1  # asked once, then the next address
            await conn.ping()  # the refusal is not left over for a later call
            await conn.send("q", b"x")
            assert len(active.log.hellos) == 1

    run(main)


@pytest.mark.parametrize("way", WAYS)
def test_connect_error_names_the_standby_refusal(way: str) -> None:
    async def main(net: InMemoryNetwork) -> None:
        standby = await refusing(net, way)
        stopping = net.node().serve_with(StoppingPeer)
        dead = await net.broker()
        await dead.kill()
        with pytest.raises(ConnectionLost) as info:
            await connect(net, standby, stopping, dead, timeout=5)
        text = str(info.value)
        assert f"{standby.address}: {REFUSAL_TEXT[way]}" in text
        assert f"{stopping.address}: refused: it is shutting down" in text
        assert dead.address in text
        assert (standby.log.refusals, stopping.log.refusals) == (1, 1)

    run(main)


def test_failover_skips_a_standby_for_the_next_active_host() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a = await net.broker()
        standby = net.node(a.state).standby()
        b = net.node(a.state)  # the pair's other broker: it takes over when A dies
        moves: list[tuple[str, str]] = []
        async with connect(net, a, standby, b,
                           on_failover=lambda old, new: moves.append((old, new))) as conn:
            sub = await conn.subscribe("work")
            await conn.send("work", b"1")
            first = await sub.get(timeout=2)
            assert first is not None
            await b.take_over(a)
            await conn.ping()  # waits through the failover
            assert conn.host == b.address
            assert moves == [(a.address, b.address)]
            assert standby.log.refusals == 1
            again = await sub.get(timeout=2)
            assert again is not None and (again.body, again.redelivered) == (b"1", True)
            await again.ack(wait=True)
            assert b.info("work")["in_flight"] == 0

    run(main)


@pytest.mark.parametrize("way", WAYS)
def test_failover_waits_for_the_standby_to_take_over(way: str) -> None:
    async def main(net: InMemoryNetwork) -> None:
        active = await net.broker()
        if way == "standby":
            standby = net.node(active.state).standby()
        else:  # it takes the store over at once, but is full: another client is on it
            standby = net.node(active.state, max_connections=1)
        moves: list[tuple[str, str]] = []
        async with connect(net, active, standby, failover_timeout=20,
                           on_failover=lambda old, new: moves.append((old, new))) as conn:
            await conn.send("q", b"stored", message_id="m1")
            if way == "standby":
                await active.kill()
            else:
                dead = active.crash()
                await standby.start()
                other = standby.accept(asyncio.get_running_loop())  # before our client
                await Node.bury(dead)
            # the client goes round the list (with back-off) while the standby refuses
            await until(lambda: standby.log.refusals >= 3, "three refusals")
            assert conn.host is None
            if way == "standby":
                await standby.start()  # the standby took over
            else:
                other.close()  # the other client left: there is room
            await asyncio.wait_for(conn.ping(), 10)
            assert moves == [(active.address, standby.address)]
            message = await conn.receive("q", timeout=1)
            assert message is not None and message.body == b"stored"

    run(main)


def test_failover_timeout_error_names_the_standby() -> None:
    async def main(net: InMemoryNetwork) -> None:
        active = await net.broker()
        standby = net.node(active.state).standby()
        async with connect(net, active, standby, failover_timeout=0.3) as conn:
            await active.kill()
            with pytest.raises(ConnectionLost) as info:
                await asyncio.wait_for(conn.receive("q"), 5)
            text = str(info.value)
            assert "within 0.3 s" in text
            assert f"{standby.address}: refused: it is a standby" in text
            assert active.address in text
            assert standby.log.refusals >= 1

    run(main)


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
    async def main(net: InMemoryNetwork) -> None:
        only = await net.broker()
        with pytest.warns(DeprecationWarning):
            pending = connect(net, only, reconnect_timeout=0.2)
        async with pending as conn:
            await only.kill()
            with pytest.raises(ConnectionLost, match=r"within 0\.2 s"):
                await asyncio.wait_for(conn.receive("q"), 5)

    run(main)
