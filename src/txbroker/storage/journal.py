"""The journal store: a segmented append-only log with CRCs and group commit.

Theory of operation
-------------------
``DIR/journal/`` holds numbered segment files (byte format:
:mod:`txbroker.storage.journal_format`) and a ``lock`` file. :meth:`recover`
locks the directory (``store_lock.py``), replays every segment
(:mod:`~txbroker.storage.journal_recovery`) and starts the writer thread
(:mod:`~txbroker.storage.journal_writer`).

:meth:`append` runs on the broker's thread and does no I/O: it picks the
entry's place — the end of the head segment, or the start of a new one when
the entry does not fit (*roll*; the new segment begins with the snapshot
from ``snapshot_provider``) — computes the body refs from that place, queues
the entry for the writer and caches the bodies. The writer writes each batch
with one ``pwrite`` per segment and one sync, then dispatches the batch's
completions in one call. Bodies are read back through the cache or with one
``pread`` (:mod:`~txbroker.storage.journal_bodies`).

A snapshot takes at most half of its segment: when it is bigger than half of
``segment_size`` (say a duplicate-id window of 60,000 ids in 128 KiB
segments), the segment grows to twice the snapshot before the next roll —
else every append would roll, and write, a segment of its own. A head that
lost its snapshot (a kill tore the roll's first write) gets a new segment with
a snapshot at the first append or ``maintain``, before an older segment can go.

Space (:mod:`~txbroker.storage.journal_space`): each segment keeps a count of
live bodies and live body bytes. Recovery counts every body live;
:meth:`release` marks one dead. :meth:`maintain` deletes dead segments from
the oldest end (through the writer, after the sync of everything queued
before), and offers the oldest sealed segment for *relocation* when that pays —
it is mostly dead, or it pins enough dead segments behind it (``SegmentSpace.
offer_relocation``; when is set by ``compaction``, a ``CompactionSettings``).
``stats()`` reports what recovery replayed (``recovered_bytes``, ``_entries``: a
warm standby's takeover resumes where it stopped, ``resume_from``), and the named
crash points of ``journal_faults.py`` let process tests kill it mid-compaction.

A clean shutdown may leave a *checkpoint* (the broker's state) that the next
:meth:`recover` hands back instead of the log (``checkpoints``;
:mod:`~txbroker.storage.journal_checkpoint`).

Threading: ``append``, ``read_body``, ``release``, ``maintain`` and ``stats``
belong to one thread (the broker's event loop); only the writer thread
writes, syncs or unlinks.
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from itertools import accumulate
from operator import and_
from pathlib import Path
from types import TracebackType

from txbroker.errors import StorageFailed, StoreError
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
from txbroker.storage.journal_bodies import REF_LENGTH_MASK, BodyReader
from txbroker.storage.journal_checkpoint import (
    CheckpointMark,
    checkpoint_entries,
    take_checkpoint_file,
    write_checkpoint,
)
from txbroker.storage.journal_faults import CrashPoints
from txbroker.storage.journal_format import (
    DEFAULT_BODY_CACHE_BYTES,
    DEFAULT_SEGMENT_SIZE,
    ENTRY_HEADER,
    ENTRY_OVERHEAD,
    JOURNAL_SUBDIR,
    MAX_BODIES,
    MAX_ENTRY_SIZE,
    MAX_KIND,
    MAX_SEGMENT_SIZE,
    MIN_SEGMENT_SIZE,
    REF_LENGTH_BITS,
    REF_SEGMENT_SHIFT,
    SEGMENT_HEADER,
    segment_name,
)
from txbroker.storage.journal_recovery import (
    LOCK_FILE,
    RecoveredSegment,
    Recovery,
    RecoveryCounts,
    ResumedSegment,
    list_segments,
    lock_directory,
)
from txbroker.storage.journal_space import CompactionSettings, SegmentInfo, SegmentSpace
from txbroker.storage.journal_writer import (
    Delete,
    EntryItem,
    GroupCommitWriter,
    Roll,
)
from txbroker.storage.store_lock import StoreLock
from txbroker.storage.writer_thread import PendingQueue

_ENTRY_HEADER_SIZE = ENTRY_HEADER.size
log = logging.getLogger("txbroker.journal")

#: A segment rolls at ``segment_size`` bytes, or at this multiple of its snapshot
#: when that is bigger: a snapshot takes at most half of its segment, however
#: big it grows (a snapshot over ``segment_size`` made every append roll).
SNAPSHOT_SEGMENT_FACTOR = 2


class _State(enum.Enum):
    NEW = "new"  #: constructed; recover() not called
    RECOVERING = "recovering"  #: recover() called; its iterator not exhausted
    OPEN = "open"  #: appends accepted
    CLOSED = "closed"


class JournalStore:
    """Segmented append-only journal implementing :class:`~txbroker.storage.interface.Store`.

    Extra public surface: :attr:`repair_report`, :attr:`writer` (its
    ``write_at``/``sync_file``/``sync_dir``/``open_segment``/``unlink``
    steps are replaceable for fault injection), :meth:`flush`, and use as a
    context manager.
    """

    keeps_log = True  #: recovery yields every entry appended, in order (but dead segments')

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
        lock: StoreLock | None = None,
        compaction: CompactionSettings | None = None,
        recovery_index: bool = False,
        checkpoints: bool = False,
    ) -> None:
        if sync not in SyncMode.ALL:
            raise ValueError(f"unknown sync mode {sync!r}; expected one of {SyncMode.ALL}")
        if not MIN_SEGMENT_SIZE <= segment_size <= MAX_SEGMENT_SIZE:
            raise ValueError(f"segment_size {segment_size} outside {MIN_SEGMENT_SIZE}.."
                             f"{MAX_SEGMENT_SIZE}")
        if body_cache_bytes < 0:
            raise ValueError("body_cache_bytes must be >= 0")
        self.directory = Path(directory)
        self.journal_dir = self.directory / JOURNAL_SUBDIR
        self.sync_mode = sync
        self.segment_size = segment_size
        self.repair = repair
        #: write a recovery index for each sealed segment and read it at recovery
        #: instead of the segment (journal_format.py): restarts skip the bodies
        self.recovery_index = recovery_index
        #: use the checkpoint a clean shutdown wrote (``journal_checkpoint.py``; a found
        #: one is deleted either way) and accept one at :meth:`close`
        self.checkpoints = checkpoints
        #: what recovery dropped: torn tails cut, damaged regions skipped (``repair``)
        self.repair_report: list[str] = []
        #: The writer thread (None until recovery); faults: ``writer.sync_file = failing``
        self.writer: GroupCommitWriter | None = None
        self._dispatch = dispatch
        self._snapshot_provider = snapshot_provider
        self._cache_limit = body_cache_bytes
        self._queue = PendingQueue()
        self._state = _State.NEW
        self._replay_iterator: Generator[StoredEntry, None, None] | None = None
        #: the directory's lock (``store_lock.py``): given when the HA part took it
        #: first, else taken by :meth:`recover`; released by :meth:`close`
        self._lock = lock
        self._created_dirs: list[Path] = []
        self._segments: dict[int, SegmentInfo] = {}
        self._bodies = BodyReader(self.journal_dir, self._segments, self._queue, body_cache_bytes)
        self._space = SegmentSpace(self.journal_dir, self._segments, self._delete_segment,
                                   compaction)
        #: named crash points for process tests (``journal_faults.py``; from the
        #: environment, none armed outside tests)
        self.crash_points = CrashPoints.from_env()
        #: what recovery read (``stats``)
        self._recovered = RecoveryCounts()
        #: what a warm standby read already (``resume_from``; journal_follow.py)
        self._resume: Mapping[int, ResumedSegment] | None = None
        self._head = 1
        self._offset = self._first_free = SEGMENT_HEADER.size
        #: the head rolls when an entry would end past this (see SNAPSHOT_SEGMENT_FACTOR)
        self._roll_at = segment_size
        #: the head has no snapshot but older segments (a torn roll): roll at once
        self._snapshot_due = False
        self._head_info = SegmentInfo(SEGMENT_HEADER.size, 0, 0)
        self._appends = 0
        self._checkpoint_lock = threading.Lock()
        #: the body length packed in a ref (no I/O): ``ref & REF_LENGTH_MASK``, a C call
        #: (a recovery asks it once per message)
        self.body_size: Callable[[BodyRef], int] = partial(and_, REF_LENGTH_MASK)

    # -- opening -----------------------------------------------------------

    @staticmethod
    def lock_path(directory: str | Path) -> Path:
        """The lock file of the journal store in ``directory`` (the HA lock too)."""
        return Path(directory) / JOURNAL_SUBDIR / LOCK_FILE

    def resume_from(self, segments: Mapping[int, ResumedSegment]) -> None:
        """Before :meth:`recover`: the segments a warm standby read and how far
        (``journal_follow.py``): recovery yields only the entries after those."""
        if self._state is not _State.NEW:
            raise StoreError("resume_from() must come before recover()")
        self._resume = segments

    def recover(self) -> Iterator[StoredEntry]:
        """Lock the directory and yield every entry in log order.

        The store accepts appends once the iterator is exhausted. Raises
        :class:`StoreLocked` if another store holds the directory and
        :class:`CorruptStore` (while iterating) on damage outside a torn tail.
        """
        if self._state is not _State.NEW:
            raise StoreError("recover() may be called only once, on a new JournalStore")
        self._lock, self._created_dirs = lock_directory(self.directory, self.journal_dir,
                                                        self._lock)
        self._state = _State.RECOVERING
        segment_ids = list_segments(self.journal_dir)
        found = take_checkpoint_file(self.journal_dir, segment_ids,
                                     why_not="not asked to" if not self.checkpoints else
                                     "a warm standby resumes" if self._resume else
                                     "repair" if self.repair else "")
        recovery = Recovery(self.journal_dir, repair=self.repair, use_index=self.recovery_index,
                            resume=found.mark.resumed() if found else self._resume)
        self.repair_report = recovery.report
        entries = recovery.entries(segment_ids, self._recovered) if found is None else \
            checkpoint_entries(found, recovery, segment_ids, self._recovered)
        self._replay_iterator = self._replay(entries)
        return self._replay_iterator

    def _replay(self, entries: Generator[StoredEntry, None, list[RecoveredSegment]]
                ) -> Generator[StoredEntry, None, None]:
        try:
            recovered = yield from entries
        except Exception:
            self.close()  # e.g. CorruptStore: unlock, so that a retry with repair can open
            raise
        self._open_for_appends(recovered)

    def _open_for_appends(self, recovered: list[RecoveredSegment]) -> None:
        for segment in recovered:
            self._segments[segment.segment_id] = SegmentInfo.recovered(segment)
        head_fd = None
        if recovered:
            self._space.oldest, self._head = recovered[0].segment_id, recovered[-1].segment_id
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
            crash_points=self.crash_points,
            recovery_index=self.recovery_index,
        )
        self.writer.pending_dir_syncs = [path.parent for path in self._created_dirs]
        self._bodies.writer = self.writer
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
        snapshot = self._take_snapshot() if roll else None
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
            queue.items.append(EntryItem(segment, offset, size, kind, meta, bodies, refs,
                                         on_durable))
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
        if self._cache_limit:
            self._bodies.remember(refs, bodies)
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
            items.append(EntryItem(self._head, self._offset, size, kind, meta, (), [], None))
            self._offset += size
            info.size += size
            info.lead = size
        self._first_free = self._offset
        self._roll_at = max(self.segment_size, SNAPSHOT_SEGMENT_FACTOR * self._first_free)
        self._snapshot_due = False

    def _take_snapshot(self) -> tuple[int, bytes] | None:
        """The snapshot a new segment starts with (None without a provider)."""
        snapshot = self._snapshot_provider() if self._snapshot_provider else None
        if snapshot is not None and (
            ENTRY_OVERHEAD + len(snapshot[1]) > MAX_ENTRY_SIZE or snapshot[0] & ~MAX_KIND
        ):
            raise ValueError(f"snapshot entry too large or malformed (kind {snapshot[0]})")
        return snapshot

    def _roll_now(self) -> None:
        """Roll to a new segment that starts with a snapshot (no entry to append)."""
        snapshot = self._take_snapshot()
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

    def read_bodies(self, refs: Sequence[BodyRef]) -> PackedBodies:
        """Many bodies, packed: one ``pread`` per run of refs that lie back to back
        in one segment (see :meth:`BodyReader.read_bodies`); no cache."""
        return self._bodies.read_bodies(refs)

    def read_body(self, ref: BodyRef) -> bytes:
        """A stored body, from the cache or with one ``pread``.

        Raises ``KeyError`` if the ref's segment was deleted or never existed.
        """
        return self._bodies.read_body(ref)

    @property
    def _cache_bytes(self) -> int:
        """Body bytes in the cache now (tests check its bound)."""
        return self._bodies.cache_bytes

    # -- space -------------------------------------------------------------

    def release(self, ref: BodyRef) -> None:
        """Mark a body dead (call once per ref and recovery)."""
        if self._space.release(ref):
            self._bodies.forget(ref)

    def maintain(self, relocate: bool = True) -> Relocation | None:
        """Delete dead segments from the oldest end; maybe offer the oldest for relocation."""
        if self._state is not _State.OPEN or self._queue.failure is not None:
            return None
        assert self.writer is not None
        self._space.count_maintain_call(self._appends)
        if self._snapshot_due:  # before an older segment, and the metadata in it, can go
            self._roll_now()
        self._space.delete_dead(self._head)
        relocation = self._space.offer_relocation(self._head, self.writer.current_segment) \
            if relocate else None
        if relocation is not None:
            self.crash_points.passed("relocation_offered")
        return relocation

    def _delete_segment(self, segment: int) -> None:
        """Close a dead segment's reader and have the writer unlink it (after the
        sync of everything queued before)."""
        self._bodies.close_segment(segment)
        self._queue.put(Delete(segment))

    # -- status and shutdown -----------------------------------------------

    def stats(self) -> StoreStats:
        """Current counters."""
        writer = self.writer
        stats = self._space.stats(self._appends, writer.syncs if writer else 0,
                                  writer.bytes_written if writer else 0)
        stats = replace(stats, body_cache_bytes=self._bodies.cache_bytes,
                        recovered_bytes=self._recovered.bytes,
                        recovered_segments=self._recovered.segments,
                        recovered_entries=self._recovered.entries,
                        recovered_from_checkpoint=self._recovered.from_checkpoint)
        if writer is None:
            return stats
        return replace(stats, batch_seconds=writer.batch_seconds,
                       batch_entries=writer.batch_entries)

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued so far is written, synced and completed.

        Not for the event loop (it blocks). Raises ``StorageFailed`` if the
        journal failed, ``TimeoutError`` if ``timeout`` passed first.
        """
        barrier = self._queue.put_barrier() if self._state is _State.OPEN else None
        if barrier is None:  # (closed, or closing: the close writes everything queued)
            return
        if not barrier.done.wait(timeout):
            raise TimeoutError(f"journal flush took longer than {timeout} s")
        if self._queue.failure is not None:
            raise StorageFailed(str(self._queue.failure))

    @property
    def appends(self) -> int:
        """Entries appended since open (a checkpoint's mark: :meth:`checkpoint_mark`)."""
        return self._appends

    def checkpoint_mark(self, appends: int) -> CheckpointMark | None:
        """Where the log ends now and every segment's accounting, for a checkpoint
        whose state was taken when ``appends`` entries had been appended, every one
        synced and completed (``journal_checkpoint.py``); None if more were appended
        since, the store failed or it keeps no checkpoints."""
        if not self.checkpoints or self._state is not _State.OPEN \
                or appends != self._appends or self._queue.failure is not None:
            return None
        return CheckpointMark(self._head, self._offset,
                              {segment_id: replace(info)
                               for segment_id, info in self._segments.items()})

    def write_checkpoint(self, mark: CheckpointMark, kind: int, meta: bytes) -> bool:
        """Write the checkpoint of ``mark`` (any thread: the file alone is touched, one
        writer at a time; a later mark written before an earlier one only costs the
        next start a longer log to replay after it). False once the store is closed:
        its directory may be another store's by then (a backup's new copy)."""
        with self._checkpoint_lock:
            if self._state is _State.CLOSED:
                return False
            return write_checkpoint(self.journal_dir, mark, kind, meta)

    def close(self, checkpoint: tuple[int, bytes, int] | None = None) -> None:
        """Write and sync what is queued, stop the writer, close files, unlock. Idempotent.
        ``checkpoint``: ``(kind, meta, appends)``, written once synced if the store still
        has ``appends`` entries and works (``journal_checkpoint.py``)."""
        if self._state is _State.CLOSED:
            return
        mark = None if checkpoint is None else self.checkpoint_mark(checkpoint[2])
        if self.writer is not None:
            self.writer.check_not_writer_thread()
        with self._checkpoint_lock:  # (a write in flight finishes first; none after)
            self._state = _State.CLOSED
        replay, self._replay_iterator = self._replay_iterator, None
        if replay is not None and inspect.getgeneratorstate(replay) != inspect.GEN_RUNNING:
            replay.close()  # an abandoned recovery: close its files
        if self.writer is not None:
            self.writer.stop()
        if checkpoint is not None and self.checkpoints:
            if mark is None or self._queue.failure is not None:
                log.warning("journal: no checkpoint written (the log moved on, or failed)")
            else:
                write_checkpoint(self.journal_dir, mark, checkpoint[0], checkpoint[1])
        self._bodies.close()
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> JournalStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
