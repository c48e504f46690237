"""The router's client library (async face) against the real broker in memory
(tests/inmemory.py): the real core's router, operation layer and native edge."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.inmemory import InMemoryNetwork, Node, run, until

import txbroker.aio
from txbroker.errors import BadRequest, IllegalState, NotFound, TransactionRolledBack
from txbroker.router.aio import (
    ALL_USER_EVENTS,
    AsyncServerMessageHandler,
    AsyncServerTransactionController,
    AsyncTransactionController,
    MessageType,
    Role,
    RouterMessage,
)

pytestmark = pytest.mark.timeout(30)
M = MessageType
#: The facility of these tests (the ``[router.facilities.BANK]`` table of a config file).
BANK = {"BANK": [{"name": "A", "low": 0, "high": 99}, {"name": "B", "low": 100, "high": 199}]}


async def started(net: InMemoryNetwork) -> Node:
    """A broker with the facility BANK."""
    return await net.broker(router_facilities=BANK)


def client_of(net: InMemoryNetwork, server: Node) -> AsyncTransactionController:
    """A client controller on its own connection to ``server``."""
    return AsyncTransactionController(server.url, transport=net)


def server_of(net: InMemoryNetwork, server: Node, **options: Any
              ) -> AsyncServerTransactionController:
    """A server controller on its own connection to ``server``."""
    return AsyncServerTransactionController(server.url, transport=net, **options)


async def pair(net: InMemoryNetwork, server: Node, *, explicit: bool = False,
               partition: Any = "A", **server_options: Any
               ) -> tuple[AsyncTransactionController, AsyncServerTransactionController]:
    client = client_of(net, server)
    await client.register_facility("BANK")
    srv = server_of(net, server, **server_options)
    await srv.register_partition("BANK", partition, explicit_prepare=explicit)
    return client, srv


def ops(server: Node, *names: str) -> list[dict[str, Any]]:
    return server.log.ops(*names)


def test_implicit_prepare_round_trip() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server)
        assert client.partition_map is not None
        assert [p.name for p in client.partition_map.partitions] == ["A", "B"]
        tid = await client.start_transaction()
        assert len(tid) == 32
        assert await client.send(b"debit 10", key=5, headers={"h": "1"}) == "A"
        assert await client.send(b"debit 20", key=7) == "A"
        first = await srv.receive(timeout=5)
        assert first == RouterMessage(M.MSG1, tid=tid, body=b"debit 10", key=5, index=0,
                                      partition="A", headers={"h": "1"})
        assert srv.tid == tid
        second = await srv.receive(timeout=5)
        assert second is not None and (second.type, second.index, second.body) == (
            M.MSG, 1, b"debit 20")
        await srv.accept_transaction()  # implicit: any time after a message
        await client.accept()
        outcome = await srv.receive(timeout=5)
        assert outcome is not None and (outcome.type, outcome.tid) == (M.ACCEPTED, tid)
        got = await client.receive(timeout=5)
        assert got is not None and (got.type, got.tid, got.reason) == (M.ACCEPTED, tid, None)
        await srv.acknowledge_outcome()
        await until(lambda: bool(ops(server, "rtr_done")) and bool(ops(server, "rtr_ack")))
        assert ops(server, "rtr_done") == [{"controller": srv.controller_id, "tid": tid}]
        assert ops(server, "rtr_ack") == [{"controller": client.controller_id, "tids": [tid]}]
        await client.close()
        await srv.close()
        await server.kill()

    run(main)


def test_explicit_prepare_votes_after_prepare_only() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server, explicit=True)
        tid = await client.start_transaction()
        await client.send(b"x", key=150)  # partition B: no server there yet
        await client.send(b"y", key=1)
        srv_b = server_of(net, server)
        await srv_b.register_partition("BANK", (100, 199), Role.PRIMARY, explicit_prepare=True)
        assert srv_b.partition == "B"
        for s in (srv, srv_b):
            message = await s.receive(timeout=5)
            assert message is not None and message.type is M.MSG1
            with pytest.raises(IllegalState, match="after PREPARE"):
                await s.accept_transaction()
        await client.accept()
        with pytest.raises(IllegalState, match="no longer reject"):
            await client.reject()
        for s in (srv, srv_b):
            prepare = await s.receive(timeout=5)
            assert prepare is not None and (prepare.type, prepare.tid) == (M.PREPARE, tid)
            await s.accept_transaction()
        for s in (srv, srv_b):
            outcome = await s.receive(timeout=5)
            assert outcome is not None and outcome.type is M.ACCEPTED
        got = await client.receive(timeout=5)
        assert got is not None and got.type is M.ACCEPTED
        await server.kill()

    run(main)


def test_set_accept_both_sides_is_one_request_each() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server)
        tid = await client.start_transaction()
        await client.set_accept(b"only", key=3)
        assert [(a["tid"], a["accept"]) for a in ops(server, "rtr_send")] == [(tid, True)]
        assert ops(server, "rtr_accept") == []
        message = await srv.receive(timeout=5)
        assert message is not None and message.type is M.MSG1
        await srv.set_accept()  # not waited for
        outcome = await srv.receive(timeout=5)
        assert outcome is not None and outcome.type is M.ACCEPTED
        assert [(a["accept"], a["tid"]) for a in ops(server, "rtr_vote")] == [(True, tid)]
        got = await client.receive(timeout=5)
        assert got is not None and got.type is M.ACCEPTED
        await server.kill()

    run(main)


def test_reject_before_vote_and_local_checks() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server)
        with pytest.raises(IllegalState, match="start_transaction first"):
            await client.send(b"x", key=1)
        tid = await client.start_transaction()
        with pytest.raises(IllegalState, match="receive the outcome first"):
            await client.start_transaction()
        with pytest.raises(BadRequest, match="key 420 is outside every partition of facility "
                                             "'BANK'"):
            await client.send(b"x", key=420)
        with pytest.raises(BadRequest, match="key type"):
            await client.send(b"x", key="7")
        with pytest.raises(IllegalState, match="nothing was sent"):
            await client.accept()
        assert ops(server, "rtr_send") == []
        await client.send(b"x", key=1)
        message = await srv.receive(timeout=5)
        assert message is not None and message.type is M.MSG1
        await client.reject()
        srv_outcome = await srv.receive(timeout=5)
        assert srv_outcome is not None
        assert (srv_outcome.type, srv_outcome.tid, srv_outcome.reason) == (M.REJECTED, tid,
                                                                          "CLIENT")
        got = await client.receive(timeout=5)
        assert got is not None and (got.type, got.reason) == (M.REJECTED, "CLIENT")
        # a server's reject reaches the client with the server's reason
        await srv.receive(timeout=0)  # acknowledges the outcome (rtr_done)
        await client.start_transaction()
        await client.send(b"y", key=2)
        assert (await srv.receive(timeout=5)) is not None
        await srv.reject_transaction("NO FUNDS")
        got = await client.receive(timeout=5)
        assert got is not None and (got.type, got.reason) == (M.REJECTED, "NO FUNDS")
        # a transaction with nothing sent is rejected locally
        local = await client.start_transaction()
        await client.reject("CHANGED MY MIND")
        got = await client.receive(timeout=5)
        assert got == RouterMessage(M.REJECTED, tid=local, reason="CHANGED MY MIND")
        with pytest.raises(NotFound, match="no facility 'NOPE'"):
            await client_of(net, server).register_facility("NOPE")
        await server.kill()

    run(main)


def test_inactivity_timeout_rejects_a_partial_transaction_only() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server, inactivity_timeout_ms=100)
        assert await srv.receive(timeout=0.3) is None  # waiting for a new one: no timeout
        tid = await client.start_transaction()
        await client.send(b"part 1", key=1)
        first = await srv.receive()
        assert first is not None and first.type is M.MSG1
        outcome = await srv.receive()  # no more messages: rejected after 100 ms
        assert outcome is not None and (outcome.type, outcome.tid, outcome.reason) == (
            M.REJECTED, tid, "TIMEOUT")
        assert [(v["accept"], v["reason"]) for v in ops(server, "rtr_vote")] == [
            (False, "TIMEOUT")]
        got = await client.receive(timeout=5)
        assert got is not None and (got.type, got.reason) == (M.REJECTED, "TIMEOUT")
        await server.kill()

    run(main)


def test_no_inactivity_timeout_after_prepare() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server, explicit=True, inactivity_timeout_ms=50)
        await client.start_transaction()
        await client.send(b"m", key=1)
        await client.accept()
        assert (await srv.receive()) is not None  # MSG1
        prepare = await srv.receive()
        assert prepare is not None and prepare.type is M.PREPARE
        assert await srv.receive(timeout=0.3) is None  # waits for the vote's outcome
        assert ops(server, "rtr_vote") == []
        await srv.accept_transaction()
        assert await srv.receive(timeout=0.3) is not None  # ACCEPTED
        await server.kill()

    run(main)


class Recorder(AsyncServerMessageHandler):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def on_initialize(self, message: RouterMessage,
                            controller: AsyncServerTransactionController) -> None:
        self.calls.append(("on_initialize", message.type.value))

    async def on_application_message(self, message: RouterMessage,
                                     controller: AsyncServerTransactionController) -> None:
        self.calls.append(("on_application_message", message.type.value))

    async def on_prepare(self, message: RouterMessage,
                         controller: AsyncServerTransactionController) -> None:
        self.calls.append(("on_prepare", message.type.value))
        await controller.accept_transaction()

    async def on_accepted(self, message: RouterMessage,
                          controller: AsyncServerTransactionController) -> None:
        self.calls.append(("on_accepted", message.type.value))

    async def on_rejected(self, message: RouterMessage,
                          controller: AsyncServerTransactionController) -> None:
        self.calls.append(("on_rejected", str(message.reason)))

    async def on_event(self, message: RouterMessage,
                       controller: AsyncServerTransactionController) -> None:
        self.calls.append(("on_event", str(message.number)))


def test_message_handler_calls_in_the_seed_order() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server, explicit=True)
        handler = Recorder()
        stop = False
        task = asyncio.create_task(handler.run(srv, stop=lambda: stop, poll_interval=0.02))
        await client.start_transaction()
        await client.send(b"1", key=1)
        await client.send(b"2", key=2)
        await client.accept()
        got = await client.receive(timeout=5)
        assert got is not None and got.type is M.ACCEPTED
        await until(lambda: len(handler.calls) == 5)
        await client.start_transaction()
        await client.send(b"3", key=3)
        await until(lambda: len(handler.calls) == 7)
        await client.reject()
        await until(lambda: len(handler.calls) == 8)
        stop = True
        await task
        assert handler.calls == [
            ("on_initialize", "MSG1"), ("on_application_message", "MSG1"),
            ("on_application_message", "MSG"), ("on_prepare", "PREPARE"),
            ("on_accepted", "ACCEPTED"),
            ("on_initialize", "MSG1"), ("on_application_message", "MSG1"),
            ("on_rejected", "CLIENT"),
        ]
        await until(lambda: len(ops(server, "rtr_done")) == 2)
        await server.kill()

    run(main)


def test_named_and_unnamed_events() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            named = AsyncTransactionController(conn)
            await named.register_facility("BANK", recipient="teller-12", events=[ALL_USER_EVENTS])
            anonymous = AsyncTransactionController(conn)  # same connection, no name
            await anonymous.register_facility("BANK", events=[5])
            srv = AsyncServerTransactionController(conn)
            await srv.register_partition("BANK", "A")
            assert await srv.send_event(5, b"hi", recipient="teller-%2") == 1
            got = await named.receive(timeout=5)
            assert got == RouterMessage(M.USER_EVENT, body=b"hi", number=5,
                                        recipient="teller-%2", facility="BANK")
            assert await srv.send_event(5, b"all") == 2  # unnamed: every subscriber of 5
            for ctl in (named, anonymous):
                message = await ctl.receive(timeout=5)
                assert message is not None and (message.number, message.body) == (5, b"all")
            assert await srv.send_event(7, recipient="*") == 1  # the unnamed one is not "*"
            with pytest.raises(ValueError, match=r"0\.\.255"):
                await srv.send_event(256)
            await named.close()
            await anonymous.close()
            await srv.close()
        await server.kill()

    run(main)


def test_client_failover_asks_the_outcome() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client, srv = await pair(net, server)
        tid = await client.start_transaction()
        await client.send(b"m", key=1)
        await client.accept()
        assert (await srv.receive(timeout=5)) is not None  # MSG1, not voted
        await server.kill()  # the broker "crashes"; its router state survives
        lost = await srv.receive(timeout=5)
        assert lost is not None and (lost.type, lost.tid, lost.reason) == (M.REJECTED, tid,
                                                                          "LOST")
        await server.start()
        # registered again: the replay. The router's journal brought the accepted
        # transaction back with its participant uncertain (core/router/journal.py)
        replay = await srv.receive(timeout=10)
        assert replay is not None and (replay.type, replay.tid, replay.body) == (
            M.UNCERTAIN, tid, b"m")
        await srv.accept_transaction()
        got = await client.receive(timeout=10)
        assert got is not None and (got.type, got.tid) == (M.ACCEPTED, tid)
        # registered again on the restarted broker (which numbers controllers from 1 again)
        assert sorted(a["kind"] for a in ops(server, "rtr_register")) == ["client"] * 2 + [
            "server"] * 2
        assert [a["tid"] for a in ops(server, "rtr_outcome")][:1] == [tid]
        outcome = await srv.receive(timeout=5)
        assert outcome is not None and outcome.type is M.ACCEPTED
        await server.kill()

    run(main, timeout=25)


def test_client_failover_unknown_and_lost_while_sending() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await started(net)
        client = client_of(net, server)
        await client.register_facility("BANK")
        tid = await client.start_transaction()
        await client.send(b"m", key=1)  # no server: it waits at the router
        await client.connection.ping()  # the send's reply is in
        # The disk fails before the accept's record is durable (the broker's failure reply
        # is held back), then the broker dies: the accept was never durable.
        server.stall()
        server.fail_store()
        accepting = asyncio.ensure_future(client.accept())
        await until(lambda: server.log.answered("rtr_accept", tid=tid), "the accept refused")
        await server.kill()
        await server.start()  # restarted on its store: no record of the transaction
        await asyncio.wait_for(accepting, 10)  # the lost reply is not an error
        got = await client.receive(timeout=10)
        assert got == RouterMessage(M.REJECTED, tid=tid, reason="UNKNOWN")
        # lost while sending: further sends fail; the outcome is REJECTED
        tid = await client.start_transaction()
        await client.send(b"m", key=1)
        await until(lambda: any(a["tid"] == tid for a in ops(server, "rtr_send")))
        await server.kill()
        await server.start()
        with pytest.raises(TransactionRolledBack, match="connection was lost"):
            await client.send(b"more", key=2)
        got = await client.receive(timeout=10)
        assert got is not None and (got.type, got.tid) == (M.REJECTED, tid)
        await client.close()
        await server.kill()

    run(main, timeout=25)
