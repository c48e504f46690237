"""Crossing transactions never wait for the vote timeout (issue 28 §2): in a wait
cycle the youngest transaction makes way (core/router/deadlock.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.core.harness import Harness
from tests.core.test_router import Rig
from txbroker.core.router.model import Role


@pytest.fixture
def rig() -> Any:
    rig = Rig(Harness())
    rig.define()
    return rig


def test_two_transfers_crossing_two_partitions_both_commit_without_a_timeout(
        rig: Rig) -> None:
    client1, client2 = rig.client(1), rig.client(2)
    a = rig.server(3, "A")  # one server per partition
    b = rig.server(4, "B")
    rig.send(1, client1, "t1", 1)  # t1: A first ...
    rig.send(2, client2, "t2", 1001)  # t2: B first ...
    assert rig.take(3) == [("MSG1", "t1")] and rig.take(4) == [("MSG1", "t2")]
    rig.send(1, client1, "t1", 1002)  # ... then B (busy with t2)
    assert rig.router.data.counters["preempted"] == 0  # waiting is no cycle yet
    rig.send(2, client2, "t2", 2)  # ... then A (busy with t1): a cycle; t2 is younger
    assert rig.take(4) == [("REJECTED", "t2")]  # t2 gives B back (reason PREEMPTED)
    assert rig.h.pushes == [] and rig.router.data.counters["preempted"] == 1
    rig.done(4, b, "t2")  # B rolled back and acknowledged: t1 gets it
    assert rig.take(4) == [("MSG1", "t1")]
    for tid, client in (("t1", 1), ("t2", 2)):
        rig.accept(client, client1 if client == 1 else client2, tid)
    rig.vote(3, a, "t1")
    rig.vote(4, b, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]
    assert rig.take(3) == [("ACCEPTED", "t1")] and rig.take(4) == [("ACCEPTED", "t1")]
    rig.done(3, a, "t1")
    rig.done(4, b, "t1")
    assert rig.take(3) == [("MSG1", "t2")]  # its A message, waiting all along
    assert rig.take(4) == [("MSG1", "t2")]  # its B message again: a new presentation
    for sid, ctl in ((3, a), (4, b)):
        rig.vote(sid, ctl, "t2")
    assert rig.take(2) == [("ACCEPTED", "t2")]


def test_the_vote_of_a_preempted_presentation_is_void(rig: Rig) -> None:
    """An implicit server voted for the transaction that then makes way: that vote
    counts for nothing; the transaction commits only on the votes of its new
    presentation."""
    client1, client2 = rig.client(1), rig.client(2)
    a = rig.server(3, "A")
    b = rig.server(4, "B")
    rig.send(1, client1, "t1", 1)
    rig.send(2, client2, "t2", 1001)
    rig.vote(4, b, "t2")  # t2's B voted accept
    rig.send(1, client1, "t1", 1002)
    rig.send(2, client2, "t2", 2)
    assert rig.take(4) == [("MSG1", "t2"), ("REJECTED", "t2")]
    assert rig.vote(4, b, "t2") == {"ignored": True}  # crossed the REJECTED on the wire
    rig.done(4, b, "t2")
    rig.accept(2, client2, "t2")
    assert rig.take(2) == []  # not decided on the void vote
    rig.accept(1, client1, "t1")
    rig.vote(3, a, "t1")
    rig.vote(4, b, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]


def test_no_preemption_without_a_cycle(rig: Rig) -> None:
    """Waiting behind a busy server is not a deadlock: nobody makes way."""
    client1, client2 = rig.client(1), rig.client(2)
    rig.server(3, "A")
    rig.server(4, "A", role=Role.STANDBY)  # standbys serve only when no primary is left
    for n, (sid, ctl) in enumerate(((1, client1), (2, client2), (1, client1))):
        rig.send(sid, ctl, f"t{n}", 1 + n)
    assert rig.router.data.counters["preempted"] == 0
