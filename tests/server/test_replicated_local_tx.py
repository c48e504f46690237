"""Issue 28 §3 (seed 001, "TX Commit/Rollback: do prepare phase as for DTX"): on a
replicated group a local transaction's commit is voted by every ready backup. A
backup that cannot write it votes fail: the commit is rolled back everywhere and
the client gets TransactionRolledBack; with every backup voting ok it commits on
every node. A one-phase XA commit is voted the same way. Real processes, kill -9
and ``txbroker ha promote``; the failing backup is broken by the named fault point
``vote_fail:local_commit`` (``server/ha/faults.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import txbroker
from tests.replicated_support import Group, RNode
from txbroker.errors import XA_RBROLLBACK, TransactionRolledBack, XAError
from txbroker.xid import Xid

pytestmark = pytest.mark.timeout(240)

#: c votes fail on the first entry that commits a local transaction (once per process).
FAIL_ON_COMMIT = {"c": ["--replica-fault", "vote_fail:local_commit"]}


@contextlib.contextmanager
def group(tmp_path: Path, **kwargs: Any) -> Iterator[Group]:
    g = Group(tmp_path / "group", 3, **kwargs)
    with g:
        yield g


def _connect(url: str) -> Any:
    return txbroker.connect(url, timeout=15, failover_timeout=60)


def depths(node: RNode, *queues: str) -> dict[str, int]:
    """The depth of each queue on ``node`` alone (0 for a queue it does not have)."""
    with _connect(node.url) as conn:
        known = {q["name"]: q for q in conn.queues()}
        return {name: int(known[name]["depth"]) if name in known else 0 for name in queues}


def bodies(node: RNode, queue: str) -> list[bytes]:
    """Every message of ``queue`` on ``node``, taken (acked durably)."""
    taken = []
    with _connect(node.url) as conn:
        while (message := conn.receive(queue, timeout=0.5)) is not None:
            taken.append(message.body)
            message.ack(wait=True)
    return taken


def on_each_node_after_promotion(g: Group, *queues: str) -> dict[str, dict[str, int]]:
    """kill -9 the primary a, promote b and read the depths; kill -9 b, promote c and
    read them again: what each backup's own copy holds."""
    seen = {}
    g.kill9(g.a)
    g.promote(g.b)
    seen["b"] = depths(g.b, *queues)
    g.wait_ready_backups(1, primary=g.b)  # c follows b: a fresh copy of b's state
    g.kill9(g.b)
    g.promote(g.c, force=True)  # alone of three (a and b dead): by force
    seen["c"] = depths(g.c, *queues)
    return seen


def test_a_backup_that_cannot_write_the_commit_rolls_it_back(tmp_path: Path) -> None:
    """c cannot write the commit: ``commit()`` raises TransactionRolledBack, the
    consumed message comes back, the sent one is nowhere — not on the primary, not on
    b (which wrote and voted ok), not on c after either promotion."""
    with group(tmp_path, node_args=FAIL_ON_COMMIT) as g:
        a, _, c = g.nodes
        with _connect(g.url) as conn:
            conn.send("in", b"m0")
            tx = conn.transaction()
            taken = tx.receive("in", timeout=5)
            assert taken is not None and taken.body == b"m0"
            tx.send("out", b"staged")
            with pytest.raises(TransactionRolledBack, match="backup c voted fail"):
                tx.commit()
            assert conn.queue_info("out")["depth"] == 0
            assert conn.queue_info("in")["depth"] == 1  # m0 is back
            xa = conn.xa_resource()
            assert xa.recover() == []  # the commit's internal branch is never shown
        assert c.log_has("voting fail, leaving")
        assert a.log_has("replication: backup c dropped: it voted fail on entry")
        g.wait_ready_backups(2)  # c joins again (the fault fires once per process)
        seen = on_each_node_after_promotion(g, "in", "out")
        assert seen == {"b": {"in": 1, "out": 0}, "c": {"in": 1, "out": 0}}
        assert bodies(c, "out") == []
        assert bodies(c, "in") == [b"m0"]


def test_the_next_commit_after_a_failed_vote_commits(tmp_path: Path) -> None:
    """After the rolled-back commit, the next transaction of the same connection
    commits once the backups vote ok."""
    with group(tmp_path, node_args=FAIL_ON_COMMIT) as g:
        with _connect(g.url) as conn:
            tx = conn.transaction()
            tx.send("out", b"first")
            with pytest.raises(TransactionRolledBack):
                tx.commit()
            g.wait_ready_backups(2)
            tx = conn.transaction()
            tx.send("out", b"second")
            tx.commit()
            assert conn.queue_info("out")["depth"] == 1
        seen = on_each_node_after_promotion(g, "out")
        assert seen == {"b": {"out": 1}, "c": {"out": 1}}
        assert bodies(g.c, "out") == [b"second"]


def test_a_commit_voted_by_every_backup_is_on_every_node(tmp_path: Path) -> None:
    """The happy path: every backup votes ok; the commit (sends and an ack) holds on
    each backup after promotion, and no internal branch is left anywhere."""
    with group(tmp_path) as g:
        a = g.a
        with _connect(g.url) as conn:
            for i in range(3):
                conn.send("in", b"m%d" % i)
            for i in range(5):
                tx = conn.transaction()
                if i < 3:
                    taken = tx.receive("in", timeout=5)
                    assert taken is not None and taken.body == b"m%d" % i
                tx.send("out", b"t%d" % i)
                tx.commit()
            assert conn.queue_info("out")["depth"] == 5
            assert conn.queue_info("in")["depth"] == 0
            assert conn.xa_resource().recover() == []
        backups = {x["node"]: x["state"] for x in a.status()["replication"]["backups"]}
        assert backups == {"b": "ready", "c": "ready"}  # nobody voted fail
        seen = on_each_node_after_promotion(g, "in", "out")
        assert seen == {"b": {"in": 0, "out": 5}, "c": {"in": 0, "out": 5}}
        with _connect(g.c.url) as conn:
            assert conn.xa_resource().recover() == []
        assert bodies(g.c, "out") == [b"t%d" % i for i in range(5)]


def test_a_one_phase_xa_commit_is_voted_too(tmp_path: Path) -> None:
    """c cannot write a one-phase XA commit: it answers XA_RBROLLBACK, the branch is
    gone and its message is nowhere after promotion; the next one commits."""
    x1, x2 = Xid(3, b"first", b"q"), Xid(3, b"second", b"q")
    with group(tmp_path, node_args=FAIL_ON_COMMIT) as g:
        with _connect(g.url) as conn:
            xa = conn.xa_resource()
            xa.start(x1)
            conn.send("xq", b"one")
            xa.end(x1)
            with pytest.raises(XAError) as info:
                xa.commit(x1, one_phase=True)
            assert info.value.errcode == XA_RBROLLBACK
            assert "backup c voted fail" in str(info.value)
            assert xa.recover() == [] and conn.queue_info("xq")["depth"] == 0
            g.wait_ready_backups(2)
            xa.start(x2)
            conn.send("xq", b"two")
            xa.end(x2)
            xa.commit(x2, one_phase=True)
        seen = on_each_node_after_promotion(g, "xq")
        assert seen == {"b": {"xq": 1}, "c": {"xq": 1}}
        assert bodies(g.c, "xq") == [b"two"]


def test_a_promoted_backup_commits_a_voted_commit_left_without_its_outcome(
        tmp_path: Path) -> None:
    """Presumed commit across a promotion: b writes and votes for the commit's
    XA_PREPARE but never gets its XA_COMMIT (fault point ``freeze_after:local_commit``);
    the client was answered; a dies; b, promoted, commits the branch: the sent message
    is there, the consumed one gone, no branch left — and c, copying b, agrees."""
    args = {"b": ["--replica-fault", "freeze_after:local_commit"]}
    with group(tmp_path, node_args=args) as g:
        with _connect(g.url) as conn:
            conn.send("in", b"m0")
            tx = conn.transaction()
            taken = tx.receive("in", timeout=5)
            assert taken is not None and taken.body == b"m0"
            tx.send("out", b"committed")
            tx.commit()  # voted by b and c
        g.kill9(g.a)
        g.promote(g.b)
        assert g.b.log_has("1 voted local commits had no outcome in the log: committed")
        assert depths(g.b, "in", "out") == {"in": 0, "out": 1}
        with _connect(g.b.url) as conn:
            assert conn.xa_resource().recover() == []
        g.wait_ready_backups(1, primary=g.b)
        g.kill9(g.b)
        g.promote(g.c, force=True)  # alone of three: by force
        assert bodies(g.c, "out") == [b"committed"] and bodies(g.c, "in") == []
