"""The broker core, driven with no loop, disk or socket (tests/core/harness.py)."""

from __future__ import annotations

import pytest

from tests.core.harness import Harness
from txbroker.core import LATER, Limits, records
from txbroker.core.records import Kind
from txbroker.errors import (
    BadRequest,
    Disabled,
    IllegalState,
    MessageTooLarge,
    NotFound,
    QuotaExceeded,
    StorageFailed,
    TransactionError,
    TransactionRolledBack,
)


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_send_is_answered_only_when_durable() -> None:
    h = Harness(auto_sync=False)
    s = h.session()
    assert h.send(s, 1, "q", b"hello") is LATER
    assert (s, 1) not in h.replies
    assert h.broker.queues["q"].messages == 0  # invisible until durable
    h.sync()
    assert h.replies[(s, 1)] == {"duplicate": False}
    assert h.broker.queues["q"].messages == 1
    got = h.receive_marked(s, 2, "q")  # the queue's first delivery waits for its mark
    assert got.body == b"hello" and got.redelivered is False and got.delivery_count == 1


def test_fifo_within_priority_and_highest_priority_first(h: Harness) -> None:
    s = h.session()
    for i, prio in enumerate([4, 4, 9, 0, 9, 4]):
        h.send(s, 10 + i, "q", f"m{i}".encode(), priority=prio)
    bodies = []
    for i in range(6):
        d = h.receive(s, 100 + i, "q")
        bodies.append(d.body)
        h.call("ack", s, 0, [d.tag], h.now)
    assert bodies == [b"m2", b"m4", b"m0", b"m1", b"m5", b"m3"]
    assert h.receive(s, 200, "q") is None


def test_competing_consumers_share_round_robin_and_respect_prefetch(h: Harness) -> None:
    a, b = h.session(1), h.session(2)
    h.call("subscribe", a, 1, "q", h.now, prefetch=2)
    h.call("subscribe", b, 1, "q", h.now, prefetch=2)
    for i in range(6):
        h.send(3 if 3 in h.broker.sessions else h.session(3), 10 + i, "q", b"x%d" % i)
    per_session = {1: 0, 2: 0}
    for d in h.deliveries:
        per_session[d.session] += 1
    assert per_session == {1: 2, 2: 2}
    assert h.broker.queues["q"].in_flight == 4
    assert h.broker.queues["q"].ready_count == 2
    first_a = next(d for d in h.deliveries if d.session == 1)
    h.call("ack", a, 5, [first_a.tag], h.now)
    assert sum(1 for d in h.deliveries if d.session == 1) == 3


def test_nack_redelivers_with_count_then_dead_letters(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "work", h.now,
           settings={"max_deliveries": 3, "dead_letter_queue": "work.dlq"})
    h.send(s, 2, "work", b"poison")
    counts = []
    for i in range(3):
        d = h.receive(s, 10 + i, "work")
        counts.append((d.delivery_count, d.redelivered))
        h.call("nack", s, [d.tag], h.now)
    assert counts == [(1, False), (2, True), (3, True)]
    assert h.receive(s, 20, "work") is None
    dead = h.receive(s, 21, "work.dlq")
    assert dead.body == b"poison"
    assert h.broker.counters["dead_lettered"] == 1
    # the move survives a restart
    h2 = h.crash()
    h2.session()
    assert h2.receive(1, 1, "work") is None
    assert h2.receive(1, 2, "work.dlq").body == b"poison"


def test_nack_without_requeue_dead_letters_at_once(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "w", h.now, settings={"dead_letter_queue": "dlq"})
    h.send(s, 2, "w", b"bad")
    d = h.receive(s, 3, "w")
    h.call("nack", s, [d.tag], h.now, requeue=False)
    assert h.receive(s, 4, "dlq").body == b"bad"


def test_ttl_expiry_moves_to_expiry_queue(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "t", h.now, settings={"expiry_queue": "expired"})
    h.send(s, 2, "t", b"short", ttl_ms=100)
    h.send(s, 3, "t", b"long", ttl_ms=10_000)
    h.tick(200)
    assert h.broker.counters["expired"] == 1
    assert h.receive(s, 4, "t").body == b"long"
    assert h.receive(s, 5, "expired").body == b"short"


def test_expired_message_without_expiry_queue_is_dropped_on_dispatch(h: Harness) -> None:
    s = h.session()
    h.send(s, 1, "t", b"gone", ttl_ms=50)
    h.now += 100
    assert h.receive(s, 2, "t") is None
    assert h.broker.queues["t"].messages == 0
    assert len(h.released) == 1


def test_delayed_delivery(h: Harness) -> None:
    s = h.session()
    h.send(s, 1, "d", b"later", delay_ms=5_000)
    assert h.receive(s, 2, "d") is None
    assert h.broker.next_wakeup() is not None
    h.tick(4_000)
    assert h.receive(s, 3, "d") is None
    assert h.receive(s, 4, "d", timeout=10_000) is LATER
    h.tick(1_000)
    assert h.replies[(s, 4)].body == b"later"


def test_receive_times_out_with_none(h: Harness) -> None:
    s = h.session()
    assert h.receive(s, 1, "q", timeout=500) is LATER
    h.tick(499)
    assert (s, 1) not in h.replies
    h.tick(1)
    assert h.replies[(s, 1)] is None
    h.send(s, 2, "q", b"after")
    assert h.broker.queues["q"].ready_count == 1  # the timed-out receive took nothing


def test_disconnect_returns_unacked_as_redelivered(h: Harness) -> None:
    a = h.session(1)
    h.send(a, 1, "q", b"one")
    d = h.receive(a, 2, "q")
    assert d.redelivered is False
    h.call("close_session", a, h.now)
    b = h.session(2)
    again = h.receive(b, 1, "q")
    assert again.body == b"one" and again.redelivered is True and again.delivery_count == 2


def test_ack_of_unknown_or_twice_acked_tag_is_illegal_state(h: Harness) -> None:
    s = h.session()
    h.send(s, 1, "q", b"x")
    d = h.receive(s, 2, "q")
    h.call("ack", s, 3, [d.tag], h.now)
    with pytest.raises(IllegalState):
        h.call("ack", s, 4, [d.tag], h.now)
    with pytest.raises(IllegalState):
        h.call("ack", s, 5, [999], h.now)


def test_acked_message_does_not_come_back_after_restart(h: Harness) -> None:
    s = h.session()
    for i in range(5):
        h.send(s, i + 1, "q", b"m%d" % i)
    for i in range(3):
        d = h.receive(s, 10 + i, "q")
        h.call("ack", s, 20 + i, [d.tag], h.now)
    h2 = h.crash()
    h2.session()
    assert [h2.receive(1, 30 + i, "q").body for i in range(2)] == [b"m3", b"m4"]
    assert h2.receive(1, 40, "q") is None


def test_unsynced_send_is_lost_on_crash_but_was_never_acknowledged() -> None:
    h = Harness(auto_sync=False)
    s = h.session()
    h.send(s, 1, "q", b"durable")
    h.sync()
    h.send(s, 2, "q", b"in-flight")
    assert (s, 2) not in h.replies
    h2 = h.crash()
    assert len(h2.broker.messages) == 1


def test_duplicate_detection_within_window_survives_restart(h: Harness) -> None:
    s = h.session()
    assert h.send(s, 1, "q", b"a", message_id="order-1") == {"duplicate": False}
    assert h.send(s, 2, "q", b"a", message_id="order-1") == {"duplicate": True}
    assert h.broker.queues["q"].messages == 1
    h2 = h.crash()
    s2 = h2.session()
    assert h2.send(s2, 1, "q", b"a", message_id="order-1") == {"duplicate": True}
    assert h2.send(s2, 2, "q", b"b", message_id="order-2") == {"duplicate": False}


def test_a_rolled_back_send_leaves_the_duplicate_window(h: Harness) -> None:
    """A mover receives A and sends B (id = A's) in a transaction that rolls back: A
    comes back, and sending B again must not be dropped as a duplicate (it lost B)."""
    s = h.session()
    tx = h.call("tx_begin", s)["tx"]
    assert h.send(s, 1, "out", b"b", message_id="order-1", tx=tx) == {"duplicate": False}
    h.call("tx_rollback", s, tx, h.now)
    tx = h.call("tx_begin", s)["tx"]
    assert h.send(s, 2, "out", b"b", message_id="order-1", tx=tx) == {"duplicate": False}
    h.call("tx_commit", s, 3, tx, h.now)
    assert h.broker.queues["out"].messages == 1
    assert h.send(s, 4, "out", b"b", message_id="order-1") == {"duplicate": True}


def test_a_snapshot_carries_only_ids_of_durable_sends(h: Harness) -> None:
    """A segment roll writes a snapshot while a transaction that sent ``order-1`` is
    open; the broker dies before the commit. The id must not outlive the send."""
    s = h.session()
    h.send(s, 1, "out", b"a", message_id="order-0")
    tx = h.call("tx_begin", s)["tx"]
    h.send(s, 2, "out", b"b", message_id="order-1", tx=tx)
    kind, meta = h.broker.snapshot()
    assert records.unpack(meta)["dups"] == {"out": ["order-0"]}
    h.log.append((kind, meta, []))  # the roll's snapshot reached the disk; no commit
    h2 = h.crash()
    s2 = h2.session()
    assert h2.send(s2, 1, "out", b"b", message_id="order-1") == {"duplicate": False}
    assert h2.send(s2, 2, "out", b"a", message_id="order-0") == {"duplicate": True}
    h.call("tx_commit", s, 3, tx, h.now)  # once durable the id is in the next snapshot
    assert records.unpack(h.broker.snapshot()[1])["dups"] == {"out": ["order-0", "order-1"]}


def test_duplicate_window_is_bounded(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "q", h.now, settings={"dup_window": 2})
    for i, mid in enumerate(["a", "b", "c"]):
        h.send(s, 10 + i, "q", b"x", message_id=mid)
    assert h.send(s, 20, "q", b"x", message_id="a") == {"duplicate": False}  # forgotten
    assert h.send(s, 21, "q", b"x", message_id="c") == {"duplicate": True}


def test_topic_fan_out_and_durable_subscription_survives_restart(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "prices", h.now, kind="topic")
    h.call("topic_subscribe", s, 2, "prices", "risk", h.now)
    h.call("topic_subscribe", s, 3, "prices", "audit", h.now)
    h.call("topic_subscribe", s, 4, "prices", "tmp", h.now, durable=False)
    h.send(s, 5, "prices", b"EURUSD 1.1")
    for name in ("prices::risk", "prices::audit", "prices::tmp"):
        assert h.broker.queues[name].messages == 1
    h2 = h.crash()
    assert sorted(h2.broker.topics["prices"].subscriptions) == ["prices::audit", "prices::risk"]
    h2.session()
    assert h2.receive(1, 1, "prices::risk").body == b"EURUSD 1.1"
    assert h2.receive(1, 2, "prices::audit").body == b"EURUSD 1.1"
    assert "prices::tmp" not in h2.broker.queues


def test_non_durable_subscription_goes_with_its_session(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "ev", h.now, kind="topic")
    h.call("topic_subscribe", s, 2, "ev", "mine", h.now, durable=False)
    h.call("close_session", s, h.now)
    assert "ev::mine" not in h.broker.queues
    assert h.broker.topics["ev"].subscriptions == set()


def test_transaction_commit_is_one_record_and_atomic(h: Harness) -> None:
    s = h.session()
    h.send(s, 1, "in", b"request")
    d = h.receive(s, 2, "in")
    tx = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, [d.tag], h.now, tx=tx)
    h.send(s, 3, "out", b"reply-1", tx=tx)
    h.send(s, 4, "out", b"reply-2", tx=tx)
    assert h.broker.queues.get("out") is not None and h.broker.queues["out"].messages == 0
    before = len(h.log)
    assert h.call("tx_commit", s, 5, tx, h.now) is LATER
    assert h.replies[(s, 5)] == {}
    tx_records = [k for k, _, _ in h.log[before:] if k == 5]
    assert len(tx_records) == 1
    assert h.broker.queues["out"].messages == 2 and h.broker.queues["in"].messages == 0


def test_transaction_rollback_redelivers_and_drops_sends(h: Harness) -> None:
    s = h.session()
    h.send(s, 1, "in", b"request")
    d = h.receive(s, 2, "in")
    tx = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, [d.tag], h.now, tx=tx)
    h.send(s, 3, "out", b"reply", tx=tx)
    h.call("tx_rollback", s, tx, h.now)
    assert h.broker.queues["out"].messages == 0
    again = h.receive(s, 4, "in")
    assert again.body == b"request" and again.redelivered is True
    with pytest.raises(TransactionError):
        h.call("tx_commit", s, 5, tx, h.now)


def test_transaction_is_all_or_nothing_across_a_crash() -> None:
    h = Harness(auto_sync=False)
    s = h.session()
    h.send(s, 1, "in", b"req")
    h.sync()
    d = h.receive_marked(s, 2, "in")
    tx = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, [d.tag], h.now, tx=tx)
    for i in range(3):
        h.send(s, 10 + i, "out", b"r%d" % i, tx=tx)
    h.call("tx_commit", s, 20, tx, h.now)
    lost = h.crash()  # the commit record never reached the disk
    assert lost.broker.queues["in"].messages == 1
    assert "out" not in lost.broker.queues or lost.broker.queues["out"].messages == 0
    h.sync()
    kept = h.crash()
    assert kept.broker.queues["in"].messages == 0
    assert kept.broker.queues["out"].messages == 3


def test_disconnect_rolls_back_open_transaction(h: Harness) -> None:
    s = h.session(1)
    h.send(s, 1, "in", b"req")
    d = h.receive(s, 2, "in")
    tx = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, [d.tag], h.now, tx=tx)
    h.send(s, 3, "out", b"half", tx=tx)
    h.call("close_session", s, h.now)
    assert h.broker.queues["out"].messages == 0
    assert h.broker.queues["in"].ready_count == 1


def test_quotas_ingress_egress_are_enforced_and_persisted(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "q", h.now, settings={"max_messages": 2})
    h.send(s, 2, "q", b"1")
    h.send(s, 3, "q", b"2")
    with pytest.raises(QuotaExceeded):
        h.send(s, 4, "q", b"3")
    h.call("queue_update", s, 5, "q", {"max_messages": 0, "max_bytes": 3}, h.now)
    with pytest.raises(QuotaExceeded):
        h.send(s, 6, "q", b"xx")
    h.call("queue_update", s, 7, "q", {"max_bytes": 0, "ingress": False, "egress": False}, h.now)
    with pytest.raises(Disabled):
        h.send(s, 8, "q", b"x")
    assert h.receive(s, 9, "q") is None  # egress off: nothing delivered
    h2 = h.crash()
    settings = h2.broker.queues["q"].settings
    assert (settings.ingress, settings.egress, settings.max_messages) == (False, False, 0)
    h2.session()
    h2.call("queue_update", 1, 1, "q", {"egress": True}, h2.now)
    assert h2.receive(1, 2, "q").body == b"1"


def test_purge_and_delete(h: Harness) -> None:
    s = h.session()
    for i in range(4):
        h.send(s, i + 1, "q", b"m")
    d = h.receive(s, 10, "q")
    h.call("queue_purge", s, 11, "q", h.now)
    assert h.replies[(s, 11)] == {"purged": 3}
    assert h.broker.queues["q"].messages == 1  # the in-flight one stays
    h.call("ack", s, 12, [d.tag], h.now)
    h.send(s, 13, "q", b"again")
    h.call("queue_delete", s, 14, "q", h.now)
    assert h.replies[(s, 14)] == {"deleted": 1}
    h2 = h.crash()
    assert "q" not in h2.broker.queues
    assert h2.broker.messages == {}
    with pytest.raises(NotFound):
        h2.call("queue_purge", 1, 1, "q", h2.now)


def test_subscription_cancelled_when_queue_deleted(h: Harness) -> None:
    s = h.session()
    h.call("subscribe", s, 7, "q", h.now)
    h.call("queue_delete", s, 1, "q", h.now)
    assert h.cancelled == [(s, 7)]


def test_bad_input_is_a_clear_error() -> None:
    h = Harness(limits=Limits(max_message_size=10, auto_create=True))
    s = h.session()
    with pytest.raises(MessageTooLarge):
        h.send(s, 1, "q", b"x" * 11)
    with pytest.raises(BadRequest):
        h.send(s, 2, "", b"x")
    with pytest.raises(BadRequest):
        h.send(s, 3, "q", b"x", priority=10)
    with pytest.raises(BadRequest):
        h.call("queue_declare", s, 4, "q2", h.now, settings={"nonsense": 1})
    with pytest.raises(TransactionError):
        h.send(s, 5, "q", b"x", tx=42)
    assert h.broker.messages == {}


def test_storage_failure_fails_the_request_and_stops_writes() -> None:
    h = Harness(auto_sync=False)
    s = h.session()
    h.send(s, 1, "q", b"x")
    h.fail_pending(OSError(5, "EIO"))
    assert isinstance(h.errors[(s, 1)], StorageFailed)
    assert h.broker.messages == {}
    with pytest.raises(StorageFailed):
        h.send(s, 2, "q", b"y")
    tx = h.call("tx_begin", s)["tx"]
    with pytest.raises(TransactionRolledBack):
        h.call("tx_commit", s, 3, tx, h.now)


def test_snapshot_replaces_metadata_on_replay(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "keep", h.now, settings={"max_messages": 7})
    h.call("queue_declare", s, 2, "gone", h.now)
    h.send(s, 3, "keep", b"m", message_id="id-1")
    kind, meta = h.broker.snapshot()
    # a restart whose log starts with the snapshot (older segments deleted)
    fresh = Harness()
    from txbroker.storage.interface import StoredEntry

    fresh.broker.replay(StoredEntry(kind, meta, ()))
    fresh.broker.finish_recovery(h.now)
    assert set(fresh.broker.queues) == {"keep", "gone"}
    assert fresh.broker.queues["keep"].settings.max_messages == 7
    assert fresh.broker.queues["keep"].seen("id-1")
    assert fresh.broker.next_id == h.broker.next_id


def test_relocation_moves_live_bodies_and_releases_old_refs(h: Harness) -> None:
    s = h.session()
    for i in range(3):
        h.send(s, i + 1, "q", b"body%d" % i)
    d = h.receive(s, 10, "q")
    h.call("ack", s, 11, [d.tag], h.now)
    from txbroker.storage.interface import StoredEntry

    entries = [StoredEntry(k, m, tuple(r)) for k, m, r in h.log]
    live = h.broker.live_refs(entries)
    assert [mid for mid, _ in live] == [2, 3]
    for mid, ref in live:
        h.call("relocate_many", [(mid, ref)], [h.bodies[ref]])
    assert all(ref in h.released for _, ref in live)
    h2 = h.crash()
    h2.session()
    assert [h2.receive(1, 20 + i, "q").body for i in range(2)] == [b"body1", b"body2"]


def test_relocated_message_survives_deletion_of_its_original_segment(h: Harness) -> None:
    s = h.session()
    h.send(s, 1, "q", b"old-and-pinned")
    h.send(s, 2, "q", b"consumed")
    d = h.receive(s, 3, "q")
    d2 = h.receive(s, 4, "q")
    h.call("nack", s, [d.tag], h.now)  # delivery count 1 is carried by the copy
    h.call("ack", s, 5, [d2.tag], h.now)
    from txbroker.storage.interface import StoredEntry

    live = h.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h.log])
    assert [mid for mid, _ in live] == [1]
    kind, meta = h.broker.snapshot()
    for mid, ref in live:
        h.call("relocate_many", [(mid, ref)], [h.bodies[ref]])
    # the store deletes the old segment: the log now starts with a snapshot
    tail = [entry for entry in h.log if entry[0] == Kind.RELOCATE_MANY]
    h.log = [(kind, meta, []), *tail]
    h2 = h.crash()
    h2.session()
    got = h2.receive(1, 1, "q")
    assert (got.body, got.delivery_count, got.redelivered) == (b"old-and-pinned", 2, True)
    assert h2.receive(1, 2, "q") is None


def test_relocate_many_copies_a_slice_in_one_entry_and_skips_the_gone(h: Harness) -> None:
    s = h.session()
    for i in range(4):
        h.send(s, i + 1, "q", b"body%d" % i)
    from txbroker.storage.interface import StoredEntry

    live = h.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h.log])
    assert [mid for mid, _ in live] == [1, 2, 3, 4]
    d = h.receive(s, 10, "q")
    h.call("ack", s, 11, [d.tag], h.now)  # message 1 is gone before the slice is copied
    pairs = h.broker.still_live(live)
    assert [mid for mid, _ in pairs] == [2, 3, 4]
    entries_before = len(h.log)
    h.call("relocate_many", pairs, [h.bodies[ref] for _, ref in pairs])
    assert [entry[0] for entry in h.log[entries_before:]] == [Kind.RELOCATE_MANY]
    assert len(h.log[-1][2]) == 3  # three bodies in the one entry
    assert all(ref in h.released for _, ref in pairs)
    assert h.broker.still_live(pairs) == []  # each message now points at its copy
    h2 = h.crash()
    h2.session()
    assert [h2.receive(1, 20 + i, "q").body for i in range(3)] == [b"body1", b"body2", b"body3"]
    assert h2.receive(1, 30, "q") is None


def test_message_acked_in_a_committing_transaction_is_not_relocated(h: Harness) -> None:
    h.auto_sync = False
    s = h.session()
    h.send(s, 1, "q", b"x")
    h.sync()
    d = h.receive_marked(s, 2, "q")
    tx = h.call("tx_begin", s)["tx"]
    h.call("ack", s, 0, [d.tag], h.now, tx=tx)
    h.call("tx_commit", s, 3, tx, h.now)  # the TX record is on its way to disk
    from txbroker.storage.interface import StoredEntry

    assert h.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h.log]) == []


def test_unacked_messages_come_back_in_their_original_order(h: Harness) -> None:
    a = h.session(1)
    for i in range(4):
        h.send(a, 10 + i, "q", b"m%d" % i)
    h.call("subscribe", a, 1, "q", h.now, prefetch=10)
    assert len(h.deliveries) == 4
    h.call("close_session", a, h.now)
    b = h.session(2)
    assert [h.receive(b, 20 + i, "q").body for i in range(4)] == [b"m0", b"m1", b"m2", b"m3"]


def test_send_to_a_topic_without_subscriptions_is_answered_at_once(h: Harness) -> None:
    s = h.session()
    h.call("queue_declare", s, 1, "news", h.now, kind="topic")
    assert h.call("send", s, 2, "news", b"nobody listens", h.now) == {"duplicate": False}
    assert h.call("send", s, 3, "news", b"nor here", h.now, persistent=False) == \
        {"duplicate": False}
    assert h.call("send_batch", s, 4, "news", [b"a", b"b"], h.now) == \
        {"count": 2, "duplicates": 0}
    assert not h.broker.outbox.group  # nothing left waiting for a record never written


def test_relocating_parked_messages_keeps_them_compact(h: Harness) -> None:
    # after a restart, parked READY messages are compact slots (47 bytes each);
    # relocating them must copy and re-point the slots, not build a Message object
    # per message (issue 29: compaction now moves fully live segments)
    s = h.session()
    for i in range(5):
        h.send(s, i + 1, "q", b"parked%d" % i)
    h2 = h.crash()
    index = h2.broker.messages
    assert (index.compact, len(index.objects)) == (5, 0)
    from txbroker.storage.interface import StoredEntry

    live = h2.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h2.log])
    assert [mid for mid, _ in live] == [1, 2, 3, 4, 5]
    assert (index.compact, len(index.objects)) == (5, 0)  # checked in place
    h2.call("relocate_many", live, [h2.bodies[ref] for _, ref in live])
    assert (index.compact, len(index.objects)) == (5, 0)  # still compact
    assert all(ref in h2.released for _, ref in live)  # the old bodies are free
    assert h2.broker.still_live(live) == []  # each slot points at its copy
    s2 = h2.session()
    got = h2.receive(s2, 1, "q")
    assert (got.body, got.redelivered) == (b"parked0", False)
    h3 = h2.crash()
    h3.session()
    assert [h3.receive(1, 20 + i, "q").body for i in range(5)] == [
        b"parked%d" % i for i in range(5)]


def test_a_parked_message_looked_up_while_its_copy_is_written_gets_the_copy(
        h: Harness) -> None:
    s = h.session()
    for i in range(3):
        h.send(s, i + 1, "q", b"parked%d" % i)
    h2 = h.crash()
    from txbroker.storage.interface import StoredEntry

    live = h2.broker.live_refs([StoredEntry(k, m, tuple(r)) for k, m, r in h2.log])
    h2.auto_sync = False
    h2.call("relocate_many", live, [h2.bodies[ref] for _, ref in live])
    promoted = h2.broker.messages[2]  # a lookup promotes slot 2 before the copy is durable
    h2.sync()
    assert all(ref in h2.released for _, ref in live)
    assert promoted.ref not in {ref for _, ref in live}  # the object got its copy
    assert h2.broker.messages.compact == 2  # the others stayed compact
    h2.auto_sync = True
    s2 = h2.session()
    assert [h2.receive(s2, 10 + i, "q").body for i in range(3)] == [
        b"parked0", b"parked1", b"parked2"]
