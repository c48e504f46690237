"""Failover between the two real brokers of a shared-store pair in memory
(tests/inmemory.py): the active dies (a crash), the standby takes its store over."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.inmemory import InMemoryNetwork, Node, run, until

import txbroker.aio
from txbroker.errors import ConnectionLost, IllegalState, TransactionRolledBack

pytestmark = pytest.mark.timeout(30)


async def pair(net: InMemoryNetwork) -> tuple[Node, Node]:
    """An active broker and its standby on the same store."""
    active = await net.broker()
    return active, net.node(active.state).standby()


async def fail_over(active: Node, standby: Node) -> None:
    """The active crashes; the standby takes the store over (recovers it, then serves)."""
    await standby.take_over(active)


def connect(net: InMemoryNetwork, *nodes: Node, **options: Any) -> Any:
    """``txbroker.aio.connect`` to the failover list ``nodes`` over the in-memory network."""
    return txbroker.aio.connect(net.url(*nodes), transport=net, **options)


def test_failover_moves_to_the_next_host_and_restores_state() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        moves: list[tuple[str, str]] = []
        async with connect(net, a, b, on_failover=lambda old, new: moves.append((old, new))
                           ) as conn:
            assert conn.host == a.address
            sub = await conn.subscribe("work", prefetch=10)
            await conn.send("work", b"before")
            before = await sub.get(timeout=1)
            assert before is not None and not before.redelivered
            tx = conn.transaction()
            await tx.send("work", b"in-tx")

            # A send whose effect happens on A but whose reply is lost with A.
            a.stall()  # from now on A's bytes never reach the client
            pending = conn.send_nowait("work", b"retried", message_id="id-1")
            await until(lambda: a.log.answered("send", message_id="id-1"), "id-1 stored on A")
            assert not pending.done()
            await fail_over(a, b)

            await asyncio.wait_for(pending, 5)  # re-sent to B, deduplicated
            assert pending.result() is None
            assert moves == [(a.address, b.address)]
            assert conn.host == b.address
            assert len(b.log.hellos) == 1

            # The unacked message comes back, redelivered, on the restored subscription.
            bodies = set()
            for _ in range(2):
                message = await sub.get(timeout=2)
                assert message is not None
                bodies.add((message.body, message.redelivered))
                await message.ack()
            # A had delivered both before it died; the buffered copies were dropped.
            assert bodies == {(b"before", True), (b"retried", True)}
            # Exactly one copy of the re-sent message: the broker dropped the duplicate.
            await conn.ping()  # the pipelined acks are processed before the ping
            assert (b.info("work")["depth"], b.info("work")["in_flight"]) == (0, 0)
            sent = a.log.ops("send") + b.log.ops("send")
            assert sum(1 for args in sent if args.get("message_id") == "id-1") == 2

            with pytest.raises(IllegalState):
                await before.ack()  # delivered on the old connection
            with pytest.raises(TransactionRolledBack):
                await tx.commit()
            await tx.rollback()  # nothing to do any more

            await conn.send("work", b"after")
            message = await sub.get(timeout=1)
            assert message is not None and message.body == b"after"
            await message.ack(wait=True)

    run(main)


def test_pending_requests_without_message_id_fail_and_receive_is_retried() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b) as conn:
            a.stall()
            lost = conn.send_nowait("q", b"no id")
            waiting = asyncio.ensure_future(conn.receive("other", timeout=5))
            await until(lambda: a.log.answered("send", dest="q"), "the send stored on A")
            await until(lambda: a.log.seen("receive", queue="other"), "the receive on A")
            await fail_over(a, b)
            with pytest.raises(ConnectionLost, match="not retried"):
                await lost
            await conn.send("other", b"x")
            message = await asyncio.wait_for(waiting, 5)
            assert message is not None and message.body == b"x"

    run(main)


def test_no_host_answers_raises_connection_lost_everywhere() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b, failover_timeout=0.3) as conn:
            sub = await conn.subscribe("q")
            waiting = asyncio.ensure_future(conn.receive("q"))
            await until(lambda: a.log.seen("receive", queue="q"), "the receive on A")
            await b.kill()
            await a.kill()
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(waiting, 5)
            with pytest.raises(ConnectionLost):
                await sub.get()
            with pytest.raises(ConnectionLost):
                await conn.ping()

    run(main)


def test_reconnect_false_fails_at_once() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        conn = await connect(net, a, b, reconnect=False)
        waiting = asyncio.ensure_future(conn.receive("q"))
        await until(lambda: a.log.seen("receive", queue="q"), "the receive on A")
        await a.kill()
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(waiting, 2)
        with pytest.raises(ConnectionLost):
            await conn.ping()
        await conn.close()

    run(main)


def test_single_host_comes_back() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        moves: list[tuple[str, str]] = []
        async with connect(net, server, on_failover=lambda *hosts: moves.append(hosts)) as conn:
            await server.kill()
            await asyncio.sleep(0.2)  # a few rounds of back-off
            assert conn.host is None
            await server.start()  # restarted on its store
            await asyncio.wait_for(conn.ping(), 5)
            assert moves == [(server.address, server.address)]

    run(main)


def test_dropped_connection_with_live_listener_and_callback_error() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()

        def broken(old: str, new: str) -> None:
            raise RuntimeError("callback bug")

        async with connect(net, server, on_failover=broken) as conn:
            sub = await conn.subscribe("q", ack="auto")
            server.drop_connections()
            await conn.send("q", b"1", message_id="m")  # waits for the failover, then sends
            message = await sub.get(timeout=2)
            assert message is not None and message.body == b"1"
            assert len(server.log.hellos) == 2

    run(main)


def test_close_during_failover() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        conn = await connect(net, server)
        waiting = asyncio.ensure_future(conn.receive("q"))
        await asyncio.sleep(0.02)
        await server.kill()
        await asyncio.sleep(0.1)
        await conn.close()
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(waiting, 2)

    run(main)


# ----------------------------------------------------------- transactions (seed 004)
# "A (non-XA) transaction is considered active when at least one message has been sent
# or received by the session ... After a failover, attempting to commit the active
# transaction results in a TransactionRolledBackException."


def test_transaction_that_did_nothing_goes_on_after_a_failover() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b) as conn:
            async with conn.transaction() as tx:  # tx_begin sent on A
                await until(lambda: a.log.answered("tx_begin"), "tx_begin on A")
                await fail_over(a, b)
                await conn.ping()  # through the failover (a send racing it would count)
                await tx.send("out", b"after")  # begun again on B
                assert conn.host == b.address
            assert b.bodies("out") == [b"after"]
            idle = conn.transaction()
            await idle.begin()
            b.drop_connections()
            await conn.ping()
            await idle.commit()  # nothing to commit: no error
            assert idle.state.value == "committed"

    run(main)


def test_transaction_that_received_is_rolled_back_and_its_message_redelivered() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b) as conn:
            await conn.send("in", b"m")
            tx = conn.transaction()
            message = await tx.receive("in", timeout=1)
            assert message is not None
            await until(lambda: a.log.seen("ack", tx=tx.tx_id), "the staged ack on A")
            await fail_over(a, b)
            await conn.ping()  # failed over (a commit written to the dead session first
            # would be in doubt: test_failover_real.py's in-doubt test)
            with pytest.raises(TransactionRolledBack):
                await tx.commit()
            with pytest.raises(TransactionRolledBack):  # and again: it stays rolled back
                await tx.commit()
            with pytest.raises(TransactionRolledBack):
                await tx.send("out", b"x")
            await tx.rollback()  # nothing to do
            again = await conn.receive("in", timeout=1)
            assert again is not None and (again.body, again.redelivered) == (b"m", True)
            await again.ack(wait=True)

    run(main)


def test_transaction_that_sent_raises_at_its_next_operation() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b) as conn:
            with pytest.raises(TransactionRolledBack):
                async with conn.transaction() as tx:
                    await tx.send("out", b"lost")
                    await fail_over(a, b)
                    await conn.ping()
                    await conn.send("in", b"waiting")
                    await tx.receive("in", timeout=1)  # refused: nothing taken
            assert b.bodies("out") == []
            await conn.ping()
            assert b.info("in")["in_flight"] == 0  # the message was not taken
            message = await conn.receive("in", timeout=1)
            assert message is not None and not message.redelivered

    run(main)


def test_receive_of_an_idle_transaction_waiting_through_a_failover() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b) as conn:
            tx = conn.transaction()
            await tx.begin()
            waiting = asyncio.ensure_future(tx.receive("in", timeout=5))
            await until(lambda: a.log.seen("receive", queue="in"), "the receive on A")
            await fail_over(a, b)
            await conn.send("in", b"m", message_id="m")
            message = await asyncio.wait_for(waiting, 5)
            assert message is not None and message.body == b"m"
            await tx.send("out", b"moved")
            await tx.commit()  # begun again on B with the message in it
            assert b.bodies("out") == [b"moved"]
            assert b.bodies("in") == [] and b.info("in")["in_flight"] == 0

    run(main)


def test_receive_of_a_worked_transaction_through_a_failover_gives_the_message_back() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b) as conn:
            tx = conn.transaction()
            await tx.send("out", b"x")
            waiting = asyncio.ensure_future(tx.receive("in", timeout=5))
            await until(lambda: a.log.seen("receive", queue="in"), "the receive on A")
            await fail_over(a, b)
            await conn.send("in", b"m", message_id="m")
            with pytest.raises(TransactionRolledBack):
                await asyncio.wait_for(waiting, 5)
            await conn.ping()  # the give-back (no reply wanted) is processed before it
            assert b.info("in")["in_flight"] == 0
            again = await conn.receive("in", timeout=1)
            assert again is not None and again.body == b"m"

    run(main)


def test_sync_subscription_drops_messages_of_the_old_session() -> None:
    async def main(net: InMemoryNetwork) -> None:
        a, b = await pair(net)
        async with connect(net, a, b) as conn:
            sub = await conn.subscribe("q", prefetch=10)
            for i in range(3):
                await conn.send("q", b"%d" % i)
            batch = await sub.get_batch(10, timeout=1)  # what the sync face holds locally
            while len(batch) < 3:
                batch += await sub.get_batch(10, timeout=1)
            await fail_over(a, b)
            await conn.ping()
            assert all(m._given_back() for m in batch)
            again = [await sub.get(timeout=1) for _ in range(3)]
            assert [(m.body, m.redelivered) for m in again if m] == [
                (b"0", True), (b"1", True), (b"2", True)]

    run(main)
