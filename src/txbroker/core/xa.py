"""XA branches: the state table (seed 002) and the staged work of one branch.

Theory of operation
-------------------
A branch is created by ``start`` and named by its :class:`~txbroker.xid.Xid`,
unique in the broker. While it is ACTIVE it is *associated* with one session:
that session's sends and acks (outside a local transaction) are staged in
the branch, exactly like a local transaction's (``LocalTransaction`` holds
them). ``end`` dissociates it (IDLE, SUSPENDED or ROLLBACK_ONLY).

``prepare`` checks the branch's endpoints and writes its whole content —
messages to add, ids of consumed messages, messages to discard — as ONE
``XA_PREPARE`` record; the branch is PREPARED once that record is durable
(until then it is PREPARING and takes no requests: the seed says a state
changes only after all processing is done). ``commit``/``rollback`` of a
prepared branch write ``XA_COMMIT``/``XA_ROLLBACK``; a one-phase commit of
an IDLE branch writes one ``TX`` record like a local commit. An operator may
complete a PREPARED branch heuristically (``XA_HEURISTIC``); it then stays
HEURISTIC_* until ``forget`` (``XA_FORGET``).

The table below is the whole state machine: ``(state, request) -> (next
state, XA code)``. ``GONE`` means the branch is removed. A missing pair is
XAER_PROTO; an unknown Xid is XAER_NOTA (except for ``start`` TMNOFLAGS);
``start`` TMNOFLAGS of a known Xid is XAER_DUPID. A row whose code is an
XA_RB* code rolls the branch back and answers with that code (the branch's
own reason, e.g. XA_RBOTHER over the message limit, when it has one).

Rules that are not about one branch's state are the named checks below the
table: which session may work on a branch (:func:`check_association`), which
kind of prepare a branch gets (:func:`prepare_request`) and when its timer
runs out (:func:`timeout_at`). Seed 002's timers: an ACTIVE branch has none (it
"persists as long as the XA session is open"); the transaction timeout of the
XAResource (``set_transaction_timeout``, 180 s by default) is an *idle* timeout
that starts at ``end``; a branch whose session broke waits the 3-minute reattach
window. Endpoint checks (seed 002: queues shut, deleted
or over quota at ``end``, ``prepare`` and ``commit``) look at the queues, so
they are the branch part's (``core/xa_branches.py``); a failed one rolls the
branch back with XA_RBROLLBACK.
"""

from __future__ import annotations

from enum import Enum

from txbroker.core.transactions import LocalTransaction
from txbroker.errors import (
    XA_HEURCOM,
    XA_HEURRB,
    XA_OK,
    XA_RBBASE,
    XA_RBEND,
    XA_RBROLLBACK,
    XA_RBTIMEOUT,
    XA_RDONLY,
    XAER_NOTA,
    XAER_PROTO,
    XAError,
)
from txbroker.xid import Xid

# XA flags (xa.h / javax.transaction.xa.XAResource); the same numbers on the wire.
TMNOFLAGS = 0x00000000  #: no flags
TMJOIN = 0x00200000  #: start: join an existing branch
TMENDRSCAN = 0x00800000  #: recover: end a scan
TMSTARTRSCAN = 0x01000000  #: recover: start a scan
TMSUSPEND = 0x02000000  #: end: suspend the association
TMSUCCESS = 0x04000000  #: end: the work is done
TMRESUME = 0x08000000  #: start: resume a suspended branch
TMFAIL = 0x20000000  #: end: the work failed, the branch is rollback-only
TMONEPHASE = 0x40000000  #: commit: one-phase

FLAG_NAMES = {
    TMNOFLAGS: "TMNOFLAGS", TMJOIN: "TMJOIN", TMENDRSCAN: "TMENDRSCAN",
    TMSTARTRSCAN: "TMSTARTRSCAN", TMSUSPEND: "TMSUSPEND", TMSUCCESS: "TMSUCCESS",
    TMRESUME: "TMRESUME", TMFAIL: "TMFAIL", TMONEPHASE: "TMONEPHASE",
}


class BranchState(Enum):
    """States of a branch. NONE = the Xid is unknown (the seed's "空闲 未分配")."""

    NONE = "none"
    ACTIVE = "active"  #: associated with a session, taking work
    SUSPENDED = "suspended"  #: end(TMSUSPEND), or its session broke: may be resumed
    IDLE = "idle"  #: end(TMSUCCESS): ready for prepare / one-phase commit
    ROLLBACK_ONLY = "rollback_only"  #: end(TMFAIL) or a failed end: only rollback frees it
    PREPARING = "preparing"  #: the XA_PREPARE record is on its way to disk
    PREPARED = "prepared"  #: durable; survives restarts; listed by recover
    COMMITTING = "committing"  #: the commit record is on its way to disk
    ROLLING_BACK = "rolling_back"  #: the rollback record is on its way to disk
    HEURISTIC_COMMITTED = "heuristic_committed"  #: an operator committed it
    HEURISTIC_ROLLED_BACK = "heuristic_rolled_back"  #: an operator rolled it back
    GONE = "gone"  #: completed: removed from the broker


class Request(Enum):
    """XA requests (and the broker's own events) that move a branch."""

    START = "start(TMNOFLAGS)"
    JOIN = "start(TMJOIN)"
    RESUME = "start(TMRESUME)"
    END_SUCCESS = "end(TMSUCCESS)"
    END_SUSPEND = "end(TMSUSPEND)"
    END_FAIL = "end(TMFAIL)"
    PREPARE = "prepare"
    PREPARE_READ_ONLY = "prepare (no work)"
    PREPARE_DURABLE = "prepare durable"
    COMMIT_ONE_PHASE = "commit(one_phase=True)"
    COMMIT = "commit(one_phase=False)"
    COMMIT_DURABLE = "commit durable"
    ROLLBACK = "rollback"
    ROLLBACK_DURABLE = "rollback durable"
    HEURISTIC_COMMIT = "heuristic commit"
    HEURISTIC_ROLLBACK = "heuristic rollback"
    FORGET = "forget"
    SESSION_LOST = "session lost"
    TIMEOUT = "timeout (the broker's timer ran out)"
    RECOVER = "recover (replay)"
    VOTE_FAILED = "a backup voted fail (replicated HA)"


S, R = BranchState, Request

#: (state, request) -> (next state, XA code of the reply). Missing: XAER_PROTO.
TRANSITIONS: dict[tuple[BranchState, Request], tuple[BranchState, int]] = {
    # Rule 1: start TMNOFLAGS creates a branch for an unknown Xid (a known one: XAER_DUPID).
    (S.NONE, R.START): (S.ACTIVE, XA_OK),
    # Rule 2: start TMRESUME re-associates a suspended branch (also after its session broke).
    (S.SUSPENDED, R.RESUME): (S.ACTIVE, XA_OK),
    # Rule 3: start TMJOIN adds work to an ACTIVE or IDLE branch (the seed's broker refuses
    # TMJOIN; we support it). Joining an ACTIVE branch moves it to the joining session.
    (S.ACTIVE, R.JOIN): (S.ACTIVE, XA_OK),
    (S.IDLE, R.JOIN): (S.ACTIVE, XA_OK),
    # Rule 4: an ACTIVE branch takes work (sends, acks) up to the branch message limit;
    # that is staged work, not a request (the branch part checks the limit).
    # Rule 5: end TMSUCCESS ends the work: IDLE (the idle timeout starts, rule 19). The seed allows
    # it on ACTIVE or IDLE (a repeated end is harmless); from SUSPENDED it ends a
    # suspended association (XA allows that; DESIGN.md lists it).
    (S.ACTIVE, R.END_SUCCESS): (S.IDLE, XA_OK),
    (S.IDLE, R.END_SUCCESS): (S.IDLE, XA_OK),
    (S.SUSPENDED, R.END_SUCCESS): (S.IDLE, XA_OK),
    # Rule 6: end TMSUSPEND suspends an ACTIVE branch; only TMRESUME continues it.
    (S.ACTIVE, R.END_SUSPEND): (S.SUSPENDED, XA_OK),
    # Rule 7: end TMFAIL marks the branch rollback-only (from ACTIVE, IDLE or SUSPENDED).
    (S.ACTIVE, R.END_FAIL): (S.ROLLBACK_ONLY, XA_OK),
    (S.IDLE, R.END_FAIL): (S.ROLLBACK_ONLY, XA_OK),
    (S.SUSPENDED, R.END_FAIL): (S.ROLLBACK_ONLY, XA_OK),
    # Rule 8: prepare an IDLE branch: PREPARING until the XA_PREPARE record is durable.
    (S.IDLE, R.PREPARE): (S.PREPARING, XA_OK),
    (S.PREPARING, R.PREPARE_DURABLE): (S.PREPARED, XA_OK),
    # Rule 8a: prepare of a branch that did no work votes XA_RDONLY: nothing is written,
    # the branch is gone (commit or rollback of it would be XAER_NOTA).
    (S.IDLE, R.PREPARE_READ_ONLY): (S.GONE, XA_RDONLY),
    # Rule 8b: prepare of a ROLLBACK_ONLY branch rolls it back and answers XA_RB*.
    (S.ROLLBACK_ONLY, R.PREPARE): (S.GONE, XA_RBROLLBACK),
    (S.ROLLBACK_ONLY, R.PREPARE_READ_ONLY): (S.GONE, XA_RBROLLBACK),
    # Rule 9: one-phase commit of an IDLE branch (no prepare): one TX record (on a
    # replicated primary: a voted XA_PREPARE of an internal branch, rule 9b), then gone.
    (S.IDLE, R.COMMIT_ONE_PHASE): (S.COMMITTING, XA_OK),
    # Rule 9b: on a replicated primary the one-phase commit is voted by the backups
    # (core/local_tx.py, "Voted commit"); a failed vote rolls it back (XA_ROLLBACK record)
    # and the commit answers XA_RBROLLBACK.
    (S.COMMITTING, R.VOTE_FAILED): (S.ROLLING_BACK, XA_RBROLLBACK),
    # Rule 9a: one-phase commit of a ROLLBACK_ONLY branch rolls it back and answers XA_RB*.
    (S.ROLLBACK_ONLY, R.COMMIT_ONE_PHASE): (S.GONE, XA_RBROLLBACK),
    # Rule 10: two-phase commit of a PREPARED branch: XA_COMMIT record, then gone.
    (S.PREPARED, R.COMMIT): (S.COMMITTING, XA_OK),
    (S.COMMITTING, R.COMMIT_DURABLE): (S.GONE, XA_OK),
    # Rule 11: rollback of any branch not yet completing; consumed messages come back.
    # Only a PREPARED branch needs a record (XA_ROLLBACK); the others were never written.
    (S.ACTIVE, R.ROLLBACK): (S.GONE, XA_OK),
    (S.IDLE, R.ROLLBACK): (S.GONE, XA_OK),
    (S.SUSPENDED, R.ROLLBACK): (S.GONE, XA_OK),
    (S.ROLLBACK_ONLY, R.ROLLBACK): (S.GONE, XA_OK),
    (S.PREPARED, R.ROLLBACK): (S.ROLLING_BACK, XA_OK),
    (S.ROLLING_BACK, R.ROLLBACK_DURABLE): (S.GONE, XA_OK),
    # Rule 12: an operator completes a PREPARED branch heuristically (XA_HEURISTIC record).
    (S.PREPARED, R.HEURISTIC_COMMIT): (S.HEURISTIC_COMMITTED, XA_OK),
    (S.PREPARED, R.HEURISTIC_ROLLBACK): (S.HEURISTIC_ROLLED_BACK, XA_OK),
    # Rule 13: commit/rollback of a heuristically completed branch report what happened
    # (XA_HEURCOM / XA_HEURRB) and leave it for forget.
    (S.HEURISTIC_COMMITTED, R.COMMIT): (S.HEURISTIC_COMMITTED, XA_HEURCOM),
    (S.HEURISTIC_COMMITTED, R.ROLLBACK): (S.HEURISTIC_COMMITTED, XA_HEURCOM),
    (S.HEURISTIC_ROLLED_BACK, R.COMMIT): (S.HEURISTIC_ROLLED_BACK, XA_HEURRB),
    (S.HEURISTIC_ROLLED_BACK, R.ROLLBACK): (S.HEURISTIC_ROLLED_BACK, XA_HEURRB),
    (S.HEURISTIC_COMMITTED, R.COMMIT_ONE_PHASE): (S.HEURISTIC_COMMITTED, XA_HEURCOM),
    (S.HEURISTIC_ROLLED_BACK, R.COMMIT_ONE_PHASE): (S.HEURISTIC_ROLLED_BACK, XA_HEURRB),
    # Rule 14: forget removes a heuristically completed branch (XA_FORGET record).
    (S.HEURISTIC_COMMITTED, R.FORGET): (S.GONE, XA_OK),
    (S.HEURISTIC_ROLLED_BACK, R.FORGET): (S.GONE, XA_OK),
    # Rule 15: the session of an ACTIVE branch broke: the branch waits SUSPENDED for the
    # client to reattach (start TMRESUME) within the reattach timeout, else it rolls back.
    (S.ACTIVE, R.SESSION_LOST): (S.SUSPENDED, XA_OK),
    # Rule 19: a branch whose timer ran out (see timeout_at) is rolled back; the next
    # request on it gets XA_RBTIMEOUT. Seed 002: the seed's IDLE state (not associated
    # with a session: end TMSUCCESS, TMFAIL "idle, rollback-only", TMSUSPEND "idle,
    # suspended") is rolled back when not prepared, committed or rolled back within the
    # idle timeout; a SUSPENDED branch whose session broke, after the reattach window
    # (rule 15). There is NO row for ACTIVE: an ACTIVE branch "persists as long as the
    # XA session is open" — it never times out.
    (S.IDLE, R.TIMEOUT): (S.GONE, XA_RBTIMEOUT),
    (S.ROLLBACK_ONLY, R.TIMEOUT): (S.GONE, XA_RBTIMEOUT),
    (S.SUSPENDED, R.TIMEOUT): (S.GONE, XA_RBTIMEOUT),
    # Rule 16: replay of an XA_PREPARE record (or of a snapshot's branch) brings a durable
    # branch back PREPARED; a replayed heuristic decision then moves it by rule 12.
    (S.NONE, R.RECOVER): (S.PREPARED, XA_OK),
}

#: States a branch has survived a restart in (and ``recover`` lists).
RECOVERABLE = frozenset({S.PREPARED, S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK})
#: States in which a branch is not prepared yet (a rollback needs no record).
UNPREPARED = frozenset({S.ACTIVE, S.SUSPENDED, S.IDLE, S.ROLLBACK_ONLY})
#: States with a timer (rule 19): those the table lets time out.
TIMED = frozenset(state for state, request in TRANSITIONS if request is R.TIMEOUT)


def rolls_back(code: int) -> bool:
    """True for an XA_RB* code: the branch was rolled back."""
    return XA_RBBASE <= code <= XA_RBEND


def check_association(associated: Xid | None, xid: Xid, request: Request) -> None:
    """Rule 17 (seed 002: one branch per session at a time): a session associated
    with a branch may start no other one; ``start TMJOIN`` of the branch it is
    already associated with is allowed (rule 3 leaves it ACTIVE)."""
    if associated is None or (request is Request.JOIN and associated == xid):
        return
    raise XAError(XAER_PROTO, f"the session is already associated with branch "
                              f"{associated} (one branch per session at a time)")


def check_owner(branch: Branch, session: int, owner_alive: bool) -> None:
    """Rule 18: an ACTIVE branch belongs to its session while that session lives;
    no other session may end or join it."""
    if branch.state is S.ACTIVE and branch.session != session and owner_alive:
        raise XAError(XAER_PROTO, f"branch {branch.xid} is associated with another session")


def prepare_request(branch: Branch) -> Request:
    """Rule 8a: a branch that staged no send and no ack gets the read-only prepare."""
    work = branch.work
    return Request.PREPARE if work.sends or work.acks else Request.PREPARE_READ_ONLY


def timeout_at(branch: Branch, reattach_ms: int) -> int:
    """Rule 19 (seed 002's timers): when a branch is rolled back with XA_RBTIMEOUT, or
    0 for never. A branch in a state the table lets time out (IDLE, ROLLBACK_ONLY,
    SUSPENDED) is timed from when it left its session: by its transaction timeout (the
    idle timeout, ``set_transaction_timeout``) after ``end``, by the reattach window
    after its session broke. ACTIVE and prepared branches have no timer."""
    if branch.state not in TIMED or not branch.idle_since_ms:
        return 0
    return branch.idle_since_ms + (reattach_ms if branch.session_lost else branch.timeout_ms)


def next_state(state: BranchState, request: Request, xid: Xid | str = "") -> tuple[
        BranchState, int]:
    """Look a request up in the table; raise XAError(XAER_PROTO / XAER_NOTA) when it is
    not allowed. Returns ``(next state, XA code)`` (a heuristic code is not raised here)."""
    try:
        return TRANSITIONS[(state, request)]
    except KeyError:
        if state is S.NONE:
            raise XAError(XAER_NOTA, f"unknown Xid {xid}") from None
        raise XAError(XAER_PROTO, f"branch {xid} is {state.value}: cannot "
                                  f"{request.value}") from None


class Branch:
    """One XA branch: its state, association, timers and staged work."""

    __slots__ = ("created_ms", "discards", "error", "idle_since_ms", "prepared_ms", "ref_ids",
                 "session", "session_lost", "state", "timeout_ms", "work", "xid")

    def __init__(self, xid: Xid, session: int, now: int, timeout_ms: int) -> None:
        self.xid = xid
        self.state = S.NONE
        self.session: int | None = session  #: the associated session (ACTIVE), else None
        self.created_ms = now
        #: when its XA_PREPARE was written (0: not prepared; replay takes the record's
        #: ``prepared_ms``, a snapshot's branch its ``created_ms``: records.xa_records)
        self.prepared_ms = 0
        #: the transaction timeout of the XAResource that started it: seed 002's idle
        #: timeout, counted from ``end`` (0: none, a replayed prepared branch)
        self.timeout_ms = timeout_ms
        #: when it left its session (``end``, or the session broke); 0 while ACTIVE
        self.idle_since_ms = 0
        self.session_lost = False  #: it left by its session breaking: the reattach window
        self.work = LocalTransaction(session, 0, is_xa=True)  #: staged sends and acks
        self.discards: set[int] = set()  #: ids of sends not to add at commit (seed rules)
        #: replay: ``[id, delivery count]`` of consumed messages (resolved after replay)
        self.ref_ids: list[list[int]] = []
        self.error = 0  #: XA_RB* reason once the branch is doomed (e.g. over the limit)

    def fire(self, request: Request) -> int:
        """Apply ``request`` (see the table); return the XA code of the reply."""
        self.state, code = next_state(self.state, request, self.xid)
        return code

    @property
    def message_count(self) -> int:
        """Messages tracked by the branch: sent plus consumed (the seed's 256 limit)."""
        return len(self.work.sends) + len(self.work.acks) + len(self.ref_ids)

    def info(self, now: int) -> dict[str, object]:
        """What ``xa list`` and ``recover`` show."""
        return {
            "xid": str(self.xid),
            "state": self.state.value,
            "age_ms": max(0, now - self.created_ms),
            "sent": len(self.work.sends),
            "consumed": len(self.work.acks) + len(self.ref_ids),
            "session": self.session,
        }
