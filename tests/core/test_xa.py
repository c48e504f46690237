"""XA branches in the broker core: the seed's table row by row, endpoint outcomes,
durability across crashes, timers (tests/core/harness.py). Every case on a broker runs
on the harness's in-memory log and on a real dir store (``FDATASYNC,DSYNC``; issue 17),
except the few that need the log itself (``LOG_ONLY``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.core.harness import Harness, StoreOpener
from txbroker.core import LATER, Limits, records
from txbroker.core.records import Kind
from txbroker.core.xa import (
    TMENDRSCAN,
    TMFAIL,
    TMJOIN,
    TMNOFLAGS,
    TMRESUME,
    TMSTARTRSCAN,
    TMSUCCESS,
    TMSUSPEND,
    TRANSITIONS,
    BranchState,
    Request,
    next_state,
)
from txbroker.errors import (
    XA_HEURCOM,
    XA_HEURRB,
    XA_OK,
    XA_RBOTHER,
    XA_RBROLLBACK,
    XA_RBTIMEOUT,
    XA_RDONLY,
    XAER_DUPID,
    XAER_INVAL,
    XAER_NOTA,
    XAER_PROTO,
    XAError,
)
from txbroker.storage.interface import StoredEntry
from txbroker.xid import Xid

X1 = str(Xid(0, b"g1", b"b1"))
X2 = str(Xid(0, b"g2", b"b1"))


def code_of(call: Any) -> int:
    with pytest.raises(XAError) as info:
        call()
    return info.value.errcode


class XA:
    """Shortcuts over a Harness for one session."""

    def __init__(self, h: Harness, sid: int = 1) -> None:
        self.h, self.sid = h, sid
        self.rid = 1000 * sid
        if sid not in h.broker.sessions:
            h.session(sid)

    def _rid(self) -> int:
        self.rid += 1
        return self.rid

    def start(self, xid: str = X1, flags: int = TMNOFLAGS) -> Any:
        return self.h.call("xa_start", self.sid, xid, flags, self.h.now)

    def end(self, xid: str = X1, flags: int = TMSUCCESS) -> Any:
        return self.h.call("xa_end", self.sid, xid, flags, self.h.now)

    def _later(self, method: str, *args: Any) -> Any:
        rid = self._rid()
        result = self.h.call(method, self.sid, rid, *args, self.h.now)
        if result is LATER:
            if (self.sid, rid) in self.h.errors:
                raise self.h.errors[(self.sid, rid)]
            return self.h.replies.get((self.sid, rid), LATER)
        return result

    def prepare(self, xid: str = X1) -> Any:
        return self._later("xa_prepare", xid)

    def commit(self, xid: str = X1, one_phase: bool = False) -> Any:
        return self._later("xa_commit", xid, one_phase)

    def rollback(self, xid: str = X1) -> Any:
        return self._later("xa_rollback", xid)

    def heuristic(self, xid: str = X1, commit: bool = True) -> Any:
        return self._later("xa_heuristic", xid, commit)

    def forget(self, xid: str = X1) -> Any:
        return self._later("xa_forget", xid)

    def recover(self, flags: int = TMSTARTRSCAN | TMENDRSCAN) -> list[str]:
        result: list[str] = self.h.call("xa_recover", self.sid, flags)
        return result

    def send(self, queue: str, body: bytes) -> Any:
        return self.h.send(self.sid, self._rid(), queue, body)

    def take(self, queue: str) -> Any:
        """Receive one message and ack it (inside the associated branch, if any)."""
        d = self.h.receive_marked(self.sid, self._rid(), queue)
        assert d is not None and d is not LATER, f"nothing in {queue}"
        self.h.call("ack", self.sid, 0, [d.tag], self.h.now)
        return d

    def state(self, xid: str = X1) -> str:
        branch = self.h.broker.branches.get(Xid.parse(xid))
        return "gone" if branch is None else branch.state.value


def depth(h: Harness, queue: str) -> int:
    q = h.broker.queues.get(queue)
    return 0 if q is None else q.ready_count


def bodies(h: Harness, queue: str, sid: int = 99) -> list[bytes]:
    if sid not in h.broker.sessions:
        h.session(sid)
    found = []
    for i in range(1000):
        d = h.receive(sid, 50_000 + len(h.replies) + i, queue)
        if d is None:
            return found
        h.call("ack", sid, 0, [d.tag], h.now)
        found.append(d.body)
    return found


#: Where the durable log lives (issue 17): the harness's in-memory log, and a real
#: dir store (``FDATASYNC,DSYNC``) under the broker, crashes included.
STORES = ["log", "dir"]
#: For the cases that need the log itself (they edit it, or relocate bodies, which the
#: dir store never asks for).
LOG_ONLY = pytest.mark.parametrize("store", ["log"], indirect=True)


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreOpener | None]:
    """None for the in-memory log, else the opener of the store the harness runs on."""
    if request.param == "log":
        yield None
        return
    opener = StoreOpener(request.param, tmp_path / "store")
    try:
        yield opener
    finally:
        opener.close()


@pytest.fixture
def h(store: StoreOpener | None) -> Harness:
    return Harness(store=store)


# ---------------------------------------------------------------- the pure table
#: The whole state table written out here, independently of core/xa.py, from seed 002's
#: table, DESIGN.md's and the rules the broker adds (TMJOIN, read-only prepare, replay):
#: (state, request) -> (state after, XA code). Every other pair must be refused.
EXPECTED_TABLE: dict[tuple[str, str], tuple[str, int]] = {
    ("none", "START"): ("active", XA_OK),
    ("suspended", "RESUME"): ("active", XA_OK),
    ("active", "JOIN"): ("active", XA_OK),
    ("idle", "JOIN"): ("active", XA_OK),
    ("active", "END_SUCCESS"): ("idle", XA_OK),
    ("idle", "END_SUCCESS"): ("idle", XA_OK),
    ("suspended", "END_SUCCESS"): ("idle", XA_OK),
    ("active", "END_SUSPEND"): ("suspended", XA_OK),
    ("active", "END_FAIL"): ("rollback_only", XA_OK),
    ("idle", "END_FAIL"): ("rollback_only", XA_OK),
    ("suspended", "END_FAIL"): ("rollback_only", XA_OK),
    ("idle", "PREPARE"): ("preparing", XA_OK),
    ("preparing", "PREPARE_DURABLE"): ("prepared", XA_OK),
    ("idle", "PREPARE_READ_ONLY"): ("gone", XA_RDONLY),
    ("rollback_only", "PREPARE"): ("gone", XA_RBROLLBACK),
    ("rollback_only", "PREPARE_READ_ONLY"): ("gone", XA_RBROLLBACK),
    ("idle", "COMMIT_ONE_PHASE"): ("committing", XA_OK),
    ("rollback_only", "COMMIT_ONE_PHASE"): ("gone", XA_RBROLLBACK),
    ("prepared", "COMMIT"): ("committing", XA_OK),
    ("committing", "COMMIT_DURABLE"): ("gone", XA_OK),
    # replicated HA: a backup voted fail on a one-phase commit (rule 9b)
    ("committing", "VOTE_FAILED"): ("rolling_back", XA_RBROLLBACK),
    ("active", "ROLLBACK"): ("gone", XA_OK),
    ("idle", "ROLLBACK"): ("gone", XA_OK),
    ("suspended", "ROLLBACK"): ("gone", XA_OK),
    ("rollback_only", "ROLLBACK"): ("gone", XA_OK),
    ("prepared", "ROLLBACK"): ("rolling_back", XA_OK),
    ("rolling_back", "ROLLBACK_DURABLE"): ("gone", XA_OK),
    ("prepared", "HEURISTIC_COMMIT"): ("heuristic_committed", XA_OK),
    ("prepared", "HEURISTIC_ROLLBACK"): ("heuristic_rolled_back", XA_OK),
    ("heuristic_committed", "COMMIT"): ("heuristic_committed", XA_HEURCOM),
    ("heuristic_committed", "COMMIT_ONE_PHASE"): ("heuristic_committed", XA_HEURCOM),
    ("heuristic_committed", "ROLLBACK"): ("heuristic_committed", XA_HEURCOM),
    ("heuristic_rolled_back", "COMMIT"): ("heuristic_rolled_back", XA_HEURRB),
    ("heuristic_rolled_back", "COMMIT_ONE_PHASE"): ("heuristic_rolled_back", XA_HEURRB),
    ("heuristic_rolled_back", "ROLLBACK"): ("heuristic_rolled_back", XA_HEURRB),
    ("heuristic_committed", "FORGET"): ("gone", XA_OK),
    ("heuristic_rolled_back", "FORGET"): ("gone", XA_OK),
    ("active", "SESSION_LOST"): ("suspended", XA_OK),
    # seed 002: the IDLE state ("idle", "idle, rollback-only", "idle, suspended") is
    # rolled back after the idle timeout; an ACTIVE branch "persists as long as the XA
    # session is open": no ("active", "TIMEOUT") row
    ("idle", "TIMEOUT"): ("gone", XA_RBTIMEOUT),
    ("rollback_only", "TIMEOUT"): ("gone", XA_RBTIMEOUT),
    ("suspended", "TIMEOUT"): ("gone", XA_RBTIMEOUT),
    ("none", "RECOVER"): ("prepared", XA_OK),
}
ALL_PAIRS = [(s, r) for s in BranchState for r in Request]


def test_expected_table_names_real_states_and_requests() -> None:
    names = {(s.value, r.name) for s, r in ALL_PAIRS}
    assert set(EXPECTED_TABLE) <= names
    assert {after for after, _ in EXPECTED_TABLE.values()} <= {s.value for s in BranchState}


@pytest.mark.parametrize(("state", "request_"), ALL_PAIRS,
                         ids=[f"{s.value}-{r.name}" for s, r in ALL_PAIRS])
def test_table_answers_every_state_and_request(state: BranchState, request_: Request) -> None:
    expected = EXPECTED_TABLE.get((state.value, request_.name))
    if expected is not None:
        after, code = next_state(state, request_)
        assert (after.value, code) == expected
    else:
        want = XAER_NOTA if state is BranchState.NONE else XAER_PROTO
        assert code_of(lambda: next_state(state, request_, "x")) == want


def test_table_has_no_rule_the_spec_lacks() -> None:
    """A row added to core/xa.py must be added to EXPECTED_TABLE too (with a reason)."""
    assert {(s.value, r.name) for s, r in TRANSITIONS} == set(EXPECTED_TABLE)


def test_rollback_allowed_states() -> None:
    for state in ("active", "idle", "suspended", "rollback_only"):
        assert next_state(BranchState(state), Request.ROLLBACK)[0] is BranchState.GONE
    assert next_state(BranchState.PREPARED, Request.ROLLBACK)[0] is BranchState.ROLLING_BACK
    assert next_state(BranchState.HEURISTIC_COMMITTED, Request.ROLLBACK)[1] == XA_HEURCOM
    assert next_state(BranchState.HEURISTIC_ROLLED_BACK, Request.COMMIT)[1] == XA_HEURRB


# ---------------------------------------------------------------- requests on the broker
def test_two_phase_commit_of_send_and_consume(h: Harness) -> None:
    setup = XA(h, 2)
    setup.send("in", b"order")
    x = XA(h)
    assert x.start() == {}
    assert x.state() == "active"
    x.take("in")
    x.send("out", b"reply")
    assert depth(h, "out") == 0 and depth(h, "in") == 0
    assert x.end() == {} and x.state() == "idle"
    assert x.prepare() == {"vote": XA_OK} and x.state() == "prepared"
    assert x.recover() == [X1]
    assert x.commit() == {} and x.state() == "gone"
    assert bodies(h, "out") == [b"reply"] and bodies(h, "in") == []
    assert x.recover() == []


def test_rollback_redelivers_consumed_and_drops_sent(h: Harness) -> None:
    XA(h, 2).send("in", b"m")
    x = XA(h)
    x.start()
    x.take("in")
    x.send("out", b"never")
    x.end()
    x.prepare()
    assert x.rollback() == {}
    got = h.receive(99 if 99 in h.broker.sessions else h.session(99), 1, "in")
    assert got.body == b"m" and got.redelivered
    assert bodies(h, "out") == []


@pytest.mark.parametrize("state", ["active", "idle", "suspended", "rollback_only"])
def test_rollback_of_unprepared_branch_in_each_state(h: Harness, state: str) -> None:
    XA(h, 2).send("in", b"m")
    x = XA(h)
    x.start()
    x.take("in")
    if state == "idle":
        x.end()
    elif state == "suspended":
        x.end(flags=TMSUSPEND)
    elif state == "rollback_only":
        x.end(flags=TMFAIL)
    assert x.state() == state
    assert x.rollback() == {} and x.state() == "gone"
    assert bodies(h, "in") == [b"m"]


def test_one_phase_commit_of_idle_branch(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.send("out", b"1pc")
    x.end()
    assert x.commit(one_phase=True) == {}
    assert x.state() == "gone" and bodies(h, "out") == [b"1pc"]


def test_suspend_and_resume_then_join(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.send("out", b"a")
    x.end(flags=TMSUSPEND)
    assert x.state() == "suspended"
    x.send("out", b"outside")  # not in the branch: committed at once
    assert code_of(lambda: x.start(flags=TMJOIN)) == XAER_PROTO  # suspended: resume only
    x.start(flags=TMRESUME)
    x.send("out", b"b")
    x.end()
    other = XA(h, 3)
    other.start(flags=TMJOIN)  # we support TMJOIN (the seed's broker does not)
    other.send("out", b"c")
    other.end()
    x.prepare()
    x.commit()
    assert bodies(h, "out") == [b"outside", b"a", b"b", b"c"]


def test_errors_are_xa_codes(h: Harness) -> None:
    x = XA(h)
    assert code_of(lambda: x.end()) == XAER_NOTA
    assert code_of(lambda: x.prepare()) == XAER_NOTA
    assert code_of(lambda: x.commit()) == XAER_NOTA
    assert code_of(lambda: x.start(flags=TMRESUME)) == XAER_NOTA
    assert code_of(lambda: x.start("garbage")) == XAER_INVAL
    assert code_of(lambda: x.start(flags=TMSUCCESS)) == XAER_INVAL
    x.start()
    assert code_of(lambda: x.start(X2)) == XAER_PROTO  # one branch per session
    assert code_of(lambda: XA(h, 2).start()) == XAER_DUPID
    assert code_of(lambda: x.prepare()) == XAER_PROTO  # ACTIVE: end first
    assert code_of(lambda: x.commit()) == XAER_PROTO
    assert code_of(lambda: x.end(flags=12345)) == XAER_INVAL
    x.end()
    assert code_of(lambda: x.commit()) == XAER_PROTO  # two-phase commit needs prepare
    assert code_of(lambda: x.end(flags=TMSUSPEND)) == XAER_PROTO
    assert code_of(lambda: x.recover(0x10)) == XAER_INVAL


def test_end_fail_makes_rollback_only(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.send("out", b"m")
    x.end(flags=TMFAIL)
    assert x.state() == "rollback_only"
    assert code_of(lambda: x.prepare()) == XA_RBROLLBACK
    assert x.state() == "gone" and bodies(h, "out") == []


def test_empty_branch_prepares_read_only(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.end()
    assert x.prepare() == {"vote": XA_RDONLY}
    assert x.state() == "gone" and not [e for e in h.log if e[0] == Kind.XA_PREPARE]


def test_branch_message_limit(store: StoreOpener | None) -> None:
    h = Harness(Limits(max_xa_branch_messages=3), store=store)
    x = XA(h)
    x.start()
    for i in range(3):
        x.send("out", b"%d" % i)
    assert code_of(lambda: x.send("out", b"too many")) == XA_RBOTHER
    assert code_of(lambda: x.end()) == XA_RBOTHER
    assert x.state() == "rollback_only"
    x.rollback()
    assert bodies(h, "out") == []


def test_heuristic_commit_rollback_and_forget(h: Harness) -> None:
    for xid, commit in ((X1, True), (X2, False)):
        x = XA(h, 1 if commit else 2)
        x.start(xid)
        x.send("out", b"c" if commit else b"r")
        x.end(xid)
        x.prepare(xid)
        assert x.heuristic(xid, commit) == {}
    assert sorted(XA(h).recover()) == sorted([X1, X2])
    assert XA(h).state(X1) == "heuristic_committed"
    assert XA(h).state(X2) == "heuristic_rolled_back"
    assert bodies(h, "out") == [b"c"]
    assert code_of(lambda: XA(h).commit(X1)) == XA_HEURCOM
    assert code_of(lambda: XA(h).rollback(X2)) == XA_HEURRB
    h2 = h.crash()
    assert sorted(XA(h2).recover()) == sorted([X1, X2])
    assert XA(h2).state(X1) == "heuristic_committed"
    XA(h2).forget(X1)
    XA(h2).forget(X2)
    assert XA(h2).recover() == []
    assert XA(h2.crash()).recover() == []


#: Far past any timer a branch could have: an ACTIVE branch must still be there (seed 002).
AN_HOUR_MS = 3_600_000


def test_active_branch_persists_while_its_session_is_open(h: Harness) -> None:
    """Seed 002: an ACTIVE branch "persists as long as the XA session is open"; the
    transaction timeout of the XAResource is an idle timeout, not a deadline from start."""
    XA(h, 2).send("in", b"m")
    x = XA(h)
    assert h.call("xa_get_timeout", 1) == {"seconds": 180}
    h.call("xa_set_timeout", 1, 5)
    x.start()
    x.take("in")
    assert h.broker.next_wakeup() is None  # no timer on an ACTIVE branch
    h.tick(AN_HOUR_MS)
    assert x.state() == "active"
    x.end()
    assert x.state() == "idle"
    x.prepare()
    x.commit()
    assert bodies(h, "in") == []


def test_transaction_timeout_is_the_idle_timeout(h: Harness) -> None:
    """The timeout set by set_transaction_timeout runs from ``end``: an IDLE branch not
    prepared, committed or rolled back within it is rolled back (XA_RBTIMEOUT next)."""
    XA(h, 2).send("in", b"m")
    x = XA(h)
    h.call("xa_set_timeout", 1, 5)
    x.start()
    x.take("in")
    h.tick(60_000)  # ACTIVE for a minute: the idle clock has not started
    x.end()
    h.tick(4_999)
    assert x.state() == "idle"
    h.tick(2)
    assert x.state() == "gone"
    assert code_of(lambda: x.prepare()) == XA_RBTIMEOUT
    assert bodies(h, "in") == [b"m"]
    assert h.call("xa_set_timeout", 1, 0) == {"seconds": 180}  # 0 restores the default


def test_default_idle_timeout_is_180_seconds(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.send("out", b"m")
    h.tick(AN_HOUR_MS)
    x.end()
    h.tick(179_999)
    assert x.state() == "idle"
    h.tick(2)
    assert x.state() == "gone"
    assert code_of(lambda: x.commit(one_phase=True)) == XA_RBTIMEOUT
    assert bodies(h, "out") == []


@pytest.mark.parametrize(("flags", "state"), [(TMFAIL, "rollback_only"),
                                              (TMSUSPEND, "suspended")])
def test_every_idle_state_has_the_idle_timeout(h: Harness, flags: int, state: str) -> None:
    """Seed 002's IDLE covers end(TMFAIL) ("idle, rollback-only") and end(TMSUSPEND)
    ("idle, suspended"): both are rolled back after the idle timeout."""
    x = XA(h)
    h.call("xa_set_timeout", 1, 2)
    x.start()
    x.send("out", b"m")
    h.tick(1_500)  # ACTIVE: not counted
    x.end(flags=flags)
    h.tick(1_999)
    assert x.state() == state
    h.tick(2)
    assert x.state() == "gone"
    assert code_of(lambda: x.rollback()) == XA_RBTIMEOUT


def test_resumed_branch_is_active_again_without_a_timer(h: Harness) -> None:
    x = XA(h)
    h.call("xa_set_timeout", 1, 2)
    x.start()
    x.end(flags=TMSUSPEND)
    h.tick(1_500)
    x.start(flags=TMRESUME)
    h.tick(AN_HOUR_MS)
    assert x.state() == "active"
    x.end()
    h.tick(1_999)
    assert x.state() == "idle"


def test_broken_session_keeps_the_reattach_window_whatever_the_timeout(
        store: StoreOpener | None) -> None:
    """The reattach window (3 minutes) is not the transaction timeout: a branch whose
    session broke waits for it even when its idle timeout is shorter."""
    h = Harness(Limits(xa_reattach_ms=180_000), store=store)
    x = XA(h)
    h.call("xa_set_timeout", 1, 1)
    x.start()
    x.send("out", b"m")
    h.call("close_session", 1, h.now)
    h.tick(179_999)
    assert x.state() == "suspended"
    h.tick(2)
    assert x.state() == "gone"


def test_broken_session_may_reattach_within_the_reattach_time(
        store: StoreOpener | None) -> None:
    h = Harness(Limits(xa_reattach_ms=3_000), store=store)
    XA(h, 2).send("in", b"m")
    x = XA(h)
    x.start()
    x.take("in")
    h.call("close_session", 1, h.now)
    assert x.state() == "suspended"
    h.tick(2_000)
    y = XA(h, 3)
    y.start(flags=TMRESUME)
    y.end()
    y.prepare()
    y.commit()
    assert bodies(h, "in") == []
    # and without reattaching, the broker rolls the branch back
    XA(h, 2).send("in", b"n")
    z = XA(h, 4)
    z.start(X2)
    z.take("in")
    h.call("close_session", 4, h.now)
    h.tick(3_001)
    assert z.state(X2) == "gone" and bodies(h, "in") == [b"n"]


# ---------------------------------------------------------------- endpoint outcomes
def _branch_sending_to(h: Harness, queue: str, settings: dict[str, Any] | None = None) -> XA:
    h.call("queue_declare", 9 if 9 in h.broker.sessions else h.session(9), 1, queue, h.now,
           settings=settings or {})
    x = XA(h)
    x.start()
    x.send(queue, b"m")
    x.end()
    return x


def _update(h: Harness, queue: str, **settings: Any) -> None:
    h.call("queue_update", 9, 2, queue, settings, h.now)


def _delete(h: Harness, queue: str) -> None:
    h.call("queue_delete", 9, 3, queue, h.now)


@pytest.mark.parametrize("reject", [True, False])
def test_prepare_with_target_shut_down(h: Harness, reject: bool) -> None:
    x = _branch_sending_to(h, "t", {"reject_to_sender_on_discard": reject})
    _update(h, "t", ingress=False)
    if reject:
        assert code_of(lambda: x.prepare()) == XA_RBROLLBACK and x.state() == "gone"
    else:
        assert x.prepare() == {"vote": XA_OK}
        _update(h, "t", ingress=True)
        x.commit()
        assert bodies(h, "t") == []  # committed, the message was not added


@pytest.mark.parametrize("reject", [True, False])
def test_prepare_with_target_over_quota(h: Harness, reject: bool) -> None:
    x = _branch_sending_to(h, "t", {"reject_to_sender_on_discard": reject})
    XA(h, 2).send("t", b"other")
    _update(h, "t", max_messages=1)
    if reject:
        assert code_of(lambda: x.prepare()) == XA_RBROLLBACK
    else:
        assert x.prepare() == {"vote": XA_OK}
        x.commit()
        assert bodies(h, "t") == [b"other"]


def test_prepare_quota_ignores_other_prepared_branches(h: Harness) -> None:
    h.call("queue_declare", h.session(9), 1, "t", h.now, settings={"max_messages": 1})
    for sid, xid in ((1, X1), (2, X2)):
        x = XA(h, sid)
        x.start(xid)
        x.send("t", b"%d" % sid)
        x.end(xid)
    assert XA(h, 1).prepare(X1) == {"vote": XA_OK}
    assert XA(h, 2).prepare(X2) == {"vote": XA_OK}  # X1's message is not counted


def test_prepare_with_target_deleted(h: Harness) -> None:
    x = _branch_sending_to(h, "t")
    _delete(h, "t")
    assert code_of(lambda: x.prepare()) == XA_RBROLLBACK


@pytest.mark.parametrize("what", ["shut", "deleted", "over_quota"])
def test_prepare_with_consumed_queue_unavailable(h: Harness, what: str) -> None:
    h.call("queue_declare", h.session(9), 1, "in", h.now)
    XA(h, 2).send("in", b"m")
    XA(h, 2).send("in", b"n")
    x = XA(h)
    x.start()
    x.take("in")
    x.end()
    if what == "shut":
        _update(h, "in", egress=False)
    elif what == "deleted":
        _delete(h, "in")
    else:
        _update(h, "in", max_messages=1)
    assert code_of(lambda: x.prepare()) == XA_RBROLLBACK and x.state() == "gone"


@pytest.mark.parametrize("what", ["shut", "deleted"])
def test_end_with_consumed_queue_unavailable_is_rollback_only(h: Harness, what: str) -> None:
    h.call("queue_declare", h.session(9), 1, "in", h.now)
    XA(h, 2).send("in", b"m")
    x = XA(h)
    x.start()
    x.take("in")
    if what == "shut":
        _update(h, "in", egress=False)
    else:
        _delete(h, "in")
    assert code_of(lambda: x.end()) == XA_RBROLLBACK
    assert x.state() == "rollback_only"
    x.rollback()


@pytest.mark.parametrize(("what", "reject", "outcome"), [
    ("shut", True, "rolled_back"), ("shut", False, "committed_dropped"),
    ("deleted", True, "rolled_back"), ("deleted", False, "rolled_back"),
])
def test_one_phase_commit_endpoint_outcomes(h: Harness, what: str, reject: bool,
                                            outcome: str) -> None:
    x = _branch_sending_to(h, "t", {"reject_to_sender_on_discard": reject})
    if what == "shut":
        _update(h, "t", ingress=False)
    else:
        _delete(h, "t")
    if outcome == "rolled_back":
        assert code_of(lambda: x.commit(one_phase=True)) == XA_RBROLLBACK
    else:
        assert x.commit(one_phase=True) == {}
        _update(h, "t", ingress=True)
        assert bodies(h, "t") == []
    assert x.state() == "gone"


@pytest.mark.parametrize("what", ["shut", "deleted"])
def test_two_phase_commit_endpoint_outcomes_commit_without_the_message(
        h: Harness, what: str) -> None:
    x = _branch_sending_to(h, "t")
    x.prepare()
    if what == "shut":
        _update(h, "t", ingress=False)
    else:
        _delete(h, "t")
    assert x.commit() == {}
    if what == "shut":
        _update(h, "t", ingress=True)
    assert bodies(h, "t") == []


# ---------------------------------------------------------------- durability
def _prepared(h: Harness) -> XA:
    XA(h, 2).send("in", b"consumed")
    x = XA(h)
    x.start()
    x.take("in")
    x.send("out", b"sent")
    x.end()
    assert x.prepare() == {"vote": XA_OK}
    return x


@pytest.mark.parametrize("commit", [True, False])
def test_prepared_branch_survives_a_crash(h: Harness, commit: bool) -> None:
    _prepared(h)
    h2 = h.crash()
    x = XA(h2)
    assert x.recover() == [X1] and x.state() == "prepared"
    assert bodies(h2, "in") == [] and bodies(h2, "out") == []  # held, not visible
    if commit:
        x.commit()
    else:
        x.rollback()
    want_in, want_out = ([], [b"sent"]) if commit else ([b"consumed"], [])
    # before the restart: counted only (consuming them would change what survives it)
    assert XA(h2).recover() == []
    assert (depth(h2, "in"), depth(h2, "out")) == (len(want_in), len(want_out))
    assert h2.broker.queues["in"].messages == len(want_in)
    h3 = h2.crash()
    assert XA(h3).recover() == []
    assert bodies(h3, "in", 97) == want_in
    assert bodies(h3, "out", 97) == want_out
    assert h3.broker.queues["in"].messages == 0


def test_unprepared_branch_is_gone_after_a_crash(h: Harness) -> None:
    XA(h, 2).send("in", b"m")
    x = XA(h)
    x.start()
    x.take("in")
    x.send("out", b"s")
    x.end()
    h2 = h.crash()
    assert XA(h2).recover() == [] and bodies(h2, "in") == [b"m"] and bodies(h2, "out") == []


def test_prepare_not_durable_is_not_prepared_after_crash(store: StoreOpener | None
                                                        ) -> None:
    h = Harness(auto_sync=False, store=store)
    XA(h, 2).send("in", b"m")
    h.sync()
    x = XA(h)
    x.start()
    x.take("in")
    x.end()
    assert x.prepare() is LATER
    assert x.state() == "preparing"
    assert code_of(lambda: x.commit()) == XAER_PROTO
    h2 = h.crash()
    assert XA(h2).recover() == [] and bodies(h2, "in") == [b"m"]


@LOG_ONLY  # edits the log: segment deletion is the journal's
def test_prepared_branch_survives_segment_deletion_via_snapshot(h: Harness) -> None:
    _prepared(h)
    kind, meta = h.broker.snapshot()
    # the store deleted every older segment except those holding live bodies: here the
    # ADD of the consumed message and the XA_PREPARE holding the branch's sent body
    keep = [e for e in h.log if e[0] in (Kind.ADD, Kind.TX, Kind.XA_PREPARE) and e[2]]
    assert [e[0] for e in keep] == [Kind.ADD, Kind.XA_PREPARE]
    h.log = [*keep, (kind, meta, [])]
    h2 = h.crash()
    x = XA(h2)
    assert x.recover() == [X1]
    assert bodies(h2, "in") == []
    x.commit()
    assert bodies(h2, "out") == [b"sent"] and bodies(h2, "in") == []


@LOG_ONLY  # edits the log: segment deletion is the journal's
def test_snapshot_carries_only_branches_no_stored_body_keeps(h: Harness) -> None:
    consumer, sender = str(Xid(0, b"consumes", b"b")), str(Xid(0, b"sends", b"b"))
    XA(h, 2).send("in", b"c")
    x = XA(h)
    x.start(consumer)
    x.take("in")
    x.end(consumer)
    assert x.prepare(consumer) == {"vote": XA_OK}
    x.start(sender)
    x.send("out", b"sent")
    x.end(sender)
    assert x.prepare(sender) == {"vote": XA_OK}
    kind, meta = h.broker.snapshot()
    # the consumer's XA_PREPARE has no body to keep its segment: the snapshot carries it;
    # the sender's is kept by its body and stays out (a sink branch holds 50,000)
    assert set(records.unpack(meta)["xa"]) == {consumer}
    # the store deleted every segment without a live body, then wrote the snapshot
    h.log = [e for e in h.log if e[0] in (Kind.ADD, Kind.XA_PREPARE) and e[2]] + [
        (kind, meta, [])]
    h2 = h.crash()
    x2 = XA(h2)
    assert sorted(x2.recover()) == sorted([consumer, sender])
    x2.commit(consumer)
    x2.commit(sender)
    assert bodies(h2, "out") == [b"sent"] and bodies(h2, "in") == []


@LOG_ONLY  # relocation: the dir store never asks for it
def test_consumed_message_of_prepared_branch_is_not_relocated(h: Harness) -> None:
    _prepared(h)
    live = h.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h.log])
    assert live == []
    h2 = h.crash()
    live = h2.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h2.log])
    assert live == []


@LOG_ONLY  # relocation: the dir store refuses RELOCATE
def test_committed_xa_sends_can_be_relocated(h: Harness) -> None:
    x = _prepared(h)
    x.commit()
    live = h.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h.log])
    assert len(live) == 1
    mid, ref = live[0]
    h.call("relocate_many", [(mid, ref)], [h.bodies[ref]])
    assert bodies(h.crash(), "out") == [b"sent"]


def test_xa_list_shows_state_age_and_counts(h: Harness) -> None:
    _prepared(h)
    h.now += 1500
    (info,) = h.broker.xa_list(h.now)
    assert info["xid"] == X1 and info["state"] == "prepared"
    assert info["sent"] == 1 and info["consumed"] == 1 and info["age_ms"] >= 1500


# ---------------------------------------------------------------- named checks (core/xa.py)
def test_join_of_own_branch_keeps_working_on_it(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.send("out", b"a")
    assert x.start(flags=TMJOIN) == {}  # rule 17: joining the branch it works on
    assert x.state() == "active"
    x.send("out", b"b")
    assert code_of(lambda: x.start(X2)) == XAER_PROTO  # one branch per session
    assert code_of(lambda: x.start(flags=TMRESUME)) == XAER_PROTO
    x.end()
    x.prepare()
    x.commit()
    assert bodies(h, "out") == [b"a", b"b"]


def test_one_phase_commit_of_rollback_only_branch_rolls_it_back(h: Harness) -> None:
    XA(h, 2).send("in", b"m")
    x = XA(h)
    x.start()
    x.take("in")
    x.send("out", b"never")
    x.end(flags=TMFAIL)
    assert code_of(lambda: x.commit(one_phase=True)) == XA_RBROLLBACK
    assert x.state() == "gone"
    assert bodies(h, "out") == [] and bodies(h, "in") == [b"m"]


def test_two_phase_commit_of_rollback_only_branch_is_a_protocol_error(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.send("out", b"m")
    x.end(flags=TMFAIL)
    assert code_of(lambda: x.commit()) == XAER_PROTO
    assert x.state() == "rollback_only"


def test_one_phase_commit_of_heuristic_branch_reports_the_heuristic(h: Harness) -> None:
    x = XA(h)
    x.start()
    x.send("out", b"m")
    x.end()
    x.prepare()
    x.heuristic(commit=False)
    assert code_of(lambda: x.commit(one_phase=True)) == XA_HEURRB
    assert x.state() == "heuristic_rolled_back"


def test_nack_inside_a_branch_is_not_staged(h: Harness) -> None:
    """Decision (docs/xa.md): a nack gives the delivery up at once, in or out of an XA
    branch; the branch's rollback or commit does not touch it, nor does it count
    against the branch's message limit."""
    setup = XA(h, 2)
    h.call("queue_declare", 2, 1, "in", h.now, settings={"dead_letter_queue": "dlq"})
    setup.send("in", b"again")
    setup.send("in", b"dead")
    x = XA(h)
    x.start()
    first = h.receive(1, 1, "in")
    h.call("nack", 1, [first.tag], h.now)
    second = h.receive(1, 2, "in")
    assert second.body == b"again" and second.redelivered  # redelivered at once
    h.call("ack", 1, 0, [second.tag], h.now)  # staged in the branch
    third = h.receive(1, 3, "in")
    assert third.body == b"dead"
    h.call("nack", 1, [third.tag], h.now, requeue=False)
    assert bodies(h, "dlq") == [b"dead"]  # dead-lettered at once
    assert h.broker.branches[Xid.parse(X1)].message_count == 1  # only the ack
    x.end()
    x.rollback()
    assert bodies(h, "in") == [b"again"]  # the ack rolled back; the nacks stand


# ---------------------------------------------------------------- duplicate window
def test_prepared_sends_stay_in_the_duplicate_window_across_a_restart(h: Harness) -> None:
    x = XA(h)
    x.start()
    assert h.send(1, 5, "out", b"m", message_id="order-1") == {"duplicate": False}
    x.end()
    assert x.prepare() == {"vote": XA_OK}
    h = h.crash()
    x = XA(h)
    # before the commit: a retry of the same message is a duplicate, not a second copy
    assert h.send(1, 6, "out", b"m", message_id="order-1") == {"duplicate": True}
    assert x.commit() == {}
    assert h.send(1, 7, "out", b"m", message_id="order-1") == {"duplicate": True}
    assert bodies(h, "out") == [b"m"]


def test_rolled_back_prepared_send_leaves_the_window_after_a_restart(h: Harness) -> None:
    x = XA(h)
    x.start()
    h.send(1, 5, "out", b"m", message_id="order-2")
    x.end()
    x.prepare()
    h = h.crash()
    x = XA(h)
    x.rollback()
    assert h.send(1, 6, "out", b"m", message_id="order-2") == {"duplicate": False}
    assert bodies(h, "out") == [b"m"]
