"""An in-memory store with the journal's semantics, for the broker's unit tests.

Theory of operation
-------------------
Like ZODB's ``MappingStorage``: the same :class:`~txbroker.storage.interface.Store`
protocol as the journal, kept in Python objects. The durable state lives in a
:class:`MemoryState` that outlives any one store, so a test can simulate a
restart: ``store.close(); store = store.reopen()`` (clean) or
``store.crash(); store = store.reopen()`` (a kill: what was not yet "synced"
is lost). The new store's :meth:`MemoryStore.recover` replays what survived.

Group commit is modelled too: ``append`` queues the entry and, if no sync is
scheduled yet, schedules one through ``dispatch``. With the default inline
dispatch the sync runs at once (inside ``append``: the callback fires before
``append`` returns); with a deferring dispatch (``loop.call_soon_threadsafe``
or a test's queue) every append made before the sync runs joins the same
batch — one sync, completions in append order.

Fault injection: ``store.sync_step`` is called for each group sync; replace
it with a function that raises ``OSError`` and the batch (and everything
after) fails with ``StorageFailed``, as the journal does.

Bodies: refs are small ints. ``release`` marks a body dead; ``maintain``
drops dead bodies (their refs become unreadable) and never relocates.
Entries themselves are kept (there is no snapshot to stand in for them).

Recovery checkpoints (``checkpoints=True``, the simulator's broker with
``recovery_checkpoint``): as the journal's (``storage/journal_checkpoint.py``), a
checkpoint is the state at a mark — here the number of durable entries and the bodies
live then — kept in the state (:attr:`MemoryState.checkpoint`, the "file"), taken by
the next recovery (deleted whatever it reads), which hands back its entry and then the
entries after the mark; not used when the log is shorter than the mark (a lying disk
lost synced entries). :meth:`flush` syncs and completes what is queued at once, on the
caller's thread: the simulator's executor runs it on the loop's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from txbroker.errors import StorageFailed, StoreError, StoreLocked
from txbroker.storage.interface import (
    BodyRef,
    Dispatch,
    DurableCallback,
    PackedBodies,
    Relocation,
    SnapshotProvider,
    StoredEntry,
    StoreStats,
)


@dataclass
class MemoryState:
    """What a memory store has made "durable"; shared by successive stores."""

    entries: list[StoredEntry] = field(default_factory=list)
    bodies: dict[BodyRef, bytes] = field(default_factory=dict)
    #: Length of every body ever stored (``body_size`` works after reclaim, as
    #: replay of old entries needs it).
    sizes: dict[BodyRef, int] = field(default_factory=dict)
    next_ref: BodyRef = 1
    #: True while a store that recovered this state is open (the "directory lock").
    locked: bool = False
    #: A name for messages (tests may set it to say which "directory" this is).
    name: str = "memory"
    #: the recovery checkpoint "file": (mark, kind, meta) — see the module docstring
    checkpoint: tuple[MemoryMark, int, bytes] | None = None


@dataclass(frozen=True)
class MemoryMark:
    """A memory store's checkpoint mark: durable entries, and the bodies live then."""

    entries: int
    live: dict[BodyRef, int]


def _no_fault() -> None:
    """The default sync step: memory is always durable."""


class MemoryStore:
    """In-memory :class:`~txbroker.storage.interface.Store`.

    ``MemoryStore()`` starts empty; ``MemoryStore(state)`` opens an existing
    :class:`MemoryState` (a restart). ``snapshot_provider`` and ``repair``
    are accepted for signature compatibility and unused. Recovery yields every
    entry appended, in order (``keeps_log``).
    """

    keeps_log = True

    def __init__(
        self,
        state: MemoryState | None = None,
        *,
        dispatch: Dispatch | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        repair: bool = False,
        checkpoints: bool = False,
    ) -> None:
        self.state = state if state is not None else MemoryState()
        #: it keeps recovery checkpoints (see the module docstring)
        self.checkpoints = checkpoints
        self._recovered_entries = 0
        self._from_checkpoint = False
        self.dispatch = dispatch
        self.snapshot_provider = snapshot_provider
        #: Always empty: nothing in memory gets damaged.
        self.repair_report: list[str] = []
        #: Called once per group sync; replace it to inject a failing sync.
        self.sync_step: Callable[[], None] = _no_fault
        self._repair = repair
        self._pending: list[tuple[StoredEntry, DurableCallback]] = []
        self._sync_scheduled = False
        self._failure: StorageFailed | None = None
        self._live: dict[BodyRef, int] = {}
        self._dead: list[BodyRef] = []
        #: released while entries were queued unsynced (one of them may be what killed
        #: the body): reclaimable only once they are synced, as the journal deletes a
        #: dead segment only after syncing what was queued before (a crash before that
        #: sync brings the body's message back, and its body must still be there)
        self._dead_unsynced: list[BodyRef] = []
        self._recovered = False
        self._open = False
        self._closed = False
        self._appends = 0
        self._syncs = 0
        self._bytes_written = 0

    # -- Store protocol ----------------------------------------------------

    def recover(self) -> Iterator[StoredEntry]:
        """Take the state's lock and return its durable entries in order."""
        if self._recovered or self._closed:
            raise StoreError("recover() may be called only once, on a new MemoryStore")
        if self.state.locked:
            raise StoreLocked(f"{self.state.name} is in use by another open store")
        self.state.locked = True
        self._recovered = True
        entries = list(self.state.entries)
        found, self.state.checkpoint = self.state.checkpoint, None
        if found is not None and self.checkpoints and found[0].entries <= len(entries):
            mark, kind, meta = found
            self._live = {ref: size for ref, size in mark.live.items()
                          if ref in self.state.bodies}
            entries = [StoredEntry(kind, meta, ()), *entries[mark.entries:]]
            self._from_checkpoint = True
        for entry in entries:
            for ref in entry.refs:
                body = self.state.bodies.get(ref)
                if body is not None:
                    self._live[ref] = len(body)
        self._recovered_entries = len(entries)
        self._open = True
        return iter(entries)

    def append(
        self,
        kind: int,
        meta: bytes,
        bodies: Sequence[bytes],
        on_durable: DurableCallback,
    ) -> list[BodyRef]:
        """Queue the entry; schedule a group sync through ``dispatch`` if none is."""
        if self._failure is not None:
            raise StorageFailed(str(self._failure))
        if not self._open:
            raise StoreError("the memory store is not open (recover() first; not after close)")
        refs = list(range(self.state.next_ref, self.state.next_ref + len(bodies)))
        self.state.next_ref += len(bodies)
        for ref, body in zip(refs, bodies, strict=True):
            self.state.bodies[ref] = bytes(body)
            self.state.sizes[ref] = self._live[ref] = len(body)
        self._pending.append((StoredEntry(kind, bytes(meta), tuple(refs)), on_durable))
        self._appends += 1
        if not self._sync_scheduled:
            self._sync_scheduled = True
            self._run(self._group_sync)
        return refs

    def read_bodies(self, refs: Sequence[BodyRef]) -> PackedBodies:
        """``read_body`` of each ref, packed."""
        return PackedBodies.of([self.read_body(ref) for ref in refs])

    def read_body(self, ref: BodyRef) -> bytes:
        """The body; ``KeyError`` if it was reclaimed or never existed."""
        try:
            return self.state.bodies[ref]
        except KeyError:
            raise KeyError(f"body ref {ref} does not exist (any more)") from None

    def body_size(self, ref: BodyRef) -> int:
        """The body's length (known even after the body was reclaimed)."""
        try:
            return self.state.sizes[ref]
        except KeyError:
            raise KeyError(f"body ref {ref} was never stored") from None

    def release(self, ref: BodyRef) -> None:
        """Mark the body dead; ``maintain`` reclaims it."""
        if self._live.pop(ref, None) is not None:
            (self._dead_unsynced if self._pending else self._dead).append(ref)

    def maintain(self, relocate: bool = True) -> Relocation | None:
        """Drop dead bodies. Memory never asks for relocation."""
        for ref in self._dead:
            self.state.bodies.pop(ref, None)
        self._dead.clear()
        return None

    def stats(self) -> StoreStats:
        """Counters; ``disk_bytes`` is the durable metas plus the stored bodies."""
        return StoreStats(
            appends=self._appends,
            syncs=self._syncs,
            bytes_written=self._bytes_written,
            segments=1,
            disk_bytes=sum(len(entry.meta) for entry in self.state.entries)
            + sum(len(body) for body in self.state.bodies.values()),
            live_bodies=len(self._live),
            live_body_bytes=sum(self._live.values()),
            recovered_entries=self._recovered_entries,
            recovered_from_checkpoint=self._from_checkpoint,
        )

    @property
    def appends(self) -> int:
        """Entries appended since open (a checkpoint's mark: :meth:`checkpoint_mark`)."""
        return self._appends

    def flush(self, timeout: float | None = None) -> None:
        """Sync and complete what is queued, at once (see the module docstring)."""
        complete = self._sync_now() if self._open else None
        if complete is not None:
            complete()
        if self._failure is not None:
            raise StorageFailed(str(self._failure))

    def checkpoint_mark(self, appends: int) -> MemoryMark | None:
        """The mark of a checkpoint taken after ``appends`` entries, all durable (None:
        more since, something queued, failed, or no checkpoints kept)."""
        if not self.checkpoints or not self._open or appends != self._appends \
                or self._pending or self._failure is not None:
            return None
        return MemoryMark(len(self.state.entries), dict(self._live))

    def write_checkpoint(self, mark: MemoryMark, kind: int, meta: bytes) -> bool:
        """Keep the checkpoint ``(kind, meta)`` of ``mark`` in the state."""
        self.state.checkpoint = (mark, kind, bytes(meta))
        return True

    def close(self, checkpoint: tuple[int, bytes, int] | None = None) -> None:
        """Sync what is queued (completions through ``dispatch``) and unlock; with
        ``(kind, meta, appends)`` keep that checkpoint if nothing was appended since.
        Idempotent."""
        if self._closed:
            return
        if checkpoint is not None:
            mark = self.checkpoint_mark(checkpoint[2])
            if mark is not None:
                self.write_checkpoint(mark, checkpoint[0], checkpoint[1])
        complete = self._sync_now()
        self._release_lock()
        if complete is not None:
            self._run(complete)

    # -- restarts ----------------------------------------------------------

    def crash(self) -> None:
        """Die like a killed process: queued entries are lost, callbacks never run."""
        if self._closed:
            return
        for entry, _callback in self._pending:
            for ref in entry.refs:
                self.state.bodies.pop(ref, None)
        self._pending.clear()
        self._release_lock()

    def reopen(self, *, dispatch: Dispatch | None = None) -> MemoryStore:
        """A fresh store over the same state (closes this one cleanly if still open).

        Call :meth:`recover` on the result, as after a restart.
        """
        self.close()
        store = MemoryStore(
            self.state,
            dispatch=dispatch if dispatch is not None else self.dispatch,
            snapshot_provider=self.snapshot_provider,
            repair=self._repair,
            checkpoints=self.checkpoints,
        )
        return store

    # -- internals ---------------------------------------------------------

    def _release_lock(self) -> None:
        if self._recovered and not self._closed:
            self.state.locked = False
        self._open = False
        self._closed = True

    def _run(self, thunk: Callable[[], None]) -> None:
        if self.dispatch is None:
            thunk()
        else:
            self.dispatch(thunk)

    def _group_sync(self) -> None:
        """One scheduled group commit, run on the broker's thread."""
        complete = self._sync_now()
        if complete is not None:
            complete()

    def _sync_now(self) -> Callable[[], None] | None:
        """Make every queued entry durable (or fail them); return their completions."""
        self._sync_scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return None
        callbacks = [callback for _entry, callback in batch]
        if self._failure is None:
            try:
                self.sync_step()
            except OSError as exc:
                self._failure = StorageFailed(f"memory store sync failed: {exc}")
        failure = self._failure
        if failure is not None:
            for entry, _callback in batch:
                for ref in entry.refs:
                    self.state.bodies.pop(ref, None)
                    self._live.pop(ref, None)
        else:
            for entry, _callback in batch:
                self.state.entries.append(entry)
                self._bytes_written += len(entry.meta) + sum(
                    self.state.sizes[ref] for ref in entry.refs
                )
            self._syncs += 1
            self._dead += self._dead_unsynced
            self._dead_unsynced.clear()

        def complete() -> None:
            for callback in callbacks:
                callback(None if failure is None else StorageFailed(str(failure)))

        return complete

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
