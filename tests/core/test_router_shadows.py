"""Shadow servers as seed 000 defines them (issue 28 §1): each site applies a
transaction once; a site that is down does not stall the other; what a down site
missed is replayed to it when it returns (RTR's shadow recovery)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.test_router import Rig
from tests.core.test_router_tombstones import rig_on
from txbroker.core.router.model import Role, Site


@pytest.fixture(params=["memory", "journal"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    yield from rig_on(request.param, tmp_path)


def test_primary_dies_before_voting_the_shadow_site_goes_on_at_once(rig: Rig) -> None:
    """Measured before: the transaction sat until the 30 s vote timeout and was
    REJECTED although the shadow site was up."""
    client = rig.client(1)
    rig.server(2, "A")
    shadow = rig.server(3, "A", role=Role.SHADOW)
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")
    assert rig.take(2) == [("MSG1", "t1")] and rig.take(3) == [("MSG1", "t1")]
    rig.close(2)  # the primary site is gone before it voted
    rig.vote(3, shadow, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]  # no stall
    assert rig.take(3) == [("ACCEPTED", "t1")]
    rig.done(3, shadow, "t1")
    assert "t1" in rig.router.data.transactions  # the primary site must still replay it
    back = rig.server(4, "A")  # the primary site returns: it gets what it missed
    assert rig.take(4) == [("MSG1", "t1"), ("ACCEPTED", "t1")]
    rig.done(4, back, "t1")
    rig.call("collected", 1, client, ["t1"], rig.h.now)
    assert "t1" not in rig.router.data.transactions


def test_shadow_dies_after_the_primary_voted_the_primary_goes_on_alone(rig: Rig) -> None:
    client = rig.client(1)
    primary = rig.server(2, "A")
    rig.server(3, "A", role=Role.SHADOW)
    rig.send(1, client, "t1", 1)
    rig.vote(2, primary, "t1")
    rig.accept(1, client, "t1")
    rig.take(2), rig.take(3)
    rig.close(3)  # the secondary site dies mid-transaction
    assert rig.take(1) == [("ACCEPTED", "t1")]  # decided at once, no 30 s stall
    assert rig.take(2) == [("ACCEPTED", "t1")]
    rig.done(2, primary, "t1")
    rig.send(1, client, "t2", 2)  # committed while the shadow is away: kept for it
    rig.vote(2, primary, "t2")
    rig.accept(1, client, "t2")
    assert rig.take(1) == [("ACCEPTED", "t2")]
    rig.done(2, primary, "t2")
    if rig.h.durable_store is not None:  # what the shadow must replay survives a restart
        rig.h = rig.h.crash()
        rig.define()
    shadow = rig.server(5, "A", role=Role.SHADOW)
    kind = "UNCERTAIN" if rig.h.durable_store is not None else "MSG1"
    assert rig.take(5)[-2:] == [(kind, "t1"), ("ACCEPTED", "t1")]
    rig.done(5, shadow, "t1")
    assert rig.take(5)[-2:] == [(kind, "t2"), ("ACCEPTED", "t2")]
    rig.done(5, shadow, "t2")


def test_two_shadows_the_secondary_site_applies_once(rig: Rig) -> None:
    """Measured before: with the primary down before its vote, the transaction went as
    MSG1 to both shadows — the one secondary site applied it twice."""
    client = rig.client(1)
    rig.server(2, "A")
    first = rig.server(3, "A", role=Role.SHADOW)
    second = rig.server(4, "A", role=Role.SHADOW)
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")
    rig.close(2)
    got = {sid: rig.take(sid) for sid in (3, 4)}
    assert sorted(len(v) for v in got.values()) == [0, 1]  # one shadow, once
    holder, ctl = (3, first) if got[3] else (4, second)
    rig.vote(holder, ctl, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]
    assert rig.take(3) + rig.take(4) == [("ACCEPTED", "t1")]


def test_role_and_exception_events_carry_the_key_range(rig: Rig) -> None:
    """Issue 28 §2: PRIMARY when the primary site is gone, SECONDARY when it returns,
    EXCEPTION (262) when a transaction strikes out; each with the partition's key
    range."""
    client = rig.client(1)
    rig.server(2, "A")
    shadow = rig.server(3, "A", role=Role.SHADOW, events=((260, 262),))

    def events(sid: int) -> list[tuple[int, str, list[int]]]:
        mine = [b for s, b in rig.h.pushes if s == sid and b["type"] == "ROUTER_EVENT"]
        rig.take(sid)
        return [(b["number"], b["partition"], b["key_range"]) for b in mine]

    assert events(3) == [(261, "A", [0, 999])]  # SECONDARY: a primary site exists
    rig.close(2)
    assert events(3) == [(260, "A", [0, 999])]  # PRIMARY: the shadow site is primary
    rig.server(4, "A")
    assert events(3) == [(261, "A", [0, 999])]  # SECONDARY again: the primary returned
    rig.call("set_partition", 9, 1, "BANK", "A", 0, None, rig.h.now)
    rig.send(1, client, "poison", 1)
    rig.accept(1, client, "poison")
    rig.take(4)
    rig.close(4)  # lost before its vote, retry count 0: SRVDIED, an exception
    assert events(3) == [(262, "A", [0, 999]), (260, "A", [0, 999])]  # EXCEPTION, PRIMARY
    assert rig.take(1) == [("REJECTED", "poison")]
    assert rig.router.data.transactions["poison"].exception
    del shadow


def test_a_server_registers_a_key_range_no_partition_has(rig: Rig) -> None:
    """Issue 28 §2: the seed's servers define partitions by their key range: an unknown
    range that overlaps no partition becomes one (durably); an overlapping one is
    refused."""
    from txbroker.errors import BadRequest

    reply = rig.call("register", 2, "BANK", server=True, partition=[2000, 2999],
                     now=rig.h.now)
    assert reply["partition"] == "2000-2999"
    assert [p["name"] for p in reply["partitions"]] == ["A", "B", "2000-2999"]
    client = rig.client(1)
    assert rig.send(1, client, "t1", 2500) == {"partition": "2000-2999"}
    assert rig.take(2)[-1] == ("MSG1", "t1")
    with pytest.raises(BadRequest, match="overlap"):
        rig.call("register", 3, "BANK", server=True, partition=[900, 1100], now=rig.h.now)
    if rig.h.durable_store is not None:
        rig.h = rig.h.crash()
        assert [p.name for p in rig.router.data.facilities["BANK"].partitions] == [
            "A", "B", "2000-2999"]


def test_a_partition_stays_shadowed_across_a_restart_while_its_shadows_are_down(
        rig: Rig) -> None:
    """Found by the simulator (router-bank-sites-live): a partition counted as shadowed
    only from a shadow's registration in the broker's run, so a transaction committed
    after a restart, before the shadow site registered again, was never kept for it —
    the secondary site's ledger lost it. Now the facility record says so, durably."""
    rig.server(2, "A")
    rig.server(3, "A", role=Role.SHADOW)
    rig.close(3)  # the secondary site goes down
    rig.call("set_partition", 9, 1, "BANK", "A", 5, None, rig.h.now)  # rewrites the record
    rig.h = rig.h.crash()  # ... and the broker restarts while it is down
    assert ("BANK", "A") in rig.router.data.shadowed
    assert ("BANK", "B") not in rig.router.data.shadowed
    [bank] = rig.router.show("BANK")["facilities"]  # rtr_show says so
    assert [(p["name"], p["shadowed"]) for p in bank["partitions"]] == [("A", True),
                                                                       ("B", False)]
    client = rig.client(1)
    primary = rig.server(2, "A")
    rig.send(1, client, "t1", 5)
    rig.vote(2, primary, "t1")
    rig.accept(1, client, "t1")
    assert rig.take(1) == [("ACCEPTED", "t1")]  # the down site does not hold the decision
    assert rig.take(2) == [("MSG1", "t1"), ("ACCEPTED", "t1")]
    rig.done(2, primary, "t1")
    rig.call("collected", 1, client, ["t1"], rig.h.now)
    assert "t1" in rig.router.data.transactions  # kept for the secondary site
    shadow = rig.server(4, "A", role=Role.SHADOW)
    assert rig.take(4)[-2:] == [("MSG1", "t1"), ("ACCEPTED", "t1")]
    rig.done(4, shadow, "t1")
    assert "t1" not in rig.router.data.transactions


def test_a_partitions_first_shadow_is_answered_once_the_facility_record_is_durable(
        rig: Rig) -> None:
    """Through the router's door (a request id): the first shadow registration of a
    partition waits for its facility record, so that a restart never forgets a
    shadow site that registered; a later one, and any other role, is answered at once."""
    from txbroker.core import LATER
    from txbroker.core.router.commands import Register

    rig.h.auto_sync = False
    for sid in (3, 4, 5):
        rig.h.session(sid)
    register = Register("BANK", server=True, partition="A", role=Role.SHADOW)
    assert rig.router.execute(3, 7, register, rig.h.now) is LATER
    rig.h.run()
    assert (3, 7) not in rig.h.replies
    rig.h.sync()
    assert rig.h.replies[(3, 7)]["partition"] == "A"
    second = rig.router.execute(4, 8, register, rig.h.now)
    assert second["partition"] == "A" and ("BANK", "A") in rig.router.data.shadowed
    primary = Register("BANK", server=True, partition="B", role=Role.PRIMARY)
    assert rig.router.execute(5, 9, primary, rig.h.now)["partition"] == "B"
    assert ("BANK", "B") not in rig.router.data.shadowed


def test_a_site_presented_while_the_commit_is_written_is_told_it_is_decided(
        rig: Rig) -> None:
    """Found by the simulator (router-bank-sites-live seed 95): the shadow site alone
    decided (the primary site was down); the primary site's standby registered while
    the commit record was on its way to disk and got MSG1 *without* ``decided``; its
    balance check refused, the vote was ignored (decided), and ACCEPTED followed with no
    work to commit — applied at the secondary site only."""
    from txbroker.core.router.states import TxState

    client = rig.client(1)
    shadow = rig.server(3, "A", role=Role.SHADOW)
    rig.send(1, client, "t1", 5)
    rig.accept(1, client, "t1")
    assert rig.take(3) == [("MSG1", "t1")]
    rig.h.auto_sync = False
    rig.vote(3, shadow, "t1")  # no primary-site server: the shadow site decides alone
    assert rig.router.data.transactions["t1"].state is TxState.COMMIT_DECIDING
    rig.server(2, "A", role=Role.STANDBY)  # the primary site returns meanwhile
    presented = [b for s, b in rig.h.pushes if s == 2 and b["type"] == "MSG1"]
    assert [(b["tid"], b.get("decided")) for b in presented] == [("t1", True)]
    assert rig.take(1) == []  # nobody is told before the decision is durable
    rig.h.sync()
    assert rig.take(2) == [("MSG1", "t1"), ("ACCEPTED", "t1")]
    assert rig.take(1) == [("ACCEPTED", "t1")]


def test_retiring_a_secondary_site_releases_what_was_kept_for_it(rig: Rig) -> None:
    """``rtr_retire_shadow``: before it, a partition once shadowed kept every decided
    transaction for its secondary site for ever (no command retired the site). Now the
    operator retires it: what only waited for the site goes, an undecided transaction
    goes on with the primary site alone, and a restart does not bring either back."""
    from txbroker.core import LATER
    from txbroker.errors import BadRequest, IllegalState, NotFound

    client = rig.client(1)
    primary = rig.server(2, "A")
    rig.server(3, "A", role=Role.SHADOW)
    with pytest.raises(IllegalState, match="shadow servers registered"):
        rig.call("retire_shadow", 9, 1, "BANK", "A", rig.h.now)
    rig.close(3)  # the secondary site goes down, for good
    rig.send(1, client, "t1", 5)
    rig.vote(2, primary, "t1")
    rig.accept(1, client, "t1")
    assert rig.take(2) == [("MSG1", "t1"), ("ACCEPTED", "t1")]
    rig.done(2, primary, "t1")
    rig.call("collected", 1, client, ["t1"], rig.h.now)
    assert "t1" in rig.router.data.transactions  # kept for the secondary site
    rig.send(1, client, "t2", 6)
    rig.accept(1, client, "t2")  # not voted yet: undecided
    assert rig.take(2) == [("MSG1", "t2")]
    kept = rig.journal()
    rig.h.session(9)
    assert rig.call("retire_shadow", 9, 11, "BANK", "A", rig.h.now) is LATER
    assert rig.h.replies[(9, 11)] == {"facility": "BANK", "partition": "A", "released": 2}
    assert "t1" not in rig.router.data.transactions  # it only waited for the site
    assert sorted(rig.router.data.transactions["t2"].participants) == [("A", Site.PRIMARY)]
    assert rig.journal() == kept - 1  # t1's record went; t2's and the facility's replaced
    assert ("BANK", "A") not in rig.router.data.shadowed
    [bank] = rig.router.show("BANK")["facilities"]
    assert [(p["name"], p["shadowed"]) for p in bank["partitions"]] == [("A", False),
                                                                       ("B", False)]
    # again: nothing to do, answered at once; bad input changes nothing
    assert rig.call("retire_shadow", 9, 12, "BANK", "A", rig.h.now) == {
        "facility": "BANK", "partition": "A", "released": 0}
    with pytest.raises(NotFound):
        rig.call("retire_shadow", 9, 13, "BANK", "Z", rig.h.now)
    with pytest.raises(NotFound):
        rig.call("retire_shadow", 9, 14, "NOPE", "A", rig.h.now)
    with pytest.raises(BadRequest):
        rig.call("retire_shadow", 9, 15, "BANK", ["A"], rig.h.now)
    if rig.h.durable_store is not None:  # the retirement survives a restart
        rig.h = rig.h.crash()
        assert ("BANK", "A") not in rig.router.data.shadowed
        assert sorted(rig.router.data.transactions) == ["t2"]
        assert sorted(rig.router.data.transactions["t2"].participants) == [
            ("A", Site.PRIMARY)]
        primary = rig.server(2, "A")
        assert rig.take(2) == [("UNCERTAIN", "t2")]
    rig.vote(2, primary, "t2")
    assert rig.take(2) == [("ACCEPTED", "t2")]
    rig.done(2, primary, "t2")
    rig.server(5, "A", role=Role.SHADOW)  # a new secondary site: from now on
    assert rig.take(5) == []  # nothing of before is replayed to it
    assert ("BANK", "A") in rig.router.data.shadowed


def test_a_secondary_site_is_not_retired_while_a_decision_is_written(rig: Rig) -> None:
    """A transaction whose decision is on its way to disk keeps its record as it is:
    the retirement is refused (try again) and changes nothing."""
    from txbroker.errors import IllegalState

    client = rig.client(1)
    primary = rig.server(2, "A")
    rig.server(3, "A", role=Role.SHADOW)
    rig.close(3)
    rig.send(1, client, "t1", 5)
    rig.accept(1, client, "t1")
    rig.take(2)
    rig.h.auto_sync = False
    rig.vote(2, primary, "t1")  # the commit record is being written
    with pytest.raises(IllegalState, match="t1 is being written"):
        rig.call("retire_shadow", 9, 1, "BANK", "A", rig.h.now)
    assert ("BANK", "A") in rig.router.data.shadowed
    assert len(rig.router.data.transactions["t1"].participants) == 2
    rig.h.sync()
    assert rig.take(1) == [("ACCEPTED", "t1")]
