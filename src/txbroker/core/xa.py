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
``start`` TMNOFLAGS of a known Xid is XAER_DUPID. Endpoint checks that fail
(at ``end``, ``prepare``, one-phase ``commit``) roll the branch back with
XA_RB* — that is the engine's job (``core/xa_engine.py``), not the table's.
"""

from __future__ import annotations

from enum import Enum

from txbroker.core.transactions import LocalTransaction
from txbroker.errors import (
    XA_HEURCOM,
    XA_HEURRB,
    XA_OK,
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
    WORK = "work"


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
    # Rule 4: an ACTIVE branch takes work (sends, acks) up to the branch message limit.
    (S.ACTIVE, R.WORK): (S.ACTIVE, XA_OK),
    # Rule 5: end TMSUCCESS ends the work: IDLE (the idle timeout starts). The seed allows
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
    # Rule 9: one-phase commit of an IDLE branch (no prepare): one TX record, then gone.
    (S.IDLE, R.COMMIT_ONE_PHASE): (S.COMMITTING, XA_OK),
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
    # Rule 14: forget removes a heuristically completed branch (XA_FORGET record).
    (S.HEURISTIC_COMMITTED, R.FORGET): (S.GONE, XA_OK),
    (S.HEURISTIC_ROLLED_BACK, R.FORGET): (S.GONE, XA_OK),
    # Rule 15: the session of an ACTIVE branch broke: the branch waits SUSPENDED for the
    # client to reattach (start TMRESUME) within the reattach timeout, else it rolls back.
    (S.ACTIVE, R.SESSION_LOST): (S.SUSPENDED, XA_OK),
}

#: States a branch has survived a restart in (and ``recover`` lists).
RECOVERABLE = frozenset({S.PREPARED, S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK})
#: States in which a branch is still being worked on (the transaction timeout applies).
UNPREPARED = frozenset({S.ACTIVE, S.SUSPENDED, S.IDLE, S.ROLLBACK_ONLY})


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

    __slots__ = ("created_ms", "deadline_ms", "discards", "error", "idle_since_ms", "ref_ids",
                 "session", "state", "timeout_ms", "work", "xid")

    def __init__(self, xid: Xid, session: int, now: int, timeout_ms: int) -> None:
        self.xid = xid
        self.state = S.NONE
        self.session: int | None = session  #: the associated session (ACTIVE), else None
        self.created_ms = now
        self.timeout_ms = timeout_ms
        self.deadline_ms = now + timeout_ms if timeout_ms else 0  #: transaction timeout
        self.idle_since_ms = 0  #: when it became IDLE (idle timeout) or lost its session
        self.work = LocalTransaction(session, 0)  #: staged sends and acks
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
