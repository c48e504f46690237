"""A local transaction's voted commit (core/local_tx.py, "Voted commit"; issue 28 §3,
seed 001): on a replicated primary the commit is an internal branch's XA_PREPARE that
the backups vote on, then XA_COMMIT — or XA_ROLLBACK and TransactionRolledBack when
a backup voted fail. Recovery commits an internal branch without an outcome
(presumed commit). A one-phase XA commit is voted the same way (rule 9b of
core/xa.py). Without the flag (single broker, shared store) either is one TX."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from tests.core.test_xa import X1, XA, bodies
from txbroker.core import LATER
from txbroker.core.records import Kind
from txbroker.errors import (
    XA_RBROLLBACK,
    XAER_INVAL,
    ReplicaVoteFailed,
    TransactionRolledBack,
    XAError,
)
from txbroker.xid import LOCAL_TX_FORMAT_ID, Xid

#: xa_recover flags: TMSTARTRSCAN | TMENDRSCAN
SCAN = 0x01800000


def voted(h: Harness) -> Harness:
    h.broker.vote_local_commits(True)
    return h


def staged(h: Harness, s: int = 1) -> int:
    """A transaction of session ``s`` that consumed ``in``'s "request" and sends
    "reply" to ``out`` (not committed yet); returns its id."""
    h.session(s)
    h.send(s, 1, "in", b"request")
    h.sync()
    d = h.receive_marked(s, 2, "in")
    tx: int = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, [d.tag], h.now, tx=tx)
    h.send(s, 3, "out", b"reply", tx=tx)
    return tx


def kinds(h: Harness, since: int = 0) -> list[int]:
    return [kind for kind, _, _ in h.log[since:]]


def test_without_the_flag_a_commit_is_one_tx_record() -> None:
    h = Harness()
    tx = staged(h)
    before = len(h.log)
    h.call("tx_commit", 1, 5, tx, h.now)
    assert h.replies[(1, 5)] == {}
    assert kinds(h, before) == [Kind.TX]


def test_a_voted_commit_is_a_prepare_then_a_commit() -> None:
    h = voted(Harness())
    tx = staged(h)
    before = len(h.log)
    assert h.call("tx_commit", 1, 5, tx, h.now) is LATER
    assert h.replies[(1, 5)] == {}
    assert kinds(h, before) == [Kind.XA_PREPARE, Kind.XA_COMMIT]
    assert h.broker.xa_recover(1, SCAN) == [] and h.broker.xa_list(h.now) == []
    assert bodies(h, "out") == [b"reply"] and bodies(h, "in") == []
    after = h.crash()  # the log replays to the same state
    assert bodies(after, "out") == [] and bodies(after, "in") == []


def test_the_reply_waits_for_the_vote_not_for_the_commit_record() -> None:
    h = voted(Harness(auto_sync=False))
    tx = staged(h)
    h.sync()
    h.call("tx_commit", 1, 5, tx, h.now)
    [(prepare, _)] = h.pending
    assert prepare.kind == Kind.XA_PREPARE and (1, 5) not in h.replies
    h.pending = []
    prepare.on_durable(None)  # every ready backup wrote it
    h.run_effects_only()
    assert h.replies[(1, 5)] == {}
    assert [p.kind for p, _ in h.pending] == [Kind.XA_COMMIT]  # follows, not waited for
    h.sync()


def test_a_failed_vote_rolls_the_commit_back() -> None:
    h = voted(Harness(auto_sync=False))
    tx = staged(h)
    h.sync()
    h.call("tx_commit", 1, 5, tx, h.now)
    [(prepare, _)] = h.pending
    h.pending = []
    prepare.on_durable(ReplicaVoteFailed("backup c voted fail: disk full"))
    h.run_effects_only()
    assert (1, 5) not in h.errors  # told once the rollback is durable
    assert [p.kind for p, _ in h.pending] == [Kind.XA_ROLLBACK]
    h.sync()
    error = h.errors[(1, 5)]
    assert isinstance(error, TransactionRolledBack) and "disk full" in str(error)
    assert h.broker.xa_recover(1, SCAN) == []
    h.auto_sync = True
    assert bodies(h, "out") == []
    assert bodies(h, "in") == [b"request"]  # the consumed message came back
    after = h.crash()
    assert bodies(after, "out") == [] and bodies(after, "in") == []  # (acked above)


def test_a_failed_vote_then_a_crash_keeps_it_rolled_back() -> None:
    h = voted(Harness(auto_sync=False))
    tx = staged(h)
    h.sync()
    h.call("tx_commit", 1, 5, tx, h.now)
    [(prepare, refs)] = h.pending
    h.pending = []
    h.log.append((prepare.kind, prepare.meta, refs))  # durable here, not on backup c
    prepare.on_durable(ReplicaVoteFailed("backup c voted fail"))
    h.run_effects_only()
    h.sync()  # the XA_ROLLBACK is durable
    after = h.crash()
    assert bodies(after, "out") == [] and bodies(after, "in") == [b"request"]


def test_a_crash_before_the_commit_record_is_a_presumed_commit() -> None:
    """XA_PREPARE durable (voted), the client answered, the XA_COMMIT lost in the crash:
    recovery commits the internal branch and writes its XA_COMMIT; nothing comes back
    at the next restart after the message is consumed."""
    h = voted(Harness(auto_sync=False))
    tx = staged(h)
    h.sync()
    h.call("tx_commit", 1, 5, tx, h.now)
    [(prepare, refs)] = h.pending
    h.pending = []
    h.log.append((prepare.kind, prepare.meta, refs))  # durable here and voted
    prepare.on_durable(None)
    h.run_effects_only()
    assert h.replies[(1, 5)] == {}
    assert [p.kind for p, _ in h.pending] == [Kind.XA_COMMIT]
    after = h.crash()  # the XA_COMMIT is lost
    after.sync()
    after.auto_sync = True
    assert kinds(after)[-2:] == [Kind.XA_PREPARE, Kind.XA_COMMIT]  # recovery wrote it
    assert after.broker.branches == {} and after.broker.xa_recover(1, SCAN) == []
    assert after.broker.xa.leftovers_committed == 1
    assert bodies(after, "out") == [b"reply"] and bodies(after, "in") == []
    again = after.crash()
    assert bodies(again, "out") == [] and bodies(again, "in") == []


def test_a_presumed_commit_flags_its_sends_redelivered() -> None:
    """The process that answered the commit may have delivered the sends before its
    XA_COMMIT was durable (a delivered mark written earlier reached past their seqs):
    after the presumed commit they come out flagged redelivered, not as new
    (``replicated-live`` seed 15, docs/simulation.md). A message of the same queue that
    the log commits outright is not flagged."""
    h = voted(Harness(auto_sync=False))
    tx = staged(h)
    h.sync()
    h.call("tx_commit", 1, 5, tx, h.now)
    [(prepare, refs)] = h.pending
    h.pending = []
    h.log.append((prepare.kind, prepare.meta, refs))
    prepare.on_durable(None)
    h.run_effects_only()
    after = h.crash()  # the XA_COMMIT is lost
    after.auto_sync = True
    after.session(2)
    first = after.receive(2, 1, "out")
    assert (first.body, first.redelivered) == (b"reply", True)
    after.send(2, 2, "out", b"plain")
    second = after.receive(2, 3, "out")
    assert (second.body, second.redelivered) == (b"plain", False)


def test_a_client_cannot_start_a_branch_with_the_reserved_format_id() -> None:
    h = Harness()
    h.session(1)
    with pytest.raises(XAError) as info:
        h.call("xa_start", 1, str(Xid(LOCAL_TX_FORMAT_ID, b"1.1", b"1")), 0, h.now)
    assert info.value.errcode == XAER_INVAL


# ---------------------------------------------------------------- one-phase XA commit
def one_phase_branch(h: Harness) -> XA:
    """Branch X1 of session 1 consumed ``in``'s "order" and sends "reply" to ``out``
    (ended, not committed)."""
    XA(h, 2).send("in", b"order")
    if not h.auto_sync:
        h.sync()
    branch = XA(h)
    branch.start()
    branch.take("in")
    branch.send("out", b"reply")
    branch.end()
    return branch


def test_a_voted_one_phase_commit_is_a_prepare_then_a_commit() -> None:
    h = voted(Harness())
    branch = one_phase_branch(h)
    before = len(h.log)
    assert branch.commit(one_phase=True) == {}
    assert kinds(h, before) == [Kind.XA_PREPARE, Kind.XA_COMMIT]
    assert branch.state() == "gone" and branch.recover() == []
    assert bodies(h, "out") == [b"reply"] and bodies(h, "in") == []


def test_a_failed_vote_rolls_a_one_phase_commit_back() -> None:
    h = voted(Harness(auto_sync=False))
    one_phase_branch(h)
    h.sync()
    h.call("xa_commit", 1, 77, X1, True, h.now)
    [(prepare, _)] = h.pending
    h.pending = []
    prepare.on_durable(ReplicaVoteFailed("backup c voted fail: disk full"))
    h.run_effects_only()
    assert [p.kind for p, _ in h.pending] == [Kind.XA_ROLLBACK]
    h.sync()
    error = h.errors[(1, 77)]
    assert isinstance(error, XAError) and error.errcode == XA_RBROLLBACK
    assert "disk full" in str(error)
    h.auto_sync = True
    assert h.broker.branches == {}
    assert bodies(h, "out") == [] and bodies(h, "in") == [b"order"]
