"""The router's sync face (thin wrappers over the async controllers) against the real
broker in memory (tests/inmemory.py), on a loop thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from tests.inmemory import LoopThread, Node

import txbroker
from txbroker.errors import IllegalState
from txbroker.router import (
    MessageType,
    RouterMessage,
    ServerMessageHandler,
    ServerTransactionController,
    TransactionController,
)

pytestmark = pytest.mark.timeout(30)
M = MessageType


#: The facility of these tests (the ``[router.facilities.BANK]`` table of a config file).
BANK = {"BANK": [{"name": "A", "low": 0, "high": 99}, {"name": "B", "low": 100, "high": 199}]}


@pytest.fixture
def thread() -> Iterator[LoopThread]:
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.stop()


@pytest.fixture
def fake(thread: LoopThread) -> Node:
    """A broker with the facility BANK (named ``fake`` as the tests always called it)."""
    return thread.broker(router_facilities=BANK)


def test_sync_round_trip_over_a_shared_connection(thread: LoopThread, fake: Node) -> None:
    net = thread.network
    with txbroker.connect(fake.url, transport=net) as conn:
        client = TransactionController(conn)
        client.register_facility("BANK")
        with ServerTransactionController(fake.url, inactivity_timeout_ms=5000,
                                         transport=net) as srv:
            assert srv.inactivity_timeout_ms == 5000
            srv.register_partition("BANK", "B", explicit_prepare=True)
            tid = client.start_transaction()
            assert client.send(b"credit", key=150) == "B"
            client.accept()
            with pytest.raises(IllegalState):
                client.reject()
            assert srv.receive(timeout=5) == RouterMessage(M.MSG1, tid=tid, body=b"credit",
                                                           key=150, partition="B")
            prepare = srv.receive(timeout=5)
            assert prepare is not None and prepare.type is M.PREPARE
            srv.accept_transaction()
            outcome = srv.receive(timeout=5)
            assert outcome is not None and outcome.type is M.ACCEPTED
            srv.acknowledge_outcome()
            got = client.receive(timeout=5)
            assert got is not None and (got.type, got.tid) == (M.ACCEPTED, tid)
            assert client.receive(timeout=0.05) is None
        client.close()
        conn.ping()  # the shared connection stays open


def test_sync_handler_runs_until_stopped(thread: LoopThread, fake: Node) -> None:
    calls: list[str] = []
    stop = threading.Event()

    class Handler(ServerMessageHandler):
        def on_initialize(self, message: RouterMessage,
                          controller: ServerTransactionController) -> None:
            calls.append("on_initialize")

        def on_application_message(self, message: RouterMessage,
                                   controller: ServerTransactionController) -> None:
            calls.append(f"on_application_message {message.body.decode()}")
            controller.set_accept()

        def on_accepted(self, message: RouterMessage,
                        controller: ServerTransactionController) -> None:
            calls.append("on_accepted")
            stop.set()

    net = thread.network
    with ServerTransactionController(fake.url, transport=net) as srv, \
            TransactionController(fake.url, transport=net) as client:
        srv.register_partition("BANK", (0, 99))
        client.register_facility("BANK")
        runner = threading.Thread(target=Handler().run, args=(srv,),
                                  kwargs={"stop": stop.is_set, "poll_interval": 0.02})
        runner.start()
        client.start_transaction()
        client.set_accept(b"one", key=1)
        got = client.receive(timeout=5)
        assert got is not None and got.type is M.ACCEPTED
        runner.join(10)
        assert not runner.is_alive()
    assert calls == ["on_initialize", "on_application_message one", "on_accepted"]
    thread.settle()  # the broker read everything the closed controllers wrote
    assert [op for op in fake.log.names() if op == "rtr_done"] == ["rtr_done"]
