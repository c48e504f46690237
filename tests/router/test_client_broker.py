"""The router's client library against a real broker process (``txbroker serve``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.support import ROOT, BrokerProcess

import txbroker
from txbroker.errors import BadRequest, IllegalState, NotFound, TransactionRolledBack
from txbroker.router import (
    ALL_ROUTER_EVENTS,
    PARTITION_DOWN,
    PARTITION_UP,
    SERVER_DOWN,
    SERVER_UP,
    ClientState,
    MessageType,
    Role,
    RouterMessage,
    ServerMessageHandler,
    ServerTransactionController,
    TransactionController,
)

pytestmark = pytest.mark.timeout(120)
M = MessageType
PARTITIONS = [{"name": "A", "low": 0, "high": 99}, {"name": "B", "low": 100, "high": 199}]


def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait (bounded) until ``condition()`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with BrokerProcess(tmp_path / "data") as proc:
        with txbroker.connect(proc.url) as conn:
            conn.request("rtr_define", {"facility": "BANK", "partitions": PARTITIONS})
        yield proc


def receive(ctl: TransactionController | ServerTransactionController,
            timeout: float = 30) -> RouterMessage:
    """The next message; bounded generously: after a broker restart on a loaded CI
    machine, the restart, the failover back-off and the re-registration come first."""
    message = ctl.receive(timeout=timeout)
    assert message is not None, "nothing received in time"
    return message


def test_two_partitions_implicit_and_explicit(broker: BrokerProcess) -> None:
    with TransactionController(broker.url) as client, \
            ServerTransactionController(broker.url) as a, \
            ServerTransactionController(broker.url) as b:
        client.register_facility("BANK")
        a.register_partition("BANK", "A")
        b.register_partition("BANK", (100, 199), explicit_prepare=True)
        tid = client.start_transaction()
        assert client.send(b"debit", key=5, headers={"n": "1"}) == "A"
        assert client.send(b"credit", key=105) == "B"
        first_a = receive(a)
        assert (first_a.type, first_a.tid, first_a.body, first_a.key, first_a.index,
                first_a.headers) == (M.MSG1, tid, b"debit", 5, 0, {"n": "1"})
        a.accept_transaction()  # implicit: votes after its message
        first_b = receive(b)
        assert (first_b.type, first_b.tid, first_b.key) == (M.MSG1, tid, 105)
        with pytest.raises(IllegalState):
            b.accept_transaction()  # explicit: only after PREPARE
        client.accept()
        with pytest.raises(IllegalState, match="no longer reject"):
            client.reject()
        assert receive(b).type is M.PREPARE
        b.accept_transaction()
        assert (receive(a).type, receive(b).type) == (M.ACCEPTED, M.ACCEPTED)
        got = receive(client)
        assert (got.type, got.tid, got.reason) == (M.ACCEPTED, tid, None)
        a.acknowledge_outcome()
        b.acknowledge_outcome()


def test_set_accept_both_sides_and_rejects(broker: BrokerProcess) -> None:
    with TransactionController(broker.url) as client, \
            ServerTransactionController(broker.url) as srv:
        client.register_facility("BANK")
        srv.register_partition("BANK", "A")
        tid = client.start_transaction()
        client.set_accept(b"one", key=1)
        assert receive(srv).type is M.MSG1
        srv.set_accept()
        assert receive(srv).type is M.ACCEPTED
        assert (receive(client).type, client.tid) == (M.ACCEPTED, tid)
        # the client rejects before any vote
        tid = client.start_transaction()
        client.send(b"two", key=2)
        assert receive(srv).type is M.MSG1  # acknowledges the last outcome first
        client.reject()
        assert (receive(srv).type, srv.tid) == (M.REJECTED, tid)
        got = receive(client)
        assert (got.type, got.reason) == (M.REJECTED, "CLIENT")
        # a server rejects with its reason
        client.start_transaction()
        client.send(b"three", key=3)
        assert receive(srv).type is M.MSG1
        srv.reject_transaction("NO FUNDS")
        got = receive(client)
        assert (got.type, got.reason) == (M.REJECTED, "NO FUNDS")
        # bad input: a clear error, nothing sent
        client.start_transaction()
        with pytest.raises(BadRequest, match="key 420 is outside every partition of facility "
                                             "'BANK'"):
            client.send(b"x", key=420)
        client.reject()
        assert receive(client).type is M.REJECTED
        with pytest.raises(NotFound):
            TransactionController(broker.url).register_facility("NOPE")


def test_inactivity_timeout_against_the_broker(broker: BrokerProcess) -> None:
    with TransactionController(broker.url) as client, \
            ServerTransactionController(broker.url, inactivity_timeout_ms=200) as srv:
        client.register_facility("BANK")
        srv.register_partition("BANK", "A")
        tid = client.start_transaction()
        client.send(b"half", key=1)
        assert receive(srv).type is M.MSG1
        outcome = receive(srv)
        assert (outcome.type, outcome.tid, outcome.reason) == (M.REJECTED, tid, "TIMEOUT")
        got = receive(client)
        assert (got.type, got.reason) == (M.REJECTED, "TIMEOUT")


def test_handler_and_events(broker: BrokerProcess) -> None:
    calls: list[str] = []
    stop = threading.Event()

    class Handler(ServerMessageHandler):
        def on_initialize(self, message: RouterMessage,
                          controller: ServerTransactionController) -> None:
            calls.append("on_initialize")

        def on_application_message(self, message: RouterMessage,
                                   controller: ServerTransactionController) -> None:
            calls.append("on_application_message")

        def on_prepare(self, message: RouterMessage,
                       controller: ServerTransactionController) -> None:
            calls.append("on_prepare")
            controller.accept_transaction()

        def on_accepted(self, message: RouterMessage,
                        controller: ServerTransactionController) -> None:
            calls.append("on_accepted")

        def on_event(self, message: RouterMessage,
                     controller: ServerTransactionController) -> None:
            calls.append(f"on_event {message.number} {message.body.decode()}")
            stop.set()

    with TransactionController(broker.url) as client, \
            ServerTransactionController(broker.url) as srv:
        client.register_facility("BANK", recipient="teller-7", events=[(0, 255)])
        srv.register_partition("BANK", "A", explicit_prepare=True, events=[9])
        runner = threading.Thread(target=Handler().run, args=(srv,),
                                  kwargs={"stop": stop.is_set, "poll_interval": 0.02})
        runner.start()
        client.start_transaction()
        client.send(b"1", key=1)
        client.send(b"2", key=2)
        client.accept()
        assert receive(client).type is M.ACCEPTED
        until(lambda: calls[-1:] == ["on_accepted"])
        assert client.send_event(9, b"bye") == 1
        runner.join(10)
        assert not runner.is_alive()
        assert srv.send_event(3, b"to tellers", recipient="teller-%") == 1
        got = receive(client)
        assert (got.type, got.number, got.body, got.recipient) == (
            M.USER_EVENT, 3, b"to tellers", "teller-%")
    assert calls == ["on_initialize", "on_application_message", "on_application_message",
                     "on_prepare", "on_accepted", "on_event 9 bye"]


def test_broker_killed_and_restarted(broker: BrokerProcess) -> None:
    with TransactionController(broker.url) as client, \
            ServerTransactionController(broker.url) as srv:
        client.register_facility("BANK")
        srv.register_partition("BANK", "A")
        accepted = client.start_transaction()
        client.send(b"durable", key=1)
        client.accept()  # on disk once this returns
        assert receive(srv).type is M.MSG1
        broker.kill()
        lost = receive(srv)
        assert (lost.type, lost.tid, lost.reason) == (M.REJECTED, accepted, "LOST")
        broker.start()
        replay = receive(srv, timeout=60)  # registered again; accepted ones come UNCERTAIN
        assert (replay.type, replay.tid, replay.body) == (M.UNCERTAIN, accepted, b"durable")
        srv.accept_transaction()
        assert receive(srv).type is M.ACCEPTED
        got = receive(client, timeout=60)
        assert (got.type, got.tid) == (M.ACCEPTED, accepted)
        # a transaction still being sent when the broker dies was never applied
        sending = client.start_transaction()
        client.send(b"half", key=2)
        assert receive(srv).type is M.MSG1
        broker.kill()
        assert (receive(srv).type, srv.tid) == (M.REJECTED, sending)
        broker.start()
        got = receive(client, timeout=60)
        assert got == RouterMessage(M.REJECTED, tid=sending, reason="UNKNOWN")
        with pytest.raises(IllegalState):
            client.accept()


def test_lost_while_sending_raises_rolled_back(broker: BrokerProcess) -> None:
    with TransactionController(broker.url) as client:
        client.register_facility("BANK")
        client.start_transaction()
        client.send(b"half", key=150)
        broker.kill()
        until(lambda: client.state is ClientState.LOST)  # the client noticed
        broker.start()
        with pytest.raises(TransactionRolledBack, match="connection was lost"):
            client.send(b"more", key=151)
        got = receive(client, timeout=60)
        assert (got.type, got.reason) == (M.REJECTED, "UNKNOWN")


def txb(broker: BrokerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "txbroker.cli", *args, "--url", broker.url],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=60)


def test_cli_against_the_broker(broker: BrokerProcess) -> None:
    done = txb(broker, "router", "define", "NAMES", "--partition", "AM:a-m",
               "--partition", "NZ:n-z", "--retry-count", "5")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[0] == "facility NAMES: 2 partition(s) defined"
    with ServerTransactionController(broker.url) as srv:
        srv.register_partition("NAMES", "AM")
        shown = txb(broker, "router", "show", "NAMES", "--json")
        assert shown.returncode == 0, shown.stderr
        facility = json.loads(shown.stdout)["facilities"][0]
        assert (facility["name"], facility["key_type"]) == ("NAMES", "str")
        parts = {p["name"]: p for p in facility["partitions"]}
        assert [(p["low"], p["high"], p["retry_count"]) for p in parts.values()] == [
            ("a", "m", 5), ("n", "z", 5)]
        assert [s["role"] for s in parts["AM"]["servers"]] == ["primary"]
    changed = txb(broker, "router", "set-partition", "NAMES", "NZ", "--vote-timeout", "1500")
    assert changed.returncode == 0, changed.stderr
    listed = txb(broker, "router", "exceptions", "list", "--json")
    assert (listed.returncode, json.loads(listed.stdout)) == (0, [])
    shown = txb(broker, "router", "show", "NAMES", "--json")
    parts = {p["name"]: p for p in json.loads(shown.stdout)["facilities"][0]["partitions"]}
    assert parts["NZ"]["vote_timeout_ms"] == 1500
    missing = txb(broker, "router", "exceptions", "commit", "f" * 32)
    assert missing.returncode == 1 and missing.stderr.startswith("error: ")


def test_retire_shadow_through_the_cli_survives_a_restart(broker: BrokerProcess) -> None:
    """A secondary site that is gone for good: until ``router retire-shadow``, what the
    partition decided waits for it; after it, nothing does, across a restart."""
    def partition_a() -> tuple[bool, dict[str, int]]:
        shown = txb(broker, "router", "show", "BANK", "--json")
        assert shown.returncode == 0, shown.stderr
        facility = json.loads(shown.stdout)["facilities"][0]
        [a] = [p for p in facility["partitions"] if p["name"] == "A"]
        return a["shadowed"], facility["transactions"]

    with TransactionController(broker.url) as client, \
            ServerTransactionController(broker.url) as srv:
        client.register_facility("BANK")
        srv.register_partition("BANK", "A")
        with ServerTransactionController(broker.url) as shadow:
            shadow.register_partition("BANK", "A", Role.SHADOW)
            refused = txb(broker, "router", "retire-shadow", "BANK", "A")
            assert refused.returncode != 0 and "unregister the secondary site" in \
                refused.stderr

        def shadows() -> int:  # the shadow's end reaches the broker on its own connection
            with txbroker.connect(broker.url) as conn:
                [bank] = conn.request("rtr_show", {"facility": "BANK"})["facilities"]
            [a] = [p for p in bank["partitions"] if p["name"] == "A"]
            return sum(s["role"] == "shadow" for s in a["servers"])

        until(lambda: shadows() == 0)
        client.start_transaction()
        client.send(b"debit", key=5)
        assert receive(srv).type is M.MSG1
        srv.accept_transaction()
        client.accept()
        assert (receive(srv).type, receive(client).type) == (M.ACCEPTED, M.ACCEPTED)
        srv.acknowledge_outcome()
        assert partition_a() == (True, {"SENDING": 0, "VREQ": 0, "COMMITTING": 1,
                                        "ABORTING": 0})  # kept for the secondary site
        retired = txb(broker, "router", "retire-shadow", "BANK", "A")
        assert (retired.returncode, retired.stderr) == (0, "")
        assert retired.stdout == ("BANK/A: secondary site retired (1 transaction(s) no "
                                  "longer wait for it)\n")
        assert partition_a() == (False, {"SENDING": 0, "VREQ": 0, "COMMITTING": 0,
                                         "ABORTING": 0})
    broker.kill()
    broker.start()
    assert partition_a() == (False, {"SENDING": 0, "VREQ": 0, "COMMITTING": 0,
                                     "ABORTING": 0})


def test_router_events_for_subscribers(broker: BrokerProcess) -> None:
    with TransactionController(broker.url) as client:
        client.register_facility("BANK", events=[ALL_ROUTER_EVENTS])
        with ServerTransactionController(broker.url) as srv:
            srv.register_partition("BANK", "B")
            up = [receive(client), receive(client)]
            assert [(m.type, m.number, m.facility, m.partition) for m in up] == [
                (M.ROUTER_EVENT, SERVER_UP, "BANK", "B"),
                (M.ROUTER_EVENT, PARTITION_UP, "BANK", "B")]
            assert up[0].detail == {"server": srv.controller_id, "role": "primary"}
        down = [receive(client), receive(client)]
        assert [(m.number, m.partition) for m in down] == [(SERVER_DOWN, "B"),
                                                            (PARTITION_DOWN, "B")]
        assert client.receive(timeout=0.1) is None


def test_the_docs_tour_runs(broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "router.md").read_text()
    tour = text.split("## Five-minute tour", 1)[1].split("\n## ", 1)[0]
    code = tour.split("```python\n", 1)[1].split("```", 1)[0]
    done = txb(broker, "router", "define", "BANK", "--partition", "A:0-999",
               "--partition", "B:1000-1999")
    assert done.returncode == 0, done.stderr  # BANK redefined while idle
    monkeypatch.setenv("TXBROKER_URL", broker.url)
    exec(compile(code, "docs/router.md", "exec"), {"__name__": "tour"})
    assert capsys.readouterr().out.splitlines() == ["ACCEPTED None", "{'A': 70, 'B': 30}"]


def test_tid_answered_never_begins_again(broker: BrokerProcess) -> None:
    """Presumed abort with a tombstone (issue 25): once the router answered a tid's
    outcome — UNKNOWN for a tid it has no record of, or the outcome of a transaction
    that was asked about and then forgotten — a client that sends with that tid gets
    a clear error and no server receives anything, across a kill -9 and restart too.
    A message after the first never begins a transaction."""
    with ServerTransactionController(broker.url) as a, \
            txbroker.connect(broker.url) as conn:
        a.register_partition("BANK", "A")
        client = conn.request("rtr_register", {"facility": "BANK", "kind": "client"})
        ctl = client["controller"]

        def send(tid: str, index: int, accept: bool = True) -> Any:
            return conn.request("rtr_send", {"controller": ctl, "tid": tid, "key": 5,
                                             "body": b"x", "accept": accept,
                                             "index": index})

        assert conn.request("rtr_outcome", {"tid": "never-seen"}) == {
            "tid": "never-seen", "state": "UNKNOWN", "reason": "UNKNOWN"}
        with pytest.raises(TransactionRolledBack, match="never begins again"):
            send("never-seen", 0)
        with pytest.raises(TransactionRolledBack, match="the earlier ones were lost"):
            send("second-message-first", 1)
        # a transaction asked about, decided, acknowledged and forgotten
        send("asked", 0)
        assert receive(a).type is M.MSG1
        assert conn.request("rtr_outcome", {"tid": "asked", "controller": ctl})["state"] in (
            "PENDING", "ACCEPTED")
        a.accept_transaction()
        assert receive(a).type is M.ACCEPTED
        a.acknowledge_outcome()
        conn.request("rtr_ack", {"controller": ctl, "tids": ["asked"]})

        def refused_by_tombstone() -> bool:  # decided, then forgotten (once both acked)
            with pytest.raises(IllegalState) as refused:
                send("asked", 0)
            return "never begins again" in str(refused.value)

        until(refused_by_tombstone)
    broker.kill()
    broker.start()
    with txbroker.connect(broker.url) as conn:
        ctl = conn.request("rtr_register", {"facility": "BANK", "kind": "client"})[
            "controller"]
        for tid, error in (("never-seen", TransactionRolledBack), ("asked", IllegalState)):
            with pytest.raises(error, match="never begins again"):
                conn.request("rtr_send", {"controller": ctl, "tid": tid, "key": 5,
                                          "body": b"x", "accept": True, "index": 0})
        assert conn.request("rtr_outcome", {"tid": "never-seen"})["state"] == "UNKNOWN"
        assert conn.request("rtr_outcome", {"tid": "asked"})["state"] == "ACCEPTED"
        with ServerTransactionController(broker.url) as a:
            a.register_partition("BANK", "A")
            assert a.receive(timeout=0.5) is None  # nothing was presented


def test_crossing_transactions_one_server_each_both_commit(broker: BrokerProcess) -> None:
    """Issue 28 §2, through the libraries and a real broker: t1 holds A and asks for B,
    t2 holds B and asks for A — a wait cycle that used to last the 30 s vote timeout.
    The younger, t2, makes way: its B server gets REJECTED PREEMPTED, rolls back and
    acknowledges; t1 commits; t2 is presented again and commits too."""
    with TransactionController(broker.url) as c1, TransactionController(broker.url) as c2, \
            ServerTransactionController(broker.url) as a, \
            ServerTransactionController(broker.url) as b:
        c1.register_facility("BANK")
        c2.register_facility("BANK")
        a.register_partition("BANK", "A")
        b.register_partition("BANK", "B")
        t1, t2 = c1.start_transaction(), c2.start_transaction()
        c1.send(b"t1-a", key=1)
        assert (receive(a).type, a.tid) == (M.MSG1, t1)
        c2.send(b"t2-b", key=101)
        assert (receive(b).type, b.tid) == (M.MSG1, t2)
        c1.send(b"t1-b", key=102)
        c2.send(b"t2-a", key=2)
        preempted = receive(b)
        assert (preempted.type, preempted.tid, preempted.reason) == (M.REJECTED, t2,
                                                                     "PREEMPTED")
        again = receive(b)  # acknowledged by receive(): B is free for t1
        assert (again.type, again.tid, again.body) == (M.MSG1, t1, b"t1-b")
        c1.accept()
        c2.accept()
        a.accept_transaction()
        b.accept_transaction()
        assert (receive(c1).type, receive(a).type, receive(b).type) == (
            M.ACCEPTED, M.ACCEPTED, M.ACCEPTED)
        got = {(m.type, m.tid, m.body) for m in (receive(a), receive(b))}
        assert got == {(M.MSG1, t2, b"t2-a"), (M.MSG1, t2, b"t2-b")}
        a.accept_transaction()
        b.accept_transaction()
        assert receive(c2).type is M.ACCEPTED


def test_set_recovery_retry_count_from_the_partition_api(broker: BrokerProcess) -> None:
    """Issue 28 §2: the seed's SetRecoveryRetryCount on the server's partition: with 0,
    the first server death before a vote rejects the transaction (SRVDIED)."""
    with TransactionController(broker.url) as client:
        client.register_facility("BANK")
        with ServerTransactionController(broker.url) as srv:
            srv.register_partition("BANK", "A")
            assert srv.set_recovery_retry_count(0)["retry_count"] == 0
            with pytest.raises(ValueError):
                srv.set_recovery_retry_count(-1)
            tid = client.start_transaction()
            client.send(b"poison", key=1)
            client.accept()
            assert receive(srv).type is M.MSG1
        # the server left before its vote: one strike is one too many
        assert receive(client) == RouterMessage(M.REJECTED, tid=tid, reason="SRVDIED")


def test_client_message_handler_gets_outcomes_and_events(broker: BrokerProcess) -> None:
    """Issue 28 §2: the client-side event model: outcomes to on_accepted/on_rejected,
    router events (with the partition's key range) to on_event."""
    from txbroker.router import ClientMessageHandler

    seen: list[tuple[str, Any]] = []

    class Handler(ClientMessageHandler):
        def on_accepted(self, message: RouterMessage, controller: Any) -> None:
            seen.append(("accepted", message.tid))

        def on_rejected(self, message: RouterMessage, controller: Any) -> None:
            seen.append(("rejected", message.reason))

        def on_event(self, message: RouterMessage, controller: Any) -> None:
            seen.append((message.type.name, (message.number, message.key_range)))

    with TransactionController(broker.url) as client, \
            ServerTransactionController(broker.url) as srv:
        client.register_facility("BANK", events=[ALL_ROUTER_EVENTS])
        srv.register_partition("BANK", "A")
        tid = client.start_transaction()
        client.send(b"x", key=1)
        client.accept()
        assert receive(srv).type is M.MSG1
        srv.accept_transaction()
        Handler().run(client, stop=lambda: any(s[0] == "accepted" for s in seen))
        assert seen[-1] == ("accepted", tid)
        assert (M.ROUTER_EVENT.name, (SERVER_UP, (0, 99))) in seen
