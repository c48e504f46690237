"""The transaction router core (seed 000): routing, votes, decisions, replay, three
strikes, exceptions, restart — no I/O (tests/core/harness.py), each store in store mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.core.harness import Harness, StoreOpener
from txbroker.core import LATER
from txbroker.core.router.log import ROUTER_QUEUE
from txbroker.core.router.model import Role
from txbroker.errors import AlreadyExists, BadRequest, IllegalState, NotFound

BANK = [{"name": "A", "low": 0, "high": 999}, {"name": "B", "low": 1000, "high": 1999}]


class Rig:
    """A harness with router helpers: sessions are ints, controllers are returned ids."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness
        self.rid = 100

    @property
    def router(self) -> Any:
        return self.h.broker.router

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.router, method)(*args, **kwargs)
        self.h.run()
        return result

    def define(self, name: str = "BANK", partitions: list[dict[str, Any]] = BANK) -> Any:
        self.rid += 1
        result = self.call("define", 90, self.rid, name, partitions, self.h.now)
        return self.h.replies.get((90, self.rid)) if result is LATER else result

    def client(self, sid: int, facility: str = "BANK", **kw: Any) -> int:
        self.h.session(sid)
        return int(self.call("register", sid, facility, server=False, now=self.h.now,
                             **kw)["controller"])

    def server(self, sid: int, partition: str, facility: str = "BANK", **kw: Any) -> int:
        self.h.session(sid)
        return int(self.call("register", sid, facility, server=True, partition=partition,
                             now=self.h.now, **kw)["controller"])

    def send(self, sid: int, ctl: int, tid: str, key: Any, body: bytes = b"x") -> Any:
        return self.call("send", sid, ctl, tid, key, body, None, self.h.now)

    def accept(self, sid: int, ctl: int, tid: str) -> Any:
        return self.call("accept", sid, ctl, tid, self.h.now)

    def vote(self, sid: int, ctl: int, tid: str, accept: bool = True, reason: str = "") -> Any:
        return self.call("vote", sid, ctl, tid, accept, reason, self.h.now)

    def done(self, sid: int, ctl: int, tid: str) -> Any:
        return self.call("done", sid, ctl, tid, self.h.now)

    def outcome(self, sid: int, tid: str, ctl: int | None = None) -> Any:
        """``rtr_outcome``: the answer, once it is durable (an UNKNOWN answer waits
        for its tombstone)."""
        self.rid += 1
        result = self.call("outcome", sid, self.rid, tid, ctl, self.h.now)
        return self.h.replies.get((sid, self.rid), LATER) if result is LATER else result

    def close(self, sid: int) -> None:
        self.h.call("close_session", sid, self.h.now)

    def take(self, sid: int) -> list[tuple[str, Any]]:
        """The pushes to ``sid`` since the last take: (type, tid or number)."""
        mine = [body for session, body in self.h.pushes if session == sid]
        self.h.pushes = [(s, b) for s, b in self.h.pushes if s != sid]
        return [(b["type"], b.get("tid", b.get("number"))) for b in mine]

    def journal(self) -> int:
        queue = self.h.broker.queues.get(ROUTER_QUEUE)
        return 0 if queue is None else queue.messages


@pytest.fixture(params=["memory", "journal", "dir"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    opener = None if request.param == "memory" else StoreOpener(request.param, tmp_path / "s")
    harness = Harness(store=opener)
    rig = Rig(harness)
    rig.define()
    yield rig
    if opener is not None:
        opener.close()


def test_implicit_prepare_round_trip(rig: Rig) -> None:
    client = rig.client(1)
    a = rig.server(2, "A")
    b = rig.server(3, "B")
    assert rig.send(1, client, "t1", 5, b"debit") == {"partition": "A"}
    assert rig.send(1, client, "t1", 1500, b"credit") == {"partition": "B"}
    assert rig.take(2) == [("MSG1", "t1")]
    assert rig.take(3) == [("MSG1", "t1")]
    rig.vote(2, a, "t1")  # an implicit server may vote before the client accepted
    rig.accept(1, client, "t1")
    assert rig.take(1) == []
    rig.vote(3, b, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]
    assert rig.take(2) == [("ACCEPTED", "t1")]
    assert rig.take(3) == [("ACCEPTED", "t1")]
    assert rig.journal() == 2  # the facility and the decided transaction
    rig.done(2, a, "t1")
    rig.done(3, b, "t1")
    rig.call("collected", 1, client, ["t1"], rig.h.now)
    assert rig.journal() == 1 and "t1" not in rig.router.data.transactions


def test_explicit_prepare_asks_after_accept(rig: Rig) -> None:
    client = rig.client(1)
    a = rig.server(2, "A", explicit_prepare=True)
    rig.send(1, client, "t1", 7)
    assert rig.take(2) == [("MSG1", "t1")]
    with pytest.raises(IllegalState, match="explicit prepare"):
        rig.vote(2, a, "t1")
    rig.accept(1, client, "t1")
    assert rig.take(2) == [("PREPARE", "t1")]
    rig.vote(2, a, "t1")
    assert rig.take(2) == [("ACCEPTED", "t1")]
    assert rig.take(1) == [("ACCEPTED", "t1")]


def test_a_server_reject_aborts_and_the_client_can_no_longer_reject(rig: Rig) -> None:
    client = rig.client(1)
    a = rig.server(2, "A")
    b = rig.server(3, "B")
    rig.send(1, client, "t1", 1)
    rig.send(1, client, "t1", 1001)
    rig.accept(1, client, "t1")
    rig.h.pushes.clear()
    with pytest.raises(IllegalState, match="can no longer be changed"):
        rig.call("reject", 1, client, "t1", "CLIENT", rig.h.now)
    rig.vote(2, a, "t1")
    rig.vote(3, b, "t1", accept=False, reason="INSUFFICIENT")
    assert rig.take(1) == [("REJECTED", "t1")]
    assert [p for _, p in rig.h.pushes] == [
        {"type": "REJECTED", "tid": "t1", "partition": "A", "reason": "INSUFFICIENT",
         "controller": a},
        {"type": "REJECTED", "tid": "t1", "partition": "B", "reason": "INSUFFICIENT",
         "controller": b}]


def test_client_reject_before_accept_writes_nothing(rig: Rig) -> None:
    client = rig.client(1)
    rig.server(2, "A")
    rig.send(1, client, "t1", 1)
    rig.call("reject", 1, client, "t1", "CLIENT", rig.h.now)
    assert rig.take(2) == [("MSG1", "t1"), ("REJECTED", "t1")]
    assert rig.take(1) == [("REJECTED", "t1")]
    assert rig.journal() == 1  # only the facility: an unaccepted transaction is never written


def test_bad_input_is_refused_and_changes_nothing(rig: Rig) -> None:
    client = rig.client(1)
    a = rig.server(2, "A")
    with pytest.raises(BadRequest, match="outside every partition"):
        rig.send(1, client, "t1", 5000)
    with pytest.raises(BadRequest, match="must be of type int"):
        rig.send(1, client, "t1", "five")
    with pytest.raises(NotFound, match="no facility 'NOPE'"):
        rig.client(5, "NOPE")
    with pytest.raises(NotFound, match="is not presented to controller"):
        rig.vote(2, a, "ghost")
    with pytest.raises(NotFound, match="no router controller"):
        rig.send(2, 999, "t1", 5)
    with pytest.raises(IllegalState, match="not a client controller"):
        rig.send(2, a, "t1", 5)
    assert rig.router.data.transactions == {}
    rig.send(1, client, "t1", 5)
    other = rig.client(4)
    with pytest.raises(AlreadyExists):
        rig.send(4, other, "t1", 6)


def test_server_dies_before_voting_replays_to_the_standby(rig: Rig) -> None:
    client = rig.client(1)
    rig.server(2, "A")
    standby = rig.server(3, "A", role=Role.STANDBY)
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")
    assert rig.take(2) == [("MSG1", "t1")]
    assert rig.take(3) == []  # a standby works only while no primary is there
    rig.close(2)
    assert rig.take(3) == [("MSG1", "t1")]  # never voted: replayed as a first message
    rig.vote(3, standby, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]
    [participant] = rig.router.data.transactions["t1"].participants.values()
    assert participant.strikes == 1


@pytest.mark.parametrize("crash", ["after_vote", "after_outcome"])
def test_server_dies_after_voting_replays_uncertain(rig: Rig, crash: str) -> None:
    client = rig.client(1)
    a = rig.server(2, "A")
    rig.send(1, client, "t1", 1, b"leg")
    rig.vote(2, a, "t1")
    if crash == "after_outcome":
        rig.accept(1, client, "t1")
        assert rig.take(2) == [("MSG1", "t1"), ("ACCEPTED", "t1")]
    rig.close(2)
    again = rig.server(4, "A")
    if crash == "after_vote":
        assert rig.take(4) == [("UNCERTAIN", "t1")]
        rig.accept(1, client, "t1")
        assert rig.take(1) == []  # the dead server's vote is void: the replay votes again
        rig.vote(4, again, "t1")
        assert rig.take(4) == [("ACCEPTED", "t1")]
    else:
        assert rig.take(4) == [("UNCERTAIN", "t1"), ("ACCEPTED", "t1")]
    rig.done(4, again, "t1")
    rig.close(4)
    rig.server(5, "A")
    assert rig.take(5) == []  # acknowledged: the router forgot it, no replay


def test_three_strikes_make_an_exception_and_the_partition_carries_on(rig: Rig) -> None:
    client = rig.client(1)
    rig.send(1, client, "poison", 13)
    rig.accept(1, client, "poison")
    for sid in (10, 11, 12, 13):  # presented 1 + retry_count (3) times, lost each time
        rig.server(sid, "A")
        assert rig.take(sid) == [("MSG1", "poison")]
        rig.close(sid)
    assert rig.take(1) == [("REJECTED", "poison")]
    from txbroker.core.router import admin as router_admin
    [entry] = router_admin.exceptions(rig.router.data)
    assert (entry["tid"], entry["reason"], entry["strikes"], entry["partitions"]) == (
        "poison", "SRVDIED", 4, ["A"])
    server = rig.server(20, "A")
    rig.send(1, client, "good", 14)
    rig.accept(1, client, "good")
    rig.vote(20, server, "good")
    assert rig.take(1) == [("ACCEPTED", "good")]
    rig.h.session(90)
    rig.rid += 1
    router_admin.discard_exception(rig.router.data, 90, rig.rid, "poison", rig.h.now)
    rig.h.run()
    assert router_admin.exceptions(rig.router.data) == []


def test_operator_commit_replays_the_exception_decided(rig: Rig) -> None:
    from txbroker.core.router import admin as router_admin
    rig.call("set_partition", 90, 1, "BANK", "A", 1, None, rig.h.now)
    client = rig.client(1)
    rig.send(1, client, "p", 13)
    for sid in (10, 11):
        rig.server(sid, "A")
        rig.close(sid)
    assert rig.take(1) == [("REJECTED", "p")]
    rig.h.session(90)
    router_admin.commit_exception(rig.router.data, 90, 7, "p", rig.h.now)
    rig.h.run()
    assert rig.h.replies[(90, 7)] == {"tid": "p", "state": "COMMITTING"}
    fixed = rig.server(12, "A")
    assert rig.take(12) == [("UNCERTAIN", "p"), ("ACCEPTED", "p")]
    rig.done(12, fixed, "p")
    held = rig.router.data.transactions
    assert "p" not in held or not held["p"].exception


def test_vote_timeout_rejects(rig: Rig) -> None:
    rig.call("set_partition", 90, 1, "BANK", "A", None, 500, rig.h.now)
    client = rig.client(1)
    rig.server(2, "A")
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")
    rig.h.tick(499)
    assert rig.take(1) == []
    rig.h.tick(2)
    assert rig.take(1) == [("REJECTED", "t1")]
    assert rig.take(2) == [("MSG1", "t1"), ("REJECTED", "t1")]


def test_restart_replays_accepted_and_decided_transactions(rig: Rig) -> None:
    client = rig.client(1)
    a = rig.server(2, "A")
    b = rig.server(3, "B")
    rig.send(1, client, "undecided", 1)
    rig.accept(1, client, "undecided")
    rig.send(1, client, "decided", 1001)
    rig.vote(3, b, "decided")
    rig.accept(1, client, "decided")
    rig.send(1, client, "unaccepted", 2)  # waits for server A, which is busy
    assert rig.take(3) == [("MSG1", "decided"), ("ACCEPTED", "decided")]
    del a
    rig.h = rig.h.crash()
    rig.define()  # the same definition again: accepted as it is
    assert sorted(rig.router.data.transactions) == ["decided", "undecided"]
    a2 = rig.server(12, "A")
    b2 = rig.server(13, "B")
    assert rig.take(12) == [("UNCERTAIN", "undecided")]
    assert rig.take(13) == [("UNCERTAIN", "decided"), ("ACCEPTED", "decided")]
    client2 = rig.client(11)
    assert rig.outcome(11, "decided", client2)["state"] == "ACCEPTED"
    assert rig.outcome(11, "undecided", client2)["state"] == "PENDING"
    assert rig.outcome(11, "unaccepted")["state"] == "UNKNOWN"
    rig.vote(12, a2, "undecided")
    assert rig.take(11) == [("ACCEPTED", "undecided")]
    rig.done(12, a2, "undecided")
    rig.done(13, b2, "decided")
    rig.call("collected", 11, client2, ["decided", "undecided"], rig.h.now)
    assert rig.router.data.transactions == {}
    # the facility, and the tombstones of the three tids asked about (issue 25)
    assert rig.journal() == 4
    assert sorted(rig.router.data.tombstones.by_tid) == ["decided", "unaccepted", "undecided"]


def test_events_named_unnamed_and_router_events(rig: Rig) -> None:
    from txbroker.core.router import admin as router_admin
    rig.client(1, recipient="teller-1", events=((1, 5),))
    rig.client(2, recipient="teller-22", events=((5, 5),))
    rig.client(3, events=((5, 5),))  # no name: never gets a named event
    server = rig.server(4, "A", events=((256, 511),))
    assert rig.take(4) == [("ROUTER_EVENT", 256), ("ROUTER_EVENT", 258)]

    def send(recipient: str | None) -> list[int]:
        reached = router_admin.user_event(rig.router.data, 4, server, 5, b"hi", recipient)
        rig.h.run()
        got = [sid for sid in (1, 2, 3) if rig.take(sid)]
        assert reached["delivered"] == len(got)
        return got

    assert send(None) == [1, 2, 3]
    assert send("*") == [1, 2]
    assert send("teller-%") == [1]
    assert send("teller-*") == [1, 2]
    assert send("teller-2%") == [2]
    assert send("nobody") == []
    with pytest.raises(BadRequest, match="0 to 255"):
        router_admin.user_event(rig.router.data, 4, server, 300, b"", None)


def test_shadow_gets_the_same_transactions_and_role_events(rig: Rig) -> None:
    client = rig.client(1)
    primary = rig.server(2, "A")
    shadow = rig.server(3, "A", role=Role.SHADOW, events=((260, 261),))
    assert rig.take(3) == [("ROUTER_EVENT", 261)]  # SECONDARY: a primary site exists
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")
    assert rig.take(2) == [("MSG1", "t1")] and rig.take(3) == [("MSG1", "t1")]
    rig.vote(2, primary, "t1")
    assert rig.take(1) == []  # the shadow votes too
    rig.vote(3, shadow, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]
    assert rig.take(3) == [("ACCEPTED", "t1")]
    rig.done(2, primary, "t1")
    rig.done(3, shadow, "t1")
    rig.close(2)
    assert rig.take(3) == [("ROUTER_EVENT", 260)]  # PRIMARY: the shadow site is primary now
    rig.send(1, client, "t2", 2)
    assert rig.take(3) == [("MSG1", "t2")]  # and serves the partition alone


def test_votes_before_the_accept_record_is_durable(tmp_path: Path) -> None:
    """The commit replaces a VREQ record still on its way to disk: one live record, and a
    restart in between either state finds exactly one copy of the transaction."""
    harness = Harness(auto_sync=False)
    rig = Rig(harness)
    rig.define()
    harness.sync()
    client = rig.client(1)
    a = rig.server(2, "A")
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")  # the VREQ record is pending
    rig.vote(2, a, "t1")  # the commit record replaces it before it is written
    assert rig.take(1) == []
    harness.sync()
    assert rig.take(1) == [("ACCEPTED", "t1")]
    assert rig.journal() == 2
    restarted = harness.crash()
    assert [tx.state.value for tx in restarted.broker.router.data.transactions.values()] == [
        "COMMITTING"]
    assert restarted.broker.queues[ROUTER_QUEUE].messages == 2


def test_a_restart_before_the_accept_is_durable_forgets_the_transaction() -> None:
    harness = Harness(auto_sync=False)
    rig = Rig(harness)
    rig.define()
    harness.sync()
    client = rig.client(1)
    rig.server(2, "A")
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")
    restarted = harness.crash()  # the VREQ record was never synced
    assert restarted.broker.router.data.transactions == {}
    rig.h = restarted
    assert rig.outcome(9, "t1") is LATER  # the UNKNOWN answer waits for its tombstone
    restarted.sync()
    assert restarted.replies[(9, rig.rid)]["state"] == "UNKNOWN"


def test_concurrent_servers_share_a_partition_one_transaction_each(rig: Rig) -> None:
    client = rig.client(1)
    first = rig.server(2, "A", role=Role.CONCURRENT)
    second = rig.server(3, "A", role=Role.CONCURRENT)
    for tid in ("t1", "t2", "t3"):
        rig.send(1, client, tid, 1)
        rig.accept(1, client, tid)
    got = {2: rig.take(2), 3: rig.take(3)}
    assert sorted(len(pushes) for pushes in got.values()) == [1, 1]  # t3 waits
    holder = {pushes[0][1]: sid for sid, pushes in got.items()}
    assert sorted(holder) == ["t1", "t2"]
    ids = {2: first, 3: second}
    sid = holder["t1"]
    rig.vote(sid, ids[sid], "t1")
    assert rig.take(sid) == [("ACCEPTED", "t1")]
    rig.done(sid, ids[sid], "t1")
    assert rig.take(sid) == [("MSG1", "t3")]  # the freed server takes the waiting one


def test_an_implicit_vote_that_did_not_see_every_message_is_stale(rig: Rig) -> None:
    """Two legs in one partition, sent with the accept: the server's vote after the
    first leg must not commit the transaction without the second (the vote race)."""
    client = rig.client(1)
    a = rig.server(2, "A")
    rig.send(1, client, "t1", 1, b"debit")
    rig.send(1, client, "t1", 2, b"credit")
    rig.accept(1, client, "t1")
    assert rig.take(2) == [("MSG1", "t1"), ("MSG", "t1")]
    assert rig.call("vote", 2, a, "t1", True, "", rig.h.now, 1) == {"stale": True}
    assert rig.take(1) == []
    assert rig.call("vote", 2, a, "t1", True, "", rig.h.now, 2) == {}
    assert rig.take(1) == [("ACCEPTED", "t1")]


def test_a_client_that_keeps_going_after_a_server_rejected_gets_the_outcome(rig: Rig) -> None:
    client = rig.client(1)
    a = rig.server(2, "A")
    rig.send(1, client, "t1", 1)
    rig.vote(2, a, "t1", accept=False, reason="INSUFFICIENT")
    assert rig.take(1) == [("REJECTED", "t1")]
    assert rig.send(1, client, "t1", 2) == {"partition": "A", "rejected": "INSUFFICIENT"}
    assert rig.accept(1, client, "t1") == {"rejected": "INSUFFICIENT"}
    assert rig.take(1) == [] and rig.take(2) == [("MSG1", "t1"), ("REJECTED", "t1")]


def test_strikes_of_an_accepted_transaction_survive_a_restart(rig: Rig) -> None:
    """Issue 28 §2: a poison transaction gets no more presentations than its retry count
    however often the broker restarts: its strikes are journaled as they happen."""
    client = rig.client(1)
    rig.server(2, "A")
    rig.send(1, client, "poison", 1)
    rig.accept(1, client, "poison")
    assert rig.take(2) == [("MSG1", "poison")]
    rig.close(2)  # lost before its vote: strike 1
    rig.h = rig.h.crash()
    rig.define()
    tx = rig.router.data.transactions["poison"]
    assert [p.strikes for p in tx.participants.values()] == [1]
