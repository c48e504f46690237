"""The XA resource manager: branch commands, endpoint rules, timers.

Theory of operation
-------------------
Branches live in :attr:`XaBranches.branches` by Xid; their state machine —
every rule, including the named checks — is ``core/xa.py``'s. While a branch
is ACTIVE its session's ``xa_work`` points at the branch's staged work, so
plain sends and acks of that session stage into it (up to
``max_xa_branch_messages``; ``core/broker.py`` routes them). A nack is not
staged: it gives a delivery up at once, in or out of a branch (it consumes
nothing, so there is nothing to commit or roll back, and seed 002's command
blocks have no place for it).

Durability follows the queue index's ordering rules: a branch's content is
written once, by ``prepare``, as one ``XA_PREPARE`` record; consumed messages
stay HELD (invisible, never relocated) until the branch completes; new
messages become visible when the commit record is durable; a heuristic
decision changes the branch's state at command time (it is metadata: the
snapshot carries it) and applies its outcome once the record is durable.

Endpoint rules (seed 002) are applied at ``end`` (consumed messages' queues
shut or deleted → rollback-only), ``prepare`` (consumed queues shut, deleted
or over quota → rolled back; target queues deleted → rolled back; shut or
over quota → rolled back when ``reject_to_sender_on_discard``, else the
message is dropped at commit; the quota counts this branch's messages but not
other prepared branches'), one-phase ``commit`` (target shut: rolled back or
dropped as above; deleted: rolled back) and two-phase ``commit`` (target shut
or deleted: commits, the message is dropped). Their checks are in
``core/xa_endpoints.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from txbroker.core.effects import Fail, Reply
from txbroker.core.limits import Limits
from txbroker.core.outbox import OnDurable, Outbox
from txbroker.core.queue_index import LATER, QueueIndex
from txbroker.core.records import XaCommit, XaForget, XaHeuristic, XaPrepare, XaRollback
from txbroker.core.sessions import Session
from txbroker.core.transactions import LocalTransaction
from txbroker.core.xa import (
    RECOVERABLE,
    TMENDRSCAN,
    TMFAIL,
    TMJOIN,
    TMNOFLAGS,
    TMRESUME,
    TMSTARTRSCAN,
    TMSUCCESS,
    TMSUSPEND,
    TRANSITIONS,
    UNPREPARED,
    Branch,
    BranchState,
    Request,
    check_association,
    check_owner,
    next_state,
    prepare_request,
    rolls_back,
    timeout_at,
)
from txbroker.core.xa_endpoints import commit_discards, consumed_problem, send_problem
from txbroker.core.xa_one_phase import write_one_phase
from txbroker.errors import (
    XA_OK,
    XA_RBOTHER,
    XA_RBROLLBACK,
    XAER_DUPID,
    XAER_INVAL,
    XAER_NOTA,
    XAER_RMFAIL,
    ReplicaVoteFailed,
    XAError,
)
from txbroker.xid import LOCAL_TX_FORMAT_ID, Xid, is_local_tx_xid, is_sink_xid

S = BranchState
#: Timed-out branches remembered so that a late request gets XA_RBTIMEOUT, not XAER_NOTA.
TIMED_OUT_MEMORY = 1_000
#: start flags -> request, end flags -> request (xa.h)
START_REQUESTS = {TMNOFLAGS: Request.START, TMRESUME: Request.RESUME, TMJOIN: Request.JOIN}
END_REQUESTS = {TMSUCCESS: Request.END_SUCCESS, TMSUSPEND: Request.END_SUSPEND,
                TMFAIL: Request.END_FAIL}


def parse_xid(value: Any) -> Xid:
    """An Xid from its text form (XAER_INVAL when malformed)."""
    if isinstance(value, Xid):
        return value
    return Xid.parse(value)


class XaBranches:
    """XA commands over the queue index. See the module docstring."""

    def __init__(self, index: QueueIndex, limits: Limits, outbox: Outbox) -> None:
        self.index = index
        self.limits = limits
        self.outbox = outbox
        self.branches: dict[Xid, Branch] = {}
        self.timed_out: OrderedDict[Xid, int] = OrderedDict()
        self.scans: set[int] = set()  #: sessions with an open recover scan
        #: a replicated primary: one-phase commits are voted (rule 9b, core/local_tx.py)
        self.voted = False
        self.voted_commits = 0  #: internal branches written (their gtrids' counter)
        #: voted commits recovery found without an outcome and committed (presumed commit)
        self.leftovers_committed = 0

    # ------------------------------------------------------------------ lookups
    def find(self, xid: Xid) -> Branch:
        """The branch ``xid`` (XAER_NOTA, or XA_RBTIMEOUT if it timed out lately)."""
        branch = self.branches.get(xid)
        if branch is None:
            reason = self.timed_out.pop(xid, None)
            if reason is not None:
                raise XAError(reason, f"branch {xid} was rolled back (timeout)")
            raise XAError(XAER_NOTA, f"unknown Xid {xid}")
        return branch

    def check_room(self, work: LocalTransaction, more: int) -> None:
        """The branch message limit (seed 002: 256; a Spark sink's branch: more)."""
        count = len(work.sends) + len(work.acks) + more
        limit = self.limits.max_xa_branch_messages
        if count <= limit:
            return
        session = self.index.sessions.get(work.session)
        branch = self.branches.get(session.xa_xid) if session is not None else None
        if branch is not None and is_sink_xid(branch.xid):
            limit = self.limits.max_sink_branch_messages  # a Spark sink's task
            if count <= limit:
                return
        if branch is not None:
            branch.error = XA_RBOTHER
        raise XAError(XA_RBOTHER, f"the branch would track more than {limit} messages "
                                  "(max_xa_branch_messages); it can only roll back")

    def _associate(self, branch: Branch, session: Session) -> None:
        session.xa_xid = branch.xid
        session.xa_work = branch.work
        branch.work.session = session.id
        branch.session = session.id

    def _dissociate(self, branch: Branch) -> None:
        if branch.session is not None:
            session = self.index.sessions.get(branch.session)
            if session is not None and session.xa_xid == branch.xid:
                session.xa_xid = None
                session.xa_work = None
        branch.session = None

    def _owner_alive(self, branch: Branch) -> bool:
        return branch.session in self.index.sessions

    # ------------------------------------------------------------------ start / end
    def start(self, session: Session, xid_text: Any, flags: int, now: int) -> Any:
        """Associate a branch with the session: new (TMNOFLAGS), TMRESUME or TMJOIN."""
        xid = parse_xid(xid_text)
        request = START_REQUESTS.get(flags)
        if request is None:
            check_association(session.xa_xid, xid, Request.START)
            raise XAError(XAER_INVAL, f"start flags must be TMNOFLAGS, TMRESUME or TMJOIN, "
                                      f"not {flags:#x}")
        check_association(session.xa_xid, xid, request)
        if is_local_tx_xid(xid):
            raise XAError(XAER_INVAL, f"format id {LOCAL_TX_FORMAT_ID:#x} is reserved for "
                                      "the broker's own local-transaction commits")
        if request is Request.START:
            if xid in self.branches:
                raise XAError(XAER_DUPID, f"branch {xid} already exists")
            timeout = session.xa_timeout_ms or self.limits.xa_transaction_timeout_ms
            branch = Branch(xid, session.id, now, timeout)
            self.branches[xid] = branch
            self.timed_out.pop(xid, None)
        else:
            branch = self.find(xid)
            check_owner(branch, session.id, self._owner_alive(branch))
        branch.fire(request)
        branch.idle_since_ms = 0  # ACTIVE: no timer (rule 19)
        branch.session_lost = False
        self._associate(branch, session)
        return {}

    def end(self, session: Session, xid_text: Any, flags: int, now: int) -> Any:
        """End the session's work on a branch: TMSUCCESS, TMSUSPEND or TMFAIL."""
        xid = parse_xid(xid_text)
        branch = self.find(xid)
        request = END_REQUESTS.get(flags)
        if request is None:
            raise XAError(XAER_INVAL, f"end flags must be TMSUCCESS, TMSUSPEND or TMFAIL, "
                                      f"not {flags:#x}")
        check_owner(branch, session.id, self._owner_alive(branch))
        if request is not Request.END_FAIL:
            problem = ("it went over the branch message limit" if branch.error
                       else consumed_problem(self.index, branch, check_quota=False))
            if problem:
                branch.fire(Request.END_FAIL)
                self._dissociate(branch)
                branch.idle_since_ms = now
                raise XAError(branch.error or XA_RBROLLBACK,
                              f"branch {xid} is rollback-only: {problem}")
        branch.fire(request)
        branch.idle_since_ms = now  # the idle timeout starts (rule 19), TMSUSPEND too
        self._dissociate(branch)
        return {}

    def _refuse_rollback_only(self, branch: Branch, request: Request, now: int) -> None:
        """Rules 8b/9a: the table says this request rolls the branch back: do so, raise."""
        row = TRANSITIONS.get((branch.state, request))
        if row is not None and rolls_back(row[1]):
            code = row[1]
            self.undo(branch, now)
            raise XAError(branch.error or code, f"branch {branch.xid} was rollback-only "
                                                "and is rolled back")

    # ------------------------------------------------------------------ prepare
    def prepare(self, session: Session, rid: int, xid_text: Any, now: int) -> Any:
        """Phase one: check the endpoints, write the branch's content, vote.

        Replies ``{"vote": XA_OK}`` once the XA_PREPARE record is durable, or
        ``{"vote": XA_RDONLY}`` at once for a branch that did no work (it is gone).
        """
        xid = parse_xid(xid_text)
        branch = self.find(xid)
        request = prepare_request(branch)
        self._refuse_rollback_only(branch, request, now)
        next_state(branch.state, request, xid)  # XAER_PROTO unless IDLE
        problem = consumed_problem(self.index, branch, check_quota=True) or send_problem(
            self.index, branch, prepare=True)
        if problem:
            self.undo(branch, now)
            raise XAError(XA_RBROLLBACK, f"branch {xid} rolled back at prepare: {problem}")
        code = branch.fire(request)
        if branch.state is S.GONE:  # rule 8a: read-only
            self.remove(branch)
            return {"vote": code}
        work = branch.work
        stored = [m for m in work.sends if m.persistent]
        branch.prepared_ms = now
        record = XaPrepare(str(xid), [m.to_record() for m in stored],
                           [[m.id, m.delivery_count] for m in work.acks.values()
                            if m.persistent],
                           sorted(branch.discards), branch.created_ms, now)

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(stored, refs, strict=True):
                message.ref = ref

        def on_durable(error: BaseException | None) -> None:
            if isinstance(error, ReplicaVoteFailed):
                self._vote_failed(branch, session.id, rid, error)
                return
            if error is not None:
                self.store_failed(session.id, rid, error)
                return
            branch.fire(Request.PREPARE_DURABLE)
            self.outbox.emit(Reply(session.id, rid, {"vote": XA_OK}))

        bodies = [m.body for m in stored if m.body is not None]
        self.outbox.write(record, on_durable, bodies, on_refs)
        return LATER

    def _vote_failed(self, branch: Branch, session_id: int, rid: int,
                     error: ReplicaVoteFailed) -> None:
        """A ready backup could not write the XA_PREPARE (``--ha replicated``): the seed's
        "fail cancels" — the branch is rolled back (an XA_ROLLBACK follows the prepare in
        the log) and the prepare answers XA_RBROLLBACK."""
        branch.fire(Request.PREPARE_DURABLE)
        branch.fire(Request.ROLLBACK)
        xid = branch.xid

        def rolled_back(failure: BaseException | None) -> None:
            if failure is not None and not isinstance(failure, ReplicaVoteFailed):
                self.store_failed(session_id, rid, failure)
                return
            self.apply(branch, commit=False, now=self.outbox.now)
            branch.fire(Request.ROLLBACK_DURABLE)
            self.remove(branch)
            self.outbox.emit(Fail(session_id, rid, XAError(
                XA_RBROLLBACK, f"branch {xid} rolled back at prepare: {error}")))

        self.outbox.write(XaRollback(str(xid), self.outbox.now), rolled_back)

    def store_failed(self, session_id: int, rid: int, error: BaseException) -> None:
        """A branch's record could not be written: the request fails with XAER_RMFAIL."""
        self.outbox.storage_failed(error)
        self.outbox.emit(Fail(session_id, rid, XAError(XAER_RMFAIL, f"store failed: {error}")))

    # ------------------------------------------------------------------ commit
    def commit(self, session: Session, rid: int, xid_text: Any, one_phase: bool,
               now: int) -> Any:
        """Commit a PREPARED branch (two-phase) or an IDLE one (``one_phase``)."""
        xid = parse_xid(xid_text)
        branch = self.find(xid)
        request = Request.COMMIT_ONE_PHASE if one_phase else Request.COMMIT
        self._refuse_rollback_only(branch, request, now)
        if branch.state in (S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK):
            code = branch.fire(request)
            raise XAError(code, f"branch {xid} was completed heuristically")
        if one_phase:
            next_state(branch.state, request, xid)  # XAER_PROTO unless IDLE
            problem = send_problem(self.index, branch, prepare=False)
            if problem:
                self.undo(branch, now)
                raise XAError(XA_RBROLLBACK, f"branch {xid} rolled back at commit: {problem}")
            branch.fire(request)
            return write_one_phase(self, branch, session.id, rid, now)
        branch.fire(request)
        discards = commit_discards(self.index, branch)
        self.outbox.write(
            XaCommit(str(xid), sorted(discards), self.commit_seqs(branch), now),
            self.when_complete(branch, session.id, rid, commit=True,
                               request=Request.COMMIT_DURABLE))
        return LATER

    def commit_seqs(self, branch: Branch) -> list[list[int]]:
        """Give a committing branch's sends their queues' seqs: ``[[id, seq]…]``."""
        sends = [m for m in branch.work.sends if m.persistent and m.id not in branch.discards]
        self.index.assign_seqs(sends)
        return [[m.id, m.seq] for m in sends if m.seq]

    def when_complete(self, branch: Branch, session_id: int, rid: int, *, commit: bool,
                      request: Request | None) -> OnDurable:
        """``on_durable`` of a completion record: apply the outcome, then reply."""
        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self.store_failed(session_id, rid, error)
                return
            self.apply(branch, commit=commit, now=self.outbox.now)
            if request is not None:
                branch.fire(request)
            if branch.state is S.GONE:
                self.remove(branch)
            self.outbox.emit(Reply(session_id, rid, {}))

        return on_durable

    # ------------------------------------------------------------------ rollback
    def rollback(self, session: Session, rid: int, xid_text: Any, now: int) -> Any:
        """Roll a branch back; its consumed messages are redelivered."""
        xid = parse_xid(xid_text)
        branch = self.find(xid)
        if branch.state in (S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK):
            code = branch.fire(Request.ROLLBACK)
            raise XAError(code, f"branch {xid} was completed heuristically")
        if branch.state in UNPREPARED:
            self.undo(branch, now)
            return {}
        branch.fire(Request.ROLLBACK)
        self.outbox.write(XaRollback(str(xid), now),
                          self.when_complete(branch, session.id, rid, commit=False,
                                             request=Request.ROLLBACK_DURABLE))
        return LATER

    def undo(self, branch: Branch, now: int) -> None:
        """Roll back an unprepared branch at once (nothing of it is in the log)."""
        if branch.state is not S.GONE:
            branch.fire(Request.ROLLBACK)
        self.apply(branch, commit=False, now=now)
        self.remove(branch)

    def remove(self, branch: Branch) -> None:
        """The branch is complete: it leaves its session and the broker."""
        self._dissociate(branch)
        if self.branches.get(branch.xid) is branch:
            del self.branches[branch.xid]

    def apply(self, branch: Branch, *, commit: bool, now: int) -> None:
        """Carry out a branch's outcome on the live state (its record is durable)."""
        work, index = branch.work, self.index
        if commit and not branch.discards:
            index.apply_adds(work.sends, now)
        else:
            for message in work.sends:
                if commit and message.id not in branch.discards:
                    index.apply_add(message, now)
                else:
                    index.drop_pending(message)
        for message in list(work.acks.values()):
            if commit:
                index.count_acked(message)
            elif message.id in index.messages:  # (gone if its queue was deleted)
                index.requeue_held(message, now)
        work.sends = []
        work.acks = {}
        branch.discards = set()

    # ------------------------------------------------------------------ heuristics, forget
    def heuristic(self, session: Session, rid: int, xid_text: Any, commit: bool,
                  now: int) -> Any:
        """Operator: complete a PREPARED branch by hand (HEURISTIC_COMMITTED /
        HEURISTIC_ROLLED_BACK). The branch stays until ``forget``."""
        xid = parse_xid(xid_text)
        branch = self.find(xid)
        branch.fire(Request.HEURISTIC_COMMIT if commit else Request.HEURISTIC_ROLLBACK)
        discards = commit_discards(self.index, branch) if commit else set()
        seqs = self.commit_seqs(branch) if commit else []
        self.outbox.write(
            XaHeuristic(str(xid), "commit" if commit else "rollback", sorted(discards), seqs,
                        now),
            self.when_complete(branch, session.id, rid, commit=commit, request=None))
        return LATER

    def forget(self, session: Session, rid: int, xid_text: Any, now: int) -> Any:
        """Remove a heuristically completed branch."""
        xid = parse_xid(xid_text)
        branch = self.find(xid)
        branch.fire(Request.FORGET)
        self.remove(branch)
        self.outbox.write(XaForget(str(xid)),
                          self.outbox.reply_when_durable(session.id, rid, {}))
        return LATER

    # ------------------------------------------------------------------ recover, timeouts
    def recover(self, session_id: int, flags: int) -> list[str]:
        """Xids of PREPARED and heuristically completed branches.

        TMSTARTRSCAN starts a scan and returns every one; TMNOFLAGS inside a scan
        returns the rest (none: one call returns all); TMENDRSCAN ends the scan.
        TMNOFLAGS outside a scan returns every one.
        """
        if flags & ~(TMSTARTRSCAN | TMENDRSCAN):
            raise XAError(XAER_INVAL, f"recover flags must be TMSTARTRSCAN, TMENDRSCAN or "
                                      f"TMNOFLAGS, not {flags:#x}")
        scanning = session_id in self.scans
        found = [str(b.xid) for b in self.branches.values()
                 if b.state in RECOVERABLE and not is_local_tx_xid(b.xid)]
        if flags & TMSTARTRSCAN:
            self.scans.add(session_id)
        elif scanning:
            found = []
        if flags & TMENDRSCAN:
            self.scans.discard(session_id)
        return found

    def set_timeout(self, session: Session, seconds: int) -> Any:
        """The transaction timeout of branches this session starts — seed 002's idle
        timeout, counted from ``end`` (rule 19); 0 = the default."""
        if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
            raise XAError(XAER_INVAL, "the transaction timeout is an integer >= 0 seconds")
        session.xa_timeout_ms = seconds * 1000
        return self.get_timeout(session)

    def get_timeout(self, session: Session) -> Any:
        """The transaction timeout (seconds) of branches this session starts."""
        ms = session.xa_timeout_ms or self.limits.xa_transaction_timeout_ms
        return {"seconds": ms // 1000}

    def list(self, now: int) -> list[dict[str, object]]:
        """Every branch with its state, age and message counts (``txbroker xa list``)."""
        return [b.info(now) for b in sorted(self.branches.values(), key=lambda b: b.created_ms)
                if not is_local_tx_xid(b.xid)]

    def leftover_written(self, error: BaseException | None) -> None:
        """``on_durable`` of an ``XA_COMMIT`` nobody waits for: a failure stops the store."""
        if error is not None:
            self.outbox.storage_failed(error)

    def session_closed(self, session: Session, now: int) -> None:
        """Rule 15: the session's ACTIVE branch waits SUSPENDED for a reattach."""
        if session.xa_xid is not None:
            branch = self.branches.get(session.xa_xid)
            if branch is not None and branch.state is S.ACTIVE:
                branch.fire(Request.SESSION_LOST)
                branch.idle_since_ms = now  # the reattach window starts (rule 19)
                branch.session_lost = True
            if branch is not None:
                self._dissociate(branch)
        self.scans.discard(session.id)

    def _timeout_at(self, branch: Branch) -> int:
        return timeout_at(branch, self.limits.xa_reattach_ms)

    def tick(self, now: int) -> None:
        """Roll back the branches whose timer ran out (rule 19)."""
        for branch in list(self.branches.values()):
            at = self._timeout_at(branch)
            if at and now >= at:
                code = branch.fire(Request.TIMEOUT)
                self.undo(branch, now)
                self.timed_out[branch.xid] = code
                while len(self.timed_out) > TIMED_OUT_MEMORY:
                    self.timed_out.popitem(last=False)

    def next_wakeup(self) -> int | None:
        """The earliest branch timer, if any."""
        times = [at for branch in self.branches.values() if (at := self._timeout_at(branch))]
        return min(times) if times else None


__all__ = ["XaBranches", "parse_xid"]
