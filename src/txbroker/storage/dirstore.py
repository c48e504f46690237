"""The directory store: one file per command block, after Enduro/X's disk queue.

Theory of operation
-------------------
``DIR/active/``, ``DIR/prepared/`` and ``DIR/committed/`` hold command
blocks and message files (byte format and names:
:mod:`~txbroker.storage.dirstore_format`). Unlike the journal, this store
keeps *state*, not a log, so it reads the broker's records
(:mod:`~txbroker.storage.dirstore_model`):

* ``ADD`` — one NEW block (with the body); it ends up as the message file
  ``committed/<message id>``;
* ``TX`` — one NEW block per message and one DELETE block per acked
  message, all in one store transaction: all of it or none of it;
* ``ACK`` / ``DROP`` — DELETE blocks: committing one removes the message file;
* ``UPDATE`` / ``MOVE`` — UPDATE blocks: new header fields for the message file;
* ``QUEUE_PUT`` / ``QUEUE_DELETE`` / ``SNAPSHOT`` — the metadata (queue
  definitions, duplicate-id windows, next id) changes and a METADATA block
  carries the new state to ``DIR/metadata``; deleting a queue also deletes
  its messages in the same transaction;
* an entry that changes nothing (a TX with no messages) is a DUMMY block, the
  seed's marker of a read-only transaction. ``RELOCATE`` is refused: this
  store never asks for relocation;
* ``XA_PREPARE`` — an XA branch: its blocks (named ``<GTRID>-<n>``) are
  written and prepared like a transaction's, and stay in ``prepared/``;
  ``XA_COMMIT`` / ``XA_ROLLBACK`` / ``XA_HEURISTIC`` / ``XA_FORGET`` and
  ``SINK_COMMIT`` are RESOLVE blocks that complete it as the seed says
  (``docs/dirstore.md``, "XA branches").

:meth:`append` (broker thread, no I/O) turns the entry into a
:class:`~txbroker.storage.dirstore_writer.Txn` — its blocks planned by the
in-memory index (:mod:`~txbroker.storage.dirstore_index`), which updates
itself and the metadata model at once — and queues it. Body refs are the
message ids; bodies are read back from the LRU body cache, the writer's
queue, or the message file. The writer
thread (:mod:`~txbroker.storage.dirstore_thread`) moves each batch through
write → prepare → commit and completes it with one ``dispatch`` call.

:meth:`recover` locks the directory and resolves what a crash left behind
(:mod:`~txbroker.storage.dirstore_recovery`), then yields one ``SNAPSHOT``
entry (the metadata), one ``ADD`` entry per stored message, in commit
order, and one ``XA_PREPARE`` (+ ``XA_HEURISTIC``) per branch left in
``prepared/``: a compacted log whose replay rebuilds the same broker state.

Threading: ``append``, ``read_body``, ``release``, ``maintain`` and ``stats``
belong to one thread (the broker's event loop); only the writer thread
creates, renames or unlinks files once recovery is over.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final

from txbroker.errors import CorruptStore, StorageFailed, StoreError
from txbroker.storage.dirstore_format import (
    LOCK_FILE,
    BlockType,
    decode_block,
    message_name,
    parse_flags,
)
from txbroker.storage.dirstore_index import MessageIndex, TxnPlan
from txbroker.storage.dirstore_model import decode_operation
from txbroker.storage.dirstore_recovery import RecoveredDirectory, Recovery, lock_directory
from txbroker.storage.dirstore_thread import DirWriter
from txbroker.storage.dirstore_writer import DirOps, Txn, read_file
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
from txbroker.storage.store_lock import StoreLock
from txbroker.storage.writer_thread import PendingQueue

log = logging.getLogger("txbroker.dirstore")

MiB: Final = 1024 * 1024
#: Default bound of the body cache (as the journal's): bodies in flight to
#: consumers are served from memory, the rest is read back from message files.
DEFAULT_BODY_CACHE_BYTES: Final = 32 * MiB
#: ``maintain`` writes the duplicate-id windows again when messages that carried
#: a client message id were deleted, at most this often (seconds): the window of
#: ids a crash can forget (their live messages' ids are in the message files).
METADATA_REFRESH_SECONDS: Final = 1.0


class _State(enum.Enum):
    NEW = "new"  #: constructed; recover() not called
    RECOVERING = "recovering"  #: recover() called; its iterator not exhausted
    OPEN = "open"  #: appends accepted
    CLOSED = "closed"


class DirStore:
    """File-per-command-block store implementing :class:`~txbroker.storage.interface.Store`.

    ``flags`` are the seed's sync flags, e.g. ``"FDATASYNC,DSYNC"`` (default
    ``""``: flush to the OS only). ``snapshot_provider`` is accepted for
    symmetry with the journal and not needed: the store keeps the metadata
    itself. Extra public surface: :attr:`report` (what recovery quarantined),
    :attr:`ops` (replaceable disk steps for fault injection), :meth:`flush`,
    use as a context manager.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        flags: str = "",
        dispatch: Dispatch | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        body_cache_bytes: int = DEFAULT_BODY_CACHE_BYTES,
        lock: StoreLock | None = None,
    ) -> None:
        if body_cache_bytes < 0:
            raise ValueError("body_cache_bytes must be >= 0")
        self.directory = Path(directory)
        self.flags = parse_flags(flags)
        #: The disk steps (``write_file``, ``sync_file``, ``sync_dir``, ``rename``,
        #: ``unlink``): replace them to inject faults, before or after recovery.
        self.ops = DirOps(self.directory, self.flags)
        #: Files recovery quarantined (or could not), one line each naming the file.
        self.report: list[str] = []
        self.repair_report = self.report  # the name the journal (and the CLI) use
        self.writer: DirWriter | None = None
        self._dispatch = dispatch
        self._snapshot_provider = snapshot_provider
        self._cache_limit = body_cache_bytes
        self._cache: OrderedDict[BodyRef, bytes] = OrderedDict()
        self._cache_bytes = 0
        self._pending = PendingQueue()
        self._state = _State.NEW
        self._replay_iterator: Generator[StoredEntry, None, None] | None = None
        #: the directory's lock (``store_lock.py``): given when the HA part took it
        #: first, else taken by :meth:`recover`; released by :meth:`close`
        self._lock = lock
        self._index = MessageIndex()
        self._appends = 0

    # -- opening -----------------------------------------------------------------------

    @staticmethod
    def lock_path(directory: str | Path) -> Path:
        """The lock file of the directory store in ``directory`` (the HA lock too)."""
        return Path(directory) / LOCK_FILE

    def recover(self) -> Iterator[StoredEntry]:
        """Lock the directory, resolve leftovers, and yield the stored state.

        Yields a ``SNAPSHOT`` entry (when metadata exists) and one ``ADD``
        entry per stored message, in commit order. Raises
        :class:`~txbroker.errors.StoreLocked` at once if another store holds
        the directory. The store accepts appends once the iterator is exhausted.
        """
        if self._state is not _State.NEW:
            raise StoreError("recover() may be called only once, on a new DirStore")
        self._lock, created = lock_directory(self.ops, self._lock)
        self._state = _State.RECOVERING
        self._replay_iterator = self._replay(created)
        return self._replay_iterator

    def _replay(self, created: list[Path]) -> Generator[StoredEntry, None, None]:
        try:
            self.ops.sync_directories(*{path.parent for path in created})
            found = Recovery(self.ops, self.report).run()
            entries = self._load(found)
        except BaseException:
            self.close()
            raise
        yield from entries
        self.writer = DirWriter(self.ops, self._pending, self._dispatch)
        self.writer.start()
        self._state = _State.OPEN

    def _load(self, found: RecoveredDirectory) -> list[StoredEntry]:
        """Index what recovery found; the entries ``recover`` yields."""
        entries = self._index.load(found)
        log.info("dir store %s: %d messages, %d XA branches, %d transactions rolled back, "
                 "%d rolled forward, %d files quarantined", self.directory, len(found.messages),
                 len(found.branches), found.rolled_back, found.rolled_forward, len(self.report))
        return entries

    # -- appending ---------------------------------------------------------------------

    def append(
        self,
        kind: int,
        meta: bytes,
        bodies: Sequence[bytes],
        on_durable: DurableCallback,
    ) -> list[BodyRef]:
        """Turn an entry into a store transaction and queue it; return its body refs
        (the message ids) at once (no I/O). ``ValueError`` for an entry this store
        cannot take (see the module docstring)."""
        if self._state is not _State.OPEN or self._pending.failure is not None:
            raise self._not_open()
        if type(meta) is not bytes:
            meta = bytes(meta)
        operation = decode_operation(kind, meta, list(bodies))
        new_ids = self._index.new_message_ids(operation)
        self._queue(self._index.plan(operation), on_durable)
        self._appends += 1
        refs: list[BodyRef] = new_ids
        if self._cache_limit:
            for ref, body in zip(refs, bodies, strict=True):
                if len(body) <= self._cache_limit:  # a huge body would flush everything else
                    self._cache_put(ref, body)
        return refs

    def _queue(self, plans: list[TxnPlan], on_durable: DurableCallback | None) -> None:
        """Queue store transactions for the writer; the last one completes the entry."""
        queue = self._pending
        with queue.lock:
            if queue.failure is not None:
                raise StorageFailed(str(queue.failure))
            for number, plan in enumerate(plans, start=1):
                queue.items.append(Txn(plan.tid, plan.blocks,
                                       on_durable if number == len(plans) else None,
                                       plan.flags, plan.prefix, plan.first))
            if queue.writer_idle:
                queue.wakeup.notify()

    def _queue_metadata(self) -> None:
        """Queue the store's own METADATA transaction (no entry waits for it)."""
        self._queue([TxnPlan(self._index.take_tid(), [self._index.metadata_block()])], None)

    def _not_open(self) -> StoreError | StorageFailed:
        if self._pending.failure is not None:
            return StorageFailed(str(self._pending.failure))
        if self._state is _State.CLOSED:
            return StoreError(f"dir store {self.directory} is closed")
        return StoreError("recover() must run (and its iterator be exhausted) before append")

    # -- reading bodies ------------------------------------------------------------------

    def body_size(self, ref: BodyRef) -> int:
        """The body length of message ``ref`` (no I/O); KeyError if unknown."""
        return self._index.body_size(ref)

    def read_bodies(self, refs: Sequence[BodyRef]) -> PackedBodies:
        """``read_body`` of each ref, packed."""
        return PackedBodies.of([self.read_body(ref) for ref in refs])

    def read_body(self, ref: BodyRef) -> bytes:
        """A stored body: from the cache, the writer's queue, or the message file.

        Raises ``KeyError`` if no such message is stored and
        :class:`~txbroker.errors.CorruptStore` if its file is damaged.
        """
        cached = self._cache.get(ref)
        if cached is not None:
            self._cache.move_to_end(ref)
            return cached
        body = self._read_file_body(ref)
        if body is None:  # not committed yet: the writer still holds it, or a branch
            body = self._unwritten_body(ref)
            if body is None:
                body = self._read_file_body(ref)
        if body is None:
            raise KeyError(f"body ref {ref}: no message {ref} in {self.ops.committed}")
        if len(body) <= self._cache_limit:
            self._cache_put(ref, body)
        return body

    def _read_file_body(self, ref: BodyRef) -> bytes | None:
        """The body in ``committed/<ref>``, or in the NEW block of the prepared XA branch
        that sends it; None if neither file is there (yet)."""
        path = self.ops.committed / message_name(ref)
        try:
            data = read_file(path)
        except FileNotFoundError:
            entry = self._index.messages.get(ref)
            if entry is None or entry.location is None:
                return None
            path = self.ops.prepared / entry.location
            try:
                data = read_file(path)
            except FileNotFoundError:
                return None
        block = decode_block(data)
        if isinstance(block, str):
            raise CorruptStore(str(path), 0, block)
        return block.body

    def _unwritten_body(self, ref: BodyRef) -> bytes | None:
        """The body of a queued or in-flight NEW block (the cache may have dropped it)."""
        with self._pending.lock:
            in_flight = self.writer.in_flight if self.writer is not None else []
            for item in (*in_flight, *self._pending.items):
                if isinstance(item, Txn):
                    for block in item.blocks:
                        if block.type is BlockType.NEW and block.message_id == ref:
                            return bytes(block.body)
        return None

    def _cache_put(self, ref: BodyRef, body: bytes) -> None:
        if ref in self._cache:
            return
        self._cache[ref] = body
        self._cache_bytes += len(body)
        while self._cache_bytes > self._cache_limit:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= len(evicted)

    # -- space -------------------------------------------------------------------------

    def release(self, ref: BodyRef) -> None:
        """The broker is done with message ``ref``'s body (after its delete, or
        because replay found it dead)."""
        if not self._index.release(ref):
            return
        cached = self._cache.pop(ref, None)
        if cached is not None:
            self._cache_bytes -= len(cached)

    def maintain(self, relocate: bool = True) -> Relocation | None:
        """Save the duplicate-id windows if deletes changed them; never relocates.

        (Space needs no upkeep here: committing a delete removes the file.)
        """
        if self._state is not _State.OPEN or self._pending.failure is not None:
            return None
        waited = time.monotonic() - self._index.metadata_saved_at
        if self._index.duplicate_ids_unsaved and waited >= METADATA_REFRESH_SECONDS:
            with contextlib.suppress(StorageFailed):  # failed meanwhile: nothing to save
                self._queue_metadata()
        return None

    # -- status and shutdown -------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Current counters: ``syncs`` counts group commits (batches), ``segments``
        message files."""
        index = self._index
        return StoreStats(
            appends=self._appends,
            syncs=self.writer.batches if self.writer else 0,
            bytes_written=self.ops.bytes_written,
            segments=index.stored_files,
            disk_bytes=index.stored_bytes,
            live_bodies=index.live_bodies,
            live_body_bytes=index.live_bytes,
            body_cache_bytes=self._cache_bytes,
            batch_seconds=self.writer.batch_seconds if self.writer else None,
            batch_entries=self.writer.batch_entries if self.writer else None,
        )

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued so far is committed and completed.

        Not for the event loop (it blocks). Raises ``StorageFailed`` if the
        store failed, ``TimeoutError`` if ``timeout`` passed first.
        """
        barrier = self._pending.put_barrier() if self._state is _State.OPEN else None
        if barrier is None:  # (closed, or closing: the close writes everything queued)
            return
        if not barrier.done.wait(timeout):
            raise TimeoutError(f"dir store flush took longer than {timeout} s")
        if self._pending.failure is not None:
            raise StorageFailed(str(self._pending.failure))

    def close(self) -> None:
        """Commit what is queued (and the duplicate-id windows), stop the writer,
        unlock. Idempotent."""
        if self._state is _State.CLOSED:
            return
        if self.writer is not None:
            self.writer.check_not_writer_thread()
        unsaved = self._index.duplicate_ids_unsaved
        if self._state is _State.OPEN and self._pending.failure is None and unsaved:
            with contextlib.suppress(StorageFailed):
                self._queue_metadata()
        self._state = _State.CLOSED
        replay, self._replay_iterator = self._replay_iterator, None
        if replay is not None and inspect.getgeneratorstate(replay) != inspect.GEN_RUNNING:
            replay.close()
        if self.writer is not None:
            self.writer.stop()
        self.ops.close()
        self._cache.clear()
        self._cache_bytes = 0
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> DirStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
