"""The router's native ops on a real broker process (raw frames): a facility from the
config file, a transaction end to end, the journal's queue refused to clients, and a
kill -9 of the broker between the client's accept and the votes (on both stores)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import STORES, BrokerProcess, RawClient, store_args

OK, ERR, PUSH = 1, 2, 3
FORBIDDEN, NOT_FOUND, BAD_REQUEST = 18, 10, 5

CONFIG = """
[router.facilities.BANK]
partitions = [{name = "A", low = 0, high = 999},
              {name = "B", low = 1000, high = 1999, retry_count = 2}]
"""


class Peer(RawClient):
    """A raw connection that keeps the router pushes it reads."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.pushes: list[dict[str, Any]] = []
        self.rid = 0
        assert self.call(self.next_rid(), "hello", version=1)[0] == OK

    def next_rid(self) -> int:
        self.rid += 1
        return self.rid

    def ok(self, op: str, **args: Any) -> Any:
        frame = self.do(op, **args)
        assert frame[0] == OK, frame
        return frame[3]

    def do(self, op: str, **args: Any) -> list[Any]:
        rid = self.next_rid()
        self.request(rid, op, args)
        while True:
            frame = self.read_frame()
            assert frame is not None, "connection closed"
            if frame[0] == PUSH:
                self.pushes.append(frame[3])
            elif frame[1] == rid:
                return frame

    def wait_push(self, count: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The next ``count`` router pushes (bounded wait)."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(0.2)
        try:
            while len(self.pushes) < count and time.monotonic() < deadline:
                try:
                    frame = self.read_frame()
                except TimeoutError:
                    continue
                assert frame is not None, "connection closed"
                if frame[0] == PUSH:
                    self.pushes.append(frame[3])
        finally:
            self.sock.settimeout(10)
        assert len(self.pushes) >= count, f"only {self.pushes}"
        taken, self.pushes = self.pushes[:count], self.pushes[count:]
        return taken


@pytest.fixture(params=STORES)
def bank(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    config = tmp_path / "broker.toml"
    config.write_text(CONFIG)
    proc = BrokerProcess(tmp_path / "data", "--config", str(config),
                         *store_args(request.param)).start()
    try:
        yield proc
    finally:
        proc.kill()


def kinds(pushes: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(p["type"], p.get("tid", "")) for p in pushes]


def test_a_transfer_end_to_end_and_the_journal_is_off_limits(bank: BrokerProcess) -> None:
    admin = Peer(bank.port)
    shown = admin.ok("rtr_show")["facilities"]
    assert [(f["name"], [(p["name"], p["low"], p["high"], p["retry_count"])
                         for p in f["partitions"]]) for f in shown] == [
        ("BANK", [("A", 0, 999, 3), ("B", 1000, 1999, 2)])]
    server_a, server_b, client = Peer(bank.port), Peer(bank.port), Peer(bank.port)
    a = server_a.ok("rtr_register", facility="BANK", kind="server", partition="A")["controller"]
    b = server_b.ok("rtr_register", facility="BANK", kind="server", partition=[1000, 1999],
                    explicit_prepare=True)["controller"]
    registered = client.ok("rtr_register", facility="BANK")
    assert registered["key_type"] == "int" and len(registered["partitions"]) == 2
    c = registered["controller"]
    assert client.ok("rtr_send", controller=c, tid="t1", key=7, body=b"-10") == {
        "partition": "A"}
    assert client.ok("rtr_send", controller=c, tid="t1", key=1007, body=b"+10",
                     accept=True) == {"partition": "B"}
    [msg_a] = server_a.wait_push()
    assert (msg_a["type"], msg_a["tid"], msg_a["key"], msg_a["body"]) == ("MSG1", "t1", 7,
                                                                          b"-10")
    assert kinds(server_b.wait_push(2)) == [("MSG1", "t1"), ("PREPARE", "t1")]
    server_a.ok("rtr_vote", controller=a, tid="t1", accept=True)
    server_b.ok("rtr_vote", controller=b, tid="t1", accept=True)
    assert kinds(client.wait_push()) == [("ACCEPTED", "t1")]
    assert kinds(server_a.wait_push()) == [("ACCEPTED", "t1")]
    assert kinds(server_b.wait_push()) == [("ACCEPTED", "t1")]
    server_a.ok("rtr_done", controller=a, tid="t1")
    server_b.ok("rtr_done", controller=b, tid="t1")
    client.ok("rtr_ack", controller=c, tids=["t1"])
    assert admin.ok("rtr_outcome", tid="t1")["state"] == "UNKNOWN"  # forgotten
    counts = admin.ok("stats")["router"]
    assert (counts["committed"], counts["rejected"], counts["controllers"],
            counts["transactions"]["COMMITTING"]) == (1, 0, 3, 0)
    # bad input: a clear refusal, nothing changes
    refused = client.do("rtr_send", controller=c, tid="t2", key=5000, body=b"x")
    assert refused[0] == ERR and refused[3]["code"] == BAD_REQUEST
    assert "outside every partition" in refused[3]["message"]
    assert client.do("rtr_register", facility="NOPE")[3]["code"] == NOT_FOUND
    for op, args in [("send", {"dest": "$router", "body": b"x"}),
                     ("receive", {"queue": "$router", "timeout_ms": 0}),
                     ("queue_purge", {"name": "$router"}),
                     ("queue_delete", {"name": "$router"})]:
        frame = client.do(op, **args)
        assert frame[0] == ERR and frame[3]["code"] == FORBIDDEN, (op, frame)
    for peer in (admin, server_a, server_b, client):
        peer.close()


def test_broker_killed_between_accept_and_votes(bank: BrokerProcess) -> None:
    server, client = Peer(bank.port), Peer(bank.port)
    s = server.ok("rtr_register", facility="BANK", kind="server", partition="A")["controller"]
    c = client.ok("rtr_register", facility="BANK")["controller"]
    client.ok("rtr_send", controller=c, tid="kept", key=1, body=b"leg", accept=True)
    client.ok("rtr_send", controller=c, tid="lost", key=2, body=b"leg")  # never accepted
    assert kinds(server.wait_push()) == [("MSG1", "kept")]
    del s
    # the accept record is not waited on by any reply: wait until it is in the journal
    admin = Peer(bank.port)
    deadline = time.monotonic() + 10
    while admin.ok("queue_info", name="$router")["depth"] < 2:  # facility + 'kept'
        assert time.monotonic() < deadline
        time.sleep(0.01)
    bank.kill()
    bank.start()
    server, client = Peer(bank.port), Peer(bank.port)
    s = server.ok("rtr_register", facility="BANK", kind="server", partition="A")["controller"]
    c = client.ok("rtr_register", facility="BANK")["controller"]
    assert client.ok("rtr_outcome", tid="lost") == {"tid": "lost", "state": "UNKNOWN",
                                                   "reason": "UNKNOWN"}
    assert client.ok("rtr_outcome", tid="kept", controller=c)["state"] == "PENDING"
    [replayed] = server.wait_push()
    assert (replayed["type"], replayed["tid"], replayed["body"]) == ("UNCERTAIN", "kept",
                                                                     b"leg")
    server.ok("rtr_vote", controller=s, tid="kept", accept=True)
    assert kinds(client.wait_push()) == [("ACCEPTED", "kept")]
    assert kinds(server.wait_push()) == [("ACCEPTED", "kept")]
    server.close()
    client.close()


def test_the_routers_journal_queue_is_not_among_the_users_queues(broker: BrokerProcess) -> None:
    """Issue 28 §2: ``$router`` holds the router's journal; it is not listed with the
    user's queues, nor counted in the broker's queues and messages."""
    peer = Peer(broker.port)
    try:
        peer.ok("rtr_define", facility="F", partitions=[{"name": "P", "low": 0, "high": 9}])
        peer.ok("send", dest="mine", body=b"x")
        assert [q["name"] for q in peer.ok("queue_list")] == ["mine"]
        stats = peer.ok("stats")
        assert (stats["queues"], stats["messages"], stats["router_records"]) == (1, 1, 1)
        assert peer.ok("queue_info", name="$router")["depth"] == 1
    finally:
        peer.close()
