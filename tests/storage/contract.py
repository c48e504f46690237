"""The store contract: one suite that every store must pass.

A test module subclasses :class:`StoreContractTests` and provides a
``factory`` fixture returning a :class:`StoreFactory`. Everything
store-specific hides behind the factory:

* ``open()`` builds a store at the factory's current *location*; opening the
  same location again after ``close()`` is a restart;
* ``fresh()`` moves the factory to a new, empty location;
* ``crasher`` damages a closed store the way crashes and disks do;
* ``features`` says which optional parts of the contract apply (segments and
  relocation, snapshots, corruption detection, survival of a killed process,
  and ``RECORDS``: the store reads the broker's records instead of keeping a log);
* ``child_spec()`` tells the kill -9 test how a subprocess opens the store.

The suite is written against the ``Store`` protocol only.

A log store (journal, memory) gives back exactly the entries it was given.
A ``RECORDS`` store (the dir store) keeps state, not a log: ``recover`` yields
a compacted, *equivalent* set of entries (metadata and live messages; acked
messages are absent). For it the cases that append arbitrary bytes use valid
broker records (``records.py``) instead, and compare the broker state that
replaying the recovered entries rebuilds (``core/replay.py``) with the
state the appended entries rebuild. The ``broker_state`` cases run on every
store, so that all stores are held to the same broker state.
"""

from __future__ import annotations

import abc
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txbroker.core import records
from txbroker.core.broker import Broker
from txbroker.core.effects import Release
from txbroker.core.records import Kind
from txbroker.errors import CorruptStore, StorageFailed, StoreError, StoreLocked
from txbroker.storage.interface import Dispatch, SnapshotProvider, Store, StoredEntry

from .crash_payload import expected_body
from .support import Completions, Loop, run_and_kill

#: Optional parts of the contract (a factory lists those its store honours).
SEGMENTS = "segments"  # maintain() deletes dead units and may ask for relocation
SNAPSHOT = "snapshot"  # each new segment starts with the snapshot_provider's entry
CORRUPTION = "corruption"  # damage outside the tail raises CorruptStore; repair=True skips it
PROCESS = "process"  # data survives the store's process being killed
RECORDS = "records"  # the store interprets broker records; recover() yields an equivalent state

#: (kind, meta, bodies) — what a test appends and expects back.
Entry = tuple[int, bytes, list[bytes]]


@dataclass(frozen=True)
class Damaged:
    """What a crasher broke: the file and offset a CorruptStore must name, and
    the positions (in the recovered log) of the entries repair will drop."""

    path: str
    offset: int
    lost: tuple[int, ...]


class Crasher(Protocol):
    """Breaks a *closed* store (or a live one's sync) on purpose."""

    def tear_last_entry(self, how: str) -> None:
        """Leave the last entry incomplete: ``how`` is "header" (cut inside its
        header), "body" (cut inside its body) or "crc" (full length, bad checksum)."""

    def truncate_log(self, entries_back: int) -> None:
        """Cut the log inside the ``entries_back``-th entry from the end."""

    def corrupt_old_entry(self) -> Damaged:
        """Flip one bit in an entry that is neither in the last unit nor at the tail."""

    def truncate_old_segment(self) -> Damaged:
        """Cut an old (not last) unit short, inside its last entry."""

    def fail_syncs(self, store: Store) -> None:
        """Make every later sync of the open ``store`` raise ``OSError(EIO)``."""


class StoreFactory(abc.ABC):
    """Opens one kind of store at a location; see the module docstring."""

    features: frozenset[str] = frozenset()
    #: Bytes a store may keep beyond its live data once fully reclaimed.
    reclaim_slack: int = 0
    crasher: Crasher

    @property
    @abc.abstractmethod
    def location_name(self) -> str:
        """How error messages name the current location (StoreLocked must include it)."""

    @abc.abstractmethod
    def open(
        self,
        *,
        dispatch: Dispatch | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        repair: bool = False,
        small_segments: bool = False,
    ) -> Store:
        """A new (not yet recovered) store at the current location."""

    @abc.abstractmethod
    def fresh(self) -> None:
        """Move to a new, empty location."""

    def child_spec(self) -> dict[str, Any] | None:
        """``{"factory": "module:callable", "kwargs": {...}}`` for a subprocess, or None."""
        return None


def recover(store: Store) -> list[StoredEntry]:
    return list(store.recover())


def contents(store: Store, entries: Iterable[StoredEntry]) -> list[Entry]:
    """(kind, meta, bodies) of recovered entries, bodies read back."""
    return [(e.kind, e.meta, [store.read_body(ref) for ref in e.refs]) for e in entries]


def append_all(store: Store, loop: Loop, entries: list[Entry]) -> list[list[int]]:
    """Append ``entries`` and wait until all are durable; return their refs."""
    done = Completions()
    refs = [
        store.append(kind, meta, bodies, done.callback(n))
        for n, (kind, meta, bodies) in enumerate(entries)
    ]
    loop.run_until(lambda: len(done) == len(entries))
    assert [error for _, error in done.calls] == [None] * len(entries)
    return refs


def sample_entries(count: int, seed: int = 7, max_body: int = 2000) -> list[Entry]:
    rng = random.Random(seed)
    return [
        (
            rng.randrange(2, 12),
            b"meta-%d-" % n + rng.randbytes(rng.randrange(0, 40)),
            [rng.randbytes(rng.randrange(0, max_body)) for _ in range(rng.choice((0, 1, 1, 2, 3)))],
        )
        for n in range(count)
    ]


# -- broker records: workloads and the broker state they rebuild ------------------------


def msg_record(
    message_id: int,
    queue: str = "q0",
    *,
    client_id: str | None = None,
    headers: dict[str, str] | None = None,
    priority: int = 4,
    delivery_count: int = 0,
) -> list[Any]:
    """A ``msg`` tuple of records.py."""
    return [message_id, queue, client_id, headers, priority, 1000 + message_id, 0, 0,
            delivery_count]


def add_entry(message_id: int, body: bytes, queue: str = "q0", **fields: Any) -> Entry:
    """An ADD record of one message."""
    return int(Kind.ADD), records.pack(msg_record(message_id, queue, **fields)), [body]


def tx_entry(adds: list[tuple[int, bytes]], acks: list[int], queue: str = "q0") -> Entry:
    """A TX record: messages ``(id, body)`` added and ids acked, atomically."""
    msgs = [msg_record(message_id, queue) for message_id, _ in adds]
    return int(Kind.TX), records.pack([msgs, acks]), [body for _, body in adds]


def queue_put(name: str, settings: dict[str, Any] | None = None, *, kind: str = "queue",
              topic: str | None = None) -> Entry:
    """A QUEUE_PUT record."""
    definition = {"name": name, "kind": kind, "topic": topic, "settings": settings or {}}
    return int(Kind.QUEUE_PUT), records.pack(definition), []


def broker_entries(count: int, seed: int = 7, max_body: int = 2000,
                   first_id: int = 1) -> list[Entry]:
    """``count`` valid broker records, as a broker would write them: queue and
    topic definitions, sends (some with client message ids), transactions of
    sends and acks, acks, drops, redelivery updates, dead-letter moves, queue
    deletions and snapshots. Acks, moves and updates name live messages only."""
    rng = random.Random(seed)
    entries: list[Entry] = [queue_put("q0"), queue_put("q1", {"max_deliveries": 5})]
    queues = ["q0", "q1"]
    live: dict[int, str] = {}  # message id -> queue, in send order
    next_id = first_id

    def new_message(queue: str) -> tuple[list[Any], bytes]:
        nonlocal next_id
        next_id += 1
        client_id = f"m{next_id - 1}" if rng.random() < 0.4 else None
        headers = {"h": str(rng.random())} if rng.random() < 0.3 else None
        msg = msg_record(next_id - 1, queue, client_id=client_id, headers=headers,
                         priority=rng.randrange(10))
        live[next_id - 1] = queue
        return msg, rng.randbytes(rng.randrange(0, max_body))

    def some_live(most: int) -> list[int]:
        return rng.sample(sorted(live), min(len(live), rng.randrange(1, most + 1)))

    while len(entries) < count:
        roll = rng.random()
        if roll < 0.35 or not live:
            msg, body = new_message(rng.choice(queues))
            entries.append((int(Kind.ADD), records.pack(msg), [body]))
        elif roll < 0.5:
            sends = [new_message(rng.choice(queues)) for _ in range(rng.randrange(0, 4))]
            acked = [i for i in some_live(2) if i not in {m[0] for m, _ in sends}]
            for message_id in acked:
                live.pop(message_id)
            entries.append((int(Kind.TX), records.pack([[m for m, _ in sends], acked]),
                            [b for _, b in sends]))
        elif roll < 0.62:
            acked = some_live(3)
            for message_id in acked:
                live.pop(message_id)
            entries.append((int(Kind.ACK), records.pack(acked), []))
        elif roll < 0.67:
            dropped = some_live(2)
            for message_id in dropped:
                live.pop(message_id)
            entries.append((int(Kind.DROP), records.pack([dropped, "expired"]), []))
        elif roll < 0.77:
            message_id = rng.choice(sorted(live))
            update = [message_id, rng.randrange(1, 5), rng.choice((0, 5000))]
            entries.append((int(Kind.UPDATE), records.pack(update), []))
        elif roll < 0.83:
            if "dlq" not in queues:
                queues.append("dlq")
                entries.append(queue_put("dlq"))
            moved = some_live(2)
            for message_id in moved:
                live[message_id] = "dlq"
            entries.append((int(Kind.MOVE), records.pack([moved, "dlq", "rejected"]), []))
        elif roll < 0.88:
            name = rng.choice(("q1", "q2", "q3"))
            if name not in queues:
                queues.append(name)
            entries.append(queue_put(name, {"max_messages": rng.randrange(100, 200)}))
        elif roll < 0.91 and len(queues) > 1:
            name = rng.choice(queues[1:])
            queues.remove(name)
            for message_id in [i for i, q in live.items() if q == name]:
                live.pop(message_id)
            entries.append((int(Kind.QUEUE_DELETE), records.pack(name), []))
        elif roll < 0.95:
            entries.append(queue_put("t", kind="topic"))
            entries.append(queue_put("t::s", topic="t"))
            if "t::s" not in queues:
                queues.append("t::s")
        else:
            definitions = {}
            for name in ("t", *queues):
                definition = records.unpack(queue_put(name)[1])
                if name == "t":
                    definition["kind"] = "topic"
                elif name == "t::s":
                    definition["topic"] = "t"
                definitions[name] = definition
            if "t::s" not in queues:
                definitions.pop("t")
            snapshot = {"next_id": next_id, "queues": definitions, "dups": {}}
            entries.append((int(Kind.SNAPSHOT), records.pack(snapshot), []))
    return entries[:count]


@dataclass(frozen=True)
class BrokerState:
    """What replaying entries into a fresh ``Broker`` rebuilds (bodies read back)."""

    queues: dict[str, Any]
    topics: dict[str, list[str]]
    messages: list[tuple[Any, ...]]  #: in replay (commit) order, body last
    next_id: int
    #: XA branches by Xid text: state, sends (id, queue, body), held message ids, discards
    branches: dict[str, Any] = field(default_factory=dict)
    sinks: dict[str, int] = field(default_factory=dict)  #: the sinks' last batch ids


def broker_state(
    entries: Iterable[StoredEntry],
    read_body: Any,
    body_size: Any,
    *,
    dups: bool = True,
    store: Store | None = None,
) -> BrokerState:
    """Replay ``entries`` as the server does; with ``store``, also hand it the
    releases of dead bodies, as the server does after recovery."""
    broker = Broker()
    broker.body_size_of = body_size
    for entry in entries:
        broker.replay(entry)
    broker.finish_recovery(0)
    for effect in broker.take_effects():
        if store is not None and isinstance(effect, Release):
            store.release(effect.ref)
    return BrokerState(
        queues={name: (q.settings, q.topic, list(q.dups) if dups else None)
                for name, q in broker.queues.items()},
        topics={name: sorted(topic.subscriptions) for name, topic in broker.topics.items()},
        messages=[(m.id, m.queue, m.message_id, m.headers, m.priority, m.timestamp_ms,
                   m.expires_ms, m.deliver_at_ms, m.delivery_count, m.size,
                   read_body(m.ref)) for m in broker.messages.values()],
        next_id=broker.next_id,
        branches={str(xid): (b.state.value,
                             [(m.id, m.queue, m.message_id, read_body(m.ref))
                              for m in b.work.sends],
                             sorted(b.work.acks), sorted(b.discards))
                  for xid, b in broker.branches.items()},
        sinks=dict(broker.sinks_part.sinks),
    )


def expected_state(entries: list[Entry], *, dups: bool = True) -> BrokerState:
    """The broker state that replaying the appended ``entries`` rebuilds."""
    bodies: list[bytes] = []
    stored = []
    for kind, meta, entry_bodies in entries:
        refs = tuple(range(len(bodies), len(bodies) + len(entry_bodies)))
        bodies += entry_bodies
        stored.append(StoredEntry(kind, meta, refs))
    return broker_state(stored, bodies.__getitem__, lambda ref: len(bodies[ref]), dups=dups)


def assert_same_state(store: Store, recovered: list[StoredEntry], entries: list[Entry],
                      *, dups: bool = True) -> BrokerState:
    """The recovered entries rebuild the broker state the appended ones do
    (the next message id may only be ahead)."""
    got = broker_state(recovered, store.read_body, store.body_size, dups=dups, store=store)
    want = expected_state(entries, dups=dups)
    assert got.queues == want.queues
    assert got.topics == want.topics
    assert got.messages == want.messages
    assert got.branches == want.branches
    assert got.sinks == want.sinks
    assert got.next_id >= want.next_id
    return got


class StoreContractTests:
    """Subclass with a ``factory`` fixture to run the contract on a store."""

    def open(self, factory: StoreFactory, **options: Any) -> tuple[Store, Loop, list[StoredEntry]]:
        loop = Loop()
        store = factory.open(dispatch=loop.dispatch, **options)
        return store, loop, recover(store)

    def restart(self, factory: StoreFactory, store: Store, **options: Any) -> tuple[Store, Loop]:
        store.close()
        store, loop, _ = self.open(factory, **options)
        return store, loop

    # A log store is given arbitrary entries and must give them back exactly; a
    # RECORDS store is given broker records and must rebuild the same broker state.

    def workload(self, factory: StoreFactory, count: int, seed: int = 7,
                 max_body: int = 2000) -> list[Entry]:
        """Entries to append: arbitrary ones for a log, broker records otherwise."""
        if RECORDS in factory.features:
            return broker_entries(count, seed=seed, max_body=max_body)
        return sample_entries(count, seed=seed, max_body=max_body)

    def check_recovered(self, factory: StoreFactory, store: Store,
                        recovered: list[StoredEntry], entries: list[Entry]) -> None:
        """``recovered`` is ``entries`` (log) or rebuilds the same broker state (RECORDS)."""
        if RECORDS in factory.features:
            assert_same_state(store, recovered, entries)
        else:
            assert contents(store, recovered) == entries

    def check_recovered_prefix(self, factory: StoreFactory, store: Store,
                               recovered: list[StoredEntry], entries: list[Entry],
                               at_least: int) -> None:
        """``recovered`` is (rebuilds the state of) a prefix of at least ``at_least``
        of ``entries``: what was not acknowledged may or may not be there."""
        if RECORDS not in factory.features:
            got = contents(store, recovered)
            assert len(got) >= at_least and got == entries[: len(got)], got
            return
        got = broker_state(recovered, store.read_body, store.body_size)
        prefixes = [expected_state(entries[:n]) for n in range(at_least, len(entries) + 1)]
        assert any(
            (got.queues, got.topics, got.messages) == (p.queues, p.topics, p.messages)
            for p in prefixes
        ), got

    # -- basics --------------------------------------------------------------

    def test_fresh_store_recovers_nothing(self, factory: StoreFactory) -> None:
        store, _, entries = self.open(factory)
        assert entries == []
        stats = store.stats()
        assert (stats.appends, stats.live_bodies, stats.live_body_bytes) == (0, 0, 0)
        store.close()

    def test_round_trip_across_restart(self, factory: StoreFactory) -> None:
        if RECORDS in factory.features:
            pytest.skip("no log: see test_broker_state_round_trip_across_restart")
        entries: list[Entry] = [
            (1, b"", []),
            (2, b"m", [b""]),
            (65535, bytes(range(256)), [b"a", b"", b"bc" * 1000]),
            (3, b"x" * 5000, [bytes(300_000)]),
            *sample_entries(50),
        ]
        store, loop, _ = self.open(factory)
        refs = append_all(store, loop, entries)
        for ref_list, (_, _, bodies) in zip(refs, entries, strict=True):
            assert [store.read_body(ref) for ref in ref_list] == bodies
            assert [store.body_size(ref) for ref in ref_list] == [len(b) for b in bodies]
        every_ref = [ref for ref_list in refs for ref in ref_list]
        every_body = [body for _, _, bodies in entries for body in bodies]
        assert store.read_bodies(every_ref).split() == every_body  # runs, gaps and all
        assert store.read_bodies(every_ref[::-1]).split() == every_body[::-1]
        assert store.read_bodies(every_ref).lengths == [len(b) for b in every_body]
        store.close()
        store, loop, recovered = self.open(factory)
        assert contents(store, recovered) == entries
        assert store.read_bodies([r for e in recovered for r in e.refs]).split() == every_body
        for entry, (_, _, bodies) in zip(recovered, entries, strict=True):
            assert [store.body_size(ref) for ref in entry.refs] == [len(b) for b in bodies]
        assert store.stats().live_bodies == sum(len(b) for _, _, b in entries)
        assert store.stats().live_body_bytes == sum(len(x) for _, _, b in entries for x in b)
        # Appends continue after a restart and survive the next one.
        more = sample_entries(5, seed=99)
        append_all(store, loop, more)
        store, loop = self.restart(factory, store)
        store.close()
        store, _, recovered = self.open(factory)
        assert contents(store, recovered) == entries + more
        store.close()

    def test_broker_state_round_trip_across_restart(self, factory: StoreFactory) -> None:
        entries: list[Entry] = [
            queue_put("q0"),
            add_entry(1, b""),
            tx_entry([(2, b"a"), (3, b""), (4, b"bc" * 1000)], []),
            add_entry(5, bytes(300_000), client_id="big", headers={"k": "v"}),
            tx_entry([], [2]),  # a transaction of acks only
            *broker_entries(80, first_id=10),
        ]
        store, loop, _ = self.open(factory)
        refs = append_all(store, loop, entries)
        assert [store.read_body(ref) for ref in refs[2]] == [b"a", b"", b"bc" * 1000]
        assert [store.body_size(ref) for ref in refs[3]] == [300_000]
        store.close()
        store, loop, recovered = self.open(factory)
        state = assert_same_state(store, recovered, entries)
        # Once the broker released what replay found dead, only live bodies count.
        assert store.stats().live_bodies == len(state.messages)
        assert store.stats().live_body_bytes == sum(len(m[-1]) for m in state.messages)
        # Appends continue after a restart and survive the next one.
        more = broker_entries(6, seed=99, first_id=100_000)
        append_all(store, loop, more)
        store, loop = self.restart(factory, store)
        store.close()
        store, _, recovered = self.open(factory)
        assert_same_state(store, recovered, entries + more)
        store.close()

    def test_bodies_readable_at_once(self, factory: StoreFactory) -> None:
        store, loop, _ = self.open(factory)
        done = Completions()
        bodies = [bytes([n]) * (n * 100) for n in range(40)]
        refs = [store.append(*add_entry(n + 1, body)[:2], [body], done.callback(n))
                for n, body in enumerate(bodies)]
        assert [store.read_body(r) for (r,) in refs] == bodies
        loop.run_until(lambda: len(done) == len(bodies))
        assert [store.read_body(r) for (r,) in refs] == bodies
        store.close()

    def test_callbacks_exactly_once_in_append_order(self, factory: StoreFactory) -> None:
        store, loop, _ = self.open(factory)
        done = Completions()
        for n, (kind, meta, bodies) in enumerate(self.workload(factory, 500)):
            store.append(kind, meta, bodies, done.callback(n))
            if n % 97 == 0:
                loop.run_pending()
        loop.run_until(lambda: len(done) == 500)
        store.close()
        loop.run_pending()
        assert done.calls == [(n, None) for n in range(500)]

    def test_group_commit(self, factory: StoreFactory) -> None:
        store, loop, _ = self.open(factory)
        done = Completions()
        adds = [add_entry(n + 1, b"x" * 100) for n in range(2000)]
        for n, (kind, meta, bodies) in enumerate(adds):
            store.append(kind, meta, bodies, done.callback(n))
        loop.run_until(lambda: len(done) == 2000)
        stats = store.stats()
        assert done.calls == [(n, None) for n in range(2000)]
        assert stats.appends == 2000
        assert 1 <= stats.syncs <= stats.appends // 10, stats
        assert loop.calls <= stats.syncs  # one dispatch per batch, not per entry
        assert stats.bytes_written >= 2000 * 100
        store.close()

    def test_misuse_is_refused(self, factory: StoreFactory) -> None:
        store = factory.open()
        with pytest.raises(StoreError):
            store.append(1, b"", [], lambda error: None)
        recover(store)
        with pytest.raises(StoreError):
            store.recover()
        store.close()
        store.close()  # idempotent
        with pytest.raises(StoreError):
            store.append(1, b"", [], lambda error: None)

    # -- locking -------------------------------------------------------------

    def test_lock_prevents_a_second_open(self, factory: StoreFactory) -> None:
        first, _, _ = self.open(factory)
        second = factory.open()
        with pytest.raises(StoreLocked, match=re.escape(factory.location_name)):
            second.recover()
        second.close()
        first.close()
        third, _, _ = self.open(factory)
        third.close()

    # -- space ---------------------------------------------------------------

    def test_release_updates_live_counts(self, factory: StoreFactory) -> None:
        store, loop, _ = self.open(factory)
        refs = append_all(
            store, loop, [tx_entry([(1, b"x" * 100), (2, b"y" * 50)], []), add_entry(3, b"z" * 7)]
        )
        store.release(refs[0][0])
        store.release(refs[1][0])
        stats = store.stats()
        assert (stats.live_bodies, stats.live_body_bytes) == (1, 50)
        assert store.maintain() is None
        assert store.read_body(refs[0][1]) == b"y" * 50
        store.close()

    def test_release_and_maintain_reclaim_space(self, factory: StoreFactory) -> None:
        if SEGMENTS not in factory.features:
            pytest.skip("store has no segments to reclaim")
        snapshots = iter(range(10**6))
        store, loop, _ = self.open(
            factory,
            small_segments=True,
            snapshot_provider=lambda: (1, b"snap-%d" % next(snapshots)),
        )
        body_of = {n: bytes([n % 251]) * 1000 for n in range(300)}
        refs = append_all(store, loop, [(4, b"%d" % n, [body_of[n]]) for n in range(300)])
        live = {ref_list[0]: n for n, ref_list in enumerate(refs) if n % 10 == 0}
        for ref_list in refs:
            if ref_list[0] not in live:
                store.release(ref_list[0])
        segments_before = store.stats().segments
        idle = 0
        for _ in range(1000):
            relocation = store.maintain()
            if relocation is None:
                idle += 1
                if idle == 2:
                    break
                continue
            idle = 0
            for entry in relocation.entries:  # the broker's part: copy what still lives
                for ref in entry.refs:
                    if ref in live:
                        n = live.pop(ref)
                        [[new_ref]] = append_all(store, loop, [(10, b"%d" % n, [body_of[n]])])
                        live[new_ref] = n
                        store.release(ref)
        stats = store.stats()
        live_bytes = 1000 * len(live)
        assert (stats.live_bodies, stats.live_body_bytes) == (30, live_bytes)
        assert stats.segments < segments_before
        assert stats.disk_bytes <= 2 * live_bytes + factory.reclaim_slack, stats
        for ref, n in live.items():
            assert store.read_body(ref) == body_of[n]
        store.close()
        # After a restart the log starts with a snapshot and every live body is there.
        store, _, recovered = self.open(factory, small_segments=True)
        assert recovered[0].kind == 1 and recovered[0].meta.startswith(b"snap-")
        last_copy = {int(e.meta): e for e in recovered if e.kind in (4, 10)}
        assert {n: store.read_body(last_copy[n].refs[0]) for n in live.values()} == {
            n: body_of[n] for n in live.values()
        }
        store.close()

    def test_snapshot_is_written_at_each_roll(self, factory: StoreFactory) -> None:
        if SNAPSHOT not in factory.features:
            pytest.skip("store writes no snapshots")
        calls: list[int] = []

        def snapshot() -> tuple[int, bytes]:
            calls.append(len(calls))
            return 1, b"snap-%d" % (len(calls) - 1)

        store, loop, _ = self.open(factory, small_segments=True, snapshot_provider=snapshot)
        entries = [(4, b"%d" % n, [bytes(900)]) for n in range(200)]
        append_all(store, loop, entries)
        assert len(calls) >= 2
        store.close()
        store, _, recovered = self.open(factory, small_segments=True)
        snaps = [e.meta for e in recovered if e.kind == 1]
        assert snaps == [b"snap-%d" % n for n in calls]
        assert contents(store, [e for e in recovered if e.kind != 1]) == entries
        store.close()

    # -- failing syncs -------------------------------------------------------

    def test_failing_sync_fails_entries_and_later_appends(self, factory: StoreFactory) -> None:
        store, loop, _ = self.open(factory)
        first = add_entry(1, b"1" * 10)
        append_all(store, loop, [first])
        factory.crasher.fail_syncs(store)
        done = Completions()
        later = [add_entry(2, b"2"), (int(Kind.ACK), records.pack([1]), [])]
        for n, (kind, meta, bodies) in enumerate(later):
            try:
                store.append(kind, meta, bodies, done.callback(n))
            except StorageFailed:
                done.calls.append((n, StorageFailed("refused at append")))
        loop.run_until(lambda: len(done) == len(later))
        assert all(isinstance(error, StorageFailed) for _, error in done.calls), done.calls
        with pytest.raises(StorageFailed):
            store.append(*add_entry(3, b"3")[:2], [b"3"], done.callback(99))
        store.close()
        loop.run_pending()
        assert sorted(n for n, _ in done.calls) == [0, 1]  # exactly once, never "durable"
        store, _, recovered = self.open(factory)
        # Unacknowledged: may or may not be there.
        self.check_recovered_prefix(factory, store, recovered, [first, *later], at_least=1)
        store.close()

    # -- crashes -------------------------------------------------------------

    @pytest.mark.parametrize("how", ["header", "body", "crc"])
    def test_torn_last_entry_is_cut(self, factory: StoreFactory, how: str) -> None:
        entries = self.workload(factory, 6, seed=3, max_body=500)
        after: Entry = (5, b"after", [b"A"])
        if RECORDS in factory.features:
            entries[-1] = add_entry(50_000, b"L" * 800)
            after = tx_entry([(50_001, b"A")], [])
        else:
            entries[-1] = (4, b"last", [b"L" * 800])
        store, loop, _ = self.open(factory)
        append_all(store, loop, entries)
        store.close()
        factory.crasher.tear_last_entry(how)
        store, loop, recovered = self.open(factory)
        self.check_recovered(factory, store, recovered, entries[:-1])
        append_all(store, loop, [after])
        store, _ = self.restart(factory, store)
        store.close()
        store, _, recovered = self.open(factory)
        self.check_recovered(factory, store, recovered, [*entries[:-1], after])
        store.close()

    @pytest.mark.parametrize("entries_back", [1, 2, 5])
    def test_truncated_log_keeps_the_prefix(self, factory: StoreFactory, entries_back: int) -> None:
        if RECORDS in factory.features:
            pytest.skip("no log to cut; the store's own crash cases cover cut-short writes")
        entries = sample_entries(12, seed=entries_back)
        store, loop, _ = self.open(factory)
        append_all(store, loop, entries)
        store.close()
        factory.crasher.truncate_log(entries_back)
        store, _, recovered = self.open(factory)
        assert contents(store, recovered) == entries[:-entries_back]
        store.close()

    @pytest.mark.parametrize("damage", ["corrupt_old_entry", "truncate_old_segment"])
    def test_damage_in_an_old_segment_stops_recovery(
        self, factory: StoreFactory, damage: str
    ) -> None:
        if CORRUPTION not in factory.features:
            pytest.skip("store does not detect corruption")
        entries = [(4, b"%d" % n, [bytes([n]) * 700]) for n in range(60)]
        store, loop, _ = self.open(factory, small_segments=True)
        append_all(store, loop, entries)
        store.close()
        store, _, before = self.open(factory, small_segments=True)
        full = contents(store, before)
        store.close()
        damaged: Damaged = getattr(factory.crasher, damage)()
        store = factory.open(small_segments=True)
        with pytest.raises(CorruptStore) as caught:
            recover(store)
        store.close()
        assert (caught.value.path, caught.value.offset) == (damaged.path, damaged.offset)
        assert damaged.path in str(caught.value) and str(damaged.offset) in str(caught.value)
        # repair=True keeps everything else and says what it dropped.
        store, _, repaired = self.open(factory, small_segments=True, repair=True)
        assert contents(store, repaired) == [e for i, e in enumerate(full) if i not in damaged.lost]
        report: list[str] = getattr(store, "repair_report")  # noqa: B009
        assert report and any(damaged.path in line for line in report), report
        store.close()
        # The repair sticks: the next start needs no repair.
        store, _, again = self.open(factory, small_segments=True)
        assert len(again) == len(full) - len(damaged.lost)
        store.close()

    def test_killed_process_loses_nothing_acknowledged(self, factory: StoreFactory) -> None:
        spec = factory.child_spec()
        if PROCESS not in factory.features or spec is None:
            pytest.skip("store does not survive its process")
        rng = random.Random(2024)
        start = 0
        acknowledged: set[int] = set()
        for cycle in range(4):
            acked_now = run_and_kill(spec, start, kill_after=rng.uniform(0.15, 0.6))
            acknowledged |= acked_now
            store, _, recovered = self.open(factory)
            if RECORDS in factory.features:
                indices = self._child_records(store, recovered)
                acknowledged = {i for i in acknowledged if expected_body(i)[1]}
            else:
                indices = []
                for entry in recovered:
                    index = int(entry.meta)
                    meta, bodies = expected_body(index)
                    assert (entry.meta, [store.read_body(r) for r in entry.refs]) == (meta, bodies)
                    indices.append(index)
            store.close()
            assert indices == sorted(set(indices)), "entries out of order or duplicated"
            missing = acknowledged - set(indices)
            assert not missing, f"cycle {cycle}: acknowledged entries lost: {sorted(missing)[:10]}"
            assert acked_now, f"cycle {cycle}: the child acknowledged nothing"
            start = indices[-1] + 1

    @staticmethod
    def _child_records(store: Store, recovered: list[StoredEntry]) -> list[int]:
        """The child's entry numbers in a RECORDS store. Its child spec turns entry
        ``n`` (crash_payload.py) into messages whose client message ids are
        ``"n.j"`` (j-th body), all in one transaction (dirstore_payload.py)."""
        state = broker_state(recovered, store.read_body, store.body_size)
        parts: dict[int, list[int]] = {}
        for message in state.messages:
            index, part = map(int, message[2].split("."))
            assert message[-1] == expected_body(index)[1][part], f"entry {index}.{part} differs"
            parts.setdefault(index, []).append(part)
        for index, seen in parts.items():
            assert seen == list(range(len(expected_body(index)[1]))), \
                f"entry {index} is partly there: bodies {seen}"
        return list(parts)

    @settings(
        max_examples=25,
        deadline=None,
        # One method, run by each store's subclass: the factory fixture makes every
        # example start from a fresh location, so sharing examples is harmless.
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.differing_executors,
        ],
    )
    @given(
        entries=st.lists(
            st.tuples(
                st.integers(0, 65535),
                st.binary(max_size=100),
                st.lists(st.binary(max_size=5000), max_size=5),
            ),
            max_size=25,
        )
    )
    def test_round_trip_property(self, factory: StoreFactory, entries: list[Entry]) -> None:
        if RECORDS in factory.features:
            pytest.skip("no log: see test_broker_state_property")
        factory.fresh()
        store, loop, _ = self.open(factory, small_segments=True)
        append_all(store, loop, entries)
        store.close()
        store, _, recovered = self.open(factory, small_segments=True)
        assert contents(store, recovered) == entries
        store.close()

    @settings(
        max_examples=20,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.differing_executors,
        ],
    )
    @given(seed=st.integers(0, 2**32), count=st.integers(0, 60), max_body=st.integers(1, 3000))
    def test_broker_state_property(
        self, factory: StoreFactory, seed: int, count: int, max_body: int
    ) -> None:
        factory.fresh()
        entries = broker_entries(count, seed=seed, max_body=max_body)
        store, loop, _ = self.open(factory, small_segments=True)
        append_all(store, loop, entries)
        store.close()
        store, _, recovered = self.open(factory, small_segments=True)
        assert_same_state(store, recovered, entries)
        store.close()
