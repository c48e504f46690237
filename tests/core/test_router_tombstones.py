"""Presumed abort with tombstones (issue 25; core/router/tombstones.py): once the
router answered a tid's outcome, that tid never begins again — across restarts, on
every store — and a message after the first never begins a transaction."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.harness import Harness, StoreOpener
from tests.core.test_router import Rig
from txbroker.core import LATER
from txbroker.core.router import tombstones
from txbroker.errors import IllegalState, TransactionRolledBack


def rig_on(store: str, tmp_path: Path) -> Iterator[Rig]:
    """A router rig with BANK defined, on ``store`` (memory, journal or dir)."""
    opener = None if store == "memory" else StoreOpener(store, tmp_path / "s")
    rig = Rig(Harness(store=opener))
    rig.define()
    yield rig
    if opener is not None:
        opener.close()


@pytest.fixture(params=["memory", "journal", "dir"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    yield from rig_on(request.param, tmp_path)


def committed(rig: Rig, client: int, a: int, tid: str) -> None:
    """One transaction on partition A, decided ACCEPTED and acknowledged by the server."""
    rig.send(1, client, tid, 5)
    rig.vote(2, a, tid)
    rig.accept(1, client, tid)
    assert rig.take(2) == [("MSG1", tid), ("ACCEPTED", tid)]
    rig.done(2, a, tid)


def test_unknown_answer_waits_for_its_tombstone() -> None:
    """The UNKNOWN answer is a promise: it is given only once the tombstone is on disk."""
    rig = Rig(Harness(auto_sync=False))
    rig.define()
    rig.h.sync()
    rig.client(1)
    assert rig.outcome(1, "t-unknown") is LATER
    rig.h.sync()
    assert rig.h.replies[(1, rig.rid)] == {"tid": "t-unknown", "state": "UNKNOWN",
                                           "reason": "UNKNOWN"}
    assert rig.outcome(1, "t-unknown") == {"tid": "t-unknown", "state": "UNKNOWN",
                                          "reason": "UNKNOWN"}  # durable: at once


def test_answered_unknown_never_begins(rig: Rig) -> None:
    client = rig.client(1)
    rig.server(2, "A")
    assert rig.outcome(1, "t1")["state"] == "UNKNOWN"
    for call in (lambda: rig.send(1, client, "t1", 5), lambda: rig.accept(1, client, "t1"),
                 lambda: rig.call("reject", 1, client, "t1", "CLIENT", rig.h.now)):
        with pytest.raises(TransactionRolledBack, match=r"answered UNKNOWN.*never begins again"):
            call()
    assert rig.take(2) == [] and "t1" not in rig.router.data.transactions
    rig.h = rig.h.crash()
    client = rig.client(11)
    rig.server(12, "A")
    with pytest.raises(TransactionRolledBack, match="never begins again"):
        rig.send(11, client, "t1", 5)
    assert rig.outcome(11, "t1")["state"] == "UNKNOWN"
    assert rig.take(12) == []


def test_asked_and_forgotten_leaves_its_outcome(rig: Rig) -> None:
    """A transaction whose outcome was asked for leaves a tombstone with that outcome
    in its record's place; one nobody asked about leaves nothing."""
    client = rig.client(1)
    a = rig.server(2, "A")
    committed(rig, client, a, "asked")
    assert rig.outcome(1, "asked", client)["state"] == "ACCEPTED"
    rig.call("collected", 1, client, ["asked"], rig.h.now)
    assert "asked" not in rig.router.data.transactions
    committed(rig, client, a, "quiet")
    rig.call("collected", 1, client, ["quiet"], rig.h.now)
    assert rig.journal() == 2  # the facility and the one tombstone
    with pytest.raises(IllegalState, match="ACCEPTED and is finished"):
        rig.send(1, client, "asked", 5)
    rig.h = rig.h.crash()
    client = rig.client(11)
    with pytest.raises(IllegalState, match="never begins again"):
        rig.send(11, client, "asked", 5)
    assert rig.outcome(11, "asked") == {"tid": "asked", "state": "ACCEPTED", "reason": None}


def test_a_later_message_never_begins_a_transaction(rig: Rig) -> None:
    client = rig.client(1)
    rig.server(2, "A")
    with pytest.raises(TransactionRolledBack, match="message 1 came with no transaction"):
        rig.call("send", 1, client, "t2", 5, b"x", None, rig.h.now, 1)
    assert "t2" not in rig.router.data.transactions and rig.take(2) == []
    assert rig.call("send", 1, client, "t3", 5, b"x", None, rig.h.now, 0) == {"partition": "A"}
    with pytest.raises(IllegalState, match="message 2 arrived where message 1 was due"):
        rig.call("send", 1, client, "t3", 6, b"y", None, rig.h.now, 2)
    assert rig.call("send", 1, client, "t3", 6, b"y", None, rig.h.now, 1) == {"partition": "A"}


def test_tombstones_expire_and_are_bounded(rig: Rig) -> None:
    rig.client(1)
    assert rig.outcome(1, "old")["state"] == "UNKNOWN"
    rig.h.tick(tombstones.TOMBSTONE_RETENTION_MS - 1)
    assert rig.router.data.tombstones.get("old") is not None
    assert rig.outcome(1, "young")["state"] == "UNKNOWN"
    rig.h.tick(1)
    assert rig.router.data.tombstones.get("old") is None  # its time is over
    assert rig.journal() == 2  # the facility and "young"
    rig.router.data.tombstones.limit = 2
    for tid in ("a", "b"):
        rig.outcome(1, tid)
    assert list(rig.router.data.tombstones.by_tid) == ["a", "b"]  # "young", the oldest, went
    assert rig.journal() == 3


def test_the_accept_is_answered_once_it_is_on_disk() -> None:
    """An accept that returned survives a broker crash (the test of a kill -9 right
    after accept() relied on it, and was flaky while the answer came first)."""
    rig = Rig(Harness(auto_sync=False))
    rig.define()
    rig.h.sync()
    client = rig.client(1)
    rig.server(2, "A")
    rig.send(1, client, "t1", 5)
    rig.rid += 1
    assert rig.call("accept", 1, client, "t1", rig.h.now, rig.rid) is LATER
    assert (1, rig.rid) not in rig.h.replies
    rig.h.sync()
    assert rig.h.replies[(1, rig.rid)] == {}
    restarted = rig.h.crash()
    assert list(restarted.broker.router.data.transactions) == ["t1"]


def test_a_reconnected_client_asking_about_a_sending_transaction_ends_it(rig: Rig) -> None:
    """Found by the simulator (router-bank-resets, seed 2): a client reconnects before
    the broker noticed its old session end and asks about the transaction it was
    sending. It is rejected (LOST) at once — waiting for the old session's end held
    its server, and that end no longer aborted it once it had a new client."""
    old = rig.client(1)
    rig.server(2, "A")
    rig.send(1, old, "t1", 5)
    assert rig.take(2) == [("MSG1", "t1")]
    new = rig.client(3)  # the same client, reconnected; session 1 is not closed yet
    assert rig.call("reject", 3, new, "t1", "LOST", rig.h.now) == {}
    assert rig.take(2) == [("REJECTED", "t1")]
    assert rig.outcome(3, "t1", new) == {"tid": "t1", "state": "REJECTED", "reason": "LOST"}
    rig.send(1, old, "t2", 6)
    newer = rig.client(4)
    assert rig.outcome(4, "t2", newer)["state"] == "REJECTED"  # asked while sending
