"""The dump a joining backup gets (core/replica.py): replayed into a fresh core it is
the same state — ready, delivered and transaction-held messages, a prepared XA branch,
the router's journal — and a dump is refused while something is on its way to disk."""

from __future__ import annotations

from tests.core.harness import Harness
from tests.core.test_xa import X1, XA, bodies
from txbroker.core.replica import check_quiet, state_entries
from txbroker.core.router_log import ROUTER_QUEUE
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
