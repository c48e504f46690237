"""Failover between fake brokers sharing one store (FakeBroker)."""

from __future__ import annotations

import asyncio

import pytest
from fakeserver import FakeBroker, FakeServer, run

import txbroker.aio
from txbroker.errors import ConnectionLost, IllegalState, TransactionRolledBack

pytestmark = pytest.mark.timeout(30)


async def logged(broker: FakeBroker, op: str, **args: object) -> None:
    """Wait until the fake brokers have received request ``op`` (with ``args``): a kill
    must come after it, not after a guessed sleep."""
    for _ in range(500):
        if any(seen == op and all(a.get(k) == v for k, v in args.items())
               for seen, a in broker.log):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{op} {args} never reached the broker: {broker.log}")


async def pair() -> tuple[FakeBroker, FakeServer, FakeServer]:
    broker = FakeBroker()
    return broker, await FakeServer(broker).start(), await FakeServer(broker).start()


def test_failover_moves_to_the_next_host_and_restores_state() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        moves: list[tuple[str, str]] = []
        url = f"txb://{a.address},{b.address}"
        async with txbroker.aio.connect(
            url, on_failover=lambda old, new: moves.append((old, new))
        ) as conn:
            assert conn.host == a.address
            sub = await conn.subscribe("work", prefetch=10)
            await conn.send("work", b"before")
            before = await sub.get(timeout=1)
            assert before is not None and not before.redelivered
            tx = conn.transaction()
            await tx.send("work", b"in-tx")

            # A send whose effect happens on A but whose reply is lost with A.
            a.hold_ops.add("send")
            pending = conn.send_nowait("work", b"retried", message_id="id-1")
            await logged(broker, "send", message_id="id-1")
            assert not pending.done()
            await a.kill()

            await asyncio.wait_for(pending, 5)  # re-sent to B, deduplicated
            assert pending.result() is None
            assert moves == [(a.address, b.address)]
            assert conn.host == b.address
            assert b.hellos and len(b.hellos) == 1

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
            assert broker.queues["work"].ready == []
            assert broker.in_flight("work") == 0
            assert sum(1 for op, args in broker.log if args.get("message_id") == "id-1") == 2

            with pytest.raises(IllegalState):
                await before.ack()  # delivered on the old connection
            with pytest.raises(TransactionRolledBack):
                await tx.commit()
            await tx.rollback()  # nothing to do any more

            await conn.send("work", b"after")
            message = await sub.get(timeout=1)
            assert message is not None and message.body == b"after"
            await message.ack(wait=True)

    run(main())


def test_pending_requests_without_message_id_fail_and_receive_is_retried() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        async with txbroker.aio.connect(f"txb://{a.address},{b.address}") as conn:
            a.hold_ops.add("send")
            lost = conn.send_nowait("q", b"no id")
            waiting = asyncio.ensure_future(conn.receive("other", timeout=5))
            await logged(broker, "send", dest="q")
            await logged(broker, "receive", queue="other")
            await a.kill()
            with pytest.raises(ConnectionLost, match="not retried"):
                await lost
            await conn.send("other", b"x")
            message = await asyncio.wait_for(waiting, 5)
            assert message is not None and message.body == b"x"

    run(main())


def test_no_host_answers_raises_connection_lost_everywhere() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        async with txbroker.aio.connect(
            f"txb://{a.address},{b.address}", failover_timeout=0.3
        ) as conn:
            sub = await conn.subscribe("q")
            waiting = asyncio.ensure_future(conn.receive("q"))
            await logged(broker, "receive", queue="q")
            await b.kill()
            await a.kill()
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(waiting, 5)
            with pytest.raises(ConnectionLost):
                await sub.get()
            with pytest.raises(ConnectionLost):
                await conn.ping()

    run(main())


def test_reconnect_false_fails_at_once() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        conn = await txbroker.aio.connect(f"txb://{a.address},{b.address}", reconnect=False)
        waiting = asyncio.ensure_future(conn.receive("q"))
        await logged(broker, "receive", queue="q")
        await a.kill()
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(waiting, 2)
        with pytest.raises(ConnectionLost):
            await conn.ping()
        await conn.close()

    run(main())


def test_single_host_comes_back() -> None:
    async def main() -> None:
        server = await FakeServer().start()
        moves: list[tuple[str, str]] = []
        async with txbroker.aio.connect(
            f"txb://{server.address}", on_failover=lambda *hosts: moves.append(hosts)
        ) as conn:
            await server.kill()
            await asyncio.sleep(0.2)  # a few rounds of back-off
            assert conn.host is None
            await server.restart()
            await asyncio.wait_for(conn.ping(), 5)
            assert moves == [(server.address, server.address)]

    run(main())


def test_dropped_connection_with_live_listener_and_callback_error() -> None:
    async def main() -> None:
        server = await FakeServer().start()

        def broken(old: str, new: str) -> None:
            raise RuntimeError("callback bug")

        async with txbroker.aio.connect(f"txb://{server.address}", on_failover=broken) as conn:
            sub = await conn.subscribe("q", ack="auto")
            server.drop_connections()
            await conn.send("q", b"1", message_id="m")  # waits for the failover, then sends
            message = await sub.get(timeout=2)
            assert message is not None and message.body == b"1"
            assert len(server.hellos) == 2

    run(main())


def test_close_during_failover() -> None:
    async def main() -> None:
        server = await FakeServer().start()
        conn = await txbroker.aio.connect(f"txb://{server.address}")
        waiting = asyncio.ensure_future(conn.receive("q"))
        await asyncio.sleep(0.02)
        await server.kill()
        await asyncio.sleep(0.1)
        await conn.close()
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(waiting, 2)

    run(main())


# ----------------------------------------------------------- transactions (seed 004)
# "A (non-XA) transaction is considered active when at least one message has been sent
# or received by the session ... After a failover, attempting to commit the active
# transaction results in a TransactionRolledBackException."


def test_transaction_that_did_nothing_goes_on_after_a_failover() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        async with txbroker.aio.connect(f"txb://{a.address},{b.address}") as conn:
            async with conn.transaction() as tx:  # tx_begin sent on A
                await logged(broker, "tx_begin")
                await a.kill()
                await conn.ping()  # through the failover (a send racing it would count)
                await tx.send("out", b"after")  # begun again on B
                assert conn.host == b.address
            assert [m.body for _, _, m in broker.queues["out"].ready] == [b"after"]
            idle = conn.transaction()
            await idle.begin()
            b.drop_connections()
            await conn.ping()
            await idle.commit()  # nothing to commit: no error
            assert idle.state.value == "committed"

    run(main())


def test_transaction_that_received_is_rolled_back_and_its_message_redelivered() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        async with txbroker.aio.connect(f"txb://{a.address},{b.address}") as conn:
            await conn.send("in", b"m")
            tx = conn.transaction()
            message = await tx.receive("in", timeout=1)
            assert message is not None
            await logged(broker, "ack", tx=tx.tx_id)
            await a.kill()
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

    run(main())


def test_transaction_that_sent_raises_at_its_next_operation() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        async with txbroker.aio.connect(f"txb://{a.address},{b.address}") as conn:
            with pytest.raises(TransactionRolledBack):
                async with conn.transaction() as tx:
                    await tx.send("out", b"lost")
                    await a.kill()
                    await conn.ping()
                    await conn.send("in", b"waiting")
                    await tx.receive("in", timeout=1)  # refused: nothing taken
            assert "out" not in broker.queues or broker.queues["out"].ready == []
            await conn.ping()
            assert broker.in_flight("in") == 0  # the message was not taken
            message = await conn.receive("in", timeout=1)
            assert message is not None and not message.redelivered

    run(main())


def test_receive_of_an_idle_transaction_waiting_through_a_failover() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        async with txbroker.aio.connect(f"txb://{a.address},{b.address}") as conn:
            tx = conn.transaction()
            await tx.begin()
            waiting = asyncio.ensure_future(tx.receive("in", timeout=5))
            await logged(broker, "receive", queue="in")
            await a.kill()
            await conn.send("in", b"m", message_id="m")
            message = await asyncio.wait_for(waiting, 5)
            assert message is not None and message.body == b"m"
            await tx.send("out", b"moved")
            await tx.commit()  # begun again on B with the message in it
            assert [m.body for _, _, m in broker.queues["out"].ready] == [b"moved"]
            assert broker.queues["in"].ready == [] and broker.in_flight("in") == 0

    run(main())


def test_receive_of_a_worked_transaction_through_a_failover_gives_the_message_back() -> None:
    async def main() -> None:
        broker, a, b = await pair()
        async with txbroker.aio.connect(f"txb://{a.address},{b.address}") as conn:
            tx = conn.transaction()
            await tx.send("out", b"x")
            waiting = asyncio.ensure_future(tx.receive("in", timeout=5))
            await logged(broker, "receive", queue="in")
            await a.kill()
            await conn.send("in", b"m", message_id="m")
            with pytest.raises(TransactionRolledBack):
                await asyncio.wait_for(waiting, 5)
            await conn.ping()  # the give-back (no reply wanted) is processed before it
            assert broker.in_flight("in") == 0
            again = await conn.receive("in", timeout=1)
            assert again is not None and again.body == b"m"

    run(main())


def test_sync_subscription_drops_messages_of_the_old_session() -> None:
    async def main() -> None:
        _, a, b = await pair()
        async with txbroker.aio.connect(f"txb://{a.address},{b.address}") as conn:
            sub = await conn.subscribe("q", prefetch=10)
            for i in range(3):
                await conn.send("q", b"%d" % i)
            batch = await sub.get_batch(10, timeout=1)  # what the sync face holds locally
            while len(batch) < 3:
                batch += await sub.get_batch(10, timeout=1)
            await a.kill()
            await conn.ping()
            assert all(m._given_back() for m in batch)
            again = [await sub.get(timeout=1) for _ in range(3)]
            assert [(m.body, m.redelivered) for m in again if m] == [
                (b"0", True), (b"1", True), (b"2", True)]

    run(main())
