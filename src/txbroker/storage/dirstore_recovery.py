"""Opening a data directory of the directory store: lock, resolve leftovers, re-index.

Theory of operation
-------------------
:func:`lock_directory` creates the directories and locks ``DIR/lock`` (``store_lock.py``)
(a second store on the same directory gets :class:`~txbroker.errors.StoreLocked` naming it and
the holder's pid: the seed's "the data directory cannot be shared").

:class:`Recovery` then brings the directory to a state with no transaction in
flight, following the seed's rules:

* ``active/`` — blocks of transactions that never finished preparing: the
  transaction is **rolled back** (its blocks in ``active/`` *and*
  ``prepared/`` are deleted). A block name gives its transaction id even when
  the file is torn, so one torn block is enough to roll its transaction back;
* ``prepared/`` — transactions with every block prepared (none left in
  ``active/``). They are local transactions, whose commit was decided when the
  prepare step ended, so they are **rolled forward** in transaction order with
  the writer's own (idempotent) commit step — which is how a crash in the
  middle of a commit still ends all-or-nothing (see ``docs/dirstore.md``).
  Blocks without the LOCAL flag (in-doubt XA branches, once XA exists) are
  left in place and reported;
* ``committed/`` — the queue content: every message file is read, checked
  (length, CRC, header, name) and indexed; the messages are handed back in
  commit order (transaction id, then sequence number), which is the order
  a journal would have replayed them in;
* ``DIR/metadata`` — the committed metadata block.

:func:`replay_moves` shapes what ``recover`` yields for messages that were
moved to another queue (their ADD, then the MOVE), so that replay puts their
client ids in the same duplicate-id windows as a journal replay would.

Anything else — a name that is not a block or message name, a torn or
damaged file, a block whose header contradicts its name, the copy of an
update a crash interrupted — is never loaded: it is logged with its path,
listed in the store's ``report`` and moved into ``DIR/quarantine/``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.errors import StoreError
from txbroker.storage.dirstore_format import (
    FLAG_LOCAL,
    LOCK_FILE,
    QUARANTINE,
    REWRITE_SUFFIX,
    Block,
    BlockType,
    decode_block,
    parse_block_name,
    parse_message_name,
)
from txbroker.storage.dirstore_model import unpack_message_info
from txbroker.storage.dirstore_writer import DirOps, PreparedBlock, read_file
from txbroker.storage.interface import StoredEntry
from txbroker.storage.store_lock import StoreLock

log = logging.getLogger("txbroker.dirstore")

#: A directory the journal store uses: its presence means DIR holds a journal.
JOURNAL_SUBDIR = "journal"


def lock_directory(ops: DirOps, lock: StoreLock | None = None) -> tuple[StoreLock, list[Path]]:
    """Create the store's directories if needed and lock ``DIR/lock``
    (``store_lock.py``), unless the caller holds that lock already (``lock``: the
    HA part takes it before it opens the store).

    Returns the lock (releasing it unlocks) and the directories it created
    (their parents get an fsync with DSYNC). Raises :class:`~txbroker.errors.StoreLocked`,
    naming the directory and the holder's pid.
    """
    created = []
    for path in (ops.directory, ops.active, ops.prepared, ops.committed):
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True)
            created.append(path)
    lock_path = ops.directory / LOCK_FILE
    if lock is None:
        lock = StoreLock.acquire(lock_path, directory=ops.directory)
    elif lock.path != lock_path or not lock.held:
        raise StoreError(f"the lock given is not a held lock of {lock_path}")
    return lock, created


@dataclass(frozen=True, slots=True)
class RecoveredMessage:
    """A committed message file, as recovery found it."""

    message_id: int
    tid: int
    sequence: int
    info: bytes  #: the packed ``msg`` tuple
    body_length: int
    file_bytes: int


@dataclass(slots=True)
class RecoveredDirectory:
    """What recovery found once the leftovers were resolved."""

    metadata: bytes | None = None  #: SNAPSHOT meta from DIR/metadata
    messages: list[RecoveredMessage] = field(default_factory=list)  #: commit order
    max_tid: int = 0
    rolled_back: int = 0  #: transactions
    rolled_forward: int = 0


class Recovery:
    """Resolves what a crash left behind and re-indexes ``committed/``."""

    def __init__(self, ops: DirOps, report: list[str]) -> None:
        self.ops = ops
        self.report = report
        self.result = RecoveredDirectory()

    def run(self) -> RecoveredDirectory:
        """Resolve ``active/`` and ``prepared/``, then read metadata and messages."""
        if (self.ops.directory / JOURNAL_SUBDIR).is_dir():
            line = (f"{self.ops.directory / JOURNAL_SUBDIR}: this data directory also holds a "
                    f"journal store; the dir store ignores it")
            log.warning("%s", line)
            self.report.append(line)
        self._resolve_transactions()
        self._read_metadata()
        self._read_messages()
        return self.result

    # -- quarantine ------------------------------------------------------------------

    def quarantine(self, path: Path, reason: str) -> None:
        """Move ``path`` into ``DIR/quarantine/`` and report it."""
        target_dir = self.ops.directory / QUARANTINE
        target = target_dir / f"{path.parent.name}.{path.name}"
        try:
            target_dir.mkdir(exist_ok=True)
            number = 0
            while target.exists():
                number += 1
                target = target_dir / f"{path.parent.name}.{path.name}.{number}"
            os.rename(path, target)
        except OSError as exc:
            line = f"{path}: {reason}; skipped (could not quarantine it: {exc})"
        else:
            line = f"{path}: {reason}; moved to {target}"
        log.warning("%s", line)
        self.report.append(line)

    def _read_block(self, path: Path) -> Block | str:
        try:
            data = read_file(path)
        except IsADirectoryError:
            return "a directory where a file belongs"
        except OSError as exc:
            return f"unreadable: {exc}"
        return decode_block(data)

    # -- active/ and prepared/ -------------------------------------------------------

    def _resolve_transactions(self) -> None:
        ops = self.ops
        active: dict[int, list[Path]] = {}
        for name in sorted(os.listdir(ops.active)):
            path = ops.active / name
            parsed = parse_block_name(name)
            if parsed is None:
                self.quarantine(path, "foreign file (not a command block name)")
                continue
            tid = parsed[0]
            active.setdefault(tid, [])
            block = self._read_block(path)
            if isinstance(block, str):
                self.quarantine(path, f"half-written block of transaction {tid:x}, rolled "
                                      f"back: {block}")
            else:
                active[tid].append(path)
        prepared: dict[int, list[tuple[int, str, Block]]] = {}
        for name in sorted(os.listdir(ops.prepared)):
            path = ops.prepared / name
            parsed = parse_block_name(name)
            if parsed is None:
                self.quarantine(path, "foreign file (not a command block name)")
                continue
            tid, sequence = parsed
            prepared.setdefault(tid, [])
            block = self._read_block(path)
            if isinstance(block, str):
                self.quarantine(path, f"damaged prepared block of transaction {tid:x}: {block}")
            elif (block.tid, block.sequence) != parsed:
                self.quarantine(path, f"block header says transaction {block.tid:x} block "
                                      f"{block.sequence}, unlike its name")
            else:
                prepared[tid].append((sequence, name, block))
        forward: list[list[PreparedBlock]] = []
        for tid in sorted(active.keys() | prepared.keys()):
            self.result.max_tid = max(self.result.max_tid, tid)
            blocks = sorted(prepared.get(tid, []))
            if tid in active:
                for path in active[tid]:
                    ops.remove(path)
                for _sequence, name, _block in blocks:
                    ops.remove(ops.prepared / name)
                self.result.rolled_back += 1
                log.info("rolled back transaction %x: it never finished preparing", tid)
            elif blocks and not all(block.flags & FLAG_LOCAL for _s, _n, block in blocks):
                line = (f"{ops.prepared}: transaction {tid:x} is in doubt (not a local "
                        f"transaction); left in prepared/")
                log.warning("%s", line)
                self.report.append(line)
            elif blocks:
                forward.append([(name, block.type, block.message_id, block.info)
                                for _sequence, name, block in blocks])
                self.result.rolled_forward += 1
                log.info("rolling forward transaction %x: prepared, commit was cut short", tid)
        if forward:
            ops.commit(forward)
        if active or prepared:
            ops.sync_directories(ops.active, ops.prepared)

    # -- metadata and committed/ -----------------------------------------------------

    def _read_metadata(self) -> None:
        path = self.ops.metadata
        if not path.exists():
            return
        block = self._read_block(path)
        if isinstance(block, str):
            self.quarantine(path, f"damaged metadata (queue definitions are lost): {block}")
            return
        if block.type is not BlockType.METADATA or not _valid_snapshot(block.info):
            self.quarantine(path, "not a metadata block (queue definitions are lost)")
            return
        self.result.metadata = block.info
        self.result.max_tid = max(self.result.max_tid, block.tid)

    def _read_messages(self) -> None:
        committed = self.ops.committed
        messages = self.result.messages
        for name in os.listdir(committed):
            path = committed / name
            message_id = parse_message_name(name)
            if message_id is None:
                stem = name.removesuffix(REWRITE_SUFFIX)
                if stem != name and parse_message_name(stem) is not None:
                    reason = "half-written copy of an update a crash interrupted"
                else:
                    reason = "foreign file (not a message file name)"
                self.quarantine(path, reason)
                continue
            block = self._read_block(path)
            if isinstance(block, str):
                self.quarantine(path, f"damaged message file: {block}")
                continue
            problem = _message_problem(block, message_id)
            if problem:
                self.quarantine(path, problem)
                continue
            messages.append(RecoveredMessage(
                message_id, block.tid, block.sequence, block.info, len(block.body),
                path.stat().st_size,
            ))
            self.result.max_tid = max(self.result.max_tid, block.tid)
        messages.sort(key=lambda m: (m.tid, m.sequence, m.message_id))


def _valid_snapshot(info: bytes) -> bool:
    try:
        meta = records.unpack(info)
    except Exception:
        return False
    return isinstance(meta, dict) and isinstance(meta.get("queues"), dict) \
        and isinstance(meta.get("next_id"), int)


def _message_problem(block: Block, message_id: int) -> str | None:
    """Why a committed file is not a loadable message, or None."""
    if block.type is not BlockType.NEW:
        return f"a {block.type.name} block where only message files belong"
    if block.message_id != message_id:
        return f"its header names message {block.message_id}, unlike its file name"
    try:
        msg, moved_to = unpack_message_info(block.info)
    except Exception as exc:
        return f"undecodable message header: {exc}"
    if (not isinstance(msg, list) or len(msg) < records.MSG_FIELDS
            or msg[records.MSG_ID] != message_id or not isinstance(moved_to, str | None)):
        return "malformed message header"
    queue = msg[records.MSG_QUEUE]
    # The queue it was sent to is None once that queue was deleted after a move.
    if not isinstance(queue, str) and not (queue is None and moved_to is not None):
        return "malformed message header"
    return None


#: The queue recovery names in the ADD of a message moved out of a queue that was
#: deleted since (deleted again at the end of recovery; no real name has a NUL).
PHANTOM_QUEUE: Final = "\x00dirstore-moved-out-of-a-deleted-queue"


def replay_moves(
    entries: list[StoredEntry], moved: list[tuple[int, list[Any], str]],
    definitions: dict[str, Any],
) -> list[StoredEntry]:
    """Recovery's ``ADD`` entries, with each moved message (``(position in
    entries, msg, queue now)``) yielded as its ADD to the queue it was sent to
    (whose duplicate-id window holds its client id) + MOVE (+ UPDATE for a
    delay set after the move), as a journal would replay it. If that queue was
    deleted meanwhile (not in ``definitions``), the ADD names
    :data:`PHANTOM_QUEUE` instead, which is deleted (with the client ids replay
    put in its window) at the end."""
    if not moved:
        return entries
    extra: dict[int, list[StoredEntry]] = {}
    phantom = False
    for position, msg, target in moved:
        message_id = msg[records.MSG_ID]
        seq = msg[records.MSG_SEQ] if len(msg) > records.MSG_SEQ else 0
        follow = [StoredEntry(int(Kind.MOVE), records.pack([[message_id], target,
                                                            "recovered", [seq]]), ())]
        if msg[records.MSG_DELIVER_AT]:
            update = [message_id, msg[records.MSG_DELIVERY_COUNT],
                      msg[records.MSG_DELIVER_AT]]
            follow.append(StoredEntry(int(Kind.UPDATE), records.pack(update), ()))
        extra[position] = follow
        if msg[records.MSG_QUEUE] not in definitions:
            phantom = True
            msg = [*msg]
            msg[records.MSG_QUEUE] = PHANTOM_QUEUE
            entries[position] = StoredEntry(int(Kind.ADD), records.pack(msg), (message_id,))
    result: list[StoredEntry] = []
    for position, entry in enumerate(entries):
        result.append(entry)
        result += extra.get(position, ())
    if phantom:
        result.append(StoredEntry(int(Kind.QUEUE_DELETE), records.pack(PHANTOM_QUEUE), ()))
    return result
