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

Two drivers run it:

* the sync manager (:mod:`txbroker.tm.manager`) makes the calls one after
  another in the caller's thread (no thread hop, no event loop). Its
  coordinator is *sequential*: it asks one participant at a time wherever the
  next step depends on the answer (begin, vote, commit), so a no stops the
  voting, and it passes the crash points :data:`SEQUENTIAL_STEPS`;
* the asyncio manager (:mod:`txbroker.tm.aio`) runs each :class:`Calls`
  batch concurrently (the participants are different resource managers); its
  coordinator is *concurrent*: every vote and every commit is one batch, and
  it passes the crash points :data:`CONCURRENT_STEPS`.

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
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from txbroker.errors import (
    XAER_RMERR,
    XAER_RMFAIL,
    ConnectionLost,
    TransactionRolledBack,
    TxBrokerError,
    XAError,
)

log = logging.getLogger("txbroker.tm")

#: The sync manager's crash points, in the order a two-phase commit passes them.
SEQUENTIAL_STEPS = ("before_prepare", "between_prepares", "after_decision", "between_commits")
#: The asyncio manager's crash points (its votes and commits overlap: no "between").
CONCURRENT_STEPS = ("before_prepare", "after_votes", "after_decision")


# ---------------------------------------------------------------------- errors
class TMError(TxBrokerError):
    """A global transaction could not be carried out."""


class RolledBack(TMError):
    """A participant voted no (or failed before the decision): everything rolled back."""


class InDoubt(TMError):
    """The only participant's one-phase commit lost its connection before the answer:
    it may have committed. Never reported as RolledBack, since redoing the work could
    apply it twice."""


def one_phase_failure(exc: BaseException) -> TMError:
    """What a failed one-phase commit means: RolledBack when the participant said it
    rolled back (an XA error, TransactionRolledBack, a refusal by the database);
    InDoubt when the connection or the resource manager failed while it committed
    (ConnectionLost, TimeoutError, OSError, XAER_RMFAIL/XAER_RMERR, or a psycopg error
    without an SQLSTATE: the connection)."""
    if isinstance(exc, XAError):  # the resource manager failed in the commit: unknown
        rolled_back = exc.errcode not in (XAER_RMFAIL, XAER_RMERR)
    elif isinstance(exc, TransactionRolledBack):
        rolled_back = True
    elif isinstance(exc, ConnectionLost | TimeoutError | OSError):
        rolled_back = False
    else:  # psycopg: an error from the server has an SQLSTATE; a broken connection not
        rolled_back = not (hasattr(exc, "sqlstate") and exc.sqlstate is None)
    if rolled_back:
        return RolledBack(f"one-phase commit failed: {exc}")
    return InDoubt(f"one-phase commit lost its connection, it may have committed: {exc}")


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

    BEGIN = "begin"  #: ``begin(xid)``
    VOTE = "vote"  #: ``vote(xid)`` -> read_only
    COMMIT_ONE_PHASE = "commit_one_phase"  #: ``commit_one_phase(xid)``
    COMMIT = "commit"  #: ``finish(xid, True)`` -> done
    ROLLBACK = "rollback"  #: ``finish(xid, False)`` -> done
    ABORT = "abort"  #: ``abort(xid)``


@dataclass(frozen=True, slots=True)
class Call:
    """Call ``op`` on the participant at ``index`` (branch order) with its Xid."""

    op: Op
    index: int


@dataclass(frozen=True, slots=True)
class Calls:
    """Make these calls (in order, or concurrently) and send back every result or
    exception, in order."""

    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class Fault:
    """A named crash point: the driver calls its hook with ``step``."""

    step: str


@dataclass(frozen=True, slots=True)
class Decide:
    """Write the commit decision for ``gtrid`` and wait until it is durable; send back
    None, or the exception the write raised."""

    gtrid: bytes


@dataclass(frozen=True, slots=True)
class Forget:
    """Every voter finished: append END for ``gtrid`` (not synced)."""

    gtrid: bytes


Effect = Calls | Fault | Decide | Forget
#: What a coordinator generator yields, receives and returns.
Steps = Generator[Effect, object, None]


# ---------------------------------------------------------------------- the table
class State(enum.Enum):
    """The coordinator's states for one global transaction."""

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

    BEGIN = "begin"  #: the application opens the transaction
    BEGAN_MORE = "began-more"  #: a branch opened, more to open (sequential)
    ALL_BEGAN = "all-began"  #: every branch is open
    BEGIN_FAILED = "begin-failed"  #: a branch did not open
    COMMIT = "commit"  #: the application commits, two or more participants
    COMMIT_ALONE = "commit-alone"  #: the application commits, one participant
    ROLLBACK = "rollback"  #: the application rolls back
    COMMITTED_ALONE = "committed-alone"  #: the one-phase commit succeeded
    REFUSED = "refused"  #: the one-phase commit failed: rolled back
    CUT_OFF = "cut-off"  #: the one-phase commit lost its connection: unknown
    YES_MORE = "yes-more"  #: a yes (or read-only), more to ask (sequential)
    ALL_YES = "all-yes"  #: every vote is in, at least one prepared
    ALL_READ_ONLY = "all-read-only"  #: every vote is in, none prepared
    VOTED_NO = "voted-no"  #: a vote raised
    DURABLE = "durable"  #: the decision is on disk
    DECISION_FAILED = "decision-failed"  #: the decision could not be written
    FINISHED_MORE = "finished-more"  #: a voter answered, more to commit (sequential)
    ALL_FINISHED = "all-finished"  #: every voter committed
    SOME_UNFINISHED = "some-unfinished"  #: a voter's commit failed: left to recovery


class Action(enum.Enum):
    """What a rule makes the coordinator do, in the order listed."""

    BEGIN = "begin"  #: open branches: the next one (sequential) or all the rest
    ABORT_STARTED = "abort-started"  #: abort the branches that opened
    ABORT_ALL = "abort-all"  #: abort every branch
    COMMIT_ONE_PHASE = "commit-one-phase"  #: the only participant commits alone
    FAULT_BEFORE_PREPARE = "before_prepare"  #: crash point (both)
    FAULT_BETWEEN_PREPARES = "between_prepares"  #: crash point (sequential)
    FAULT_AFTER_VOTES = "after_votes"  #: crash point (concurrent)
    FAULT_AFTER_DECISION = "after_decision"  #: crash point (both)
    FAULT_BETWEEN_COMMITS = "between_commits"  #: crash point (sequential)
    VOTE = "vote"  #: ask for votes: the next one (sequential) or all
    CLEAN_UP = "clean-up"  #: roll back the prepared voters, then abort the others
    DECIDE = "decide"  #: write the commit decision, wait until durable
    COMMIT = "commit"  #: commit the prepared voters: the next one or all
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
    # Begin: open the branches (one at a time when sequential, else all at once).
    (S.NEW, E.BEGIN): ((A.BEGIN,), S.BEGINNING),
    # Sequential: one more branch to open.
    (S.BEGINNING, E.BEGAN_MORE): ((A.BEGIN,), S.BEGINNING),
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
    # Sequential: a yes, ask the next one.
    (S.PREPARING, E.YES_MORE): ((A.FAULT_BETWEEN_PREPARES, A.VOTE), S.PREPARING),
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
    # Sequential: commit the next voter (whatever the last one answered).
    (S.COMMITTING, E.FINISHED_MORE): ((A.FAULT_BETWEEN_COMMITS, A.COMMIT), S.COMMITTING),
    # Every voter committed: the decision is no longer needed.
    (S.COMMITTING, E.ALL_FINISHED): ((A.FORGET, A.COUNT_COMMITTED), S.COMMITTED),
    # A voter did not finish: its branch and the decision stay for recovery.
    (S.COMMITTING, E.SOME_UNFINISHED): ((A.COUNT_IN_DOUBT, A.COUNT_COMMITTED),
                                        S.COMMITTED),
    # Rollback of an open transaction: abort every branch, nothing logged.
    (S.ACTIVE, E.ROLLBACK): ((A.ABORT_ALL, A.COUNT_ROLLED_BACK), S.ROLLED_BACK),
}
del S, E, A

_FAULTS = {Action.FAULT_BEFORE_PREPARE, Action.FAULT_BETWEEN_PREPARES,
           Action.FAULT_AFTER_VOTES, Action.FAULT_AFTER_DECISION,
           Action.FAULT_BETWEEN_COMMITS}
_COUNTS = {Action.COUNT_COMMITTED: "committed", Action.COUNT_ONE_PHASE: "one_phase",
           Action.COUNT_ROLLED_BACK: "rolled_back", Action.COUNT_IN_DOUBT: "in_doubt"}


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
        self.names = list(names)
        self.sequential = sequential
        #: the crash points this coordinator passes
        self.steps = SEQUENTIAL_STEPS if sequential else CONCURRENT_STEPS
        self.counters = counters
        self.state = State.NEW
        self.started: list[int] = []  #: branches open, by index
        self.asked = 0  #: votes asked so far
        self.prepared: list[int] = []  #: yes voters that are not read-only, by index
        self.committed_to = 0  #: prepared voters asked to commit so far
        self.unfinished = 0  #: prepared voters whose commit did not finish
        self.failure: BaseException | None = None  #: raised by Action.RAISE
        self.cause: BaseException | None = None  #: its ``__cause__``

    @property
    def done(self) -> bool:
        """Commit or rollback has started (or the begin failed)."""
        return self.state not in (State.NEW, State.BEGINNING, State.ACTIVE)

    def begin(self) -> Steps:
        """Open every branch; raises the error of a branch that did not open (after
        aborting those that did)."""
        yield from self._run(Input.BEGIN)

    def commit(self) -> Steps:
        """Commit: one phase for a single participant, else two; raises RolledBack,
        InDoubt, or the decision log's error."""
        yield from self._run(Input.COMMIT_ALONE if len(self.names) == 1 else Input.COMMIT)

    def rollback(self) -> Steps:
        """Roll every branch back (nothing is logged)."""
        yield from self._run(Input.ROLLBACK)

    def _run(self, event: Input | None) -> Steps:
        while event is not None:
            actions, self.state = transition(self.state, event)
            event = None
            for action in actions:
                found = yield from self._do(action)
                if found is not None:
                    event = found

    def _do(self, action: Action) -> Generator[Effect, object, Input | None]:
        if action in _FAULTS:
            if action.value in self.steps:
                yield Fault(action.value)
            return None
        counter = _COUNTS.get(action)
        if counter is not None:
            self.counters[counter] += 1
            return None
        if action is Action.BEGIN:
            return (yield from self._begin())
        if action is Action.VOTE:
            return (yield from self._vote())
        if action is Action.COMMIT:
            return (yield from self._commit())
        if action is Action.COMMIT_ONE_PHASE:
            return (yield from self._commit_one_phase())
        if action is Action.DECIDE:
            return (yield from self._decide())
        if action is Action.FORGET:
            yield Forget(self.gtrid)
            return None
        if action is Action.RAISE:
            assert self.failure is not None
            if self.cause is None:
                raise self.failure
            raise self.failure from self.cause
        yield from self._clean_up(action)
        return None

    def _calls(self, op: Op, indexes: Sequence[int]) -> Generator[Effect, object,
                                                                   list[object]]:
        if not indexes:
            return []
        results = yield Calls(tuple(Call(op, index) for index in indexes))
        assert isinstance(results, list) and len(results) == len(indexes)
        return results

    def _begin(self) -> Generator[Effect, object, Input]:
        first = len(self.started)
        indexes = range(first, first + 1 if self.sequential else len(self.names))
        results = yield from self._calls(Op.BEGIN, indexes)
        for index, result in zip(indexes, results, strict=True):
            if isinstance(result, BaseException):
                if self.failure is None:
                    self.failure = result
            else:
                self.started.append(index)
        if self.failure is not None:
            return Input.BEGIN_FAILED
        return Input.ALL_BEGAN if len(self.started) == len(self.names) else Input.BEGAN_MORE

    def _vote(self) -> Generator[Effect, object, Input]:
        first = self.asked
        indexes = range(first, first + 1 if self.sequential else len(self.names))
        results = yield from self._calls(Op.VOTE, indexes)
        self.asked = indexes.stop
        for result in results:
            _fatal(result)
        for index, result in zip(indexes, results, strict=True):
            if isinstance(result, BaseException):
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
        if self.asked < len(self.names):
            return Input.YES_MORE
        return Input.ALL_YES if self.prepared else Input.ALL_READ_ONLY

    def _commit_one_phase(self) -> Generator[Effect, object, Input]:
        (result,) = yield from self._calls(Op.COMMIT_ONE_PHASE, [0])
        if not isinstance(result, BaseException):
            return Input.COMMITTED_ALONE
        _fatal(result)
        self.failure, self.cause = one_phase_failure(result), result
        return Input.CUT_OFF if isinstance(self.failure, InDoubt) else Input.REFUSED

    def _decide(self) -> Generator[Effect, object, Input]:
        error = yield Decide(self.gtrid)
        if error is None:
            return Input.DURABLE
        assert isinstance(error, BaseException)
        _fatal(error)
        self.failure = error
        return Input.DECISION_FAILED

    def _commit(self) -> Generator[Effect, object, Input]:
        first = self.committed_to
        indexes = self.prepared[first:first + 1] if self.sequential else self.prepared
        results = yield from self._calls(Op.COMMIT, indexes)
        self.committed_to = first + len(indexes)
        for result in results:
            _fatal(result)
            if result is not True:  # False, or a finish that raised: recovery's
                self.unfinished += 1
        if self.committed_to < len(self.prepared):
            return Input.FINISHED_MORE
        return Input.SOME_UNFINISHED if self.unfinished else Input.ALL_FINISHED

    def _clean_up(self, action: Action) -> Generator[Effect, object, None]:
        everyone = range(len(self.names))
        if action is Action.CLEAN_UP:
            calls = [Call(Op.ROLLBACK, index) for index in self.prepared]
            calls += [Call(Op.ABORT, index) for index in everyone
                      if index not in self.prepared]
        elif action is Action.ABORT_STARTED:
            calls = [Call(Op.ABORT, index) for index in self.started]
        else:
            assert action is Action.ABORT_ALL
            calls = [Call(Op.ABORT, index) for index in everyone]
        if calls:
            results = yield Calls(tuple(calls))
            assert isinstance(results, list)
            for result in results:  # cleanup must not fail: an error is not an answer
                _fatal(result)

