"""A tiny edge for core tests: runs effects with an in-memory log, no I/O — or, with
``store=``, over a real store.

``Harness.sync()`` makes everything appended durable (group commit in one go);
``Harness.crash()`` forgets what was not synced and replays the log into a
fresh Broker, exactly as a restart would.

Store mode (``Harness(store=StoreOpener("dir", path))``): the durable log is a real
store (``txbroker.storage``). ``sync()`` appends the pending entries to it, waits
for their durability (``store.flush()``) and only then runs their ``on_durable`` on
the harness's thread; body refs are the ones the store returns, bodies are read
back with ``store.read_body`` and ``Release`` effects call ``store.release``.
``crash()`` closes the store (only synced entries were ever appended, so closing
loses nothing that should survive; un-synced ``pending`` entries are dropped as in
the in-memory mode), opens a new store object on the same directory and replays
what its ``recover()`` yields. A dir store yields a compacted equivalent state
(SNAPSHOT, ADDs, prepared branches), not the log: after a crash ``log`` holds the
recovered entries, so tests that edit ``log`` or expect it to be the history are
for the in-memory log only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from txbroker.core import LATER, Broker, Limits
from txbroker.core.effects import (
    Cancelled,
    Continue,
    Deliver,
    Fail,
    Notify,
    Persist,
    Release,
    Reply,
)
from txbroker.storage.dirstore import DirStore
from txbroker.storage.interface import Store, StoredEntry
from txbroker.storage.journal import JournalStore

#: The dir store's flags in store mode: the ones that promise the journal's durability
#: (docs/dirstore.md), as issue 17 asks the XA suites to run on.
DIR_FLAGS = "FDATASYNC,DSYNC"
#: Seconds a harness waits for a store's group commit before calling the store stuck.
FLUSH_TIMEOUT = 60.0


class StoreOpener:
    """Opens a store of one ``kind`` ("dir" or "journal") on one directory: each call is
    a new store object on the same data (a restart). Remembers what it opened, so that
    :meth:`close` stops every writer thread at the end of a test."""

    def __init__(self, kind: str, directory: Path) -> None:
        if kind not in ("dir", "journal"):
            raise ValueError(f"unknown store kind {kind!r}")
        self.kind = kind
        self.directory = directory
        self.opened: list[Store] = []

    def __call__(self) -> Store:
        store: Store
        if self.kind == "dir":
            store = DirStore(self.directory, flags=DIR_FLAGS)
        else:
            store = JournalStore(self.directory)
        self.opened.append(store)
        return store

    def close(self) -> None:
        for store in self.opened:
            store.close()

    def __repr__(self) -> str:
        return f"StoreOpener({self.kind!r}, {str(self.directory)!r})"


@dataclass
class Delivery:
    session: int
    sub: int
    rid: int
    tag: int
    message_id: int
    queue: str
    body: bytes
    redelivered: bool
    delivery_count: int
    headers: dict[str, str] | None


@dataclass
class Harness:
    limits: Limits = field(default_factory=Limits)
    auto_sync: bool = True
    now: int = 1_000_000
    auto_continue: bool = True
    #: None: the in-memory log; else opens the real store the durable log lives in
    store: StoreOpener | None = None

    def __post_init__(self) -> None:
        self.broker = Broker(self.limits)
        self.log: list[tuple[int, bytes, list[int]]] = []  # durable entries
        self.pending: list[tuple[Persist, list[int]]] = []
        self.bodies: dict[int, bytes] = {}
        self.released: set[int] = set()
        self.next_ref = 1
        self.replies: dict[tuple[int, int], Any] = {}
        self.errors: dict[tuple[int, int], Exception] = {}
        self.deliveries: list[Delivery] = []
        self.cancelled: list[tuple[int, int]] = []
        self.continues: list[Continue] = []
        #: router pushes: (session, body) in order
        self.pushes: list[tuple[int, dict[str, Any]]] = []
        self.durable_store: Store | None = None
        if self.store is None:
            self.broker.body_size_of = lambda ref: len(self.bodies[ref])
        else:
            self._open_store(self.store)

    def _open_store(self, opener: StoreOpener) -> None:
        """Open the store and replay what it recovers into the broker (and ``log``)."""
        store = self.durable_store = opener()
        self.broker.body_size_of = store.body_size
        for entry in store.recover():
            self.log.append((entry.kind, entry.meta, list(entry.refs)))
            self.broker.replay(entry)

    def read_body(self, ref: int) -> bytes:
        """A stored body, by its ref."""
        if self.durable_store is not None:
            return self.durable_store.read_body(ref)
        return self.bodies[ref]

    # -- running effects ----------------------------------------------------
    def run(self) -> None:
        """Carry out the effects; with ``auto_continue``, run long work (``Continue``)
        to its end as later loop turns would."""
        self._run_effects()
        while self.auto_continue and self.continues:
            self.continues.pop(0).step(self.now)
            self._run_effects()

    def next_turn(self) -> bool:
        """Run one pending ``Continue`` step (a later loop turn); False if none."""
        if not self.continues:
            return False
        self.continues.pop(0).step(self.now)
        self._run_effects()
        return True

    def _run_effects(self) -> None:
        for effect in self.broker.take_effects():
            if isinstance(effect, Persist):
                refs = []
                if self.durable_store is None:  # store mode: the store gives refs at sync
                    for body in effect.bodies:
                        ref = self.next_ref
                        self.next_ref += 1
                        self.bodies[ref] = body
                        refs.append(ref)
                    if effect.on_refs is not None:
                        effect.on_refs(refs)
                self.pending.append((effect, refs))
            elif isinstance(effect, Reply):
                self.replies[(effect.session, effect.rid)] = effect.result
            elif isinstance(effect, Fail):
                self.errors[(effect.session, effect.rid)] = effect.error
            elif isinstance(effect, Deliver):
                m = effect.message
                body = m.body if m.body is not None else self.read_body(m.ref)  # type: ignore[arg-type]
                d = Delivery(effect.session, effect.sub, effect.rid, effect.tag, m.id, m.queue,
                             body, effect.redelivered, m.delivery_count, m.headers)
                self.deliveries.append(d)
                if effect.rid:
                    self.replies[(effect.session, effect.rid)] = d
            elif isinstance(effect, Release):
                assert effect.ref not in self.released, f"double release of {effect.ref}"
                self.released.add(effect.ref)
                if self.durable_store is not None:
                    self.durable_store.release(effect.ref)
            elif isinstance(effect, Cancelled):
                self.cancelled.append((effect.session, effect.sub))
            elif isinstance(effect, Continue):
                self.continues.append(effect)
            elif isinstance(effect, Notify):
                self.pushes.append((effect.session, effect.body))
        if self.auto_sync and self.pending:
            self.sync()

    def sync(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            if self.durable_store is not None:
                outcomes = self._store_batch(batch)
            else:
                outcomes = [None] * len(batch)
                for effect, refs in batch:
                    self.log.append((effect.kind, effect.meta, refs))
            self.broker.set_now(self.now)
            for (effect, _), outcome in zip(batch, outcomes, strict=True):
                effect.on_durable(outcome)
            self.run_effects_only()

    def _store_batch(self, batch: list[tuple[Persist, list[int]]]
                     ) -> list[BaseException | None]:
        """Append a batch to the store (one group commit) and wait for it; the
        completions the store reported, in append order."""
        store = self.durable_store
        assert store is not None
        outcomes: dict[int, BaseException | None] = {}
        for n, (effect, _) in enumerate(batch):

            def on_durable(error: BaseException | None, n: int = n) -> None:
                outcomes[n] = error  # on the store's writer thread: record only

            refs = store.append(effect.kind, effect.meta, effect.bodies, on_durable)
            if effect.on_refs is not None:
                effect.on_refs(refs)
            self.log.append((effect.kind, effect.meta, refs))
        store.flush(FLUSH_TIMEOUT)  # type: ignore[attr-defined]
        assert sorted(outcomes) == list(range(len(batch))), "a completion is missing"
        return [outcomes[n] for n in range(len(batch))]

    def run_effects_only(self) -> None:
        auto, self.auto_sync = self.auto_sync, False
        try:
            self.run()
        finally:
            self.auto_sync = auto

    def fail_pending(self, error: Exception) -> None:
        batch, self.pending = self.pending, []
        for effect, _ in batch:
            effect.on_durable(error)
        self.run_effects_only()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.broker, method)(*args, **kwargs)
        self.run()
        return result

    # -- convenience ----------------------------------------------------------
    def session(self, sid: int = 1) -> int:
        self.broker.open_session(sid)
        return sid

    def send(self, sid: int, rid: int, dest: str, body: bytes, **kw: Any) -> Any:
        result = self.call("send", sid, rid, dest, body, self.now, **kw)
        if result is LATER:
            return self.replies.get((sid, rid), LATER)
        return result

    def receive(self, sid: int, rid: int, queue: str, timeout: int | None = 0) -> Any:
        result = self.call("receive", sid, rid, queue, self.now, timeout)
        if result is LATER:
            return self.replies.get((sid, rid), LATER)
        return result

    def receive_marked(self, sid: int, rid: int, queue: str) -> Any:
        """``receive`` for tests without ``auto_sync``: a delivery the queue's delivered
        mark holds back (core/delivered_mark.py) goes out after one sync — which also
        makes whatever else is pending durable, so call it with nothing pending."""
        result = self.receive(sid, rid, queue)
        if result is LATER and (sid, rid) not in self.replies and self.pending:
            self.sync()
            result = self.replies.get((sid, rid), LATER)
        return result

    def tick(self, ms: int) -> None:
        self.now += ms
        self.call("tick", self.now)

    def crash(self) -> Harness:
        """A restart: only synced entries survive; replay them into a new broker."""
        if self.durable_store is not None:
            # only synced entries were appended: closing loses nothing that should survive
            self.durable_store.close()
            fresh = Harness(self.limits, self.auto_sync, self.now, store=self.store)
        else:
            fresh = Harness(self.limits, self.auto_sync, self.now)
            fresh.bodies = dict(self.bodies)
            fresh.next_ref = self.next_ref
            fresh.log = list(self.log)
            for kind, meta, refs in self.log:
                fresh.broker.replay(StoredEntry(kind, meta, tuple(refs)))
        fresh.broker.finish_recovery(self.now)
        fresh.released = set()
        problems = fresh.broker.restore_router(
            lambda m: fresh.read_body(m.ref), self.now)  # type: ignore[arg-type]
        assert not problems, problems
        fresh.run()
        return fresh

    def live_bodies(self) -> set[int]:
        return {m.ref for m in self.broker.messages.values() if m.ref is not None}
