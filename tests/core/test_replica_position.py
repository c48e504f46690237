"""A replicated backup's log says which of the primary's LSNs it holds (``REPLICA_AT``,
``server/ha/replica.py``, "Resuming from the disk"): replay counts every entry after a
position but snapshots, a snapshot carries the count at its roll, and an empty epoch
ends the count. These are the rules a restarted backup's resume stands on: a wrong
count would make the primary resend entries the copy holds (applied twice) or skip
some (lost)."""

from __future__ import annotations

from txbroker.core import Broker
from txbroker.core.records import (
    Ack,
    Add,
    QueuePut,
    ReplicaAt,
    Snapshot,
    StoredEntry,
    entry,
)

DEF = {"name": "q", "kind": "queue", "topic": None, "settings": {}}


def _add(message_id: int) -> StoredEntry:
    return entry(Add([message_id, "q", None, None, 4, 1000, 0, 0, 0, 0]), (message_id,))


def test_a_primary_log_has_no_position() -> None:
    broker = Broker()
    for stored in (entry(QueuePut(DEF)), _add(1), entry(Ack([1]))):
        broker.replay(stored)
    assert broker.replica_at is None
    assert Snapshot.decode(broker.snapshot()[1]).replica is None  # nor do its snapshots


def test_every_entry_after_a_position_counts_one_lsn_but_snapshots() -> None:
    broker = Broker()
    broker.replay(entry(QueuePut(DEF)))  # the dump's entries: no position yet
    broker.replay(_add(1))
    assert broker.replica_at is None
    broker.replay(entry(ReplicaAt("e1", 40)))  # the dump stood for LSN 40
    assert broker.replica_at == ReplicaAt("e1", 40)
    broker.replay(_add(2))
    broker.replay(entry(Ack([1])))
    assert broker.replica_at == ReplicaAt("e1", 42)
    kind, meta = broker.snapshot()  # a roll now: the snapshot carries the count ...
    assert Snapshot.decode(meta).replica == ReplicaAt("e1", 42)
    broker.replay(StoredEntry(kind, meta, ()))  # ... and does not count itself
    assert broker.replica_at == ReplicaAt("e1", 42)
    broker.replay(_add(3))
    assert broker.replica_at == ReplicaAt("e1", 43)


def test_a_restart_from_a_later_segment_counts_from_its_snapshot() -> None:
    """Dead segments went: replay starts at a segment whose snapshot says LSN 42."""
    written = Broker()
    written.replay(entry(QueuePut(DEF)))
    written.replay(entry(ReplicaAt("e1", 42)))
    kind, meta = written.snapshot()
    restarted = Broker()
    for stored in (StoredEntry(kind, meta, ()), _add(7), _add(8)):
        restarted.replay(stored)
    assert restarted.replica_at == ReplicaAt("e1", 44)


def test_a_new_position_replaces_the_count_and_an_empty_epoch_ends_it() -> None:
    broker = Broker()
    broker.replay(entry(ReplicaAt("e1", 5)))
    broker.replay(_add(1))
    broker.replay(entry(ReplicaAt("e1", 9)))  # re-based (the next entry is LSN 10)
    assert broker.replica_at == ReplicaAt("e1", 9)
    broker.replay(entry(ReplicaAt("", 0)))  # promoted: its own entries from here
    broker.replay(_add(2))
    assert broker.replica_at is None
    assert Snapshot.decode(broker.snapshot()[1]).replica is None
