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
    NOT_ASKED,
    RULES,
    Call,
    Calls,
    Coordinator,
    Decide,
    Fault,
    Forget,
    Input,
    Op,
    State,
    Steps,
    transition,
)
from txbroker.tm.errors import InDoubt, RolledBack, TMError
from txbroker.tm.manager import STEPS
from txbroker.tm.recovery import RESOLUTIONS, Outcome, Resolved, resolved

# (state, input) -> (actions, next state), by their values. Written from the protocol
# in docs/tm.md, not copied from engine.py.
EXPECTED_TABLE: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    # opening the branches: one by one, stopping at a failure (sync), or all at once
    ("new", "begin"): (("begin",), "beginning"),
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
    ("preparing", "all-yes"): (("after_votes", "decide"), "deciding"),
    ("preparing", "all-read-only"): (("after_votes", "count-committed"), "committed"),
    ("preparing", "voted-no"): (("clean-up", "count-rolled-back", "raise"), "rolled-back"),
    # the decision
    ("deciding", "durable"): (("after_decision", "commit"), "committing"),
    ("deciding", "decision-failed"): (("raise",), "undecided"),
    # phase two
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
GTRID = b"\x07" * 16


def yes(call: Call) -> object:
    """Every participant: begins, votes yes (not read-only), finishes."""
    return {Op.VOTE: False, Op.COMMIT: True, Op.ROLLBACK: True}.get(call.op)


def drive(coordinator: Coordinator, steps: Steps, answer: Answer = yes,
          decide: BaseException | None = None) -> list[str]:
    """Run ``steps`` as the coordinator's kind of driver would (one call after another
    when sequential, honouring ``between`` and ``stop_at_failure``; else a batch at
    once), answering each call with ``answer``. Returns what was done, in order:
    ``"vote 1"`` (a call), ``"vote 0 1 2"`` (a batch at once), ``"! step"`` (a crash
    point), ``"decide"``, ``"forget"``."""
    done: list[str] = []
    reply: object = None
    while True:
        try:
            effect = steps.send(reply)
        except StopIteration:
            return done
        reply = None
        if isinstance(effect, Calls):
            results: list[object] = []
            if coordinator.sequential:
                for call in effect.calls:
                    if results and effect.stop_at_failure \
                            and isinstance(results[-1], BaseException):
                        results.append(NOT_ASKED)
                        continue
                    if results and effect.between is not None:
                        done.append(f"! {effect.between}")
                    done.append(f"{call.op.value} {call.index}")
                    results.append(answer(call))
            else:
                assert effect.between is None  # no crash point inside a batch made at once
                op = effect.calls[0].op
                assert all(call.op is op for call in effect.calls)
                done.append(" ".join([op.value, *(str(c.index) for c in effect.calls)]))
                results = [answer(call) for call in effect.calls]
            reply = results
        elif isinstance(effect, Fault):
            done.append(f"! {effect.step}")
        elif isinstance(effect, Decide):
            assert effect.gtrid == GTRID
            done.append("decide")
            reply = decide
        else:
            assert isinstance(effect, Forget) and effect.gtrid == GTRID
            done.append("forget")


def opened(n: int, *, sequential: bool) -> tuple[Coordinator, dict[str, int]]:
    counters = {"committed": 0, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}
    coordinator = Coordinator(GTRID, [f"p{i}" for i in range(n)], sequential=sequential,
                              counters=counters)
    drive(coordinator, coordinator.begin())
    assert coordinator.state is State.ACTIVE
    return coordinator, counters


def test_sequential_commit_asks_one_at_a_time_and_passes_the_sync_steps() -> None:
    coordinator, counters = opened(3, sequential=True)
    done = drive(coordinator, coordinator.commit())
    assert done == ["! before_prepare", "vote 0", "! between_prepares", "vote 1",
                    "! between_prepares", "vote 2", "decide", "! after_decision",
                    "commit 0", "! between_commits", "commit 1", "! between_commits",
                    "commit 2", "forget"]
    assert coordinator.state is State.COMMITTED
    assert counters == {"committed": 1, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}
    assert {d[2:] for d in done if d.startswith("!")} == set(STEPS)


def test_concurrent_commit_asks_everyone_at_once_and_passes_the_async_steps() -> None:
    coordinator, counters = opened(3, sequential=False)
    done = drive(coordinator, coordinator.commit())
    assert done == ["! before_prepare", "vote 0 1 2", "! after_votes", "decide",
                    "! after_decision", "commit 0 1 2", "forget"]
    assert tuple(d[2:] for d in done if d.startswith("!")) == ASYNC_STEPS
    assert counters == {"committed": 1, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_begin_opens_every_branch_in_order(sequential: bool) -> None:
    coordinator = Coordinator(GTRID, ["a", "b"], sequential=sequential, counters={})
    done = drive(coordinator, coordinator.begin())
    assert done == (["begin 0", "begin 1"] if sequential else ["begin 0 1"])
    assert coordinator.started == [0, 1] and not coordinator.done


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_a_failed_begin_aborts_the_open_branches_and_raises_its_error(sequential: bool) -> None:
    coordinator = Coordinator(GTRID, ["a", "b", "c"], sequential=sequential, counters={})
    made: list[str] = []

    def answer(call: Call) -> object:
        made.append(f"{call.op.value} {call.index}")
        return RuntimeError("resource down") if call == Call(Op.BEGIN, 1) else None

    with pytest.raises(RuntimeError, match="resource down"):
        drive(coordinator, coordinator.begin(), answer)
    assert coordinator.state is State.ROLLED_BACK and coordinator.done
    # sequential: c is never asked; at once: c opened, and is aborted too
    if sequential:
        assert made == ["begin 0", "begin 1", "abort 0"]
    else:
        assert made == ["begin 0", "begin 1", "begin 2", "abort 0", "abort 2"]


def test_sequential_no_stops_the_voting_and_cleans_up() -> None:
    coordinator, counters = opened(4, sequential=True)

    def answer(call: Call) -> object:
        if call.op is Op.VOTE:
            return {0: True, 1: False, 2: RuntimeError("no")}[call.index]
        return yes(call)

    made: list[str] = []

    def recording(call: Call) -> object:
        made.append(f"{call.op.value} {call.index}")
        return answer(call)

    with pytest.raises(RolledBack, match="p2 voted no: no") as info:
        drive(coordinator, coordinator.commit(), recording)
    assert isinstance(info.value.__cause__, RuntimeError)
    # p0 read-only, p1 prepared, p2 said no, p3 never asked: roll back p1, abort the rest
    assert made == ["vote 0", "vote 1", "vote 2", "rollback 1", "abort 0", "abort 2",
                    "abort 3"]
    assert coordinator.asked == 3 and coordinator.prepared == [1]
    assert counters["rolled_back"] == 1 and coordinator.state is State.ROLLED_BACK


def test_concurrent_no_asks_everyone_then_cleans_up_in_one_batch() -> None:
    coordinator, counters = opened(4, sequential=False)
    made: list[list[str]] = []
    steps = coordinator.commit()
    reply: object = None
    with pytest.raises(RolledBack, match="p2 voted no"):
        while True:
            effect = steps.send(reply)
            reply = None
            if isinstance(effect, Calls):
                made.append([f"{c.op.value} {c.index}" for c in effect.calls])
                reply = [{0: True, 1: False, 2: RuntimeError("no"), 3: False}[c.index]
                         if c.op is Op.VOTE else None for c in effect.calls]
    assert made == [["vote 0", "vote 1", "vote 2", "vote 3"],
                    ["rollback 1", "rollback 3", "abort 0", "abort 2"]]
    assert counters["rolled_back"] == 1 and coordinator.asked == 4


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_read_only_voters_need_no_decision(sequential: bool) -> None:
    coordinator, counters = opened(2, sequential=sequential)
    done = drive(coordinator, coordinator.commit(),
                 lambda call: True if call.op is Op.VOTE else None)
    assert "decide" not in done and "forget" not in done
    assert not any(d.startswith("commit") for d in done)
    assert counters["committed"] == 1 and coordinator.state is State.COMMITTED


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_a_read_only_voter_is_not_asked_to_commit(sequential: bool) -> None:
    coordinator, _ = opened(3, sequential=sequential)
    done = drive(coordinator, coordinator.commit(),
                 lambda call: (call.index == 1) if call.op is Op.VOTE else yes(call))
    commits = [d for d in done if d.startswith("commit")]
    assert commits == (["commit 0", "commit 2"] if sequential else ["commit 0 2"])


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_an_unfinished_commit_keeps_the_decision(sequential: bool) -> None:
    coordinator, counters = opened(3, sequential=sequential)

    def answer(call: Call) -> object:
        if call.op is Op.COMMIT:
            return {0: True, 1: False, 2: RuntimeError("broke its contract")}[call.index]
        return yes(call)

    done = drive(coordinator, coordinator.commit(), answer)
    # every voter is still asked to commit; the two that did not finish are recovery's
    assert done[-1] == ("commit 2" if sequential else "commit 0 1 2")
    assert "forget" not in done and coordinator.unfinished == 2
    assert counters == {"committed": 1, "rolled_back": 0, "one_phase": 0, "in_doubt": 1}


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_a_failed_decision_raises_and_starts_no_phase_two(sequential: bool) -> None:
    coordinator, counters = opened(2, sequential=sequential)
    made: list[Call] = []

    def answer(call: Call) -> object:
        made.append(call)
        return yes(call)

    with pytest.raises(OSError, match="disk gone"):
        drive(coordinator, coordinator.commit(), answer, decide=OSError("disk gone"))
    assert coordinator.state is State.UNDECIDED
    assert [call.op for call in made] == [Op.VOTE, Op.VOTE]  # no commit, no rollback
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
    assert next(steps) == Calls([Call(Op.COMMIT_ONE_PHASE, 0)])
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
    votes = steps.send(None)
    assert votes == Calls([Call(Op.VOTE, 0), Call(Op.VOTE, 1)], True, "between_prepares")
    with pytest.raises(KeyboardInterrupt):
        steps.send([KeyboardInterrupt(), NOT_ASKED])
    assert counters["rolled_back"] == 0 and coordinator.state is State.PREPARING


def test_commit_twice_and_rollback_after_commit_are_refused() -> None:
    coordinator, _ = opened(2, sequential=True)
    drive(coordinator, coordinator.commit())
    with pytest.raises(TMError, match="already completed"):
        drive(coordinator, coordinator.commit())
    with pytest.raises(TMError, match="already completed"):
        drive(coordinator, coordinator.rollback())


@pytest.mark.parametrize("sequential", [True, False], ids=["sync", "async"])
def test_rollback_aborts_everyone_and_logs_nothing(sequential: bool) -> None:
    coordinator, counters = opened(3, sequential=sequential)
    done = drive(coordinator, coordinator.rollback())
    assert done == (["abort 0", "abort 1", "abort 2"] if sequential else ["abort 0 1 2"])
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
