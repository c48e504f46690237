"""The transaction manager: two-phase commit across txbroker and PostgreSQL.

Theory of operation
-------------------
``tm.begin(participants)`` opens a :class:`GlobalTransaction` with a fresh
global id; each participant opens its branch (Xid = our format id, the global
id, the participant's name). The application works on the participants'
connections, then calls :meth:`GlobalTransaction.commit`:

1. participants are ordered by ``sort_key``;
2. a single participant commits in one phase (no log record at all);
3. otherwise every participant votes (prepare), one after another. A no (an
   exception) stops the voting and aborts every participant — prepared ones
   are rolled back, the others cleaned up — and raises :class:`RolledBack`.
   Read-only voters drop out;
4. the commit decision is written to the :class:`~txbroker.tm.log.DecisionLog`
   and synced (group commit with other transactions deciding at the same
   time) — from here on the transaction *will* commit;
5. every voter finishes (commit); finish never raises: a failure (False)
   leaves the branch for recovery (:func:`txbroker.tm.recovery.recover`);
6. if all finished, the decision is forgotten (``END`` record, not synced);
   otherwise it stays in the log until recovery completes the branches.

These rules are written once, in :mod:`txbroker.tm.engine` (a sans-IO
coordinator, also run by the asyncio manager :mod:`txbroker.tm.aio`); this
module drives it with blocking calls in the caller's thread, one at a time
(a *sequential* coordinator).

Crash points: ``hook(step)`` is called at ``before_prepare``,
``between_prepares``, ``after_decision`` and ``between_commits``
(:data:`STEPS`); tests replace it to kill the process at that step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import TracebackType

from txbroker.tm.engine import (
    NOT_ASKED,
    SEQUENTIAL_STEPS,
    Calls,
    Coordinator,
    Decide,
    Fault,
    Op,
    Steps,
    in_branch_order,
)
from txbroker.tm.errors import InDoubt, RolledBack, TMError, one_phase_failure
from txbroker.tm.log import DecisionLog
from txbroker.tm.participants import Participant, Resource, branch_xid
from txbroker.tm.recovery import RecoveryReport, recover
from txbroker.xid import Xid

__all__ = ["STEPS", "GlobalTransaction", "InDoubt", "RolledBack", "TMError",
           "TransactionManager", "in_branch_order", "one_phase_failure"]

#: The crash points, in the order a two-phase commit passes them.
STEPS = SEQUENTIAL_STEPS


class TransactionManager:
    """Creates global transactions and owns the decision log."""

    def __init__(self, log_path: str | os.PathLike[str], *, fsync: bool = True,
                 hook: Callable[[str], None] | None = None) -> None:
        self.log = DecisionLog(log_path, fsync=fsync)
        self.hook = hook or (lambda step: None)
        self.counters = {"committed": 0, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}
        #: global ids of the transactions begun and not yet completed (recovery skips them)
        self.in_flight: set[bytes] = set()

    def begin(self, participants: Sequence[Participant]) -> GlobalTransaction:
        """Start a global transaction over ``participants`` (each opens its branch)."""
        return GlobalTransaction(self, list(participants))

    def recover(self, resources: Sequence[Resource]) -> RecoveryReport:
        """Resolve the in-doubt branches of ``resources`` from this manager's log,
        leaving those of its transactions in flight to them (``tm/recovery.py``): safe
        to run beside running transactions, e.g. periodically in a worker process."""
        return recover(self.log, resources, in_flight=self.in_flight)

    def close(self) -> None:
        """Close the decision log."""
        self.log.close()


class GlobalTransaction:
    """One global transaction (``with tm.begin([...]) as gtx:`` commits on success)."""

    def __init__(self, manager: TransactionManager, participants: list[Participant]) -> None:
        self.manager = manager
        self.gtrid = os.urandom(16)
        self.participants = in_branch_order(participants)
        self.xids = {id(p): branch_xid(self.gtrid, p.sort_key) for p in self.participants}
        self._xids = list(self.xids.values())  # in branch order, as the coordinator counts
        self.coordinator = Coordinator(self.gtrid, [p.sort_key for p in self.participants],
                                       sequential=True, counters=manager.counters)
        manager.in_flight.add(self.gtrid)
        try:
            self._drive(self.coordinator.begin())
        except BaseException:
            manager.in_flight.discard(self.gtrid)
            raise

    @property
    def done(self) -> bool:
        """Commit or rollback has started."""
        return self.coordinator.done

    def xid_of(self, participant: Participant) -> Xid:
        """The branch Xid of one participant."""
        return self.xids[id(participant)]

    def commit(self) -> None:
        """Two-phase commit (one phase for a single participant). Raises RolledBack
        when a participant voted no; returns once the decision is durable and every
        participant finished (or was left to recovery)."""
        try:
            self._drive(self.coordinator.commit())
        finally:
            self.manager.in_flight.discard(self.gtrid)

    def rollback(self) -> None:
        """Roll every participant back (nothing is logged: presumed abort)."""
        try:
            self._drive(self.coordinator.rollback())
        finally:
            self.manager.in_flight.discard(self.gtrid)

    def _drive(self, steps: Steps) -> None:
        """Run the coordinator's effects with blocking calls, one after another."""
        reply: object = None
        while True:
            try:
                effect = steps.send(reply)
            except StopIteration:
                return
            reply = None
            if isinstance(effect, Calls):
                reply = self._calls(effect)
            elif isinstance(effect, Fault):
                self.manager.hook(effect.step)
            elif isinstance(effect, Decide):
                try:
                    self.manager.log.decide(effect.gtrid)
                except Exception as exc:
                    reply = exc
            else:
                self.manager.log.forget(effect.gtrid)

    def _calls(self, effect: Calls) -> list[object]:
        """One call after another; the crash point ``between`` between two, and no more
        calls after one that raised when ``stop_at_failure``."""
        results: list[object] = []
        for call in effect.calls:
            if results:
                if effect.stop_at_failure and isinstance(results[-1], BaseException):
                    results += [NOT_ASKED] * (len(effect.calls) - len(results))
                    break
                if effect.between is not None:
                    self.manager.hook(effect.between)
            results.append(self._call(call.op, call.index))
        return results

    def _call(self, op: Op, index: int) -> object:
        try:
            return _CALL[op](self.participants[index], self._xids[index])
        except BaseException as exc:  # the coordinator decides what it means
            return exc

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


#: How the sync driver makes each participant call (a dict: no chain of enum compares).
_CALL: dict[Op, Callable[[Participant, Xid], object]] = {
    Op.BEGIN: lambda participant, xid: participant.begin(xid),
    Op.VOTE: lambda participant, xid: participant.vote(xid),
    Op.COMMIT_ONE_PHASE: lambda participant, xid: participant.commit_one_phase(xid),
    Op.COMMIT: lambda participant, xid: participant.finish(xid, True),
    Op.ROLLBACK: lambda participant, xid: participant.finish(xid, False),
    Op.ABORT: lambda participant, xid: participant.abort(xid),
}
