"""The asyncio transaction manager: many global transactions in flight at once.

Theory of operation
-------------------
The same two-phase commit as :mod:`txbroker.tm.manager` (presumed abort, the
same decision log and file format, the same recovery), for asyncio
applications that keep many global transactions in flight on one event loop:

1. participants are ordered by ``sort_key``; each opens its branch
   (:meth:`AsyncParticipant.begin`);
2. a single participant commits in one phase (nothing is logged);
3. phase one: every participant votes **concurrently** (each is a different
   resource manager, so their prepares overlap). Any no aborts all: the yes
   voters are rolled back, the others cleaned up, :class:`RolledBack` raised;
4. the decision: ``COMMIT gtrid`` goes to the :class:`AsyncDecisionLog`,
   which gathers the decisions of every transaction that reaches this point
   while a sync is under way and writes them with ONE write and ONE
   ``fdatasync`` (in a worker thread, so the loop keeps running the other
   transactions). The commit waits until its record is durable — phase two
   never starts before that (the durability contract of docs/tm.md);
5. phase two: every voter finishes (commit) concurrently; a failure leaves
   the branch prepared and the decision in the log for recovery;
6. ``END gtrid`` (not synced) once all finished.

These rules are written once, in :mod:`txbroker.tm.engine` (the sans-IO
coordinator the sync manager drives too); this module runs it on the event
loop as a *concurrent* coordinator: each batch of participant calls it yields
runs at once.

Crash points: ``hook(step)`` runs at ``before_prepare``, ``after_votes`` and
``after_decision`` (:data:`ASYNC_STEPS`); tests make it kill the process.

Participants: :class:`AsyncBrokerParticipant` (an
:class:`~txbroker.client.aio.AsyncConnection`'s XAResource, with ``start``,
``end`` pipelined) and :class:`AsyncPostgresParticipant` (a
``psycopg.AsyncConnection``'s TPC methods).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar

from txbroker.client.xa import TMFAIL, TMSUCCESS, XA_RDONLY
from txbroker.errors import XAError
from txbroker.tm.aio_recovery import AsyncResource, recover_async
from txbroker.tm.engine import (
    CONCURRENT_STEPS,
    Call,
    Calls,
    Coordinator,
    Decide,
    Fault,
    Op,
    Steps,
    in_branch_order,
)
from txbroker.tm.errors import InDoubt as InDoubt  # re-exported, as before
from txbroker.tm.errors import RolledBack as RolledBack
from txbroker.tm.errors import TMError as TMError
from txbroker.tm.log import DecisionLog
from txbroker.tm.participants import _pg_xid, branch_xid, finish_failed
from txbroker.tm.recovery import RecoveryReport
from txbroker.xid import Xid

log = logging.getLogger("txbroker.tm")

T = TypeVar("T")

#: The crash points of the asyncio manager, in the order a commit passes them.
ASYNC_STEPS = CONCURRENT_STEPS


class AsyncParticipant(Protocol):
    """The asyncio form of :class:`~txbroker.tm.participants.Participant`."""

    @property
    def sort_key(self) -> str:
        """Participants are named (and ordered) by this."""

    async def begin(self, xid: Xid) -> None:
        """Start this resource's branch ``xid``."""

    async def vote(self, xid: Xid) -> bool:
        """Prepare: True when read-only (no phase two); raising is a "no"."""

    async def commit_one_phase(self, xid: Xid) -> None:
        """The only participant: commit without a prepare (may raise: rolled back)."""

    async def finish(self, xid: Xid, commit: bool) -> bool:
        """Commit or roll back the prepared branch; never raises (False: left to
        recovery)."""

    async def abort(self, xid: Xid) -> None:
        """Roll back a branch that did not vote yes (never raises)."""


async def _together(calls: list[Coroutine[Any, Any, T]], *,
                    inline_first: bool = True) -> list[T | BaseException]:
    """Run ``calls`` concurrently and return their results or exceptions, in order.
    ``inline_first``: the first runs in the current task at once (one task fewer than
    ``asyncio.gather``); otherwise every call is a task, and they all start in order on
    the next loop iteration (so requests that other tasks queue now join theirs in one
    write). Either way the participants' requests go out in ``sort_key`` order."""
    first, *rest = calls
    if not inline_first:
        rest = calls
    tasks = [asyncio.ensure_future(call) for call in rest]
    results: list[T | BaseException] = []
    if inline_first:
        try:
            results.append(await first)
        except Exception as exc:
            results.append(exc)
    for task in tasks:
        try:
            results.append(await task)
        except Exception as exc:
            results.append(exc)
    return results


def _random_gtrid() -> bytes:
    return os.urandom(16)


class AsyncDecisionLog:
    """Group commit of a :class:`DecisionLog` for one event loop: every decision that
    arrives while a sync runs goes into the next write + sync."""

    def __init__(self, decisions: DecisionLog) -> None:
        self.log = decisions
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  #: syncs this object asked for
        self.decided = 0  #: decisions written

    async def decide(self, gtrid: bytes) -> None:
        """Record the commit decision for ``gtrid``; returns once it is durable."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((gtrid, future))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush())
        await future

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await asyncio.to_thread(self.log.decide_many, [g for g, _ in batch])
                except BaseException as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                self.batches += 1
                self.decided += len(batch)
                for _, future in batch:
                    if not future.done():
                        future.set_result(None)
        finally:
            self._task = None

    def forget(self, gtrid: bytes) -> None:
        """Every participant finished (END, not synced)."""
        self.log.forget(gtrid)


class AsyncTransactionManager:
    """Creates asyncio global transactions and owns the decision log."""

    def __init__(self, log_path: str | os.PathLike[str], *, fsync: bool = True,
                 hook: Callable[[str], None] | None = None,
                 decision_log: DecisionLog | None = None,
                 new_gtrid: Callable[[], bytes] | None = None) -> None:
        #: the decision log: ``decision_log`` when given (e.g. over a simulated disk),
        #: else one at ``log_path``
        self.log = DecisionLog(log_path, fsync=fsync) if decision_log is None else decision_log
        self.decisions = AsyncDecisionLog(self.log)
        #: where global ids come from: 16 random bytes unless given (a simulation seeds it)
        self.new_gtrid: Callable[[], bytes] = new_gtrid or _random_gtrid
        self.hook = hook or (lambda step: None)
        self.counters = {"committed": 0, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}
        #: global ids of the transactions begun and not yet completed (recovery skips them)
        self.in_flight: set[bytes] = set()

    async def begin(self, participants: Sequence[AsyncParticipant]) -> AsyncGlobalTransaction:
        """Start a global transaction over ``participants`` (each opens its branch)."""
        gtx = AsyncGlobalTransaction(self, list(participants))
        self.in_flight.add(gtx.gtrid)
        try:
            await gtx._begin()
        except BaseException:
            self.in_flight.discard(gtx.gtrid)
            raise
        return gtx

    async def recover(self, resources: Sequence[AsyncResource]) -> RecoveryReport:
        """Resolve the in-doubt branches of ``resources`` from this manager's log,
        leaving those of its transactions in flight to them (``tm/recovery.py``): safe
        to run beside running transactions."""
        return await recover_async(self.log, resources, in_flight=self.in_flight)

    def close(self) -> None:
        """Close the decision log (after every transaction completed)."""
        self.log.close()


class AsyncGlobalTransaction:
    """One global transaction (``async with await tm.begin([...]):`` commits on success)."""

    def __init__(self, manager: AsyncTransactionManager,
                 participants: list[AsyncParticipant]) -> None:
        self.manager = manager
        self.gtrid = manager.new_gtrid()
        self.participants = in_branch_order(participants)
        self.xids = [branch_xid(self.gtrid, p.sort_key) for p in self.participants]
        self.coordinator = Coordinator(self.gtrid, [p.sort_key for p in self.participants],
                                       sequential=False, counters=manager.counters)
        #: seconds the commit spent voting, deciding (the log sync) and finishing
        self.timings: dict[str, float] = {}

    @property
    def done(self) -> bool:
        """Commit or rollback has started (or the begin failed)."""
        return self.coordinator.done

    async def _begin(self) -> None:
        await self._drive(self.coordinator.begin())

    def xid_of(self, participant: AsyncParticipant) -> Xid:
        """The branch Xid of one participant."""
        return self.xids[self.participants.index(participant)]

    async def commit(self) -> None:
        """Two-phase commit (one phase for a single participant); see the module
        docstring. Raises RolledBack when a participant voted no."""
        try:
            await self._drive(self.coordinator.commit())
        finally:
            self.manager.in_flight.discard(self.gtrid)

    async def rollback(self) -> None:
        """Roll every participant back (nothing is logged: presumed abort)."""
        try:
            await self._drive(self.coordinator.rollback())
        finally:
            self.manager.in_flight.discard(self.gtrid)

    async def _drive(self, steps: Steps) -> None:
        """Run the coordinator's effects on the loop, each batch of calls at once."""
        reply: object = None
        clock = asyncio.get_running_loop().time  # monotonic, and virtual in a simulation
        while True:
            try:
                effect = steps.send(reply)
            except StopIteration:
                return
            reply = None
            if isinstance(effect, Calls):
                op = effect.calls[0].op
                started = clock()
                # begins start together on the next loop iteration (the broker's pipelined
                # xa_start then shares a write with what the application queues meanwhile,
                # e.g. a receive); other batches run their first call in this task
                reply = await _together([self._call(call) for call in effect.calls],
                                        inline_first=op is not Op.BEGIN)
                if op is Op.VOTE:
                    self.timings["votes"] = clock() - started
                elif op is Op.COMMIT:
                    self.timings["finishes"] = clock() - started
            elif isinstance(effect, Fault):
                self.manager.hook(effect.step)
            elif isinstance(effect, Decide):
                started = clock()
                try:
                    await self.manager.decisions.decide(effect.gtrid)
                except Exception as exc:
                    reply = exc
                self.timings["decision"] = clock() - started
            else:
                self.manager.decisions.forget(effect.gtrid)

    def _call(self, call: Call) -> Coroutine[Any, Any, object]:
        return _CALL[call.op](self.participants[call.index], self.xids[call.index])

    async def __aenter__(self) -> AsyncGlobalTransaction:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.done:
            return
        if exc_type is None:
            await self.commit()
        else:
            await self.rollback()


#: How the asyncio driver makes each participant call.
_CALL: dict[Op, Callable[[AsyncParticipant, Xid], Coroutine[Any, Any, object]]] = {
    Op.BEGIN: lambda participant, xid: participant.begin(xid),
    Op.VOTE: lambda participant, xid: participant.vote(xid),
    Op.COMMIT_ONE_PHASE: lambda participant, xid: participant.commit_one_phase(xid),
    Op.COMMIT: lambda participant, xid: participant.finish(xid, True),
    Op.ROLLBACK: lambda participant, xid: participant.finish(xid, False),
    Op.ABORT: lambda participant, xid: participant.abort(xid),
}


# ---------------------------------------------------------------------- participants
class AsyncBrokerParticipant:
    """A txbroker :class:`~txbroker.client.aio.AsyncConnection`'s branch: its sends and
    acks between :meth:`begin` and :meth:`vote` belong to it. ``start`` and ``end`` are
    pipelined (a refusal is raised by the next request), so a dequeue costs three round
    trips: receive, prepare, commit."""

    def __init__(self, connection: Any, name: str = "txbroker") -> None:
        self.connection = connection
        self.name = name
        self._xa = connection.xa_resource()

    @property
    def sort_key(self) -> str:
        """Participants are named (and ordered) by this."""
        return self.name

    async def begin(self, xid: Xid) -> None:
        """Start the branch (pipelined)."""
        await self._xa.start(xid, wait=False)

    async def vote(self, xid: Xid) -> bool:
        """End (pipelined) and prepare; True when read-only."""
        await self._xa.end(xid, TMSUCCESS, wait=False)
        return bool(await self._xa.prepare(xid) == XA_RDONLY)

    async def commit_one_phase(self, xid: Xid) -> None:
        """End and commit in one phase."""
        await self._xa.end(xid, TMSUCCESS, wait=False)
        await self._xa.commit(xid, True)

    async def finish(self, xid: Xid, commit: bool) -> bool:
        """Commit or roll back the prepared branch; False leaves it to recovery."""
        try:
            if commit:
                await self._xa.commit(xid, False)
            else:
                await self._xa.rollback(xid)
        except Exception as exc:  # finish must not fail
            return finish_failed(self.name, xid, commit, exc)
        return True

    async def abort(self, xid: Xid) -> None:
        """Roll back a branch that did not vote yes (never raises)."""
        try:
            with contextlib.suppress(XAError):  # already ended (or unknown)
                await self._xa.end(xid, TMFAIL)
            await self._xa.rollback(xid)
        except Exception as exc:
            log.info("%s: abort of %s: %s", self.name, xid, exc)


class AsyncPostgresParticipant:
    """A ``psycopg.AsyncConnection``'s branch (not autocommit): work on it between
    :meth:`begin` and :meth:`vote` belongs to the branch."""

    def __init__(self, connection: Any, name: str = "postgres") -> None:
        self.connection = connection
        self.name = name

    @property
    def sort_key(self) -> str:
        """Participants are named (and ordered) by this."""
        return self.name

    async def begin(self, xid: Xid) -> None:
        """``tpc_begin``."""
        await self.connection.tpc_begin(_pg_xid(self.connection, xid))

    async def commit_one_phase(self, xid: Xid) -> None:
        """``tpc_commit`` without a prepare."""
        await self.connection.tpc_commit()

    async def vote(self, xid: Xid) -> bool:
        """``PREPARE TRANSACTION``; never read-only."""
        try:
            await self.connection.tpc_prepare()
        except Exception:
            # as in PostgresParticipant.vote: the server rolled it back, psycopg 3.3
            # believes it is prepared
            if hasattr(self.connection, "_tpc"):
                self.connection._tpc = None
            raise
        return False

    async def finish(self, xid: Xid, commit: bool) -> bool:
        """``COMMIT PREPARED`` / ``ROLLBACK PREPARED``; False leaves it to recovery."""
        try:
            if commit:
                await self.connection.tpc_commit()
            else:
                await self.connection.tpc_rollback()
        except Exception as exc:  # finish must not fail
            finish_failed(self.name, xid, commit, exc)
            await self._reset()
            return False
        return True

    async def abort(self, xid: Xid) -> None:
        """Roll back a branch that did not vote yes (never raises)."""
        if getattr(self.connection, "_tpc", True) is None:
            return  # nothing open (a failed prepare rolled it back)
        try:
            await self.connection.tpc_rollback()
        except Exception as exc:
            log.info("%s: abort of %s: %s", self.name, xid, exc)
            await self._reset()

    async def _reset(self) -> None:
        with contextlib.suppress(Exception):  # a broken connection: nothing more to do
            await self.connection.rollback()
