"""The journal's writer thread: group commit.

Theory of operation
-------------------
``JournalStore.append`` runs on the broker's thread: it assigns the entry its
place (segment, offset), hands back body refs, and puts a work item on the
:class:`PendingQueue`. It never writes, syncs or unlinks.

One :class:`GroupCommitWriter` thread loops: it takes *everything* pending
(a batch), encodes the entries, issues one ``pwrite`` per segment the batch
touches, then one sync per segment (``fdatasync``/``fsync``, nothing in mode
``none``), a directory fsync if a segment file was created, and finally hands
every completion of the batch to ``dispatch`` in one call. While it syncs,
new appends pile up for the next batch: the slower the disk, the larger the
batches.

The work items, in queue order:

* an :class:`EntryItem`, written at the offset ``append`` chose;
* :class:`Roll` — seal the current segment (write + sync what is buffered,
  close it) and create the next one;
* :class:`Delete` — unlink a dead segment *after* this batch's sync, so that
  every entry queued before the delete (e.g. the acks that killed its
  bodies) is durable before the bodies go;
* :class:`Barrier` — set an event once everything before it is done
  (``JournalStore.flush``).

Pre-allocation: in sync modes ``fdatasync`` and ``fsync`` the head segment is kept
zeros ahead of its writes (the zeros go out in the same ``pwrite`` as the entries
that cross the allocated end): 256 KiB at first, doubling at every extension up to
:data:`PREALLOCATE_BYTES`, so an idle broker writes few zeros and a busy one extends
rarely. An append inside the
file's size changes no metadata, so its ``fdatasync`` is one device flush instead of
two (data, then the filesystem's journal commit for the new size: bench/peers.md).
A roll first cuts the sealed segment back to its data (``ftruncate`` + sync, before
the next segment file exists), and a clean close does the same, so only the head
segment of a crashed broker can end in zeros; recovery and the readers treat that
tail as free space (journal_recovery.py).

Crash points are replaceable steps: ``write_at``, ``sync_file``, ``sync_dir``,
``open_segment`` and ``unlink`` are plain attributes that tests swap for
functions that raise. An ``OSError`` from a write or sync poisons the store:
the batch and everything queued after it complete with ``StorageFailed``,
and ``append`` refuses further entries (retrying a failed fsync can report
lost data as durable, so the journal never does).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from txbroker.errors import StorageFailed
from txbroker.storage.interface import BodyRef, Dispatch, DurableCallback, SyncMode
from txbroker.storage.journal_faults import CrashPoints
from txbroker.storage.journal_format import (
    encode_entry,
    encode_index,
    encode_segment_header,
    index_name,
    index_record,
    segment_name,
)
from txbroker.storage.synced_files import write_synced
from txbroker.storage.writer_thread import (
    Barrier,
    PendingQueue,
    WriterThread,
    completion,
)

log = logging.getLogger("txbroker.journal")

class EntryItem:
    """Work item: one entry to write at the place ``append`` chose for it."""

    __slots__ = ("bodies", "kind", "meta", "offset", "on_durable", "refs", "segment", "size")

    def __init__(self, segment: int, offset: int, size: int, kind: int, meta: bytes,
                 bodies: Sequence[bytes], refs: list[BodyRef],
                 on_durable: DurableCallback | None) -> None:
        self.segment = segment  #: the segment id
        self.offset = offset  #: where in the segment
        self.size = size  #: the encoded entry's size
        self.kind = kind  #: the record kind (``core/records``)
        self.meta = meta
        self.bodies = bodies
        self.refs = refs  #: the bodies' refs, handed back by ``append``
        self.on_durable = on_durable  #: None for a segment's snapshot

#: Permission bits of new segment files (before the umask).
SEGMENT_FILE_MODE = 0o640
#: Most zeros written ahead of the head segment's data at once (see the module doc).
PREALLOCATE_BYTES = 8 * 1024 * 1024
#: The first extension's zeros.
PREALLOCATE_FIRST = 256 * 1024


class Roll:
    """Work item: seal the current segment and start segment ``segment_id``."""

    __slots__ = ("segment_id",)

    def __init__(self, segment_id: int) -> None:
        self.segment_id = segment_id


class Delete:
    """Work item: unlink segment ``segment_id`` once the batch is synced."""

    __slots__ = ("segment_id",)

    def __init__(self, segment_id: int) -> None:
        self.segment_id = segment_id




WorkItem = EntryItem | Roll | Delete | Barrier


def _no_sync(fd: int) -> None:
    """Mode ``none``: leave flushing to the OS."""


def _file_sync_for(mode: str) -> Callable[[int], None]:
    if mode == SyncMode.FDATASYNC:
        return os.fdatasync
    if mode == SyncMode.FSYNC:
        return os.fsync
    if mode == SyncMode.NONE:
        return _no_sync
    raise ValueError(f"unknown sync mode {mode!r}; expected one of {SyncMode.ALL}")


def _create_segment_file(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, SEGMENT_FILE_MODE)


class GroupCommitWriter(WriterThread):
    """The one thread that writes, syncs and deletes segment files."""

    thread_name = "txbroker-journal-writer"
    store_label = "journal"

    def __init__(
        self,
        journal_dir: Path,
        queue: PendingQueue,
        *,
        sync: str,
        dispatch: Dispatch | None,
        head_segment: int,
        head_fd: int | None,
        head_offset: int,
        crash_points: CrashPoints | None = None,
        recovery_index: bool = False,
    ) -> None:
        self.journal_dir = journal_dir
        #: named crash points for process tests (``journal_faults.py``; none armed
        #: outside tests)
        self.crash_points = crash_points or CrashPoints()
        super().__init__(queue)
        self.sync_mode = sync
        self.dispatch = dispatch
        # Replaceable steps (crash points): tests swap these for failing ones.
        self.write_at: Callable[[int, memoryview, int], int] = os.pwrite
        self.sync_file: Callable[[int], None] = _file_sync_for(sync)
        self.sync_dir: Callable[[int], None] = os.fsync
        self.open_segment: Callable[[Path], int] = _create_segment_file
        self.unlink: Callable[[Path], None] = os.unlink
        #: Segment the writer appends to; segments below it are fully written.
        self.current_segment = head_segment
        self.syncs = 0
        self.bytes_written = 0
        #: Directories to fsync with the next batch (a freshly created journal dir's parent).
        self.pending_dir_syncs: list[Path] = []
        self._fd = head_fd
        self._offset = head_offset
        #: Pre-allocate only where appends are synced (mode ``none`` never flushes).
        self.preallocate = PREALLOCATE_FIRST if sync != SyncMode.NONE else 0
        #: The head segment file's size: data up to ``_offset``, zeros after it.
        self._allocated = os.fstat(head_fd).st_size if head_fd is not None else 0
        self._dir_fd = os.open(journal_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._deletes_broken = False
        #: write a recovery index (``<id>.idx``, journal_format.py) for each segment
        #: this writer fills from its start, when it seals it
        self.recovery_index = recovery_index
        #: the index records of the segment being written (None: not tracked — the
        #: index is off, or the segment was recovered, not started by this writer)
        self._index: list[bytes] | None = None
        self._index_lead = 0

    # -- the loop ----------------------------------------------------------

    def _process(self, batch: list[WorkItem]) -> None:
        if self.queue.failure is not None:
            self._poison(batch, self.queue.failure)
            return
        callbacks: list[DurableCallback] = []
        deletes: list[Delete] = []
        barriers: list[Barrier] = []
        parts: list[bytes] = []
        start = self._offset
        created = False
        try:
            for item in batch:
                if type(item) is EntryItem:
                    size, kind, meta, on_durable = item.size, item.kind, item.meta, item.on_durable
                    bodies = item.bodies
                    assert item.offset == self._offset, (item.offset, self._offset)
                    if type(meta) is not bytes:
                        meta = bytes(meta)
                    body_list = _as_bytes(bodies)
                    parts += encode_entry(kind, meta, body_list, size)
                    index = self._index
                    if index is not None:
                        if not index and not body_list:
                            self._index_lead = size  # the segment's snapshot
                        index.append(index_record(kind, meta, body_list, size))
                    self._offset += size
                    if on_durable is not None:
                        callbacks.append(on_durable)
                elif isinstance(item, Roll):
                    if self._fd is not None:
                        written = self._write(parts, start)
                        if self._cut_zeros() or written:
                            self._sync_segment()
                        os.close(self._fd)
                        self._fd = None
                        if self._index is not None:
                            self._write_index(self.current_segment, self._offset, self._index)
                    self._index = [] if self.recovery_index else None
                    self._index_lead = 0
                    path = self.journal_dir / segment_name(item.segment_id)
                    self._fd = self.open_segment(path)
                    self._allocated = 0
                    self.current_segment = item.segment_id
                    header = encode_segment_header(item.segment_id)
                    parts = [header]
                    start, self._offset = 0, len(header)
                    created = True
                elif isinstance(item, Delete):
                    deletes.append(item)
                elif isinstance(item, Barrier):
                    barriers.append(item)
            if self._write(parts, start):
                self._sync_segment()
            if created and self.sync_mode != SyncMode.NONE:
                self._sync_directories()
        except OSError as exc:
            failure = StorageFailed(f"journal write/sync failed in {self.journal_dir}: {exc}")
            log.error("%s; the journal refuses further appends", failure)
            self._poison(batch, failure)
            return
        if self.crash_points.kind >= 0:
            self._pass_synced(batch)
        if callbacks:
            self._dispatch(completion(callbacks, None))
        self._delete(deletes)
        with self.queue.lock:
            self.in_flight = []
        for barrier in barriers:
            barrier.done.set()

    def _write_index(self, segment_id: int, size: int, records: list[bytes]) -> None:
        """Write the recovery index of a sealed segment: to a temporary name, synced,
        renamed (the directory is synced with the next segment's creation, in this
        batch). A failure only costs the index: recovery then scans the segment."""
        path = self.journal_dir / index_name(segment_id)
        temporary = path.with_name(path.name + ".tmp")
        data = encode_index(segment_id, size, self._index_lead, records)
        try:
            write_synced(temporary, data, self.sync_file, SEGMENT_FILE_MODE)
            os.rename(temporary, path)
        except OSError as exc:
            log.warning("could not write the recovery index of segment %d: %s", segment_id, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    def _pass_synced(self, batch: list[WorkItem]) -> None:
        """Crash point ``synced:KIND``: the batch holds an entry of that kind, durable."""
        points = self.crash_points
        if any(type(item) is EntryItem and item.kind == points.kind for item in batch):
            points.passed(points.point)

    def _write(self, parts: list[bytes], offset: int) -> bool:
        """Write ``parts`` at ``offset`` of the current segment (one pwrite)."""
        if not parts:
            return False
        assert self._fd is not None
        data_bytes = sum(len(part) for part in parts)
        end = offset + data_bytes
        if self.preallocate and end > self._allocated:
            # the zeros ahead ride on this write: one syscall, synced with the data
            parts.append(bytes(self.preallocate))
            self._allocated = end + self.preallocate
            self.preallocate = min(2 * self.preallocate, PREALLOCATE_BYTES)
        data = b"".join(parts)
        parts.clear()
        view = memoryview(data)
        while view:
            written = self.write_at(self._fd, view, offset)
            if written <= 0:
                raise OSError(errno.EIO, "write returned 0")
            view = view[written:]
            offset += written
        self.bytes_written += data_bytes
        return True

    def _cut_zeros(self) -> bool:
        """Cut the head segment's pre-allocated zeros (before a roll or a close)."""
        if self._fd is None or self._allocated <= self._offset:
            return False
        os.ftruncate(self._fd, self._offset)
        self._allocated = self._offset
        return True

    def _sync_segment(self) -> None:
        assert self._fd is not None
        self.sync_file(self._fd)
        self.syncs += 1

    def _sync_directories(self) -> None:
        self.sync_dir(self._dir_fd)
        while self.pending_dir_syncs:
            fd = os.open(self.pending_dir_syncs[0], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self.sync_dir(fd)
            finally:
                os.close(fd)
            self.pending_dir_syncs.pop(0)

    def _delete(self, deletes: list[Delete]) -> None:
        """Unlink dead segments, oldest first; stop at the first failure (no gaps)."""
        if not deletes or self._deletes_broken:
            return
        try:
            for item in deletes:
                self.crash_points.passed("before_unlink")
                with contextlib.suppress(FileNotFoundError):  # its index goes first
                    os.unlink(self.journal_dir / index_name(item.segment_id))
                self.unlink(self.journal_dir / segment_name(item.segment_id))
                self.crash_points.passed("after_unlink")
            if self.sync_mode != SyncMode.NONE:
                self.sync_dir(self._dir_fd)
        except OSError as exc:
            # Leftover dead segments are harmless (replayed, then released again);
            # deleting past a failure would leave a gap, which recovery rejects.
            self._deletes_broken = True
            log.error("could not delete a dead journal segment: %s; keeping the rest", exc)

    def _poison(self, batch: list[WorkItem], failure: StorageFailed) -> None:
        """Fail ``batch`` and everything still queued; refuse later appends."""
        with self.queue.lock:
            self.queue.failure = failure
            batch = batch + self.queue.items
            self.queue.items = []
            self.in_flight = []
        callbacks = [item.on_durable for item in batch
                     if type(item) is EntryItem and item.on_durable is not None]
        if callbacks:
            self._dispatch(completion(callbacks, failure))
        for item in batch:
            if isinstance(item, Barrier):
                item.done.set()

    def _dispatch(self, complete: Callable[[], None]) -> None:
        if self.dispatch is None:
            complete()
            return
        try:
            self.dispatch(complete)
        except Exception:
            log.exception("dispatch of journal completions failed")

    def _close_files(self) -> None:
        if self._fd is not None:
            if self.queue.failure is None:
                try:
                    if self._cut_zeros():
                        self.sync_file(self._fd)
                except OSError as exc:  # the zeros stay: recovery reads them as free space
                    log.warning("could not cut the journal head's pre-allocated tail: %s", exc)
            os.close(self._fd)
            self._fd = None
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


def _as_bytes(bodies: Sequence[bytes]) -> list[bytes]:
    """Bodies as ``bytes`` (the CRC binding refuses bytearray and memoryview)."""
    return [body if type(body) is bytes else bytes(body) for body in bodies]
