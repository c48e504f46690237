"""The XA resource manager of the broker: commands, endpoint rules, timers, replay.

Theory of operation
-------------------
Branches live in :attr:`XaEngine.branches` by Xid; their state machine is the
table of ``core/xa.py``. While a branch is ACTIVE its session's ``xa_work``
points at the branch's staged work, so the engine's ordinary ``send`` and
``ack`` stage into it (up to ``max_xa_branch_messages``).

Durability follows the engine's ordering rules: a branch's content is written
once, by ``prepare``, as one ``XA_PREPARE`` record; consumed messages stay
HELD (invisible, never relocated) until the branch completes; new messages
become visible when the commit record is durable; a heuristic decision
changes the branch's state at command time (it is metadata: the snapshot
carries it) and applies its outcome once the record is durable.

Endpoint rules (seed 002) are applied at ``end`` (consumed messages' queues
shut or deleted → rollback-only), ``prepare`` (consumed queues shut, deleted
or over quota → rolled back; target queues deleted → rolled back; shut or
over quota → rolled back when ``reject_to_sender_on_discard``, else the
message is dropped at commit; the quota counts this branch's messages but not
other prepared branches'), one-phase ``commit`` (target shut: rolled back or
dropped as above; deleted: rolled back) and two-phase ``commit`` (target shut
or deleted: commits, the message is dropped).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from txbroker.core import records
from txbroker.core.admin import Admin
from txbroker.core.effects import Fail, Release, Reply
from txbroker.core.engine import LATER
from txbroker.core.messages import Message, State
from txbroker.core.records import Kind
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
    UNPREPARED,
    Branch,
    BranchState,
    Request,
)
from txbroker.errors import (
    XA_OK,
    XA_RBOTHER,
    XA_RBROLLBACK,
    XA_RBTIMEOUT,
    XA_RDONLY,
    XAER_DUPID,
    XAER_INVAL,
    XAER_NOTA,
    XAER_PROTO,
    XAER_RMFAIL,
    XAError,
)
from txbroker.xid import Xid, is_sink_xid

S = BranchState
#: Timed-out branches remembered so that a late request gets XA_RBTIMEOUT, not XAER_NOTA.
TIMED_OUT_MEMORY = 1_000


def _pack_ref(ref: int | None) -> bytes | None:
    """A body ref as msgpack can carry it: refs are opaque ints of up to 136 bits."""
    return None if ref is None else ref.to_bytes((ref.bit_length() + 7) // 8 or 1, "big")


def _unpack_ref(value: Any) -> int | None:
    return int.from_bytes(value, "big") if isinstance(value, bytes) else value


def parse_xid(value: Any) -> Xid:
    """An Xid from its text form (XAER_INVAL when malformed)."""
    if isinstance(value, Xid):
        return value
    return Xid.parse(value)


class XaEngine(Admin):
    """XA commands on top of the engine and admin. See the module docstring."""

    #: The edge sets this to the store's ``body_size`` before replaying (recovery.py).
    body_size_of: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.branches: dict[Xid, Branch] = {}
        self.xa_timed_out: OrderedDict[Xid, int] = OrderedDict()
        self.xa_scans: set[int] = set()  #: sessions with an open recover scan
        self._replay_completed = set()

    # ------------------------------------------------------------------ lookups
    def _find(self, xid: Xid) -> Branch:
        branch = self.branches.get(xid)
        if branch is None:
            reason = self.xa_timed_out.pop(xid, None)
            if reason is not None:
                raise XAError(reason, f"branch {xid} was rolled back (timeout)")
            raise XAError(XAER_NOTA, f"unknown Xid {xid}")
        return branch

    def _check_branch_room(self, tx: LocalTransaction, more: int) -> None:
        limit = self.limits.max_xa_branch_messages
        if len(tx.sends) + len(tx.acks) + more > limit:
            session = self.sessions.get(tx.session)
            branch = self.branches.get(session.xa_xid) if session is not None else None
            if branch is not None and is_sink_xid(branch.xid):
                limit = self.limits.max_sink_branch_messages  # a Spark sink's task
                if len(tx.sends) + len(tx.acks) + more <= limit:
                    return
            if branch is not None:
                branch.error = XA_RBOTHER
            raise XAError(XA_RBOTHER, f"the branch would track more than {limit} messages "
                                      "(max_xa_branch_messages); it can only roll back")

    def _associate(self, branch: Branch, session_id: int) -> None:
        session = self.session(session_id)
        session.xa_xid = branch.xid
        session.xa_work = branch.work
        branch.work.session = session_id
        branch.session = session_id

    def _dissociate(self, branch: Branch) -> None:
        if branch.session is not None:
            session = self.sessions.get(branch.session)
            if session is not None and session.xa_xid == branch.xid:
                session.xa_xid = None
                session.xa_work = None
        branch.session = None

    # ------------------------------------------------------------------ start / end
    def xa_start(self, session_id: int, xid_text: Any, flags: int, now: int) -> Any:
        """Associate a branch with the session: new (TMNOFLAGS), TMRESUME or TMJOIN."""
        xid = parse_xid(xid_text)
        session = self.session(session_id)
        if flags == TMJOIN and session.xa_xid == xid:
            return {}  # joining the branch this session already works on
        if session.xa_xid is not None:
            raise XAError(XAER_PROTO, f"the session is already associated with branch "
                                      f"{session.xa_xid} (one branch per session at a time)")
        if flags == TMNOFLAGS:
            if xid in self.branches:
                raise XAError(XAER_DUPID, f"branch {xid} already exists")
            timeout = session.xa_timeout_ms or self.limits.xa_transaction_timeout_ms
            branch = Branch(xid, session_id, now, timeout)
            branch.fire(Request.START)
            self.branches[xid] = branch
            self.xa_timed_out.pop(xid, None)
        elif flags in (TMRESUME, TMJOIN):
            branch = self._find(xid)
            if branch.state is S.ACTIVE and branch.session in self.sessions:
                raise XAError(XAER_PROTO, f"branch {xid} is associated with another session")
            branch.fire(Request.RESUME if flags == TMRESUME else Request.JOIN)
        else:
            raise XAError(XAER_INVAL, f"start flags must be TMNOFLAGS, TMRESUME or TMJOIN, "
                                      f"not {flags:#x}")
        branch.idle_since_ms = 0
        self._associate(branch, session_id)
        return {}

    def xa_end(self, session_id: int, xid_text: Any, flags: int, now: int) -> Any:
        """End the session's work on a branch: TMSUCCESS, TMSUSPEND or TMFAIL."""
        xid = parse_xid(xid_text)
        branch = self._find(xid)
        request = {TMSUCCESS: Request.END_SUCCESS, TMSUSPEND: Request.END_SUSPEND,
                   TMFAIL: Request.END_FAIL}.get(flags)
        if request is None:
            raise XAError(XAER_INVAL, f"end flags must be TMSUCCESS, TMSUSPEND or TMFAIL, "
                                      f"not {flags:#x}")
        if branch.state is S.ACTIVE and branch.session != session_id:
            raise XAError(XAER_PROTO, f"branch {xid} is associated with another session")
        if request is not Request.END_FAIL:
            problem = ("it went over the branch message limit" if branch.error
                       else self._consumed_problem(branch, check_quota=False))
            if problem:
                branch.fire(Request.END_FAIL)
                self._dissociate(branch)
                branch.idle_since_ms = now
                raise XAError(branch.error or XA_RBROLLBACK,
                              f"branch {xid} is rollback-only: {problem}")
        branch.fire(request)
        if request is not Request.END_SUSPEND:
            branch.idle_since_ms = now
        self._dissociate(branch)
        return {}

    def _consumed_problem(self, branch: Branch, *, check_quota: bool) -> str:
        """Why the branch's consumed messages cannot be taken (seed 002), or ''."""
        for message in branch.work.acks.values():
            queue = self.queues.get(message.queue)
            if queue is None or message.state is State.GONE:
                return f"queue {message.queue!r} of a consumed message was deleted"
            if not queue.settings.egress:
                return f"queue {message.queue!r} of a consumed message is shut down (egress)"
            limit = queue.settings.max_messages
            if check_quota and limit and queue.messages > limit:
                return f"queue {message.queue!r} of a consumed message is over its quota"
        return ""

    # ------------------------------------------------------------------ prepare
    def xa_prepare(self, session_id: int, rid: int, xid_text: Any, now: int) -> Any:
        """Phase one: check the endpoints, write the branch's content, vote.

        Replies ``{"vote": XA_OK}`` once the XA_PREPARE record is durable, or
        ``{"vote": XA_RDONLY}`` at once for a branch that did no work (it is gone).
        """
        xid = parse_xid(xid_text)
        branch = self._find(xid)
        if branch.state is S.ROLLBACK_ONLY:
            self._undo(branch, now)
            raise XAError(branch.error or XA_RBROLLBACK,
                          f"branch {xid} was rollback-only and is rolled back")
        if branch.state is not S.IDLE:
            branch.fire(Request.PREPARE)  # raises XAER_PROTO
        problem = self._consumed_problem(branch, check_quota=True) or self._send_problem(
            branch, prepare=True)
        if problem:
            self._undo(branch, now)
            raise XAError(XA_RBROLLBACK, f"branch {xid} rolled back at prepare: {problem}")
        work = branch.work
        if not work.sends and not work.acks:
            branch.fire(Request.PREPARE)
            self._remove(branch)
            return {"vote": XA_RDONLY}
        branch.fire(Request.PREPARE)
        stored = [m for m in work.sends if m.persistent]
        meta = [str(xid), [m.to_record() for m in stored],
                [[m.id, m.delivery_count] for m in work.acks.values() if m.persistent],
                sorted(branch.discards), branch.created_ms, now]

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(stored, refs, strict=True):
                message.ref = ref

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self._storage_failed(error)
                self._emit(Fail(session_id, rid, XAError(XAER_RMFAIL, f"store failed: {error}")))
                return
            branch.fire(Request.PREPARE_DURABLE)
            self._emit(Reply(session_id, rid, {"vote": XA_OK}))

        bodies = [m.body for m in stored if m.body is not None]
        self._persist(Kind.XA_PREPARE, meta, on_durable, bodies, on_refs)
        return LATER

    def _send_problem(self, branch: Branch, *, prepare: bool) -> str:
        """Check the branch's target queues (prepare / one-phase commit). Messages that
        may be dropped go to ``branch.discards``; a refusal is returned as a reason."""
        if self._sends_fit(branch, prepare=prepare):
            return ""
        adding: dict[str, list[int]] = {}
        for message in branch.work.sends:
            queue = self.queues.get(message.queue)
            if queue is None:
                return f"target queue {message.queue!r} was deleted"
            reason = ""
            if not queue.settings.ingress:
                reason = f"target queue {message.queue!r} is shut down (ingress)"
            elif prepare:
                counts = adding.setdefault(queue.name, [0, 0])
                counts[0] += 1
                counts[1] += message.size
                # the quota counts the queue's messages and this branch's, not those of
                # other branches (prepared or not) nor sends still on their way to disk
                msgs = queue.messages + counts[0]
                size = queue.bytes + counts[1]
                limit, max_bytes = queue.settings.max_messages, queue.settings.max_bytes
                if (limit and msgs > limit) or (max_bytes and size > max_bytes):
                    reason = f"target queue {message.queue!r} is over its quota"
            if reason:
                if queue.settings.reject_to_sender_on_discard:
                    return reason
                branch.discards.add(message.id)
        return ""

    # ------------------------------------------------------------------ commit
    def xa_commit(self, session_id: int, rid: int, xid_text: Any, one_phase: bool,
                  now: int) -> Any:
        """Commit a PREPARED branch (two-phase) or an IDLE one (``one_phase``)."""
        xid = parse_xid(xid_text)
        branch = self._find(xid)
        if one_phase and branch.state is S.ROLLBACK_ONLY:
            self._undo(branch, now)
            raise XAError(branch.error or XA_RBROLLBACK, f"branch {xid} was rollback-only "
                                                         "and is rolled back")
        if branch.state in (S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK):
            code = branch.fire(Request.COMMIT)
            raise XAError(code, f"branch {xid} was completed heuristically")
        if one_phase:
            if branch.state is not S.IDLE:
                branch.fire(Request.COMMIT_ONE_PHASE)  # raises XAER_PROTO
            problem = self._send_problem(branch, prepare=False)
            if problem:
                self._undo(branch, now)
                raise XAError(XA_RBROLLBACK, f"branch {xid} rolled back at commit: {problem}")
            branch.fire(Request.COMMIT_ONE_PHASE)
            return self._write_one_phase(branch, session_id, rid, now)
        branch.fire(Request.COMMIT)
        discards = self._commit_discards(branch)
        self._persist(Kind.XA_COMMIT, [str(xid), sorted(discards), self._commit_seqs(branch), now],
                      self._when_complete(branch, session_id, rid, commit=True,
                                          request=Request.COMMIT_DURABLE))
        return LATER

    def _commit_discards(self, branch: Branch) -> set[int]:
        """Two-phase commit: sends to a shut or deleted queue are dropped (seed 002)."""
        for message in branch.work.sends:
            queue = self.queues.get(message.queue)
            if queue is None or not queue.settings.ingress:
                branch.discards.add(message.id)
        return branch.discards

    def _sends_fit(self, branch: Branch, *, prepare: bool) -> bool:
        """The fast path of :meth:`_send_problem`: every target queue exists, takes
        messages and has room for all of this branch's (checked per queue, not per
        message; a Spark sink branch holds 50,000)."""
        sends = branch.work.sends
        per_queue = Counter(m.queue for m in sends)
        for name, count in per_queue.items():
            queue = self.queues.get(name)
            if queue is None or not queue.settings.ingress:
                return False
            if not prepare:
                continue
            limit, max_bytes = queue.settings.max_messages, queue.settings.max_bytes
            if limit and queue.messages + count > limit:
                return False
            if max_bytes and queue.bytes + sum(m.size for m in sends if m.queue == name) \
                    > max_bytes:
                return False
        return True

    def _commit_seqs(self, branch: Branch) -> list[list[int]]:
        """Give a committing branch's sends their queues' seqs: ``[[id, seq]…]``."""
        sends = [m for m in branch.work.sends if m.persistent and m.id not in branch.discards]
        self._assign_seqs(sends)
        return [[m.id, m.seq] for m in sends if m.seq]

    def _write_one_phase(self, branch: Branch, session_id: int, rid: int, now: int) -> Any:
        work = branch.work
        stored = [m for m in work.sends if m.persistent and m.id not in branch.discards]
        acked = [m for m in work.acks.values() if m.persistent]
        for message in work.acks.values():
            message.state = State.GONE  # never relocated once its ack is on its way
        if not stored and not acked:
            self._apply(branch, commit=True, now=now)
            branch.fire(Request.COMMIT_DURABLE)
            self._remove(branch)
            return {}

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(stored, refs, strict=True):
                message.ref = ref

        self._assign_seqs(stored)
        meta = [[m.to_record() for m in stored], [m.id for m in acked], now]
        bodies = [m.body for m in stored if m.body is not None]
        self._persist(Kind.TX, meta, self._when_complete(branch, session_id, rid, commit=True,
                                                         request=Request.COMMIT_DURABLE),
                      bodies, on_refs)
        return LATER

    def _when_complete(self, branch: Branch, session_id: int, rid: int, *, commit: bool,
                       request: Request | None) -> Any:
        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self._storage_failed(error)
                self._emit(Fail(session_id, rid, XAError(XAER_RMFAIL, f"store failed: {error}")))
                return
            self._apply(branch, commit=commit, now=self._now)
            if request is not None:
                branch.fire(request)
            if branch.state is S.GONE:
                self._remove(branch)
            self._emit(Reply(session_id, rid, {}))

        return on_durable

    # ------------------------------------------------------------------ rollback
    def xa_rollback(self, session_id: int, rid: int, xid_text: Any, now: int) -> Any:
        """Roll a branch back; its consumed messages are redelivered."""
        xid = parse_xid(xid_text)
        branch = self._find(xid)
        if branch.state in (S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK):
            code = branch.fire(Request.ROLLBACK)
            raise XAError(code, f"branch {xid} was completed heuristically")
        if branch.state in UNPREPARED:
            self._undo(branch, now)
            return {}
        branch.fire(Request.ROLLBACK)
        self._persist(Kind.XA_ROLLBACK, [str(xid), now],
                      self._when_complete(branch, session_id, rid, commit=False,
                                          request=Request.ROLLBACK_DURABLE))
        return LATER

    def _undo(self, branch: Branch, now: int) -> None:
        """Roll back an unprepared branch at once (nothing of it is in the log)."""
        if branch.state is not S.GONE:
            branch.fire(Request.ROLLBACK)
        self._apply(branch, commit=False, now=now)
        self._remove(branch)

    def _remove(self, branch: Branch) -> None:
        self._dissociate(branch)
        if self.branches.get(branch.xid) is branch:
            del self.branches[branch.xid]

    def _apply(self, branch: Branch, *, commit: bool, now: int) -> None:
        """Carry out a branch's outcome on the live state (its record is durable)."""
        work = branch.work
        if commit and not branch.discards:
            self._apply_adds(work.sends, now)
        else:
            for message in work.sends:
                if commit and message.id not in branch.discards:
                    self._apply_add(message, now)
                else:
                    self._drop_pending(message)
        for message in list(work.acks.values()):
            if commit:
                queue = self.queues.get(message.queue)
                if queue is not None:
                    queue.count_out(message)
                self.counters["acked"] += 1
                self._forget(message)
            elif message.id in self.messages:  # (gone if its queue was deleted)
                self._requeue_held(message, now)
        work.sends = []
        work.acks = {}
        branch.discards = set()

    # ------------------------------------------------------------------ heuristics, forget
    def xa_heuristic(self, session_id: int, rid: int, xid_text: Any, commit: bool,
                     now: int) -> Any:
        """Operator: complete a PREPARED branch by hand (HEURISTIC_COMMITTED /
        HEURISTIC_ROLLED_BACK). The branch stays until ``forget``."""
        xid = parse_xid(xid_text)
        branch = self._find(xid)
        branch.fire(Request.HEURISTIC_COMMIT if commit else Request.HEURISTIC_ROLLBACK)
        discards = self._commit_discards(branch) if commit else set()
        seqs = self._commit_seqs(branch) if commit else []
        self._persist(Kind.XA_HEURISTIC,
                      [str(xid), "commit" if commit else "rollback", sorted(discards), seqs, now],
                      self._when_complete(branch, session_id, rid, commit=commit, request=None))
        return LATER

    def xa_forget(self, session_id: int, rid: int, xid_text: Any, now: int) -> Any:
        """Remove a heuristically completed branch."""
        xid = parse_xid(xid_text)
        branch = self._find(xid)
        branch.fire(Request.FORGET)
        self._remove(branch)
        self._persist(Kind.XA_FORGET, str(xid), self._reply_when_durable(session_id, rid, {}))
        return LATER

    # ------------------------------------------------------------------ recover, timeouts
    def xa_recover(self, session_id: int, flags: int) -> list[str]:
        """Xids of PREPARED and heuristically completed branches.

        TMSTARTRSCAN starts a scan and returns every one; TMNOFLAGS inside a scan
        returns the rest (none: one call returns all); TMENDRSCAN ends the scan.
        TMNOFLAGS outside a scan returns every one.
        """
        if flags & ~(TMSTARTRSCAN | TMENDRSCAN):
            raise XAError(XAER_INVAL, f"recover flags must be TMSTARTRSCAN, TMENDRSCAN or "
                                      f"TMNOFLAGS, not {flags:#x}")
        scanning = session_id in self.xa_scans
        found = [str(b.xid) for b in self.branches.values() if b.state in RECOVERABLE]
        if flags & TMSTARTRSCAN:
            self.xa_scans.add(session_id)
        elif scanning:
            found = []
        if flags & TMENDRSCAN:
            self.xa_scans.discard(session_id)
        return found

    def xa_set_timeout(self, session_id: int, seconds: int) -> Any:
        """The transaction timeout of branches this session starts; 0 = the default."""
        if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
            raise XAError(XAER_INVAL, "the transaction timeout is an integer >= 0 seconds")
        self.session(session_id).xa_timeout_ms = seconds * 1000
        return {"seconds": self._timeout_seconds(session_id)}

    def xa_get_timeout(self, session_id: int) -> Any:
        """The transaction timeout (seconds) of branches this session starts."""
        return {"seconds": self._timeout_seconds(session_id)}

    def _timeout_seconds(self, session_id: int) -> int:
        ms = self.session(session_id).xa_timeout_ms or self.limits.xa_transaction_timeout_ms
        return ms // 1000

    def xa_list(self, now: int) -> list[dict[str, object]]:
        """Every branch with its state, age and message counts (``txbroker xa list``)."""
        return [b.info(now) for b in sorted(self.branches.values(), key=lambda b: b.created_ms)]

    def close_session(self, session_id: int, now: int) -> None:
        session = self.sessions.get(session_id)
        if session is not None and session.xa_xid is not None:
            branch = self.branches.get(session.xa_xid)
            if branch is not None and branch.state is S.ACTIVE:
                branch.fire(Request.SESSION_LOST)
                branch.idle_since_ms = now  # the reattach timer starts
            if branch is not None:
                self._dissociate(branch)
        self.xa_scans.discard(session_id)
        super().close_session(session_id, now)

    def _xa_expired(self, branch: Branch, now: int) -> int:
        """The XA_RB* code if a branch's timer has run out, else 0."""
        if branch.state not in UNPREPARED:
            return 0
        if branch.deadline_ms and now >= branch.deadline_ms:
            return XA_RBTIMEOUT
        if branch.state is S.IDLE and branch.idle_since_ms and \
                now >= branch.idle_since_ms + self.limits.xa_idle_timeout_ms:
            return XA_RBTIMEOUT
        if branch.state is S.SUSPENDED and branch.session is None and branch.idle_since_ms \
                and now >= branch.idle_since_ms + self.limits.xa_reattach_ms:
            return XA_RBTIMEOUT
        return 0

    def tick(self, now: int) -> None:
        super().tick(now)
        for branch in list(self.branches.values()):
            code = self._xa_expired(branch, now)
            if code:
                self._undo(branch, now)
                self.xa_timed_out[branch.xid] = code
                while len(self.xa_timed_out) > TIMED_OUT_MEMORY:
                    self.xa_timed_out.popitem(last=False)

    def next_wakeup(self) -> int | None:
        wake = super().next_wakeup()
        for branch in self.branches.values():
            if branch.state not in UNPREPARED:
                continue
            times = [branch.deadline_ms] if branch.deadline_ms else []
            if branch.idle_since_ms and branch.state is S.IDLE:
                times.append(branch.idle_since_ms + self.limits.xa_idle_timeout_ms)
            if branch.idle_since_ms and branch.state is S.SUSPENDED and branch.session is None:
                times.append(branch.idle_since_ms + self.limits.xa_reattach_ms)
            for at in times:
                wake = at if wake is None else min(wake, at)
        return wake

    # ------------------------------------------------------------------ snapshot, replay
    def xa_snapshot(self) -> dict[str, Any]:
        """The ``"xa"`` part of the SNAPSHOT (records.py): the durable branches whose
        XA_PREPARE entry no stored body keeps (consumes only), and heuristic ones."""
        found: dict[str, Any] = {}
        for branch in self.branches.values():
            if branch.state in (S.PREPARED, S.COMMITTING, S.ROLLING_BACK):
                sends = [m for m in branch.work.sends if m.persistent]
                if sends and None not in [m.ref for m in sends]:
                    # Its XA_PREPARE entry holds these bodies, so the store keeps that
                    # entry's segment while they live (they are never relocated): replay
                    # finds the branch there. Copying it here would cost every segment
                    # roll as much as all prepared sends (a Spark micro-batch prepares
                    # millions), quadratic in the batch.
                    continue
                found[str(branch.xid)] = [
                    S.PREPARED.value, [m.to_record() for m in sends],
                    [_pack_ref(m.ref) for m in sends],
                    [[m.id, m.delivery_count] for m in branch.work.acks.values()]
                    + branch.ref_ids,
                    sorted(branch.discards), branch.created_ms]
            elif branch.state in (S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK):
                found[str(branch.xid)] = [branch.state.value, [], [], [], [],
                                          branch.created_ms]
        return found

    def _replay_xa(self, kind: int, meta: Any, refs: tuple[int, ...]) -> None:
        if kind == Kind.XA_PREPARE:
            xid_text, sends, consumed, discards, created = meta[:5]
            xid = parse_xid(xid_text)
            self._replay_completed.discard(xid)
            self._replay_branch(xid, S.PREPARED, sends, list(refs), consumed, discards, created)
        elif kind == Kind.XA_COMMIT:
            self._replay_commit(parse_xid(meta[0]), meta[1], meta[2] if len(meta) > 2 else [])
        elif kind == Kind.XA_ROLLBACK:
            xid = parse_xid(meta if isinstance(meta, str) else meta[0])
            branch = self.branches.pop(xid, None)
            self._replay_completed.add(xid)
            if branch is not None:
                self._replay_outcome(branch, commit=False)
        elif kind == Kind.XA_HEURISTIC:
            xid_text, outcome, discards = meta[:3]
            branch = self.branches.get(parse_xid(xid_text))
            if branch is not None and branch.state is S.PREPARED:
                branch.discards.update(discards)
                if outcome == "commit" and len(meta) > 3:
                    self._replay_seqs(branch, meta[3])
                self._replay_outcome(branch, commit=outcome == "commit")
                branch.state = (S.HEURISTIC_COMMITTED if outcome == "commit"
                                else S.HEURISTIC_ROLLED_BACK)
        elif kind == Kind.XA_FORGET:
            xid = parse_xid(meta)
            self.branches.pop(xid, None)
            self._replay_completed.add(xid)
        else:
            raise ValueError(f"unknown record kind {kind}")

    def _replay_commit(self, xid: Xid, discards: list[int], seqs: list[Any]) -> None:
        """Replay a branch's commit (XA_COMMIT, or one branch of a SINK_COMMIT)."""
        branch = self.branches.pop(xid, None)
        self._replay_completed.add(xid)
        if branch is not None:
            branch.discards.update(discards)
            self._replay_seqs(branch, seqs)
            self._replay_outcome(branch, commit=True)

    @staticmethod
    def _replay_seqs(branch: Branch, pairs: list[Any]) -> None:
        seqs = dict((int(pair[0]), int(pair[1])) for pair in pairs)
        for message in branch.work.sends:
            message.seq = seqs.get(message.id, 0)

    #: Xids completed by a record during replay: a later snapshot (taken while the
    #: completion was on its way to disk) must not bring such a branch back.
    _replay_completed: set[Xid]

    def _replay_xa_snapshot(self, found: dict[str, Any]) -> None:
        for xid_text, (state, sends, refs, consumed, discards, created) in found.items():
            xid = parse_xid(xid_text)
            if xid in self._replay_completed:
                continue
            branch = self.branches.get(xid)
            wanted = S(state)
            if branch is None:
                branch = self._replay_branch(xid, S.PREPARED, sends, refs, consumed, discards,
                                             created)
                if wanted is S.PREPARED:
                    continue
                branch.state = S.HEURISTIC_COMMITTED  # no content: nothing to apply
            if wanted is not S.PREPARED and branch.state is S.PREPARED:
                self._replay_outcome(branch, commit=wanted is S.HEURISTIC_COMMITTED)
            branch.state = wanted

    def _replay_branch(self, xid: Xid, state: BranchState, sends: list[Any], refs: list[Any],
                       consumed: list[Any], discards: list[int], created: int) -> Branch:
        branch = Branch(xid, 0, created, 0)
        branch.session = None
        branch.work.session = 0
        branch.state = state
        body_size_of = self.body_size_of
        for msg, packed in zip(sends, refs, strict=True):
            ref = _unpack_ref(packed)
            size = int(body_size_of(ref)) if body_size_of is not None and ref is not None else 0
            message = Message.from_record(msg, size, ref)
            branch.work.sends.append(message)
            if message.id >= self.next_id:
                self.next_id = message.id + 1
        branch.ref_ids = [[int(pair[0]), int(pair[1])] for pair in consumed]  # [id, count]
        branch.discards = set(discards)
        self.branches[xid] = branch
        return branch

    def _replay_outcome(self, branch: Branch, *, commit: bool) -> None:
        for message in branch.work.sends:
            if commit and message.id not in branch.discards:
                self.messages[message.id] = message
            elif message.ref is not None:
                self._emit(Release(message.ref))
        if commit:
            for message_id, _ in branch.ref_ids:
                consumed = self.messages.pop(message_id, None)
                if consumed is not None and consumed.ref is not None:
                    self._emit(Release(consumed.ref))
        branch.work.sends = []
        branch.ref_ids = []
        branch.discards = set()

    def _xa_hold_recovered(self) -> list[Message]:
        """Before the survivors go into their queues: take out the messages consumed by
        prepared branches (they stay HELD). Returns them for :meth:`_xa_finish`."""
        held: list[Message] = []
        for branch in self.branches.values():
            for message_id, delivery_count in branch.ref_ids:
                message = self.messages.pop(message_id, None)
                if message is not None:
                    message.delivery_count = max(message.delivery_count, delivery_count)
                    held.append(message)
                    branch.work.acks[message_id] = message
            branch.ref_ids = []
        return held

    def _xa_finish(self, held: list[Message]) -> None:
        """After recovery: held messages counted in their queues, prepared sends pending
        (a new message is counted in ``pending`` until it is added or dropped)."""
        for message in held:
            queue = self.queues.get(message.queue)
            if queue is not None:
                queue.count_in(message)
            message.state = State.HELD
            self.messages[message.id] = message
        for branch in self.branches.values():
            for message in branch.work.sends:
                queue = self.queues.get(message.queue)
                if queue is not None:
                    queue.pending += 1
                    queue.pending_bytes += message.size

    def xa_replay_meta(self, kind: int, meta: bytes) -> Any:
        """Decode a record's meta (for tools)."""
        return records.unpack(meta)
