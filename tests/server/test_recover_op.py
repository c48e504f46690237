"""The ``recover`` op (JMS ``Session.recover()``) against a real broker process: on the
wire, and through the sync and async clients (also after a failover)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import txbroker
import txbroker.aio
from tests.support import STORES, BrokerProcess, RawClient
from txbroker.errors import IllegalState

pytestmark = pytest.mark.timeout(120)

PUSH = 3


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """Every case runs on the journal and on the dir store (FDATASYNC,DSYNC; issue 17)."""
    return str(request.param)



def pushes(raw: RawClient, count: int) -> list[dict[str, Any]]:
    """The next ``count`` deliver pushes (nothing else is expected meanwhile)."""
    found = []
    while len(found) < count:
        frame = raw.read_frame()
        assert frame is not None, "connection closed"
        assert frame[0] == PUSH and frame[2] == "deliver", frame
        found.append(frame[3])
    return found


def test_recover_on_the_wire(broker: BrokerProcess) -> None:
    raw = RawClient(broker.port)
    try:
        assert raw.call(1, "hello", version=1)[0] == 1
        for i in range(3):
            assert raw.call(10 + i, "send", dest="q", body=b"m%d" % i)[0] == 1
        assert raw.call(20, "subscribe", queue="q", sub=1, prefetch=10)[0] == 1
        first = pushes(raw, 3)
        assert raw.call(21, "ack", tags=[first[1]["tag"]])[0] == 1

        reply = raw.call(22, "recover")

        assert reply[0] == 1
        assert reply[3] == {"recovered": 2, "next_tag": first[-1]["tag"] + 1}
        again = pushes(raw, 2)  # after the reply: the broker writes the reply first
        assert [(m["body"], m["redelivered"], m["delivery_count"]) for m in again] == [
            (b"m0", True, 2), (b"m2", True, 2)]
        assert all(m["tag"] >= reply[3]["next_tag"] for m in again)
        refused = raw.call(23, "ack", tags=[first[0]["tag"]])  # given back
        assert refused[0] == 2 and refused[3]["code"] == 22
        assert raw.call(24, "ack", tags=[m["tag"] for m in again])[0] == 1
        assert raw.call(25, "recover")[3] == {"recovered": 0,
                                              "next_tag": again[-1]["tag"] + 1}
    finally:
        raw.close()


def test_sync_recover_drops_buffered_and_refuses_old_acks(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        for i in range(5):
            conn.send("q", b"m%d" % i)
        received = conn.receive("q", timeout=5)  # m0, by receive
        assert received is not None
        sub = conn.subscribe("q", prefetch=10)
        handed = sub.get(timeout=5)  # m1; m2..m4 stay buffered
        assert handed is not None and handed.body == b"m1"
        acked = sub.get(timeout=5)
        assert acked is not None and acked.body == b"m2"
        acked.ack()  # pipelined: sent before the recover

        assert conn.recover() == 4  # m0, m1, m3, m4

        with pytest.raises(IllegalState, match="recover"):
            handed.ack()
        with pytest.raises(IllegalState, match="recover"):
            received.ack()
        again = [sub.get(timeout=5) for _ in range(4)]
        assert [(m.body, m.redelivered, m.delivery_count) for m in again if m] == [
            (b"m0", True, 2), (b"m1", True, 2), (b"m3", True, 2), (b"m4", True, 2)]
        for message in again:
            assert message is not None
            message.ack()
        assert sub.get(timeout=0.2) is None  # the buffered copies were dropped
        conn.ping()
        info = conn.queue_info("q")
        assert (info["depth"], info["in_flight"]) == (0, 0)


def test_async_recover_and_transactions(broker: BrokerProcess) -> None:
    async def main() -> None:
        async with txbroker.aio.connect(broker.url) as conn:
            for i in range(3):
                await conn.send("q", b"m%d" % i)
            tx = conn.transaction()
            in_tx = await tx.receive("q", timeout=5)  # consumed by the transaction
            loose = await conn.receive("q", timeout=5)
            assert in_tx is not None and loose is not None
            assert await conn.recover() == 1
            with pytest.raises(IllegalState):
                await tx.ack(loose)  # given back: not for a transaction either
            await tx.commit()
            bodies = []
            while (message := await conn.receive("q", timeout=0.5)) is not None:
                bodies.append((message.body, message.redelivered))
                await message.ack(wait=True)
            assert bodies == [(b"m1", True), (b"m2", False)]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_messages_of_a_session_lost_in_a_restart_are_not_recovered_twice(
        broker: BrokerProcess) -> None:
    moved = threading.Event()
    with txbroker.connect(broker.url, failover_timeout=60,
                          on_failover=lambda old, new: moved.set()) as conn:
        conn.send("q", b"before")  # durable once send returns
        message = conn.receive("q", timeout=5)
        assert message is not None
        broker.kill()
        broker.start()
        assert moved.wait(60), "the client did not fail over to the restarted broker"
        assert conn.recover() == 0  # the new session has no unacked delivery
        message.ack(wait=True)  # seed 004: one receiver, the ack by its id succeeds
        assert conn.receive("q", timeout=0.2) is None
