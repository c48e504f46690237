"""The one-phase commit of an XA branch, and the recovery of voted commits.

An IDLE branch committed with ``one_phase`` (rule 9) writes its sends and acks as one
``TX`` record — nothing at all when it stored nothing — and applies them when the
record is durable (:func:`write_one_phase`). On a replicated primary
(``XaBranches.voted``) the commit is voted instead (rule 9b, as a local transaction's,
``core/local_tx.py``): the work goes out as an internal branch's ``XA_PREPARE`` the
backups vote on, then ``XA_COMMIT`` — or ``XA_ROLLBACK`` and ``XA_RBROLLBACK``. A voted
commit that recovery finds prepared without an outcome is committed
(:func:`commit_leftover_local`, presumed commit).

The branch state machine is ``core/xa.py``'s; the other commands are
``core/xa_branches.py``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txbroker.core.effects import Fail, Reply
from txbroker.core.messages import Message, State
from txbroker.core.queue_index import LATER
from txbroker.core.records import Tx, XaCommit, XaPrepare, XaRollback
from txbroker.core.xa import Branch, BranchState, Request
from txbroker.errors import XA_RBROLLBACK, ReplicaVoteFailed, XAError
from txbroker.xid import is_local_tx_xid, local_tx_xid

if TYPE_CHECKING:
    from txbroker.core.xa_branches import XaBranches

S = BranchState


def write_one_phase(xa: XaBranches, branch: Branch, session_id: int, rid: int,
                    now: int) -> Any:
    """Write an IDLE branch's one-phase commit: a ``TX`` record (or nothing, when it
    stored nothing), or on a replicated primary a voted internal branch."""
    work = branch.work
    stored = [m for m in work.sends if m.persistent and m.id not in branch.discards]
    acked = [m for m in work.acks.values() if m.persistent]
    if xa.voted and (stored or acked):
        return _one_phase_voted(xa, branch, session_id, rid, stored, acked, now)
    for message in work.acks.values():
        message.state = State.GONE  # never relocated once its ack is on its way
    if not stored and not acked:
        xa.apply(branch, commit=True, now=now)
        branch.fire(Request.COMMIT_DURABLE)
        xa.remove(branch)
        return {}

    def on_refs(refs: list[int]) -> None:
        for message, ref in zip(stored, refs, strict=True):
            message.ref = ref

    xa.index.assign_seqs(stored)
    record = Tx([m.to_record() for m in stored], [m.id for m in acked], now)
    bodies = [m.body for m in stored if m.body is not None]
    xa.outbox.write(record,
                    xa.when_complete(branch, session_id, rid, commit=True,
                                     request=Request.COMMIT_DURABLE),
                    bodies, on_refs)
    return LATER


def _one_phase_voted(xa: XaBranches, branch: Branch, session_id: int, rid: int,
                     stored: list[Message], acked: list[Message], now: int) -> Any:
    """Rule 9b: the one-phase commit as an internal branch's XA_PREPARE, voted by
    the backups, then XA_COMMIT — or XA_ROLLBACK and XA_RBROLLBACK (as a local
    transaction's voted commit, ``core/local_tx.py``)."""
    xa.voted_commits += 1
    internal = str(local_tx_xid(session_id, f"xa{xa.voted_commits}", now))
    outbox, xid = xa.outbox, branch.xid

    def on_refs(refs: list[int]) -> None:
        for message, ref in zip(stored, refs, strict=True):
            message.ref = ref

    def rolled_back(failure: BaseException | None, error: BaseException) -> None:
        if failure is not None and not isinstance(failure, ReplicaVoteFailed):
            xa.store_failed(session_id, rid, failure)
            return
        xa.apply(branch, commit=False, now=outbox.now)
        branch.fire(Request.ROLLBACK_DURABLE)
        xa.remove(branch)
        outbox.emit(Fail(session_id, rid, XAError(
            XA_RBROLLBACK, f"branch {xid} rolled back at commit: {error}")))

    def on_durable(error: BaseException | None) -> None:
        if isinstance(error, ReplicaVoteFailed):
            branch.fire(Request.VOTE_FAILED)
            outbox.write(XaRollback(internal, outbox.now),
                         lambda failure: rolled_back(failure, error))
            return
        if error is not None:
            xa.store_failed(session_id, rid, error)
            return
        at = max(outbox.now, now)
        outbox.write(XaCommit(internal, [], xa.commit_seqs(branch), at),
                     xa.leftover_written)
        for message in branch.work.acks.values():
            message.state = State.GONE  # its ack is in the log from now on
        xa.apply(branch, commit=True, now=at)
        branch.fire(Request.COMMIT_DURABLE)
        xa.remove(branch)
        outbox.emit(Reply(session_id, rid, {}))

    record = XaPrepare(internal, [m.to_record() for m in stored],
                       [[m.id, m.delivery_count] for m in acked], [], branch.created_ms,
                       now)
    bodies = [m.body for m in stored if m.body is not None]
    outbox.write(record, on_durable, bodies, on_refs)
    return LATER


def commit_leftover_local(xa: XaBranches, now: int) -> None:
    """Recovery is over: a voted local commit (``core/local_tx.py``) whose internal
    branch has no outcome in the log is committed — presumed commit: its client was
    never told it rolled back (that answer waits for the durable XA_ROLLBACK). The
    outcome applies now; its XA_COMMIT follows in the log (a crash before it is
    durable commits the branch again, the same way).

    Its sends come out flagged ``redelivered``: the process (or the primary) that
    answered the commit may have delivered them already — under a delivered mark that
    reached past their seqs, before its XA_COMMIT was durable here — and they get their
    seqs only now, so no mark of this log covers them (the simulator's
    ``replicated-live`` seed 15)."""
    for branch in [b for b in xa.branches.values() if is_local_tx_xid(b.xid)]:
        if branch.state is not S.PREPARED:
            continue
        for message in branch.work.sends:  # "likely, but not guaranteed, delivered"
            message.delivery_count = max(message.delivery_count, 1)
        seqs = xa.commit_seqs(branch)
        xa.apply(branch, commit=True, now=now)
        xa.remove(branch)
        xa.leftovers_committed += 1
        xa.outbox.write(XaCommit(str(branch.xid), [], seqs, now), xa.leftover_written)
