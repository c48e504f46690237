"""The ``Store`` protocol every message store implements.

Theory of operation
-------------------
A store is an ordered log of *entries*. An entry is ``(kind, meta, bodies)``:

* ``kind`` — a small int naming the record type (see ``core/records/__init__.py``);
  the store never interprets it, except that it writes the snapshot entry
  given by ``snapshot_provider`` first in every new segment;
* ``meta`` — opaque bytes (msgpack written by ``records.py``);
* ``bodies`` — zero or more message bodies. The store hands back one
  :data:`BodyRef` per body at ``append`` time; the broker keeps only the ref
  in memory and reads the body back with :meth:`Store.read_body` on delivery.

``append`` is called from the broker's event loop and returns at once; the
entry is written by the store's writer (group commit: many entries, one
write, one sync) and ``on_durable(None)`` is called — through the
``dispatch`` function given to the store, which the server sets to
``loop.call_soon_threadsafe`` — once the entry is durable under the sync mode.
Completions arrive in append order. If the write or the sync fails,
``on_durable(exc)`` is called with a :class:`~txbroker.errors.StorageFailed`
for that entry and every later one, and the store refuses further appends:
nothing is acknowledged without a successful sync.

``recover()`` opens the store and yields every entry in log order as
``(kind, meta, refs)``. The broker replays them to rebuild its state.

Body liveness drives space reclamation: the broker calls ``release(ref)``
when a stored message is gone (acked, expired, moved, purged). A segment (or
whatever unit the store uses) whose bodies are all released may be deleted
by ``maintain`` — only from the oldest end, so that delete/ack entries are
never dropped while the entries they cancel still exist. ``maintain`` also
returns the entries of the oldest segment when relocating pays (it is mostly
dead, or it pins dead segments behind it: ``journal_space.py``) so that the
broker can *relocate* its live messages (append a fresh copy, release the old
ref once the copy is durable), which lets the oldest segment go.

Every new segment starts with the snapshot entry returned by the store's
``snapshot_provider`` (queue definitions, subscriptions, duplicate-id
windows) so that deleting old segments never loses metadata; metadata
entries must therefore be idempotent on replay.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from txbroker.core.records import BodyRef as BodyRef
from txbroker.core.records import StoredEntry as StoredEntry
from txbroker.protocol.columns import split_bodies

#: ``BodyRef``: an opaque handle to a stored body (only the store that issued it
#: interprets it) and ``StoredEntry`` live in ``core/records/__init__.py`` (replay takes them).

#: Called once per entry when it is durable (``None``) or failed (the error).
DurableCallback = Callable[[BaseException | None], None]

#: Runs a completion on the broker's thread (``loop.call_soon_threadsafe``).
Dispatch = Callable[[Callable[[], None]], None]

#: Returns the ``(kind, meta)`` of a metadata snapshot: written first in each new segment.
SnapshotProvider = Callable[[], tuple[int, bytes]]


class PackedBodies(NamedTuple):
    """Many bodies back to back: what :meth:`Store.read_bodies` returns.

    A stream reader's page goes on the wire as ``data`` and ``lengths``
    (``protocol/columns.py``), so a store that keeps neighbouring bodies
    contiguous can hand over whole runs without cutting them into objects.
    """

    data: bytes  #: the bodies, concatenated in the order of the refs
    lengths: list[int]  #: the length of each body

    @classmethod
    def of(cls, bodies: Sequence[bytes]) -> PackedBodies:
        """Pack bodies that are already separate objects."""
        return cls(b"".join(bodies), [len(body) for body in bodies])

    def split(self) -> list[bytes]:
        """The bodies as separate objects."""
        return split_bodies(self.data, self.lengths)


class SyncMode:
    """How hard a store pushes data to the disk before calling it durable."""

    NONE = "none"  #: write() to the OS only (survives a process crash, not power loss)
    FDATASYNC = "fdatasync"  #: os.fdatasync after each group write (the default)
    FSYNC = "fsync"  #: os.fsync after each group write

    ALL = (NONE, FDATASYNC, FSYNC)


#: Upper bounds (seconds) of the buckets of the time a writer thread takes to write
#: and sync one group-commit batch: an fdatasync on an SSD is ~0.1-2 ms, a disk's ~10 ms.
BATCH_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Upper bounds of the buckets of the work items (mostly records) of one batch.
BATCH_ENTRIES_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


class Histogram:
    """Counts of observed values per bucket (``value <= bound``), their sum and
    count: filled by a store's writer thread, read by the loop for ``/metrics``
    (plain ints under the GIL: a reading may be one observation behind)."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  #: the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one value."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, values <= it)`` per bucket, the last bound ``inf``."""
        result, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            result.append((bound, running))
        return result


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters a store exposes for ``txbroker stat`` and the benchmarks."""

    appends: int  #: entries appended since open
    syncs: int  #: group syncs (fsync/fdatasync calls, or write batches in mode none)
    bytes_written: int
    segments: int
    disk_bytes: int
    live_bodies: int
    live_body_bytes: int
    #: bytes of bodies held in the store's LRU body cache now (bounded by its setting)
    body_cache_bytes: int = 0
    #: bytes the last recovery read from the store's files (what a restart costs:
    #: with compaction it follows the live data, not the history; with a recovery
    #: index it leaves out the bodies of sealed segments)
    recovered_bytes: int = 0
    #: files (segments) the last recovery read
    recovered_segments: int = 0
    #: entries the last recovery replayed (a warm standby's takeover: only those its
    #: core had not replayed yet)
    recovered_entries: int = 0
    #: the last recovery read a recovery checkpoint (then only the log after it)
    recovered_from_checkpoint: bool = False
    #: seconds to write and sync each group-commit batch (None: not measured)
    batch_seconds: Histogram | None = None
    #: work items (records) per batch: the group commit's size
    batch_entries: Histogram | None = None


@dataclass(frozen=True, slots=True)
class Relocation:
    """Relocating the oldest segment pays (it is mostly dead, or it pins dead
    segments): its entries, so the broker can copy live messages forward (decode
    ``meta``, keep those whose ref is still current)."""

    segment: int
    entries: tuple[StoredEntry, ...]


@runtime_checkable
class Store(Protocol):
    """What the broker needs from a message store. See the module docstring."""

    def recover(self) -> Iterator[StoredEntry]:
        """Open the store (once) and yield every stored entry in log order."""
        ...

    def append(
        self,
        kind: int,
        meta: bytes,
        bodies: Sequence[bytes],
        on_durable: DurableCallback,
    ) -> list[BodyRef]:
        """Queue an entry for the writer; return one ref per body at once."""
        ...

    def read_body(self, ref: BodyRef) -> bytes:
        """Read a stored body back (from cache or disk)."""
        ...

    def read_bodies(self, refs: Sequence[BodyRef]) -> PackedBodies:
        """Read many bodies back (a stream reader's page), packed back to back: like
        ``read_body`` for each, but a store may read neighbours at once and skip its
        cache."""
        ...

    def body_size(self, ref: BodyRef) -> int:
        """The length of the body ``ref`` names, without reading it."""
        ...

    def release(self, ref: BodyRef) -> None:
        """The body is dead: its space may be reclaimed."""
        ...

    def maintain(self, relocate: bool = True) -> Relocation | None:
        """Delete fully dead oldest segments; maybe ask to relocate live bodies (never
        when ``relocate`` is False: a replicated backup, whose copies the primary's
        own relocations move)."""
        ...

    def stats(self) -> StoreStats:
        """Current counters."""
        ...

    def close(self) -> None:
        """Flush what is queued, sync, stop the writer and close files."""
        ...


class CheckpointStore(Protocol):
    """A store that keeps a recovery checkpoint next to its log (the journal with
    ``checkpoints``: ``storage/journal_checkpoint.py``): taken at a clean shutdown or
    while the broker runs, handed back at recovery with the log that follows it."""

    #: it accepts checkpoints and hands one back at recovery
    checkpoints: bool

    def checkpoint_mark(self, appends: int) -> Any:
        """Where the log ends now, for a checkpoint taken after ``appends`` entries, all
        synced and completed (None: more were appended since, or the store failed)."""
        ...

    def write_checkpoint(self, mark: Any, kind: int, meta: bytes) -> bool:
        """Write the checkpoint ``(kind, meta)`` of ``mark`` (from any thread)."""
        ...

    @property
    def appends(self) -> int:
        """Entries appended since open: the mark of a checkpoint taken now."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything appended is written, synced and completed."""
        ...

    def close(self, checkpoint: tuple[int, bytes, int] | None = None) -> None:
        """Close; with ``(kind, meta, appends)``, write that checkpoint if the store
        still has exactly ``appends`` entries."""
        ...
