"""The directory store's disk steps and its writer thread (group commit).

Theory of operation
-------------------
Every store entry becomes one *transaction* (:class:`Txn`): a list of
command blocks (see :mod:`~txbroker.storage.dirstore_format`) with a store
transaction id. ``DirStore.append`` builds it on the broker's thread and
queues it; the :class:`DirWriter` thread takes *everything* queued (a
batch) and moves the whole batch through the seed's three steps, so that the
directory syncs are shared by every transaction of the batch. The writer
thread does step 1 and hands the batch on to its commit thread, which does
steps 2 and 3 batch by batch, in order, so that step 1 of the next batch
overlaps steps 2 and 3 of this one (see :meth:`DirWriter._process` for why
that keeps the crash-safety argument):

1. **write** — each block is created in ``active/`` as ``<tid>-<seq>`` and,
   with ``FSYNC``/``FDATASYNC``, its contents synced (one sync per file, many
   at once: :class:`~txbroker.storage.dirstore_pool.SyncPool`);
2. **prepare** — each block is renamed into ``prepared/``; with ``DSYNC``,
   ``active/`` and ``prepared/`` are fsynced. Once every block of a
   transaction is in ``prepared/`` the (local) transaction is committed: from
   here on recovery rolls it *forward*;
3. **commit** — in transaction order: a NEW block is renamed into
   ``committed/`` under its message id; a DELETE removes the message file; an
   UPDATE rewrites the message file with the new header fields (a copy
   renamed over it); a METADATA block is renamed to ``DIR/metadata``; a
   DUMMY changes nothing. With ``DSYNC``, ``committed/`` (and ``DIR`` for
   metadata) is fsynced; *then* the remaining blocks are removed from
   ``prepared/``.

Only then are the batch's completions handed to ``dispatch`` in one call
(from the commit thread).

Crash points are replaceable steps of :class:`DirOps` — ``write_file``,
``sync_file``, ``sync_dir``, ``rename``, ``unlink`` — which tests swap for
functions that raise (a "kill" between any two steps) or that record what a
power loss would undo. An ``OSError`` in any step poisons the store like the
journal's writer: the batch and everything queued after it complete with
``StorageFailed``, nothing is cleaned up (the files stay as a crash would
leave them) and ``append`` refuses further entries.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue as stdqueue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from txbroker.core import records
from txbroker.errors import StorageFailed
from txbroker.storage.dirstore_format import (
    ACTIVE,
    COMMITTED,
    FDATASYNC,
    FSYNC,
    METADATA_FILE,
    PREPARED,
    REWRITE_SUFFIX,
    BlockType,
    SyncFlags,
    block_name,
    decode_block,
    encode_block,
    message_name,
)
from txbroker.storage.dirstore_model import apply_patch
from txbroker.storage.dirstore_pool import SyncPool
from txbroker.storage.interface import DurableCallback
from txbroker.storage.writer_thread import (
    Barrier,
    PendingQueue,
    WriterThread,
    completion,
)

log = logging.getLogger("txbroker.dirstore")

#: Permission bits of new block files (before the umask).
BLOCK_FILE_MODE = 0o640
#: Threads that sync the block files of a batch at once (FSYNC/FDATASYNC): one
#: fsync per file is the seed's rule, but concurrent ones are served together
#: by the disk (and share the file system's journal commits on ext4/xfs).
SYNC_THREADS = 64
#: Block files written but not yet synced and closed (bounds the open fds).
MAX_UNSYNCED_FILES = 1024


@dataclass(slots=True)
class BlockOp:
    """One command block of a transaction, before it is written."""

    type: BlockType
    message_id: int
    info: bytes = b""
    body: bytes = b""


@dataclass(slots=True)
class Txn:
    """Work item: one store transaction (one appended entry, or the store's own
    metadata refresh when ``on_durable`` is None)."""

    tid: int
    blocks: list[BlockOp]
    on_durable: DurableCallback | None




WorkItem = Txn | Barrier

#: A block in ``prepared/`` ready to commit: file name, type, message id, info.
PreparedBlock = tuple[str, BlockType, int, bytes]


def _no_sync(fd: int) -> None:
    """No FSYNC/FDATASYNC flag: leave flushing file contents to the OS."""


def _no_dir_sync(path: Path) -> None:
    """No DSYNC flag: leave flushing directories to the OS."""


def write_new_file(path: Path, parts: Sequence[bytes]) -> int:
    """Create ``path`` (it must not exist), write ``parts``; return the open fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, BLOCK_FILE_MODE)
    try:
        total = sum(len(part) for part in parts)
        written = os.writev(fd, parts)
        if written < total:  # a short writev (huge blocks): write the rest plainly
            rest = memoryview(b"".join(parts))[written:]
            while rest:
                count = os.write(fd, rest)
                if count <= 0:
                    raise OSError(errno.EIO, f"write to {path} returned {count}")
                rest = rest[count:]
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: Path) -> bytes:
    """The whole contents of ``path``."""
    with open(path, "rb") as file:
        return file.read()


class DirOps:
    """The store's disk operations on one data directory, as replaceable steps.

    Used by the writer thread and by recovery (which rolls transactions
    forward with the same :meth:`commit`).
    """

    def __init__(self, directory: Path, flags: SyncFlags) -> None:
        self.directory = directory
        self.active = directory / ACTIVE
        self.prepared = directory / PREPARED
        self.committed = directory / COMMITTED
        self.metadata = directory / METADATA_FILE
        self.flags = flags
        # Replaceable steps (crash points).
        self.write_file: Callable[[Path, Sequence[bytes]], int] = write_new_file
        self.sync_file: Callable[[int], None] = (
            os.fsync if flags.file_sync == FSYNC
            else os.fdatasync if flags.file_sync == FDATASYNC
            else _no_sync
        )
        self.sync_dir: Callable[[Path], None] = self.fsync_directory if flags.dir_sync \
            else _no_dir_sync
        self.rename: Callable[[Path, Path], None] = os.rename
        self.unlink: Callable[[Path], None] = os.unlink
        #: Counters: real file and directory syncs, bytes of block files written.
        self.file_syncs = 0
        self.dir_syncs = 0
        self.bytes_written = 0
        self._dir_fds: dict[Path, int] = {}
        self._sync_pool: SyncPool | None = None

    # -- primitive steps with their bookkeeping --------------------------------------

    def fsync_directory(self, path: Path) -> None:
        """fsync a directory (its fd is opened once and kept)."""
        fd = self._dir_fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._dir_fds[path] = fd
        os.fsync(fd)

    def close(self) -> None:
        """Close the directory fds kept for fsync; stop the sync threads."""
        for fd in self._dir_fds.values():
            os.close(fd)
        self._dir_fds.clear()
        if self._sync_pool is not None:
            self._sync_pool.close()
            self._sync_pool = None

    def sync_directories(self, *paths: Path) -> None:
        """The DSYNC step: fsync each directory (a no-op without DSYNC)."""
        for path in paths:
            self.sync_dir(path)
            if self.flags.dir_sync:
                self.dir_syncs += 1

    def create(self, path: Path, parts: Sequence[bytes]) -> None:
        """Create a file with ``parts``; sync its contents (FSYNC/FDATASYNC)."""
        fd = self.write_file(path, parts)
        try:
            self.sync_file(fd)
        finally:
            os.close(fd)
        if self.flags.file_sync:
            self.file_syncs += 1
        self.bytes_written += sum(len(part) for part in parts)

    def remove(self, path: Path) -> None:
        """Unlink a file that may already be gone (steps are idempotent)."""
        with contextlib.suppress(FileNotFoundError):
            self.unlink(path)

    # -- the three steps of a batch ------------------------------------------------

    def write_active(self, txns: Sequence[Txn]) -> None:
        """Step 1: every block of every transaction into ``active/``; with
        FSYNC/FDATASYNC each file's contents are synced before step 2.

        The files are created one after the other, in order, on this thread;
        with a file sync flag each is handed to the :class:`SyncPool` as soon
        as it is written, so up to :data:`SYNC_THREADS` syncs run at once and
        overlap the creates that follow. Returns once every file is synced and
        closed; the first failure is raised (after the syncs under way ended).
        """
        active = self.active
        write_file = self.write_file
        written = 0
        if not self.flags.file_sync or sum(len(txn.blocks) for txn in txns) == 1:
            for txn in txns:
                count = len(txn.blocks)
                for sequence, block in enumerate(txn.blocks):
                    parts = encode_block(
                        block.type, sequence=sequence, count=count, tid=txn.tid,
                        message_id=block.message_id, info=block.info, body=block.body,
                    )
                    fd = write_file(active / block_name(txn.tid, sequence), parts)
                    try:
                        self.sync_file(fd)
                    finally:
                        os.close(fd)
                    written += sum(map(len, parts))
                    if self.flags.file_sync:
                        self.file_syncs += 1
            self.bytes_written += written
            return
        pool = self._syncer()
        submitted = 0
        try:
            for txn in txns:
                count = len(txn.blocks)
                for sequence, block in enumerate(txn.blocks):
                    if pool.failed:  # a sync failed: create nothing more
                        return
                    parts = encode_block(
                        block.type, sequence=sequence, count=count, tid=txn.tid,
                        message_id=block.message_id, info=block.info, body=block.body,
                    )
                    fd = write_file(active / block_name(txn.tid, sequence), parts)
                    pool.submit(self.sync_file, fd)
                    submitted += 1
                    written += sum(map(len, parts))
        finally:
            self.bytes_written += written
            try:
                pool.wait()  # every fd closed; raises the first failed sync
            finally:
                self.file_syncs += submitted

    def _syncer(self) -> SyncPool:
        """The sync workers (started on first use, stopped by :meth:`close`)."""
        if self._sync_pool is None:
            self._sync_pool = SyncPool(SYNC_THREADS, max_open=MAX_UNSYNCED_FILES,
                                       name="txbroker-dirstore-sync")
        return self._sync_pool

    def prepare(self, txns: Sequence[Txn]) -> None:
        """Step 2: rename every block into ``prepared/``; DSYNC both directories."""
        for txn in txns:
            for sequence in range(len(txn.blocks)):
                name = block_name(txn.tid, sequence)
                self.rename(self.active / name, self.prepared / name)
        self.sync_directories(self.active, self.prepared)

    def commit(self, transactions: Sequence[Sequence[PreparedBlock]]) -> None:
        """Step 3: apply prepared transactions in order, then drop their blocks.

        Idempotent, so that recovery can run it again on what a crash left in
        ``prepared/``: a NEW block already renamed is gone from ``prepared/``,
        a DELETE of a missing file and an UPDATE of a missing message do
        nothing, and an UPDATE applied twice gives the same header.
        """
        leftovers: list[Path] = []
        metadata = False
        for blocks in transactions:
            for name, block_type, message_id, info in blocks:
                source = self.prepared / name
                if block_type is BlockType.NEW:
                    self.rename(source, self.committed / message_name(message_id))
                elif block_type is BlockType.METADATA:
                    self.rename(source, self.metadata)
                    metadata = True
                else:
                    if block_type is BlockType.DELETE:
                        self.remove(self.committed / message_name(message_id))
                    elif block_type is BlockType.UPDATE:
                        self.apply_update(message_id, info)
                    leftovers.append(source)
        self.sync_directories(self.committed, *((self.directory,) if metadata else ()))
        for path in leftovers:
            self.remove(path)

    def apply_update(self, message_id: int, info: bytes) -> None:
        """Rewrite a message file with new header fields (copy, then rename over it)."""
        path = self.committed / message_name(message_id)
        try:
            data = read_file(path)
        except FileNotFoundError:
            return  # deleted by a later transaction already (recovery replays in order)
        block = decode_block(data)
        if isinstance(block, str) or block.type is not BlockType.NEW:
            log.error("cannot update %s: %s; left for recovery to quarantine", path,
                      block if isinstance(block, str) else "not a message block")
            return
        parts = encode_block(
            BlockType.NEW, sequence=block.sequence, count=block.count, tid=block.tid,
            message_id=message_id, info=apply_patch(block.info, records.unpack(info)),
            body=block.body, flags=block.flags,
        )
        temporary = path.with_name(path.name + REWRITE_SUFFIX)
        self.remove(temporary)  # a leftover of an update a crash interrupted
        self.create(temporary, parts)
        self.rename(temporary, path)


def prepared_blocks(txn: Txn) -> list[PreparedBlock]:
    """The blocks of a transaction as :meth:`DirOps.commit` takes them."""
    return [
        (block_name(txn.tid, sequence), block.type, block.message_id, block.info)
        for sequence, block in enumerate(txn.blocks)
    ]


class DirWriter(WriterThread):
    """The one thread that writes, renames and deletes block files."""

    thread_name = "txbroker-dirstore-writer"
    store_label = "dir store"

    def __init__(
        self,
        ops: DirOps,
        queue: PendingQueue,
        dispatch: Callable[[Callable[[], None]], None] | None,
    ) -> None:
        self.ops = ops
        super().__init__(queue)
        self.dispatch = dispatch
        #: Group commits done (batches that wrote at least one transaction).
        self.batches = 0
        #: Batches whose write step is done, for the commit thread (in order); a
        #: batch comes with the failure of its write step, if it failed. At most
        #: one waits, so at most three batches are in flight (committing,
        #: waiting, being written). None stops the commit thread.
        self._written: stdqueue.Queue[tuple[list[WorkItem], StorageFailed | None] | None] = \
            stdqueue.Queue(maxsize=1)
        self._committer = threading.Thread(
            target=self._commit_loop, name="txbroker-dirstore-commit", daemon=True)
        self.stage_threads.append(self._committer)

    def _process(self, batch: list[WorkItem]) -> None:
        """The writer thread's part: step 1 (write) of ``batch``, then hand the
        batch on to the commit thread, which does steps 2 and 3 and completes it.

        So step 1 of the next batch overlaps steps 2-3 of this one. That keeps
        the crash-safety argument: the next batch's blocks are only in
        ``active/`` (recovery rolls such transactions back, and none of them
        was acknowledged) until the commit thread prepares them, after it
        finished this batch — commit points stay in append order, and every
        block's sync returned before its rename (``write_active`` waits).
        """
        if self._committer.ident is None:
            self._committer.start()
        failure = self.queue.failure
        txns = [item for item in batch if isinstance(item, Txn)]
        if txns and failure is None:
            try:
                self.ops.write_active(txns)
            except OSError as exc:
                failure = StorageFailed(f"dir store write failed in {self.ops.directory}: {exc}")
                log.error("%s; the store refuses further appends", failure)
                with self.queue.lock:  # refuse appends now; the commit thread fails them
                    self.queue.failure = failure
        with self.queue.lock:
            self.handed_on = self.handed_on + batch
            self.in_flight = self.handed_on
        self._written.put((batch, failure))

    def _commit_loop(self) -> None:
        """The commit thread: steps 2 and 3 of each written batch, in order, then
        its completions. After a failure (of a write step or of its own) every
        later batch fails too, unprepared."""
        failed: StorageFailed | None = None
        while True:
            handed = self._written.get()
            if handed is None:
                return
            batch, failure = handed
            try:
                failed = self._commit_batch(batch, failed or failure)
            except BaseException:  # a bug: fail everything rather than hang every caller
                log.exception("dir store commit thread crashed")
                failed = StorageFailed("dir store writer crashed")
                self._fail(batch, failed)
            finally:
                with self.queue.lock:
                    self.handed_on = self.handed_on[len(batch):]
                    self.in_flight = self.in_flight[len(batch):]

    def _commit_batch(self, batch: list[WorkItem],
                      failure: StorageFailed | None) -> StorageFailed | None:
        """Steps 2 and 3 of a written batch and its completions, or its failure
        (``failure``: the batch or one before it failed); the failure, if any."""
        if failure is not None:
            self._fail(batch, failure)
            return failure
        txns = [item for item in batch if isinstance(item, Txn)]
        if txns:
            try:
                self.ops.prepare(txns)
                self.ops.commit([prepared_blocks(txn) for txn in txns])
            except OSError as exc:
                failure = StorageFailed(
                    f"dir store write failed in {self.ops.directory}: {exc}"
                )
                log.error("%s; the store refuses further appends", failure)
                self._fail(batch, failure)
                return failure
            self.batches += 1
            callbacks = [txn.on_durable for txn in txns if txn.on_durable is not None]
            if callbacks:
                self._dispatch(completion(callbacks, None))
        for item in batch:
            if isinstance(item, Barrier):
                item.done.set()
        return None

    def _fail(self, batch: list[WorkItem], failure: StorageFailed) -> None:
        """Fail ``batch`` and refuse later appends (commit thread). Unlike
        ``_poison`` it leaves the queued entries alone: the writer hands them on
        with the failure, so every completion still comes in append order."""
        with self.queue.lock:
            self.queue.failure = failure
        callbacks = [
            item.on_durable for item in batch
            if isinstance(item, Txn) and item.on_durable is not None
        ]
        if callbacks:
            self._dispatch(completion(callbacks, failure))
        for item in batch:
            if isinstance(item, Barrier):
                item.done.set()

    def _finish_stages(self) -> None:
        """Let the commit thread finish every written batch, then end it."""
        if self._committer.is_alive():
            self._written.put(None)
            self._committer.join()

    def _poison(self, batch: list[WorkItem], failure: StorageFailed) -> None:
        """Fail ``batch`` and everything still queued; refuse later appends."""
        with self.queue.lock:
            self.queue.failure = failure
            batch = batch + self.queue.items
            self.queue.items = []
            self.in_flight = []
        callbacks = [
            item.on_durable for item in batch
            if isinstance(item, Txn) and item.on_durable is not None
        ]
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
            log.exception("dispatch of dir store completions failed")
