"""The client's XA bookkeeping across failovers (``client/_xa_state.py``), rule by rule
(no broker: the real-broker cases are in test_failover_real.py)."""

from __future__ import annotations

import pytest

from txbroker.client._xa_state import XaBranchState
from txbroker.errors import XA_RBCOMMFAIL, XAER_NOTA, XAER_PROTO, XAError


def lost_error(state: XaBranchState, op: str, xid: str) -> XAError:
    with pytest.raises(XAError) as info:
        state.check_lost(op, xid)
    assert info.value.errcode == XA_RBCOMMFAIL and info.value.rolled_back
    return info.value


def test_associated_branch_resumed_carries_on() -> None:
    state = XaBranchState()
    state.starting("x", 1)
    state.resumed(2)
    assert state.unprepared == {"x": 2} and state.broken is None
    state.check_work()  # nothing refused
    assert not state.check_lost("xa_end", "x")


def test_associated_branch_not_resumed_refuses_work_until_it_is_ended() -> None:
    state = XaBranchState()
    state.starting("x", 1)
    state.resume_failed("b:2 could not resume it")
    with pytest.raises(XAError, match="end or roll it back") as info:
        state.check_work()
    assert info.value.errcode == XA_RBCOMMFAIL
    assert "b:2 could not resume it" in str(lost_error(state, "xa_end", "x"))
    state.check_work()  # ended: no association, work is done at once again
    lost_error(state, "xa_prepare", "x")  # still rolled back
    assert state.check_lost("xa_rollback", "x")  # done: nothing to send
    assert not state.check_lost("xa_prepare", "x")  # forgotten
    assert state.unprepared == {}


def test_commit_and_join_of_a_lost_branch() -> None:
    state = XaBranchState()
    state.starting("x", 1)
    state.resume_failed("gone")
    lost_error(state, "xa_start", "x")  # TMRESUME / TMJOIN of it
    lost_error(state, "xa_commit", "x")
    assert state.lost == {} and state.unprepared == {} and state.associated is None


def test_unknown_branch_of_an_older_epoch_was_lost_with_its_broker() -> None:
    state = XaBranchState()
    state.starting("idle", 1)
    state.ended("idle")
    nota = XAError(XAER_NOTA, "no such branch")
    assert not state.translate("xa_prepare", "idle", nota, 1)  # same broker: it stands
    assert not state.translate("xa_prepare", "idle", XAError(XAER_PROTO), 2)
    assert not state.translate("xa_prepare", "other", nota, 2)  # not ours
    with pytest.raises(XAError) as info:
        state.translate("xa_prepare", "idle", nota, 2)
    assert info.value.rolled_back
    assert state.check_lost("xa_rollback", "idle")  # known lost now: done locally
    assert state.unprepared == {} and state.lost == {}
    state.starting("again", 2)
    state.ended("again")
    assert state.translate("xa_rollback", "again", nota, 3)  # a rollback: done


def test_prepared_and_completed_branches_are_forgotten() -> None:
    state = XaBranchState()
    state.starting("p", 1)
    state.ended("p")
    state.prepared("p")
    assert state.unprepared == {}
    assert not state.translate("xa_commit", "p", XAError(XAER_NOTA), 2)  # not ours to judge
    state.starting("c", 1)
    state.completed("c")
    assert state.unprepared == {} and state.associated is None
    state.start_failed("c")  # (no association left to undo)
    state.starting("f", None)  # the session was not known yet: recorded by started()
    state.start_failed("f")
    assert state.associated is None
    state.started("f", 3)
    assert state.unprepared == {"f": 3}
