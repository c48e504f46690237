"""The transaction manager: two-phase commit across txbroker and PostgreSQL.

Theory of operation
-------------------
``tm.begin(participants)`` opens a :class:`GlobalTransaction` with a fresh
global id; each participant opens its branch (Xid = our format id, the global
id, the participant's name). The application works on the participants'
connections, then calls :meth:`GlobalTransaction.commit`:

1. participants are ordered by ``sort_key``;
2. a single participant commits in one phase (no log record at all);
3. otherwise every participant votes (prepare). A no (an exception) aborts
   every participant — prepared ones are rolled back, the others cleaned up
   — and raises :class:`RolledBack`. Read-only voters drop out;
4. the commit decision is written to the :class:`~txbroker.tm.log.DecisionLog`
   and synced (group commit with other transactions deciding at the same
   time) — from here on the transaction *will* commit;
5. every voter finishes (commit); finish never raises: a failure (False)
   leaves the branch for recovery (:func:`txbroker.tm.recovery.recover`);
6. if all finished, the decision is forgotten (``END`` record, not synced);
   otherwise it stays in the log until recovery completes the branches.

Crash points: ``hook(step)`` is called at ``before_prepare``,
``between_prepares``, ``after_decision`` and ``between_commits``; tests
replace it to kill the process at that step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol, TypeVar

from txbroker.errors import (
    XAER_RMERR,
    XAER_RMFAIL,
    ConnectionLost,
    TransactionRolledBack,
    TxBrokerError,
    XAError,
)
from txbroker.tm.log import DecisionLog
from txbroker.tm.participants import Participant, branch_xid
from txbroker.xid import Xid

log = logging.getLogger("txbroker.tm")


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


#: The crash points, in the order a two-phase commit passes them.
STEPS = ("before_prepare", "between_prepares", "after_decision", "between_commits")


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


class TransactionManager:
    """Creates global transactions and owns the decision log."""

    def __init__(self, log_path: str | os.PathLike[str], *, fsync: bool = True,
                 hook: Callable[[str], None] | None = None) -> None:
        self.log = DecisionLog(log_path, fsync=fsync)
        self.hook = hook or (lambda step: None)
        self.counters = {"committed": 0, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}

    def begin(self, participants: Sequence[Participant]) -> GlobalTransaction:
        """Start a global transaction over ``participants`` (each opens its branch)."""
        return GlobalTransaction(self, list(participants))

    def close(self) -> None:
        """Close the decision log."""
        self.log.close()


class GlobalTransaction:
    """One global transaction (``with tm.begin([...]) as gtx:`` commits on success)."""

    def __init__(self, manager: TransactionManager, participants: list[Participant]) -> None:
        self.manager = manager
        self.gtrid = os.urandom(16)
        self.participants = in_branch_order(participants)
        self.xids: dict[int, Xid] = {}
        self.done = False
        started: list[Participant] = []
        try:
            for participant in self.participants:
                xid = branch_xid(self.gtrid, participant.sort_key)
                participant.begin(xid)
                self.xids[id(participant)] = xid
                started.append(participant)
        except BaseException:
            for participant in started:
                participant.abort(self.xids[id(participant)])
            raise

    def xid_of(self, participant: Participant) -> Xid:
        """The branch Xid of one participant."""
        return self.xids[id(participant)]

    def commit(self) -> None:
        """Two-phase commit (one phase for a single participant). Raises RolledBack
        when a participant voted no; returns once the decision is durable and every
        participant finished (or was left to recovery)."""
        self._check_open()
        self.done = True
        manager, hook = self.manager, self.manager.hook
        if len(self.participants) == 1:
            participant = self.participants[0]
            try:
                participant.commit_one_phase(self.xid_of(participant))
            except Exception as exc:
                failure = one_phase_failure(exc)
                manager.counters["in_doubt" if isinstance(failure, InDoubt)
                                 else "rolled_back"] += 1
                raise failure from exc
            manager.counters["one_phase"] += 1
            return
        hook("before_prepare")
        voters: list[Participant] = []
        for index, participant in enumerate(self.participants):
            if index:
                hook("between_prepares")
            try:
                read_only = participant.vote(self.xid_of(participant))
            except Exception as exc:
                self._abort(voters, participant)
                manager.counters["rolled_back"] += 1
                raise RolledBack(f"{participant.sort_key} voted no: {exc}") from exc
            if not read_only:
                voters.append(participant)
        if not voters:
            manager.counters["committed"] += 1
            return
        manager.log.decide(self.gtrid)
        hook("after_decision")
        finished = True
        for index, participant in enumerate(voters):
            if index:
                hook("between_commits")
            finished = participant.finish(self.xid_of(participant), True) and finished
        if finished:
            manager.log.forget(self.gtrid)
        else:
            manager.counters["in_doubt"] += 1  # the decision stays for recovery
        manager.counters["committed"] += 1

    def rollback(self) -> None:
        """Roll every participant back (nothing is logged: presumed abort)."""
        self._check_open()
        self.done = True
        for participant in self.participants:
            participant.abort(self.xid_of(participant))
        self.manager.counters["rolled_back"] += 1

    def _abort(self, voters: list[Participant], failed: Participant) -> None:
        for participant in voters:
            participant.finish(self.xid_of(participant), False)
        for participant in self.participants:
            if participant not in voters:
                participant.abort(self.xid_of(participant))
        log.info("global transaction %s rolled back (%s voted no)", self.gtrid.hex(),
                 failed.sort_key)

    def _check_open(self) -> None:
        if self.done:
            raise TMError("the global transaction is already completed")

    def __enter__(self) -> GlobalTransaction:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.rollback()
