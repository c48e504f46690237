"""The two-phase commit engine of the transaction manager, written once (sans-IO).

Theory of operation
-------------------
The coordinator of one global transaction is a table, :data:`RULES`:
``(state, input) -> (actions, next state)``, one comment per rule, in the style
of ``txbroker.core.xa``. :class:`Coordinator` never calls a participant, a
log or a clock: its :meth:`~Coordinator.begin`, :meth:`~Coordinator.commit`
and :meth:`~Coordinator.rollback` are generators that *yield* what they need
done — :class:`Calls` (participant calls), :class:`Fault` (a named crash
point), :class:`Decide` (make the commit decision durable), :class:`Forget`
(the END record) — and receive each answer through ``send``: for
:class:`Calls` a list with the result or the exception of every call, in
order; for :class:`Decide` ``None`` or the exception the write raised.

Each phase is one :class:`Calls` batch (open every branch, ask every vote,
commit every prepared voter), and two drivers run it:

* the sync manager (:mod:`txbroker.tm.manager`) makes a batch's calls one
  after another in the caller's thread (no thread hop, no event loop). It
  stops a batch at the first call that raised when the batch says
  ``stop_at_failure`` (a failed begin, a no: the rest are not asked), and
  passes the crash point the batch names ``between`` two calls. Its
  coordinator is *sequential*: it names the crash points of
  :data:`SEQUENTIAL_STEPS` (``between_prepares``, ``between_commits``);
* the asyncio manager (:mod:`txbroker.tm.aio`) makes a batch's calls at once
  (the participants are different resource managers); its coordinator is
  *concurrent*: it passes the crash points of :data:`CONCURRENT_STEPS`
  (``after_votes`` instead of the two "between" points).

Either way the rules below decide what the answers mean: the table and the
coordinator's methods are the only copy of the protocol.

The protocol: presumed abort (nothing is logged before the decision, a
transaction without a decision is rolled back by recovery); a single
participant commits in one phase; read-only voters drop out of phase two; a
no rolls back the prepared voters and aborts the rest; the decision is
durable before phase two starts; a commit that does not finish leaves the
branch and its decision to recovery, whose rule for each branch it finds
(heuristic outcomes included) is the table
:data:`txbroker.tm.recovery.RESOLUTIONS`.

A ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt,
CancelledError) is never an answer: the engine raises it at once — except
that a failed begin first aborts the branches already open.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from txbroker.tm.errors import InDoubt, RolledBack, TMError, one_phase_failure

log = logging.getLogger("txbroker.tm")

#: The sync manager's crash points, in the order a two-phase commit passes them.
SEQUENTIAL_STEPS = ("before_prepare", "between_prepares", "after_decision", "between_commits")
#: The asyncio manager's crash points (its votes and commits overlap: no "between").
CONCURRENT_STEPS = ("before_prepare", "after_votes", "after_decision")


class _Named(Protocol):
    @property
    def sort_key(self) -> str: ...


_P = TypeVar("_P", bound=_Named)


def in_branch_order(participants: Sequence[_P]) -> list[_P]:
    """The participants of one global transaction in ``sort_key`` order (every TM
    opens, votes and finishes branches in it); raises :class:`TMError` when two share
    a name. Shared by the sync and async TMs."""
    ordered = sorted(participants, key=lambda p: p.sort_key)
    names = [p.sort_key for p in ordered]
    if len(set(names)) != len(names):
        raise TMError(f"participants need distinct names, got {names}")
    return ordered


# ---------------------------------------------------------------------- effects
class Op(enum.Enum):
    """A participant call (the ``Participant`` protocol's methods)."""

    __hash__ = object.__hash__  # members are singletons: hash by identity (C speed)

    BEGIN = "begin"  #: ``begin(xid)``
    VOTE = "vote"  #: ``vote(xid)`` -> read_only
    COMMIT_ONE_PHASE = "commit_one_phase"  #: ``commit_one_phase(xid)``
    COMMIT = "commit"  #: ``finish(xid, True)`` -> done
    ROLLBACK = "rollback"  #: ``finish(xid, False)`` -> done
    ABORT = "abort"  #: ``abort(xid)``


@dataclass(slots=True)
class Call:
    """Call ``op`` on the participant at ``index`` (branch order) with its Xid."""

    op: Op
    index: int


def _calls(op: Op, indexes: Iterable[int]) -> list[Call]:
    return [Call(op, index) for index in indexes]


class _NotAsked:
    """The type of :data:`NOT_ASKED`."""

    def __repr__(self) -> str:
        return "NOT_ASKED"


#: The answer of a call a sequential driver did not make (an earlier one raised).
NOT_ASKED = _NotAsked()


@dataclass(slots=True)
class Calls:
    """Make these calls and send back, in order, every call's result or exception.

    A driver that makes them one after another (the sync manager) passes the crash
    point ``between`` (when not None) between two calls, and with ``stop_at_failure``
    makes no more calls after one that raised: their answers are :data:`NOT_ASKED`.
    A driver that makes them at once (the asyncio manager) makes them all."""

    calls: list[Call]
    stop_at_failure: bool = False
    between: str | None = None


@dataclass(frozen=True, slots=True)
class Fault:
    """A named crash point: the driver calls its hook with ``step``."""

    step: str


@dataclass(slots=True)
class Decide:
    """Write the commit decision for ``gtrid`` and wait until it is durable; send back
    None, or the exception the write raised."""

    gtrid: bytes


@dataclass(slots=True)
class Forget:
    """Every voter finished: append END for ``gtrid`` (not synced)."""

    gtrid: bytes


Effect = Calls | Fault | Decide | Forget
#: What a coordinator generator yields, receives and returns.
Steps = Generator[Effect, object, None]


# ---------------------------------------------------------------------- the table
class State(enum.Enum):
    """The coordinator's states for one global transaction."""

    __hash__ = object.__hash__  # members are singletons: hash by identity (C speed)

    NEW = "new"  #: created, no branch open
    BEGINNING = "beginning"  #: branches being opened
    ACTIVE = "active"  #: every branch open: the application works on them
    ONE_PHASE = "one-phase"  #: the only participant commits alone
    PREPARING = "preparing"  #: phase one: votes asked
    DECIDING = "deciding"  #: every vote yes: the decision being made durable
    COMMITTING = "committing"  #: phase two: the voters commit
    COMMITTED = "committed"  #: done: committed (branches left over are recovery's)
    ROLLED_BACK = "rolled-back"  #: done: nothing committed
    IN_DOUBT = "in-doubt"  #: done: a one-phase commit cut off, outcome unknown
    UNDECIDED = "undecided"  #: the decision failed: prepared branches left to recovery


class Input(enum.Enum):
    """What happens to a coordinator: a request, or the answers to its last calls."""

    __hash__ = object.__hash__  # members are singletons: hash by identity (C speed)

    BEGIN = "begin"  #: the application opens the transaction
    ALL_BEGAN = "all-began"  #: every branch is open
    BEGIN_FAILED = "begin-failed"  #: a branch did not open
    COMMIT = "commit"  #: the application commits, two or more participants
    COMMIT_ALONE = "commit-alone"  #: the application commits, one participant
    ROLLBACK = "rollback"  #: the application rolls back
    COMMITTED_ALONE = "committed-alone"  #: the one-phase commit succeeded
    REFUSED = "refused"  #: the one-phase commit failed: rolled back
    CUT_OFF = "cut-off"  #: the one-phase commit lost its connection: unknown
    ALL_YES = "all-yes"  #: every vote is yes, at least one prepared
    ALL_READ_ONLY = "all-read-only"  #: every vote is yes, none prepared (read-only)
    VOTED_NO = "voted-no"  #: a vote raised
    DURABLE = "durable"  #: the decision is on disk
    DECISION_FAILED = "decision-failed"  #: the decision could not be written
    ALL_FINISHED = "all-finished"  #: every voter committed
    SOME_UNFINISHED = "some-unfinished"  #: a voter's commit failed: left to recovery


class Action(enum.Enum):
    """What a rule makes the coordinator do, in the order listed. The participant
    calls are one :class:`Calls` each; a sequential coordinator asks them one after
    another, stopping at a failure where noted, with a crash point in between."""

    __hash__ = object.__hash__  # members are singletons: hash by identity (C speed)

    BEGIN = "begin"  #: open every branch (sequential: stop at a failure)
    ABORT_STARTED = "abort-started"  #: abort the branches that opened
    ABORT_ALL = "abort-all"  #: abort every branch
    COMMIT_ONE_PHASE = "commit-one-phase"  #: the only participant commits alone
    FAULT_BEFORE_PREPARE = "before_prepare"  #: crash point
    VOTE = "vote"  #: ask every vote (sequential: stop at a no, between_prepares)
    FAULT_AFTER_VOTES = "after_votes"  #: crash point (concurrent only: ASYNC_STEPS)
    CLEAN_UP = "clean-up"  #: roll back the prepared voters, then abort the others
    DECIDE = "decide"  #: write the commit decision, wait until durable
    FAULT_AFTER_DECISION = "after_decision"  #: crash point
    COMMIT = "commit"  #: commit every prepared voter (sequential: between_commits)
    FORGET = "forget"  #: END record (not synced)
    COUNT_COMMITTED = "count-committed"  #: counters["committed"] += 1
    COUNT_ONE_PHASE = "count-one-phase"  #: counters["one_phase"] += 1
    COUNT_ROLLED_BACK = "count-rolled-back"  #: counters["rolled_back"] += 1
    COUNT_IN_DOUBT = "count-in-doubt"  #: counters["in_doubt"] += 1
    RAISE = "raise"  #: raise the failure behind the input (RolledBack, InDoubt, ...)


S, E, A = State, Input, Action
#: The coordinator: (state, input) -> (actions, next state). A pair not listed is a
#: misuse (commit or rollback of a completed transaction): TMError.
RULES: dict[tuple[State, Input], tuple[tuple[Action, ...], State]] = {
    # Begin: open the branches.
    (S.NEW, E.BEGIN): ((A.BEGIN,), S.BEGINNING),
    # Every branch open: the application works.
    (S.BEGINNING, E.ALL_BEGAN): ((), S.ACTIVE),
    # A branch did not open: abort those that did and raise its error (not counted).
    (S.BEGINNING, E.BEGIN_FAILED): ((A.ABORT_STARTED, A.RAISE), S.ROLLED_BACK),
    # One participant: one-phase commit, nothing logged.
    (S.ACTIVE, E.COMMIT_ALONE): ((A.COMMIT_ONE_PHASE,), S.ONE_PHASE),
    (S.ONE_PHASE, E.COMMITTED_ALONE): ((A.COUNT_ONE_PHASE,), S.COMMITTED),
    # The one-phase commit said it rolled back: RolledBack.
    (S.ONE_PHASE, E.REFUSED): ((A.COUNT_ROLLED_BACK, A.RAISE), S.ROLLED_BACK),
    # The one-phase commit lost its connection: InDoubt, never RolledBack.
    (S.ONE_PHASE, E.CUT_OFF): ((A.COUNT_IN_DOUBT, A.RAISE), S.IN_DOUBT),
    # Two or more: phase one (nothing is logged before the decision: presumed abort).
    (S.ACTIVE, E.COMMIT): ((A.FAULT_BEFORE_PREPARE, A.VOTE), S.PREPARING),
    # Every vote yes: write the decision; phase two waits for it to be durable.
    (S.PREPARING, E.ALL_YES): ((A.FAULT_AFTER_VOTES, A.DECIDE), S.DECIDING),
    # Every voter read-only: nothing to commit, nothing logged.
    (S.PREPARING, E.ALL_READ_ONLY): ((A.FAULT_AFTER_VOTES, A.COUNT_COMMITTED), S.COMMITTED),
    # A no: roll back the prepared voters, abort the rest (the no voter, read-only
    # voters, those not asked), raise RolledBack.
    (S.PREPARING, E.VOTED_NO): ((A.CLEAN_UP, A.COUNT_ROLLED_BACK, A.RAISE), S.ROLLED_BACK),
    # The decision is durable: from here on the transaction commits.
    (S.DECIDING, E.DURABLE): ((A.FAULT_AFTER_DECISION, A.COMMIT), S.COMMITTING),
    # The decision could not be written: raise; no phase two, the prepared branches
    # are recovery's (which rolls them back: no decision).
    (S.DECIDING, E.DECISION_FAILED): ((A.RAISE,), S.UNDECIDED),
    # Every voter committed: the decision is no longer needed.
    (S.COMMITTING, E.ALL_FINISHED): ((A.FORGET, A.COUNT_COMMITTED), S.COMMITTED),
    # A voter did not finish (False, or its finish raised): the others were still
    # asked; its branch and the decision stay for recovery.
    (S.COMMITTING, E.SOME_UNFINISHED): ((A.COUNT_IN_DOUBT, A.COUNT_COMMITTED),
                                        S.COMMITTED),
    # Rollback of an open transaction: abort every branch, nothing logged.
    (S.ACTIVE, E.ROLLBACK): ((A.ABORT_ALL, A.COUNT_ROLLED_BACK), S.ROLLED_BACK),
}
del S, E, A


def transition(state: State, event: Input) -> tuple[tuple[Action, ...], State]:
    """The rule for ``event`` in ``state``; TMError when there is none (the transaction
    is already completed, or being completed)."""
    try:
        return RULES[state, event]
    except KeyError:
        if state in (State.NEW, State.BEGINNING):
            raise TMError(f"the global transaction is not open ({state.value})") from None
        raise TMError("the global transaction is already completed") from None


def _fatal(result: object) -> None:
    """Raise a result that is a BaseException but not an Exception: never an answer."""
    if isinstance(result, BaseException) and not isinstance(result, Exception):
        raise result


# ---------------------------------------------------------------------- the coordinator
class Coordinator:
    """The two-phase commit of one global transaction over participants named
    ``names`` (in branch order), as generators of effects (see the module docstring).
    ``sequential``: the driver makes calls one after another (the sync manager);
    otherwise concurrently (the asyncio manager). ``counters`` is the manager's."""

    def __init__(self, gtrid: bytes, names: Sequence[str], *, sequential: bool,
                 counters: dict[str, int]) -> None:
        self.gtrid = gtrid
        self.names = names
        self.sequential = sequential
        #: the crash points this coordinator passes
        self.steps = SEQUENTIAL_STEPS if sequential else CONCURRENT_STEPS
        self.counters = counters
        self.state = State.NEW
        self.started: list[int] = []  #: branches open, by index
        self.asked = 0  #: votes asked
        self.prepared: list[int] = []  #: yes voters that are not read-only, by index
        self.unfinished = 0  #: prepared voters whose commit did not finish
        self.failure: BaseException | None = None  #: raised by Action.RAISE
        self.cause: BaseException | None = None  #: its ``__cause__``

    @property
    def done(self) -> bool:
        """Commit or rollback has started (or the begin failed)."""
        return self.state not in _OPEN

    def begin(self) -> Steps:
        """Open every branch; raises the error of a branch that did not open (after
        aborting those that did)."""
        return self._run(Input.BEGIN)

    def commit(self) -> Steps:
        """Commit: one phase for a single participant, else two; raises RolledBack,
        InDoubt, or the decision log's error."""
        return self._run(Input.COMMIT_ALONE if len(self.names) == 1 else Input.COMMIT)

    def rollback(self) -> Steps:
        """Roll every branch back (nothing is logged)."""
        return self._run(Input.ROLLBACK)

    def _run(self, event: Input | None) -> Steps:
        while event is not None:
            rule = _COMPILED.get((self.state, event))
            if rule is None:
                transition(self.state, event)  # raises TMError
                return
            plan, self.state = rule
            event = None
            for kind, argument, reading in plan:
                if kind == _ASK:  # the question's answers are the next input
                    event = reading(self, (yield argument(self)))
                elif kind == _FAULT:
                    if argument in self.steps:
                        yield _FAULT_EFFECTS[argument]
                elif kind == _COUNT:
                    self.counters[argument] += 1
                elif kind == _FORGET:
                    yield Forget(self.gtrid)
                elif kind == _CLEAN_UP:
                    yield from self._clean_up(argument)
                else:
                    assert self.failure is not None
                    if self.cause is None:
                        raise self.failure
                    raise self.failure from self.cause

    # Each ask is a question (the effect to yield) and the reading of its answers.
    def _ask_begin(self) -> Effect:
        return Calls(_calls(Op.BEGIN, range(len(self.names))), True)

    def _read_begin(self, results: object) -> Input:
        assert isinstance(results, list)
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                if self.failure is None:
                    self.failure = result
            elif result is not NOT_ASKED:
                self.started.append(index)
        return Input.ALL_BEGAN if self.failure is None else Input.BEGIN_FAILED

    def _ask_votes(self) -> Effect:
        between = "between_prepares" if self.sequential else None
        return Calls(_calls(Op.VOTE, range(len(self.names))), True, between)

    def _read_votes(self, results: object) -> Input:
        assert isinstance(results, list)
        for index, result in enumerate(results):
            if result is NOT_ASKED:
                continue
            self.asked += 1
            if isinstance(result, BaseException):
                _fatal(result)
                if self.failure is None:
                    name = self.names[index]
                    log.info("global transaction %s rolled back (%s voted no)",
                             self.gtrid.hex(), name)
                    self.failure = RolledBack(f"{name} voted no: {result}")
                    self.cause = result
            elif not result:
                self.prepared.append(index)
        if self.failure is not None:
            return Input.VOTED_NO
        return Input.ALL_YES if self.prepared else Input.ALL_READ_ONLY

    def _ask_one_phase(self) -> Effect:
        return Calls(_calls(Op.COMMIT_ONE_PHASE, (0,)))

    def _read_one_phase(self, results: object) -> Input:
        assert isinstance(results, list)
        (result,) = results
        if not isinstance(result, BaseException):
            return Input.COMMITTED_ALONE
        _fatal(result)
        self.failure, self.cause = one_phase_failure(result), result
        return Input.CUT_OFF if isinstance(self.failure, InDoubt) else Input.REFUSED

    def _ask_decision(self) -> Effect:
        return Decide(self.gtrid)

    def _read_decision(self, error: object) -> Input:
        if error is None:
            return Input.DURABLE
        assert isinstance(error, BaseException)
        _fatal(error)
        self.failure = error
        return Input.DECISION_FAILED

    def _ask_commits(self) -> Effect:
        between = "between_commits" if self.sequential else None
        return Calls(_calls(Op.COMMIT, self.prepared), False, between)

    def _read_commits(self, results: object) -> Input:
        assert isinstance(results, list)
        for result in results:
            if result is not True:  # False, or a finish that raised: recovery's
                _fatal(result)
                self.unfinished += 1
        return Input.SOME_UNFINISHED if self.unfinished else Input.ALL_FINISHED

    def _clean_up(self, action: Action) -> Generator[Effect, object, None]:
        everyone = range(len(self.names))
        if action is Action.CLEAN_UP:
            calls = _calls(Op.ROLLBACK, self.prepared)
            calls += _calls(Op.ABORT, [index for index in everyone
                                       if index not in self.prepared])
        elif action is Action.ABORT_STARTED:
            calls = _calls(Op.ABORT, self.started)
        else:
            assert action is Action.ABORT_ALL
            calls = _calls(Op.ABORT, everyone)
        if calls:
            results = yield Calls(calls)
            assert isinstance(results, list)
            for result in results:  # cleanup must not fail: an error is not an answer
                _fatal(result)


# How ``Coordinator._run`` carries out an action (plain ints: compared per action).
_FAULT = 0  #: yield a crash point (when the coordinator's steps name it)
_COUNT = 1  #: bump a counter
_ASK = 2  #: make calls or the decision: their answers are the next input
_FORGET = 3  #: yield Forget
_CLEAN_UP = 4  #: make cleanup calls (answers ignored)
_RAISE = 5  #: raise the failure
_OPEN = frozenset({State.NEW, State.BEGINNING, State.ACTIVE})


_COUNTERS = {Action.COUNT_COMMITTED: "committed", Action.COUNT_ONE_PHASE: "one_phase",
             Action.COUNT_ROLLED_BACK: "rolled_back", Action.COUNT_IN_DOUBT: "in_doubt"}
_ASKS: dict[Action, tuple[Callable[[Coordinator], Effect],
                          Callable[[Coordinator, object], Input]]] = {
    Action.BEGIN: (Coordinator._ask_begin, Coordinator._read_begin),
    Action.VOTE: (Coordinator._ask_votes, Coordinator._read_votes),
    Action.COMMIT_ONE_PHASE: (Coordinator._ask_one_phase, Coordinator._read_one_phase),
    Action.DECIDE: (Coordinator._ask_decision, Coordinator._read_decision),
    Action.COMMIT: (Coordinator._ask_commits, Coordinator._read_commits)}
_FAULT_EFFECTS = {step: Fault(step) for step in (*SEQUENTIAL_STEPS, *CONCURRENT_STEPS)}


def _plan(action: Action) -> tuple[int, Any, Any]:
    if action.value in _FAULT_EFFECTS:
        return _FAULT, action.value, None
    if action in _COUNTERS:
        return _COUNT, _COUNTERS[action], None
    if action in _ASKS:
        return _ASK, *_ASKS[action]
    if action is Action.FORGET:
        return _FORGET, None, None
    if action is Action.RAISE:
        return _RAISE, None, None
    return _CLEAN_UP, action, None


#: :data:`RULES` with each action worked out once: what ``_run`` does for it.
_COMPILED: dict[tuple[State, Input], tuple[tuple[tuple[int, Any, Any], ...], State]] = {
    key: (tuple(_plan(action) for action in actions), after)
    for key, (actions, after) in RULES.items()}
