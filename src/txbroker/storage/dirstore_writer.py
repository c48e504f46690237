"""The directory store's disk steps (its writer thread is ``dirstore_thread.py``).

Theory of operation
-------------------
Every store entry becomes one *transaction* (:class:`Txn`): a list of
command blocks (see :mod:`~txbroker.storage.dirstore_format`) with a store
transaction id. ``DirStore.append`` builds it on the broker's thread and
queues it; the one writer thread (``dirstore_thread.py``) takes *everything*
queued (a batch) and moves the whole batch through the seed's three steps, so that the
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

Spare files
-----------
Creating a file and removing one are the dir store's dearest steps, and on
some file systems much dearer than a rename: ext4 without a journal (this
project's CI machines) scans past recently freed inodes on every create,
and a ``discard`` mount trims the blocks of every removed file. So a removed
block or message file is not unlinked but **renamed into** ``DIR/spare/``
(up to :data:`MAX_SPARE_FILES` files of at most :data:`MAX_SPARE_BYTES`),
and a new block is **written into a spare file** (its old bytes overwritten
in place, the length cut to the new block's), which is then renamed to the
block's name. To every step after it, that is a created file: its contents
are whole before its name appears (a crash in between leaves garbage in
``spare/`` only), its contents are synced as the flags say before the block
is prepared, and a file removed from ``committed/`` or ``prepared/`` is gone
from there as the seed says. ``spare/`` has no meaning for recovery: its
files are reused or left alone, never read.

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
from txbroker.storage.dirstore_blocks import BranchHeader, ResolveInfo
from txbroker.storage.dirstore_format import (
    ACTIVE,
    COMMITTED,
    FDATASYNC,
    FLAG_LOCAL,
    FLAG_XA,
    FSYNC,
    METADATA_FILE,
    PREPARED,
    REWRITE_SUFFIX,
    SPARE,
    TID_DIGITS,
    Block,
    BlockType,
    SyncFlags,
    block_name,
    branch_block_name,
    decode_block,
    encode_block,
    message_name,
)
from txbroker.storage.dirstore_model import COMMITTING_OUTCOMES, HEURISTIC_OUTCOMES, apply_patch
from txbroker.storage.interface import DurableCallback

log = logging.getLogger("txbroker.dirstore")

#: Permission bits of new block files (before the umask).
BLOCK_FILE_MODE = 0o640
#: Threads that sync the block files of a batch at once (FSYNC/FDATASYNC): one
#: fsync per file is the seed's rule, but concurrent ones share the file
#: system's journal commits (ext4/xfs), which is most of their cost.
SYNC_THREADS = 16
#: Block files written before their syncs run (bounds the open fds of a batch).
FILES_PER_SYNC_ROUND = 256
#: Spare files kept for reuse (see "Spare files"), and the largest file kept.
MAX_SPARE_FILES = 32768
MAX_SPARE_BYTES = 8 * 1024


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
    metadata refresh when ``on_durable`` is None). A local transaction (the
    default) is written, prepared and committed in one batch; an XA branch
    (``flags`` FLAG_XA) is written and prepared, and stays in ``prepared/``
    until a later RESOLVE block completes it."""

    tid: int
    blocks: list[BlockOp]
    on_durable: DurableCallback | None
    flags: int = FLAG_LOCAL
    prefix: str | None = None  #: an XA branch's gtrid hex: its blocks' names
    first: int = 0  #: the number in the name of an XA branch's first block

    def name(self, sequence: int) -> str:
        """The file name of block ``sequence``."""
        if self.prefix is None:
            return block_name(self.tid, sequence)
        return branch_block_name(self.prefix, self.first + sequence)



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
        write_parts(fd, parts, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_parts(fd: int, parts: Sequence[bytes], path: Path) -> int:
    """Write ``parts`` at ``fd``'s offset; return the bytes written."""
    total = sum(len(part) for part in parts)
    written = os.writev(fd, parts)
    if written < total:  # a short writev (huge blocks): write the rest plainly
        rest = memoryview(b"".join(parts))[written:]
        while rest:
            count = os.write(fd, rest)
            if count <= 0:
                raise OSError(errno.EIO, f"write to {path} returned {count}")
            rest = rest[count:]
    return total


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
        self.spare = directory / SPARE
        self.flags = flags
        #: Names of the files in ``spare/`` ("Spare files"), and the next name's number.
        self._spares: list[str] = []
        self._next_spare = 0
        # Replaceable steps (crash points).
        self.write_file: Callable[[Path, Sequence[bytes]], int] = self.write_spare_or_new
        self.sync_file: Callable[[int], None] = (
            os.fsync if flags.file_sync == FSYNC
            else os.fdatasync if flags.file_sync == FDATASYNC
            else _no_sync
        )
        self.sync_dir: Callable[[Path], None] = self.fsync_directory if flags.dir_sync \
            else _no_dir_sync
        self.rename: Callable[[Path, Path], None] = os.rename
        self.unlink: Callable[[Path], None] = self.keep_as_spare
        #: Counters: real file and directory syncs, bytes of block files written.
        self.file_syncs = 0
        self.dir_syncs = 0
        self.bytes_written = 0
        self._dir_fds: dict[Path, int] = {}
        self._sync_pool: ThreadPoolExecutor | None = None

    # -- spare files -------------------------------------------------------------------

    def open_spares(self) -> None:
        """Find the files in ``spare/`` (once the directory is locked)."""
        self.spare.mkdir(exist_ok=True)
        names = sorted(os.listdir(self.spare))
        numbers = [int(name, 16) for name in names if _is_hex(name)]
        self._spares = [name for name in names if _is_hex(name)][:MAX_SPARE_FILES]
        self._next_spare = max(numbers, default=-1) + 1

    def write_spare_or_new(self, path: Path, parts: Sequence[bytes]) -> int:
        """The ``write_file`` step: a spare file written and renamed to ``path`` if
        there is one, else a new file; ``path`` must not exist. Returns the open fd."""
        while self._spares:
            spare = self.spare / self._spares.pop()
            try:
                fd = os.open(spare, os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # (removed by hand): try the next one
            try:
                total = write_parts(fd, parts, path)
                if os.fstat(fd).st_size > total:
                    os.ftruncate(fd, total)
                if os.path.lexists(path):
                    raise FileExistsError(errno.EEXIST, "File exists", str(path))
                os.rename(spare, path)
            except BaseException:
                os.close(fd)
                raise
            return fd
        return write_new_file(path, parts)

    def keep_as_spare(self, path: Path) -> None:
        """The ``unlink`` step: ``path`` leaves its directory for ``spare/`` (or is
        unlinked when ``spare/`` is full or the file is large)."""
        if len(self._spares) >= MAX_SPARE_FILES or os.stat(path).st_size > MAX_SPARE_BYTES:
            os.unlink(path)
            return
        name = f"{self._next_spare:x}"
        self._next_spare += 1
        os.rename(path, self.spare / name)
        self._spares.append(name)

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
                        flags=txn.flags,
                    )
                    unsynced.append(self.write_file(self.active / txn.name(sequence), parts))
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
                name = txn.name(sequence)
                self.rename(self.active / name, self.prepared / name)
        self.sync_directories(self.active, self.prepared)

    def commit(self, transactions: Sequence[Sequence[PreparedBlock]]) -> None:
        """Step 3: apply prepared transactions in order, then drop their blocks.

        Idempotent, so that recovery can run it again on what a crash left in
        ``prepared/``: a NEW block already renamed is gone from ``prepared/``,
        a DELETE of a missing file and an UPDATE of a missing message do
        nothing, and an UPDATE applied twice gives the same header; a RESOLVE
        is idempotent in the same ways (:meth:`resolve`).
        """
        leftovers: list[Path] = []
        metadata = rewrote_prepared = False
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
                    elif block_type is BlockType.RESOLVE:
                        rewrote_prepared |= self.resolve(int(name[:TID_DIGITS], 16), info,
                                                         leftovers)
                    leftovers.append(source)
        extra = (self.directory,) if metadata else ()
        self.sync_directories(self.committed, *extra,
                              *((self.prepared,) if rewrote_prepared else ()))
        for path in leftovers:
            self.remove(path)

    def resolve(self, tid: int, info: bytes, leftovers: list[Path]) -> bool:
        """Carry out the RESOLVE block of transaction ``tid`` (``dirstore_format.py``)
        on the branch's blocks in ``prepared/``; add the blocks to drop to
        ``leftovers``. True if it rewrote the branch's first block (a heuristic
        outcome, kept until forget).

        For a commit, as the seed says: each NEW block the branch sends (and did
        not discard) is renamed into ``committed/`` under its message id — and
        then rewritten with the header fields the commit decided (its queue seq)
        under transaction ``tid`` (its place in commit order) — and each DELETE
        block removes the consumed message's file. Idempotent: a block already
        gone from ``prepared/`` was done before a crash, and a message file still
        flagged XA is rewritten again; a block whose header names another
        transaction is not this branch's and is left alone.
        """
        resolve = ResolveInfo.decode(info)
        outcome, xid, gtrid, branch_tid = (resolve.outcome, resolve.xid, resolve.gtrid,
                                           resolve.branch_tid)
        committing = outcome in COMMITTING_OUTCOMES
        discarded = set(resolve.discards)
        moved: dict[int, Block] = {}
        rewrote = False
        for number in range(resolve.first, resolve.first + resolve.count):
            path = self.prepared / branch_block_name(gtrid, number)
            try:
                data = read_file(path)
            except FileNotFoundError:
                continue  # done before a crash
            block = decode_block(data)
            if isinstance(block, str) or block.tid != branch_tid:
                log.error("%s: not a block of XA branch %s (%s); left for recovery to "
                          "quarantine", path, xid,
                          block if isinstance(block, str) else f"transaction {block.tid:x}")
                continue
            if block.type is BlockType.NEW and committing and block.message_id not in discarded:
                self.rename(path, self.committed / message_name(block.message_id))
                moved[block.message_id] = block
                continue
            if block.type is BlockType.DELETE and committing:
                self.remove(self.committed / message_name(block.message_id))
            elif block.type is BlockType.DUMMY and outcome in HEURISTIC_OUTCOMES:
                if block.count != 1:  # the branch's first block stays, as its outcome
                    header = BranchHeader.decode(block.info)
                    header.state = outcome
                    self.rewrite(path, encode_block(
                        BlockType.DUMMY, sequence=0, count=1, tid=branch_tid, message_id=0,
                        info=header.encode(), flags=block.flags))
                    rewrote = True
                continue
            leftovers.append(path)
        for message_id, seq in resolve.seqs if committing else ():
            self._commit_message(message_id, seq, tid, moved.get(message_id))
        return rewrote

    def _commit_message(self, message_id: int, seq: int, tid: int, block: Block | None) -> None:
        """Give a committed branch's message file its commit header (unless it has it)."""
        if block is None:  # a roll-forward: the rename happened before the crash
            try:
                found = decode_block(read_file(self.committed / message_name(message_id)))
            except FileNotFoundError:
                return  # consumed since (a later transaction deleted it)
            if isinstance(found, str) or not found.flags & FLAG_XA:
                return  # rewritten already (or damaged: recovery quarantines it)
            block = found
        parts = encode_block(
            BlockType.NEW, sequence=block.sequence, count=block.count, tid=tid,
            message_id=message_id, info=apply_patch(block.info, {records.MSG_SEQ: seq}),
            body=block.body, flags=FLAG_LOCAL)
        self.rewrite(self.committed / message_name(message_id), parts)

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
        self.rewrite(path, encode_block(
            BlockType.NEW, sequence=block.sequence, count=block.count, tid=block.tid,
            message_id=message_id, info=apply_patch(block.info, records.unpack(info)),
            body=block.body, flags=block.flags))

    def rewrite(self, path: Path, parts: Sequence[bytes]) -> None:
        """Replace ``path`` by a file with ``parts``: a synced copy renamed over it."""
        temporary = path.with_name(path.name + REWRITE_SUFFIX)
        self.remove(temporary)  # a leftover of a rewrite a crash interrupted
        self.create(temporary, parts)
        self.rename(temporary, path)


def _is_hex(name: str) -> bool:
    return bool(name) and all(c in "0123456789abcdef" for c in name)
