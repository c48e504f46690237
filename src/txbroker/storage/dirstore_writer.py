"""The directory store's disk steps and its writer thread (group commit).

Theory of operation
-------------------
Every store entry becomes one *transaction* (:class:`Txn`): a list of
command blocks (see :mod:`~txbroker.storage.dirstore_format`) with a store
transaction id. ``DirStore.append`` builds it on the broker's thread and
queues it; the one :class:`DirWriter` thread takes *everything* queued (a
batch) and moves the whole batch through the seed's three steps, so that the
directory syncs are shared by every transaction of the batch:

1. **write** — each block is created in ``active/`` as ``<tid>-<seq>`` and,
   with ``FSYNC``/``FDATASYNC``, its contents synced;
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

Only then are the batch's completions handed to ``dispatch`` in one call.

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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
#: fsync per file is the seed's rule, but concurrent ones share the file
#: system's journal commits (ext4/xfs), which is most of their cost.
SYNC_THREADS = 16
#: Block files written before their syncs run (bounds the open fds of a batch).
FILES_PER_SYNC_ROUND = 256


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
        self._sync_pool: ThreadPoolExecutor | None = None

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
            self._sync_pool.shutdown()
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
        FSYNC/FDATASYNC each file's contents are synced before step 2 — by
        :data:`SYNC_THREADS` threads at once, so that the file system can put
        many of them into one journal commit."""
        unsynced: list[int] = []
        try:
            for txn in txns:
                count = len(txn.blocks)
                for sequence, block in enumerate(txn.blocks):
                    parts = encode_block(
                        block.type, sequence=sequence, count=count, tid=txn.tid,
                        message_id=block.message_id, info=block.info, body=block.body,
                    )
                    unsynced.append(self.write_file(self.active / block_name(txn.tid, sequence),
                                                    parts))
                    self.bytes_written += sum(len(part) for part in parts)
                    if len(unsynced) >= FILES_PER_SYNC_ROUND:
                        self._sync_files(unsynced)
            self._sync_files(unsynced)
        finally:
            for fd in unsynced:  # only after a failure
                os.close(fd)

    def _sync_files(self, fds: list[int]) -> None:
        """Sync (per the flags) and close ``fds``; empties the list."""
        count = len(fds)
        try:
            if self.flags.file_sync and len(fds) > 1:
                if self._sync_pool is None:
                    self._sync_pool = ThreadPoolExecutor(
                        SYNC_THREADS, thread_name_prefix="txbroker-dirstore-sync")
                for _ in self._sync_pool.map(self.sync_file, fds):
                    pass
            else:
                for fd in fds:
                    self.sync_file(fd)
        finally:
            for fd in fds:
                os.close(fd)
            fds.clear()
        if self.flags.file_sync:
            self.file_syncs += count

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

    def _process(self, batch: list[WorkItem]) -> None:
        if self.queue.failure is not None:
            self._poison(batch, self.queue.failure)
            return
        txns = [item for item in batch if isinstance(item, Txn)]
        if txns:
            try:
                self.ops.write_active(txns)
                self.ops.prepare(txns)
                self.ops.commit([prepared_blocks(txn) for txn in txns])
            except OSError as exc:
                failure = StorageFailed(
                    f"dir store write failed in {self.ops.directory}: {exc}"
                )
                log.error("%s; the store refuses further appends", failure)
                self._poison(batch, failure)
                return
            self.batches += 1
            callbacks = [txn.on_durable for txn in txns if txn.on_durable is not None]
            if callbacks:
                self._dispatch(completion(callbacks, None))
        with self.queue.lock:
            self.in_flight = []
        for item in batch:
            if isinstance(item, Barrier):
                item.done.set()

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
