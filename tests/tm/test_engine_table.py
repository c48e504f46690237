"""The TM's two-phase commit engine (txbroker.tm.engine) against a table written here
independently from docs/tm.md, as tests/core/test_xa.py does for XA branches; then the
effects each kind of coordinator yields, driven by a scripted driver (no I/O), and
recovery's per-branch table."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from txbroker.errors import XA_HEURCOM, XA_HEURRB, XA_RBROLLBACK, XAER_NOTA, XAER_RMFAIL, XAError
from txbroker.tm.aio import ASYNC_STEPS
from txbroker.tm.engine import (
    RULES,
    Call,
    Calls,
    Coordinator,
    Decide,
    Effect,
    Fault,
    Forget,
    InDoubt,
    Input,
    Op,
    RolledBack,
    State,
    Steps,
    TMError,
    transition,
)
from txbroker.tm.manager import STEPS
from txbroker.tm.recovery import RESOLUTIONS, Outcome, Resolved, resolved

# (state, input) -> (actions, next state), by their values. Written from the protocol
# in docs/tm.md, not copied from engine.py.
EXPECTED_TABLE: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    # opening the branches: one by one (sync) or all at once (async)
    ("new", "begin"): (("begin",), "beginning"),
    ("beginning", "began-more"): (("begin",), "beginning"),
    ("beginning", "all-began"): ((), "active"),
    # a branch that does not open: the open ones are aborted, its error raised, and
    # nothing is counted
    ("beginning", "begin-failed"): (("abort-started", "raise"), "rolled-back"),
    # one participant: one phase, nothing logged
    ("active", "commit-alone"): (("commit-one-phase",), "one-phase"),
    ("one-phase", "committed-alone"): (("count-one-phase",), "committed"),
    ("one-phase", "refused"): (("count-rolled-back", "raise"), "rolled-back"),
    ("one-phase", "cut-off"): (("count-in-doubt", "raise"), "in-doubt"),
    # phase one
    ("active", "commit"): (("before_prepare", "vote"), "preparing"),
    ("preparing", "yes-more"): (("between_prepares", "vote"), "preparing"),
    ("preparing", "all-yes"): (("after_votes", "decide"), "deciding"),
    ("preparing", "all-read-only"): (("after_votes", "count-committed"), "committed"),
    ("preparing", "voted-no"): (("clean-up", "count-rolled-back", "raise"), "rolled-back"),
    # the decision
    ("deciding", "durable"): (("after_decision", "commit"), "committing"),
    ("deciding", "decision-failed"): (("raise",), "undecided"),
    # phase two
    ("committing", "finished-more"): (("between_commits", "commit"), "committing"),
    ("committing", "all-finished"): (("forget", "count-committed"), "committed"),
    ("committing", "some-unfinished"): (("count-in-doubt", "count-committed"), "committed"),
    # rollback by the application
    ("active", "rollback"): (("abort-all", "count-rolled-back"), "rolled-back"),
}


def test_expected_table_names_real_states_inputs_and_actions() -> None:
    states = {s.value for s in State}
    inputs = {i.value for i in Input}
    assert {s for s, _ in EXPECTED_TABLE} <= states
    assert {i for _, i in EXPECTED_TABLE} <= inputs
    assert {after for _, after in EXPECTED_TABLE.values()} <= states


def test_every_row_of_the_engine_is_expected_and_none_is_missing() -> None:
    """A rule added to engine.py must be added here too (with a reason)."""
    assert {(s.value, i.value) for s, i in RULES} == set(EXPECTED_TABLE)


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
@pytest.mark.parametrize("event", list(Input), ids=lambda i: i.value)
def test_each_pair_follows_the_expected_table(state: State, event: Input) -> None:
    expected = EXPECTED_TABLE.get((state.value, event.value))
    if expected is None:
        with pytest.raises(TMError):
            transition(state, event)
        return
    actions, after = transition(state, event)
    assert (tuple(a.value for a in actions), after.value) == expected


def test_completed_transactions_refuse_commit_and_rollback() -> None:
    for state in ("committed", "rolled-back", "in-doubt", "undecided", "preparing",
                  "deciding", "committing", "one-phase"):
        for request in ("commit", "commit-alone", "rollback"):
            assert (state, request) not in EXPECTED_TABLE


# ---------------------------------------------------------------------- effects
Answer = Callable[[Call], object]


def yes(call: Call) -> object:
    """Every participant: begins, votes yes (not read-only), finishes."""
    return {Op.VOTE: False, Op.COMMIT: True, Op.ROLLBACK: True}.get(call.op)


def drive(steps: Steps, answer: Answer = yes,
          decide: BaseException | None = None) -> list[Effect]:
    """Run ``steps``, answering each call with ``answer``; return every effect."""
    effects: list[Effect] = []
    reply: object = None
    while True:
        try:
            effect = steps.send(reply)
        except StopIteration:
            return effects
        effects.append(effect)
        reply = None
        if isinstance(effect, Calls):
            reply = [answer(call) for call in effect.calls]
        elif isinstance(effect, Decide):
            reply = decide


def opened(n: int, *, sequential: bool) -> tuple[Coordinator, dict[str, int]]:
    counters = {"committed": 0, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}
    coordinator = Coordinator(b"\x07" * 16, [f"p{i}" for i in range(n)],
                              sequential=sequential, counters=counters)
    drive(coordinator.begin())
    assert coordinator.state is State.ACTIVE
    return coordinator, counters


def calls(*pairs: tuple[Op, int]) -> Calls:
    return Calls(tuple(Call(op, index) for op, index in pairs))


GTRID = b"\x07" * 16


def test_sequential_commit_asks_one_at_a_time_and_passes_the_sync_steps() -> None:
    coordinator, counters = opened(3, sequential=True)
    effects = drive(coordinator.commit())
    assert effects == [
        Fault("before_prepare"), calls((Op.VOTE, 0)),
        Fault("between_prepares"), calls((Op.VOTE, 1)),
        Fault("between_prepares"), calls((Op.VOTE, 2)),
        Decide(GTRID), Fault("after_decision"), calls((Op.COMMIT, 0)),
        Fault("between_commits"), calls((Op.COMMIT, 1)),
        Fault("between_commits"), calls((Op.COMMIT, 2)),
        Forget(GTRID)]
    assert coordinator.state is State.COMMITTED and counters["committed"] == 1
    assert [f.step for f in effects if isinstance(f, Fault)] == [
        "before_prepare", "between_prepares", "between_prepares", "after_decision",
        "between_commits", "between_commits"]
    assert {f.step for f in effects if isinstance(f, Fault)} == set(STEPS)


def test_concurrent_commit_asks_everyone_at_once_and_passes_the_async_steps() -> None:
    coordinator, counters = opened(3, sequential=False)
    effects = drive(coordinator.commit())
    assert effects == [
        Fault("before_prepare"), calls((Op.VOTE, 0), (Op.VOTE, 1), (Op.VOTE, 2)),
        Fault("after_votes"), Decide(GTRID), Fault("after_decision"),
        calls((Op.COMMIT, 0), (Op.COMMIT, 1), (Op.COMMIT, 2)), Forget(GTRID)]
    assert tuple(f.step for f in effects if isinstance(f, Fault)) == ASYNC_STEPS
    assert counters == {"committed": 1, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_begin_opens_every_branch_in_order(sequential: bool) -> None:
    coordinator = Coordinator(GTRID, ["a", "b"], sequential=sequential, counters={})
    effects = drive(coordinator.begin())
    if sequential:
        assert effects == [calls((Op.BEGIN, 0)), calls((Op.BEGIN, 1))]
    else:
        assert effects == [calls((Op.BEGIN, 0), (Op.BEGIN, 1))]


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_a_failed_begin_aborts_the_open_branches_and_raises_its_error(sequential: bool) -> None:
    coordinator = Coordinator(GTRID, ["a", "b", "c"], sequential=sequential, counters={})
    down = RuntimeError("resource down")

    def answer(call: Call) -> object:
        return down if (call.op, call.index) == (Op.BEGIN, 1) else None

    steps = coordinator.begin()
    with pytest.raises(RuntimeError, match="resource down"):
        drive(steps, answer)
    assert coordinator.state is State.ROLLED_BACK and coordinator.done
    # sequential: c was never asked; concurrent: c opened and is aborted too
    assert coordinator.started == ([0] if sequential else [0, 2])


def test_sequential_no_stops_the_voting_and_cleans_up() -> None:
    coordinator, counters = opened(4, sequential=True)
    made: list[Call] = []

    def answer(call: Call) -> object:
        made.append(call)
        if call.op is Op.VOTE:
            return {0: True, 1: False, 2: RuntimeError("no")}[call.index]
        return yes(call)

    with pytest.raises(RolledBack, match="p2 voted no: no") as info:
        drive(coordinator.commit(), answer)
    assert isinstance(info.value.__cause__, RuntimeError)
    # p0 read-only, p1 prepared, p2 said no, p3 never asked: roll back p1, abort the rest
    assert made == [Call(Op.VOTE, 0), Call(Op.VOTE, 1), Call(Op.VOTE, 2),
                    Call(Op.ROLLBACK, 1), Call(Op.ABORT, 0), Call(Op.ABORT, 2),
                    Call(Op.ABORT, 3)]
    assert counters["rolled_back"] == 1 and coordinator.state is State.ROLLED_BACK


def test_the_clean_up_after_a_no_rolls_back_the_prepared_then_aborts_the_rest() -> None:
    coordinator, _ = opened(4, sequential=False)
    seen: list[Calls] = []
    steps = coordinator.commit()
    reply: object = None
    with pytest.raises(RolledBack):
        while True:
            effect = steps.send(reply)
            reply = None
            if isinstance(effect, Calls):
                seen.append(effect)
                reply = [{0: True, 1: False, 2: RuntimeError("no"), 3: False}[c.index]
                         if c.op is Op.VOTE else None for c in effect.calls]
    assert seen[-1] == calls((Op.ROLLBACK, 1), (Op.ROLLBACK, 3), (Op.ABORT, 0), (Op.ABORT, 2))
    assert not any(isinstance(c, Calls) and c.calls[0].op is Op.COMMIT for c in seen)


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_read_only_voters_need_no_decision(sequential: bool) -> None:
    coordinator, counters = opened(2, sequential=sequential)
    effects = drive(coordinator.commit(), lambda call: True if call.op is Op.VOTE else None)
    assert not any(isinstance(e, Decide | Forget) for e in effects)
    assert counters["committed"] == 1 and coordinator.state is State.COMMITTED


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_a_read_only_voter_is_not_asked_to_commit(sequential: bool) -> None:
    coordinator, _ = opened(3, sequential=sequential)
    effects = drive(coordinator.commit(),
                    lambda call: (call.index == 1) if call.op is Op.VOTE else yes(call))
    committed = [c.index for e in effects if isinstance(e, Calls) for c in e.calls
                 if c.op is Op.COMMIT]
    assert committed == [0, 2]


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_an_unfinished_commit_keeps_the_decision(sequential: bool) -> None:
    coordinator, counters = opened(3, sequential=sequential)

    def answer(call: Call) -> object:
        if call.op is Op.COMMIT:
            return {0: True, 1: False, 2: RuntimeError("broke its contract")}[call.index]
        return yes(call)

    effects = drive(coordinator.commit(), answer)
    assert not any(isinstance(e, Forget) for e in effects)
    # every voter is still asked to commit; the two that did not finish are recovery's
    assert sum(len(e.calls) for e in effects if isinstance(e, Calls)) == 6
    assert coordinator.unfinished == 2
    assert counters == {"committed": 1, "rolled_back": 0, "one_phase": 0, "in_doubt": 1}


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_a_failed_decision_raises_and_starts_no_phase_two(sequential: bool) -> None:
    coordinator, counters = opened(2, sequential=sequential)
    with pytest.raises(OSError, match="disk gone"):
        drive(coordinator.commit(), decide=OSError("disk gone"))
    assert coordinator.state is State.UNDECIDED and coordinator.committed_to == 0
    assert counters == {"committed": 0, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}


@pytest.mark.parametrize(("error", "raised", "state", "counter"), [
    (None, None, State.COMMITTED, "one_phase"),
    (XAError(XA_RBROLLBACK, "rolled back"), RolledBack, State.ROLLED_BACK, "rolled_back"),
    (XAError(XAER_RMFAIL, "rm failed"), InDoubt, State.IN_DOUBT, "in_doubt"),
    (ConnectionResetError(), InDoubt, State.IN_DOUBT, "in_doubt"),
], ids=["ok", "refused", "rm-failed", "cut-off"])
def test_one_participant_commits_in_one_phase(error: Exception | None,
                                              raised: type[Exception] | None, state: State,
                                              counter: str) -> None:
    coordinator, counters = opened(1, sequential=True)
    steps = coordinator.commit()
    assert next(steps) == calls((Op.COMMIT_ONE_PHASE, 0))
    if raised is None:
        with pytest.raises(StopIteration):
            steps.send([error])
    else:
        with pytest.raises(raised) as info:
            steps.send([error])
        assert info.value.__cause__ is error
    assert coordinator.state is state and counters[counter] == 1 and sum(counters.values()) == 1


def test_a_keyboard_interrupt_is_never_a_vote() -> None:
    coordinator, counters = opened(2, sequential=True)
    steps = coordinator.commit()
    assert next(steps) == Fault("before_prepare")
    assert steps.send(None) == calls((Op.VOTE, 0))
    with pytest.raises(KeyboardInterrupt):
        steps.send([KeyboardInterrupt()])
    assert counters["rolled_back"] == 0 and coordinator.state is State.PREPARING


def test_commit_twice_and_rollback_after_commit_are_refused() -> None:
    coordinator, _ = opened(2, sequential=True)
    drive(coordinator.commit())
    with pytest.raises(TMError, match="already completed"):
        drive(coordinator.commit())
    with pytest.raises(TMError, match="already completed"):
        drive(coordinator.rollback())


def test_rollback_aborts_everyone_and_logs_nothing() -> None:
    coordinator, counters = opened(3, sequential=False)
    assert drive(coordinator.rollback()) == [calls((Op.ABORT, 0), (Op.ABORT, 1), (Op.ABORT, 2))]
    assert counters["rolled_back"] == 1 and coordinator.state is State.ROLLED_BACK


# ---------------------------------------------------------------------- recovery
EXPECTED_RESOLUTIONS: dict[tuple[bool, str], tuple[str, bool]] = {
    (True, "ok"): ("committed", False),
    (False, "ok"): ("rolled_back", False),
    (True, "gone"): ("not reported", False),  # already complete
    (False, "gone"): ("not reported", False),
    (True, "heuristic"): ("heuristic", False),  # reported, never hidden
    (False, "heuristic"): ("heuristic", False),
    (True, "failed"): ("unresolved", True),  # the decision stays for the next run
    (False, "failed"): ("unresolved", True),
}


def test_recovery_resolutions_follow_the_expected_table() -> None:
    assert {(d, r.value): (o.value, keep) for (d, r), (o, keep) in RESOLUTIONS.items()} \
        == EXPECTED_RESOLUTIONS
    assert {o.value for o in Outcome} == {o for o, _ in EXPECTED_RESOLUTIONS.values()}


def test_recovery_classifies_resolve_errors() -> None:
    assert resolved(None) is Resolved.OK
    assert resolved(XAError(XAER_NOTA, "gone")) is Resolved.GONE
    assert resolved(XAError(XA_HEURCOM, "h")) is Resolved.HEURISTIC
    assert resolved(XAError(XA_HEURRB, "h")) is Resolved.HEURISTIC
    assert resolved(XAError(XAER_RMFAIL, "down")) is Resolved.FAILED
    assert resolved(OSError("down")) is Resolved.FAILED
