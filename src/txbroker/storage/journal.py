"""The journal store: a segmented append-only log with CRCs and group commit.

Theory of operation
-------------------
``DIR/journal/`` holds numbered segment files (byte format:
:mod:`txbroker.storage.journal_format`) and a ``lock`` file. :meth:`recover`
locks the directory (``flock``), replays every segment
(:mod:`~txbroker.storage.journal_recovery`) and starts the writer thread
(:mod:`~txbroker.storage.journal_writer`).

:meth:`append` runs on the broker's thread and does no I/O: it picks the
entry's place — the end of the head segment, or the start of a new one when
the entry does not fit (*roll*; the new segment begins with the snapshot
from ``snapshot_provider``) — computes the body refs from that place, queues
the entry for the writer and caches the bodies. The writer writes each batch
with one ``pwrite`` per segment and one sync, then dispatches the batch's
completions in one call.

A snapshot takes at most half of its segment: when it is bigger than half of
``segment_size`` (say a duplicate-id window of 60,000 ids in 128 KiB
segments), the segment grows to twice the snapshot before the next roll —
else every append would roll, and write, a segment of its own. A head that
lost its snapshot (a kill tore the roll's first write) gets a new segment with
a snapshot at the first append or ``maintain``, before an older segment can go.

Space: each segment keeps a count of live bodies and live body bytes.
Recovery counts every body live; :meth:`release` marks one dead.
:meth:`maintain` deletes dead segments from the oldest end (through the
writer, after the sync of everything queued before), and offers the oldest
sealed segment for *relocation* when that pays: copying its live messages
(bodies, and per body the segment's average record overhead) writes less than
:data:`RELOCATE_BELOW_LIVE_FRACTION` of what deleting it frees (its size less
its snapshot).

Threading: ``append``, ``read_body``, ``release``, ``maintain`` and ``stats``
belong to one thread (the broker's event loop); only the writer thread
writes, syncs or unlinks.
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
from collections import OrderedDict
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from operator import add, and_, ne, rshift
from pathlib import Path
from types import TracebackType

from txbroker.errors import CorruptStore, StorageFailed, StoreError
from txbroker.storage.interface import (
    BodyRef,
    Dispatch,
    DurableCallback,
    PackedBodies,
    Relocation,
    SnapshotProvider,
    StoredEntry,
    StoreStats,
    SyncMode,
)
from txbroker.storage.journal_format import (
    ENTRY_HEADER,
    ENTRY_OVERHEAD,
    MAX_BODIES,
    MAX_ENTRY_SIZE,
    MAX_KIND,
    REF_LENGTH_BITS,
    REF_OFFSET_BITS,
    REF_SEGMENT_SHIFT,
    SEGMENT_HEADER,
    segment_name,
    unpack_ref,
)
from txbroker.storage.journal_recovery import (
    RecoveredSegment,
    Recovery,
    list_segments,
    lock_directory,
    read_segment_entries,
)
from txbroker.storage.journal_writer import (
    Delete,
    EntryItem,
    GroupCommitWriter,
    Roll,
)
from txbroker.storage.writer_thread import Barrier, PendingQueue

log = logging.getLogger("txbroker.journal")
_REF_LENGTH_MASK = (1 << REF_LENGTH_BITS) - 1
_REF_OFFSET_MASK = (1 << REF_OFFSET_BITS) - 1
_ENTRY_HEADER_SIZE = ENTRY_HEADER.size

MiB = 1024 * 1024
#: Default segment size. Artemis uses 10 MiB journal files, Kafka 1 GiB log
#: segments; a 64 MiB segment replays in about 0.2 s and reclaims space in
#: reasonable steps.
DEFAULT_SEGMENT_SIZE = 64 * MiB
#: Smallest segment size accepted (tests use tiny segments to force rolls).
MIN_SEGMENT_SIZE = 1024
#: Largest segment size: body offsets in a ref have 40 bits; 4 GiB keeps far below.
MAX_SEGMENT_SIZE = 4 * 1024 * MiB
#: Default bound of the body cache: enough for the bodies in flight to
#: consumers of a busy broker without holding the whole journal in memory.
DEFAULT_BODY_CACHE_BYTES = 32 * MiB
#: ``maintain`` offers the oldest sealed segment for relocation when copying its
#: live messages (``SegmentInfo.copy_bytes``) writes less than this fraction of
#: its size less its snapshot (Artemis compacts at 30 % live; 0.5 bounds disk
#: use to about twice the live data).
RELOCATE_BELOW_LIVE_FRACTION = 0.5
#: If an offered segment is still there after this many ``maintain`` calls
#: (the broker could not move everything yet), offer it again: about a minute
#: at the server's default 1 s maintain interval.
RELOCATION_RETRY_CALLS = 60
#: Relocate only once the journal has this many segments (Artemis compacts from
#: journal-compact-min-files = 10; with 64 MiB segments 4 is a similar amount).
RELOCATE_MIN_SEGMENTS = 4
#: A segment rolls at ``segment_size`` bytes, or at this multiple of its snapshot
#: when that is bigger: a snapshot takes at most half of its segment, however
#: big it grows (a snapshot over ``segment_size`` made every append roll).
SNAPSHOT_SEGMENT_FACTOR = 2
#: Subdirectory of the data directory that holds the journal.
JOURNAL_SUBDIR = "journal"


class _State(enum.Enum):
    NEW = "new"  #: constructed; recover() not called
    RECOVERING = "recovering"  #: recover() called; its iterator not exhausted
    OPEN = "open"  #: appends accepted
    CLOSED = "closed"


@dataclass(slots=True)
class SegmentInfo:
    """Space accounting of one segment (on the broker's thread)."""

    size: int  #: bytes assigned (written or queued)
    live_bodies: int
    live_bytes: int
    bodies: int = 0  #: bodies ever stored in it
    #: bytes of its body-carrying entries that are not bodies: entry headers and
    #: message records, which a relocation copies too
    overhead: int = 0
    lead: int = 0  #: bytes of its snapshot (every segment has one)

    def copy_bytes(self) -> float:
        """About what relocating its live messages writes: their bodies and, per
        body, the segment's average record overhead."""
        if not self.bodies:
            return self.live_bytes
        return self.live_bytes + self.live_bodies * self.overhead / self.bodies


class JournalStore:
    """Segmented append-only journal implementing :class:`~txbroker.storage.interface.Store`.

    Extra public surface: :attr:`repair_report`, :attr:`writer` (its
    ``write_at``/``sync_file``/``sync_dir``/``open_segment``/``unlink``
    steps are replaceable for fault injection), :meth:`flush`, and use as a
    context manager.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        sync: str = SyncMode.FDATASYNC,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        dispatch: Dispatch | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        body_cache_bytes: int = DEFAULT_BODY_CACHE_BYTES,
        repair: bool = False,
    ) -> None:
        if sync not in SyncMode.ALL:
            raise ValueError(f"unknown sync mode {sync!r}; expected one of {SyncMode.ALL}")
        if not MIN_SEGMENT_SIZE <= segment_size <= MAX_SEGMENT_SIZE:
            raise ValueError(
                f"segment_size {segment_size} outside {MIN_SEGMENT_SIZE}..{MAX_SEGMENT_SIZE}"
            )
        if body_cache_bytes < 0:
            raise ValueError("body_cache_bytes must be >= 0")
        self.directory = Path(directory)
        self.journal_dir = self.directory / JOURNAL_SUBDIR
        self.sync_mode = sync
        self.segment_size = segment_size
        self.repair = repair
        #: What recovery dropped: torn tails it cut, and (with ``repair``) damaged
        #: regions it skipped, one line each naming file, offsets and bytes.
        self.repair_report: list[str] = []
        #: The writer thread (None until recovery is done). Fault injection:
        #: ``store.writer.sync_file = failing_function``.
        self.writer: GroupCommitWriter | None = None
        self._dispatch = dispatch
        self._snapshot_provider = snapshot_provider
        self._cache_limit = body_cache_bytes
        self._cache: OrderedDict[BodyRef, bytes] = OrderedDict()
        self._cache_bytes = 0
        self._queue = PendingQueue()
        self._state = _State.NEW
        self._replay_iterator: Generator[StoredEntry, None, None] | None = None
        self._lock_fd = -1
        self._created_dirs: list[Path] = []
        self._segments: dict[int, SegmentInfo] = {}
        self._read_fds: dict[int, int] = {}
        self._oldest = self._head = 1
        self._offset = self._first_free = SEGMENT_HEADER.size
        #: the head rolls when an entry would end past this (see SNAPSHOT_SEGMENT_FACTOR)
        self._roll_at = segment_size
        #: the head has no snapshot but older segments (a torn roll): roll at once
        self._snapshot_due = False
        self._head_info = SegmentInfo(SEGMENT_HEADER.size, 0, 0)
        self._appends = 0
        self._relocating: int | None = None
        self._relocation_offered_at = 0
        self._maintain_calls = 0

    # -- opening -----------------------------------------------------------

    def recover(self) -> Iterator[StoredEntry]:
        """Lock the directory and yield every entry in log order.

        The store accepts appends once the iterator is exhausted. Raises
        :class:`StoreLocked` if another store holds the directory and
        :class:`CorruptStore` (while iterating) on damage outside a torn tail.
        """
        if self._state is not _State.NEW:
            raise StoreError("recover() may be called only once, on a new JournalStore")
        self._lock_fd, self._created_dirs = lock_directory(self.directory, self.journal_dir)
        self._state = _State.RECOVERING
        recovery = Recovery(self.journal_dir, repair=self.repair)
        self.repair_report = recovery.report
        self._replay_iterator = self._replay(recovery, list_segments(self.journal_dir))
        return self._replay_iterator

    def _replay(self, recovery: Recovery, ids: list[int]) -> Generator[StoredEntry, None, None]:
        replay = recovery.replay(ids)
        try:
            while True:
                yield from next(replay)
        except StopIteration as done:
            recovered: list[RecoveredSegment] = done.value
        except Exception:
            self.close()  # e.g. CorruptStore: unlock, so that a retry with repair can open
            raise
        self._open_for_appends(recovered)

    def _open_for_appends(self, recovered: list[RecoveredSegment]) -> None:
        for segment in recovered:
            self._segments[segment.segment_id] = SegmentInfo(
                segment.size, segment.bodies, segment.body_bytes, segment.bodies,
                segment.overhead, segment.lead,
            )
        head_fd = None
        if recovered:
            self._oldest, self._head = recovered[0].segment_id, recovered[-1].segment_id
            self._offset = recovered[-1].size
            head_path = self.journal_dir / segment_name(self._head)
            head_fd = os.open(head_path, os.O_WRONLY | os.O_CLOEXEC)
            self._find_head_snapshot(recovered[-1].lead, len(recovered) > 1)
        else:
            self._segments[1] = SegmentInfo(SEGMENT_HEADER.size, 0, 0)
            self._queue.items.append(Roll(1))
        self._head_info = self._segments[self._head]
        self.writer = GroupCommitWriter(
            self.journal_dir,
            self._queue,
            sync=self.sync_mode,
            dispatch=self._dispatch,
            head_segment=self._head if recovered else 0,
            head_fd=head_fd,
            head_offset=self._offset,
        )
        self.writer.pending_dir_syncs = [path.parent for path in self._created_dirs]
        self.writer.start()
        self._state = _State.OPEN

    def _find_head_snapshot(self, lead: int, older: bool) -> None:
        """Where the recovered head's snapshot ends, so that the head keeps the
        roll limit it had; or, if it has none but has older segments (a kill tore
        the snapshot its roll wrote), mark a snapshot due."""
        if self._snapshot_provider is None:
            return
        if lead:  # every segment but a new journal's first starts with its snapshot
            self._first_free = SEGMENT_HEADER.size + lead
            self._roll_at = max(self.segment_size, SNAPSHOT_SEGMENT_FACTOR * self._first_free)
        else:  # empty, or it begins with bodies (written so by an older version)
            self._snapshot_due = older

    # -- appending ---------------------------------------------------------

    def append(
        self,
        kind: int,
        meta: bytes,
        bodies: Sequence[bytes],
        on_durable: DurableCallback,
    ) -> list[BodyRef]:
        """Queue an entry for the writer; return one ref per body at once (no I/O)."""
        if self._state is not _State.OPEN:
            raise self._not_open()
        count = len(bodies)
        if count == 1:
            body_bytes = len(bodies[0])
        else:
            lengths = [len(body) for body in bodies]
            body_bytes = sum(lengths)
        meta_start = _ENTRY_HEADER_SIZE + 4 * count
        size = meta_start + len(meta) + body_bytes + 4
        if size > MAX_ENTRY_SIZE or kind & ~MAX_KIND or count > MAX_BODIES:
            raise ValueError(f"entry too large or malformed (kind {kind}, {size} bytes)")
        offset = self._offset
        roll = (offset + size > self._roll_at and offset > self._first_free) or self._snapshot_due
        snapshot = self._snapshot_provider() if roll and self._snapshot_provider else None
        if snapshot is not None and (
            ENTRY_OVERHEAD + len(snapshot[1]) > MAX_ENTRY_SIZE or snapshot[0] & ~MAX_KIND
        ):
            raise ValueError(f"snapshot entry too large or malformed (kind {snapshot[0]})")
        queue = self._queue
        queue.lock.acquire()
        try:
            if queue.failure is not None:
                raise StorageFailed(str(queue.failure))
            if roll:
                self._roll(snapshot)
                offset = self._offset
            segment = self._head
            body = offset + meta_start + len(meta)
            if count == 1:
                refs = [segment << REF_SEGMENT_SHIFT | body << REF_LENGTH_BITS | body_bytes]
            else:
                base = segment << REF_SEGMENT_SHIFT
                starts = accumulate(lengths, initial=body)  # one more than lengths
                refs = [base | start << REF_LENGTH_BITS | length
                        for start, length in zip(starts, lengths, strict=False)]
            queue.items.append((segment, offset, size, kind, meta, bodies, refs, on_durable))
            if queue.writer_idle:
                queue.wakeup.notify()
            self._offset = offset + size
        finally:
            queue.lock.release()
        info = self._head_info
        info.size += size
        if count:
            info.live_bodies += count
            info.live_bytes += body_bytes
            info.bodies += count
            info.overhead += size - body_bytes
        self._appends += 1
        limit = self._cache_limit
        if limit:
            cache = self._cache
            for ref, body_data in zip(refs, bodies, strict=True):
                if len(body_data) <= limit:  # a huge body would flush everything else
                    cache[ref] = body_data
                    self._cache_bytes += len(body_data)
            if self._cache_bytes > limit:
                self._evict()
        return refs

    def _roll(self, snapshot: tuple[int, bytes] | None) -> None:
        """Start the next segment (under the queue lock); its first entry is the snapshot."""
        self._head += 1
        items = self._queue.items
        items.append(Roll(self._head))
        info = SegmentInfo(SEGMENT_HEADER.size, 0, 0)
        self._segments[self._head] = self._head_info = info
        self._offset = SEGMENT_HEADER.size
        if snapshot is not None:
            kind, meta = snapshot
            size = ENTRY_OVERHEAD + len(meta)
            snap: EntryItem = (self._head, self._offset, size, kind, meta, (), [], None)
            items.append(snap)
            self._offset += size
            info.size += size
            info.lead = size
        self._first_free = self._offset
        self._roll_at = max(self.segment_size, SNAPSHOT_SEGMENT_FACTOR * self._first_free)
        self._snapshot_due = False

    def _roll_now(self) -> None:
        """Roll to a new segment that starts with a snapshot (no entry to append)."""
        snapshot = self._snapshot_provider() if self._snapshot_provider else None
        if snapshot is not None and (
            ENTRY_OVERHEAD + len(snapshot[1]) > MAX_ENTRY_SIZE or snapshot[0] & ~MAX_KIND
        ):
            raise ValueError(f"snapshot entry too large or malformed (kind {snapshot[0]})")
        queue = self._queue
        with queue.lock:
            if queue.failure is not None:
                return
            self._roll(snapshot)
            if queue.writer_idle:
                queue.wakeup.notify()

    def _not_open(self) -> StoreError | StorageFailed:
        if self._queue.failure is not None:
            return StorageFailed(str(self._queue.failure))
        if self._state is _State.CLOSED:
            return StoreError(f"journal {self.journal_dir} is closed")
        return StoreError("recover() must run (and its iterator be exhausted) before append")

    # -- reading bodies ----------------------------------------------------

    def body_size(self, ref: BodyRef) -> int:
        """The body length packed in ``ref`` (no I/O)."""
        return ref & _REF_LENGTH_MASK

    def read_bodies(self, refs: Sequence[BodyRef]) -> PackedBodies:
        """Many bodies, packed: each run of refs that lie back to back in one segment
        (the sends of one record) is read with one ``pread`` and handed over as
        read, without cutting it into objects; the cache is neither searched nor
        filled (a stream reader's scan would only push the hot bodies out). The
        caller bounds the total (a ``stream_read`` page)."""
        # A ref is segment << 72 | offset << 32 | length, so ``ref >> 32`` is the
        # body's position (segment and offset) and a run goes on where the next
        # body's position is this one's position + length. The runs are found
        # with C-level maps: no Python work per body.
        count = len(refs)
        lengths = list(map(and_, refs, repeat(_REF_LENGTH_MASK, count)))
        starts = list(map(rshift, refs, repeat(REF_LENGTH_BITS, count)))
        ends = list(map(add, starts, lengths))
        breaks = list(compress(range(1, count), map(ne, ends, starts[1:])))
        parts: list[bytes] = []
        for low, high in zip([0, *breaks], [*breaks, count], strict=True):
            if high <= low:
                continue
            position, size = starts[low], ends[high - 1] - starts[low]
            segment = position >> REF_OFFSET_BITS
            data = None
            if segment in self._segments:
                data = self._pread(segment, position & _REF_OFFSET_MASK, size)
            if data is None:  # not on disk as expected: the careful way, body by body
                parts.extend(self.read_body(ref) for ref in refs[low:high])
            else:
                parts.append(data)
        return PackedBodies(b"".join(parts), lengths)

    def read_body(self, ref: BodyRef) -> bytes:
        """A stored body, from the cache or with one ``pread``.

        Raises ``KeyError`` if the ref's segment was deleted or never existed.
        """
        cached = self._cache.get(ref)
        if cached is not None:
            self._cache.move_to_end(ref)
            return cached
        segment, offset, length = unpack_ref(ref)
        if segment not in self._segments:
            raise KeyError(f"body ref {ref:#x}: segment {segment} does not exist (any more)")
        if not length:
            return b""
        body = self._pread(segment, offset, length)
        if body is None:  # not written yet: the writer still holds it
            body = self._unwritten_body(ref) or self._pread(segment, offset, length)
        if body is None:
            raise KeyError(f"body ref {ref:#x}: segment {segment} ends before offset {offset}")
        self._cache_put(ref, body)
        return body

    def _pread(self, segment: int, offset: int, length: int) -> bytes | None:
        fd = self._read_fds.get(segment)
        if fd is None:
            try:
                fd = os.open(self.journal_dir / segment_name(segment), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            self._read_fds[segment] = fd
        body = os.pread(fd, length, offset)
        return body if len(body) == length else None

    def _unwritten_body(self, ref: BodyRef) -> bytes | None:
        """The body of a queued or in-flight entry (the cache may have dropped it)."""
        with self._queue.lock:
            in_flight = self.writer.in_flight if self.writer is not None else []
            for item in (*in_flight, *self._queue.items):
                if type(item) is tuple and ref in item[6]:
                    return bytes(item[5][item[6].index(ref)])
        return None

    def _cache_put(self, ref: BodyRef, body: bytes) -> None:
        if len(body) <= self._cache_limit and ref not in self._cache:
            self._cache[ref] = body
            self._cache_bytes += len(body)
            if self._cache_bytes > self._cache_limit:
                self._evict()

    def _evict(self) -> None:
        """Drop least recently used bodies until the cache fits its bound."""
        while self._cache_bytes > self._cache_limit:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= len(evicted)

    # -- space -------------------------------------------------------------

    def release(self, ref: BodyRef) -> None:
        """Mark a body dead (call once per ref and recovery)."""
        segment, _offset, length = unpack_ref(ref)
        info = self._segments.get(segment)
        if info is None:
            return
        if info.live_bodies <= 0:
            log.warning("release of ref %#x: segment %d has no live bodies left", ref, segment)
            return
        info.live_bodies -= 1
        info.live_bytes -= length
        cached = self._cache.pop(ref, None)
        if cached is not None:
            self._cache_bytes -= len(cached)

    def maintain(self) -> Relocation | None:
        """Delete dead segments from the oldest end; maybe offer the oldest for relocation."""
        if self._state is not _State.OPEN or self._queue.failure is not None:
            return None
        assert self.writer is not None
        self._maintain_calls += 1
        if self._snapshot_due:  # before an older segment, and the metadata in it, can go
            self._roll_now()
        while self._oldest < self._head and self._segments[self._oldest].live_bodies == 0:
            self._drop_oldest()
        oldest = self._oldest
        if oldest >= self._head or oldest >= self.writer.current_segment:
            return None  # only the head is left, or the oldest is not fully written yet
        info = self._segments[oldest]
        if info.copy_bytes() >= RELOCATE_BELOW_LIVE_FRACTION * (info.size - info.lead):
            return None  # copying would write as much as it frees (the copies need
            # segments, and snapshots, of their own)
        if len(self._segments) < RELOCATE_MIN_SEGMENTS:
            return None  # a few segments of waste are cheaper than copying
        watched, self._oldest_watch = self._oldest_watch, (oldest, info.live_bodies)
        if watched[0] == oldest and watched[1] > info.live_bodies:
            return None  # consumers are eating it: it will likely die on its own
        recently = self._maintain_calls - self._relocation_offered_at < RELOCATION_RETRY_CALLS
        if self._relocating == oldest and recently:
            return None
        self._relocating = oldest
        self._relocation_offered_at = self._maintain_calls
        try:
            entries = read_segment_entries(self.journal_dir, oldest, info.size)
        except (CorruptStore, OSError) as exc:
            log.error("cannot read segment %d for relocation: %s", oldest, exc)
            return None
        return Relocation(oldest, entries)

    _oldest_watch: tuple[int, int] = (-1, 0)

    def _drop_oldest(self) -> None:
        segment = self._oldest
        del self._segments[segment]
        fd = self._read_fds.pop(segment, None)
        if fd is not None:
            os.close(fd)
        if self._relocating == segment:
            self._relocating = None
        self._queue.put(Delete(segment))
        self._oldest += 1

    # -- status and shutdown -----------------------------------------------

    def stats(self) -> StoreStats:
        """Current counters."""
        writer = self.writer
        segments = self._segments.values()
        return StoreStats(
            appends=self._appends,
            syncs=writer.syncs if writer else 0,
            bytes_written=writer.bytes_written if writer else 0,
            segments=len(segments),
            disk_bytes=sum(info.size for info in segments),
            live_bodies=sum(info.live_bodies for info in segments),
            live_body_bytes=sum(info.live_bytes for info in segments),
        )

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued so far is written, synced and completed.

        Not for the event loop (it blocks). Raises ``StorageFailed`` if the
        journal failed, ``TimeoutError`` if ``timeout`` passed first.
        """
        if self._state is not _State.OPEN:
            return
        barrier = Barrier()
        self._queue.put(barrier)
        if not barrier.done.wait(timeout):
            raise TimeoutError(f"journal flush took longer than {timeout} s")
        if self._queue.failure is not None:
            raise StorageFailed(str(self._queue.failure))

    def close(self) -> None:
        """Write and sync what is queued, stop the writer, close files, unlock. Idempotent."""
        if self._state is _State.CLOSED:
            return
        if self.writer is not None:
            self.writer.check_not_writer_thread()
        self._state = _State.CLOSED
        replay, self._replay_iterator = self._replay_iterator, None
        if replay is not None and inspect.getgeneratorstate(replay) != inspect.GEN_RUNNING:
            replay.close()  # an abandoned recovery: close its files
        if self.writer is not None:
            self.writer.stop()
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()
        self._cache.clear()
        self._cache_bytes = 0
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> JournalStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
