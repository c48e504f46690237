"""The dump a joining backup gets (core/replica.py): replayed into a fresh core it is
the same state — ready, delivered and transaction-held messages, a prepared XA branch,
the router's journal — and a dump is refused while something is on its way to disk."""

from __future__ import annotations

from tests.core.harness import Harness
from tests.core.test_xa import X1, XA, bodies
from txbroker.core.records import Kind, XaPrepare
from txbroker.core.replica import check_quiet, state_entries
from txbroker.core.router.log import ROUTER_QUEUE
from txbroker.storage.interface import StoredEntry


def replay_dump(source: Harness) -> Harness:
    """A fresh core that replayed ``source``'s dump, as a backup does, then finished
    recovery, as a promoted backup does."""
    assert check_quiet(source.broker) is None
    target = Harness()
    for entry in state_entries(source.broker):
        refs = []
        for message in entry.messages:
            assert message.ref is not None
            target.bodies[target.next_ref] = source.read_body(message.ref)
            refs.append(target.next_ref)
            target.next_ref += 1
        target.log.append((entry.kind, entry.meta, refs))
        target.broker.replay(StoredEntry(entry.kind, entry.meta, tuple(refs)))
    target.broker.finish_recovery(source.now)
    target.run()
    return target


def test_a_dump_replays_into_the_same_state() -> None:
    h = Harness()
    producer = XA(h, 2)
    for body in (b"in-1", b"in-2", b"in-3"):
        producer.send("in", body)
    producer.send("keep", b"keep-1")
    producer.send("keep", b"keep-2")
    h.session(5)
    delivered = h.receive(5, 1, "in")  # delivered, never acked
    assert delivered.body == b"in-1"
    h.session(6)
    tx = h.call("tx_begin", 6)["tx"]
    held = h.receive(6, 2, "keep")
    h.call("ack", 6, 3, [held.tag], h.now, tx=tx)  # acked inside an open transaction
    branch = XA(h)
    branch.start()
    branch.take("in")
    branch.send("out", b"reply")
    branch.end()
    branch.prepare()
    h.broker.router.define(9, 1, "BANK", [{"name": "A", "low": 0, "high": 9}], h.now)
    h.run()

    copy = replay_dump(h)
    assert sorted(copy.broker.queues) == sorted(h.broker.queues)
    assert ROUTER_QUEUE in copy.broker.queues
    assert copy.broker.xa_recover(1, 0x01800000) == [X1]
    assert sorted(bodies(copy, "keep")) == [b"keep-1", b"keep-2"]  # the open tx's ack
    assert XA(copy, 1).commit() == {}
    assert bodies(copy, "out") == [b"reply"]
    assert sorted(bodies(copy, "in")) == [b"in-1", b"in-3"]  # in-2 went to the branch


def test_no_dump_while_something_is_on_its_way_to_disk() -> None:
    h = Harness(auto_sync=False)
    h.session(1)
    h.send(1, 1, "q", b"x")
    assert check_quiet(h.broker) is not None
    h.sync()
    assert check_quiet(h.broker) is None


def test_a_failed_backup_vote_rolls_the_prepare_back() -> None:
    """Seed 001, "fail cancels": the XA_PREPARE completes with ReplicaVoteFailed, the
    branch is rolled back (XA_ROLLBACK written) and prepare answers XA_RBROLLBACK."""
    from txbroker.core.records import Kind
    from txbroker.errors import XA_RBROLLBACK, ReplicaVoteFailed, XAError

    h = Harness()
    XA(h, 2).send("in", b"order")
    branch = XA(h)
    branch.start()
    branch.take("in")
    branch.send("out", b"reply")
    branch.end()
    h.auto_sync = False
    result = h.call("xa_prepare", 1, 77, X1, h.now)
    [(prepare, _)] = [p for p in h.pending if p[0].kind == Kind.XA_PREPARE]
    h.pending = [p for p in h.pending if p[0] is not prepare]
    prepare.on_durable(ReplicaVoteFailed("backup b2 voted fail: disk full"))
    h.run_effects_only()
    h.sync()
    assert result is not None
    error = h.errors[(1, 77)]
    assert isinstance(error, XAError) and error.errcode == XA_RBROLLBACK
    assert "disk full" in str(error)
    assert [kind for kind, _, _ in h.log][-1:] == [Kind.XA_ROLLBACK]
    assert h.broker.xa_recover(1, 0x01800000) == []
    assert bodies(h, "in") == [b"order"] and bodies(h, "out") == []


def test_a_dumped_prepare_carries_the_branch_prepare_time() -> None:
    """XA_PREPARE's sixth field is ``prepared_ms`` (core/records/xa_records.py): the dump
    writes the branch's own prepare time (it used to write ``created_ms`` there), and a
    backup that replayed it dumps the same time again."""
    h = Harness()
    branch = XA(h)
    created = h.now
    branch.start()
    branch.send("out", b"reply")
    branch.end()
    h.now += 5_000
    branch.prepare()
    h.run()

    def dumped_prepare(source: Harness) -> XaPrepare:
        [prepare] = [XaPrepare.decode(entry.meta) for entry in state_entries(source.broker)
                     if entry.kind == Kind.XA_PREPARE]
        return prepare

    prepare = dumped_prepare(h)
    assert (prepare.xid, prepare.created_ms, prepare.prepared_ms) == (X1, created,
                                                                      created + 5_000)
    assert dumped_prepare(replay_dump(h)).prepared_ms == created + 5_000
