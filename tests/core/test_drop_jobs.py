"""Purging and deleting big queues a slice per loop turn (core/drop_jobs.py)."""

from __future__ import annotations

from tests.core.harness import Harness
from txbroker.core.drop_jobs import DROP_SLICE
from txbroker.core.records import Kind

#: More than two slices, and not a multiple of the slice.
MANY = 2 * DROP_SLICE + 123


def filled(h: Harness, queue: str = "q", count: int = MANY) -> None:
    h.session(1)
    h.call("send_batch", 1, 1, queue, [b"m%d" % i for i in range(count)], h.now)


def test_purge_takes_one_slice_per_turn_and_replies_when_all_are_durable() -> None:
    h = Harness(auto_continue=False)
    filled(h)
    h.send(1, 2, "other", b"keep")
    h.call("queue_purge", 1, 3, "q", h.now)
    queue = h.broker.queues["q"]
    assert queue.ready_count == 0  # taken out at once: no consumer sees them any more
    assert (1, 3) not in h.replies  # not all dropped yet
    assert len(h.continues) == 1
    turns = 0
    while h.next_turn():
        turns += 1
    assert turns == MANY // DROP_SLICE  # the first slice ran in the command's turn
    assert h.replies[(1, 3)] == {"purged": MANY}
    drops = [meta for kind, meta, _ in h.log if kind == Kind.DROP]
    assert len(drops) == MANY // DROP_SLICE + 1
    assert queue.messages == 0 and len(h.broker.messages) == 1  # "other" keeps its one
    assert h.receive(1, 4, "q") is None


def test_messages_sent_during_a_purge_are_kept() -> None:
    h = Harness(auto_continue=False)
    filled(h)
    h.call("queue_purge", 1, 3, "q", h.now)
    h.send(1, 4, "q", b"after the purge")
    while h.next_turn():
        pass
    assert h.replies[(1, 3)] == {"purged": MANY}
    got = h.receive(1, 5, "q")
    assert got is not None and got.body == b"after the purge"


def test_a_purge_cut_short_by_a_crash_drops_only_durable_slices() -> None:
    h = Harness(auto_continue=False)
    filled(h)
    h.call("queue_purge", 1, 3, "q", h.now)
    h.next_turn()  # two slices done
    h = h.crash()
    assert h.broker.queues["q"].messages == MANY - 2 * DROP_SLICE


def test_delete_drops_slices_and_compaction_never_copies_them() -> None:
    h = Harness(auto_continue=False)
    filled(h)
    refs = [(m.id, m.ref) for m in h.broker.messages.values() if m.ref is not None]
    h.call("queue_delete", 1, 3, "q", h.now)
    assert h.replies[(1, 3)] == {"deleted": MANY}  # answered when QUEUE_DELETE is durable
    assert "q" not in h.broker.queues and h.continues
    assert h.broker.still_live(refs) == []  # not yet forgotten, but never relocated
    h.call("queue_declare", 1, 4, "q", h.now)  # the name may be used again at once
    h.send(1, 5, "q", b"new")
    while h.next_turn():
        pass
    assert h.broker.index.deleting == {}
    assert [m.queue for m in h.broker.messages.values()] == ["q"]
    got = h.receive(1, 6, "q")
    assert got is not None and got.body == b"new"
    assert len(h.released) == MANY
    h = h.crash()
    assert h.broker.queues["q"].messages == 1


def test_delete_forgets_held_messages_and_a_rollback_does_not_bring_them_back() -> None:
    h = Harness()
    h.session(1)
    h.send(1, 1, "q", b"held")
    tx = h.call("tx_begin", 1)["tx"]
    got = h.receive(1, 2, "q")
    h.call("ack", 1, 0, [got.tag], h.now, tx=tx)
    h.call("queue_delete", 1, 3, "q", h.now)
    h.call("queue_declare", 1, 4, "q", h.now)
    h.call("tx_rollback", 1, tx, h.now)
    assert h.broker.queues["q"].messages == 0 and h.receive(1, 5, "q") is None
    assert h.crash().broker.queues["q"].messages == 0
