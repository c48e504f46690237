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
* ``prepared/`` — local transactions with every block prepared (none left in
  ``active/``): their commit was decided when the prepare step ended, so they
  are **rolled forward** in transaction order with the writer's own
  (idempotent) commit step — which is how a crash in the middle of a commit
  still ends all-or-nothing (see ``docs/dirstore.md``). A RESOLVE among them
  finishes an XA branch's commit or rollback the same way;
* then the **XA branches** left in ``prepared/`` (blocks flagged XA, named
  ``<GTRID>-<n>``): a branch whose prepare never finished (a block still in
  ``active/``) is rolled back with the seed's dummy-first reading — its
  blocks are deleted without reading message content; a whole branch (every
  block of its prepare, its first block a DUMMY holding a parsable Xid whose
  gtrid is the name's) is **prepared** (or heuristically completed) and is
  handed back to the broker as an ``XA_PREPARE`` (+ ``XA_HEURISTIC``) entry;
  an incomplete branch, XA blocks without their first block ("a file for an
  unknown Xid"), a branch under another gtrid's name or a second copy of a
  branch are quarantined and reported;
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from txbroker.core import records
from txbroker.errors import StoreError
from txbroker.storage.dirstore_blocks import BranchHeader
from txbroker.storage.dirstore_format import (
    FLAG_LOCAL,
    FLAG_XA,
    LOCK_FILE,
    QUARANTINE,
    REWRITE_SUFFIX,
    Block,
    BlockType,
    block_size,
    decode_block,
    parse_block_name,
    parse_branch_block_name,
    parse_message_name,
)
from txbroker.storage.dirstore_model import HEURISTIC_OUTCOMES, PREPARED_STATE, unpack_message_info
from txbroker.storage.dirstore_writer import DirOps, PreparedBlock, read_file
from txbroker.storage.interface import StoredEntry
from txbroker.storage.journal_format import JOURNAL_SUBDIR  # its presence: DIR holds a journal
from txbroker.storage.store_lock import StoreLock
from txbroker.xid import Xid

log = logging.getLogger("txbroker.dirstore")



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


@dataclass(frozen=True, slots=True)
class RecoveredBranch:
    """A prepared (or heuristically completed) XA branch found in ``prepared/``."""

    xid: str
    gtrid: str  #: uppercase hex: its blocks' name prefix
    first: int  #: the number in its first block's name
    tid: int  #: its blocks' transaction id
    state: str  #: ``"prepared"``, ``"heuristic-commit"`` or ``"heuristic-rollback"``
    discards: list[int]
    created_ms: int
    prepared_ms: int
    sends: list[RecoveredMessage]  #: the messages it sends, in its order
    locations: list[str]  #: the file name of each send's NEW block
    consumed: list[tuple[int, int]]  #: message id, delivery count


@dataclass(slots=True)
class RecoveredDirectory:
    """What recovery found once the leftovers were resolved."""

    metadata: bytes | None = None  #: SNAPSHOT meta from DIR/metadata
    messages: list[RecoveredMessage] = field(default_factory=list)  #: commit order
    branches: list[RecoveredBranch] = field(default_factory=list)  #: by transaction id
    next_branch_block: int = 0  #: past the number in every XA block's name
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
        self.ops.open_spares()
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
        active: dict[int, list[Path]] = {}  # transactions that never finished preparing
        for name in sorted(os.listdir(ops.active)):
            path = ops.active / name
            local = parse_block_name(name)
            if local is None and parse_branch_block_name(name) is None:
                self.quarantine(path, _foreign(name))
                continue
            block = self._read_block(path)
            if isinstance(block, str):
                # A local name gives the transaction; an XA branch a torn block belonged
                # to is incomplete in prepared/, which rolls it back below.
                if local is not None:
                    active.setdefault(local[0], [])
                self.quarantine(path, f"half-written block, rolled back: {block}")
            else:
                tid = block.tid if block.flags & FLAG_XA or local is None else local[0]
                active.setdefault(tid, []).append(path)
        prepared: dict[int, list[tuple[int, str, Block]]] = {}
        branches: set[int] = set()
        for name, block in self._prepared_blocks():
            prepared.setdefault(block.tid, []).append((block.sequence, name, block))
            if block.flags & FLAG_XA:
                branches.add(block.tid)
        forward: list[list[PreparedBlock]] = []
        for tid in sorted(active.keys() | prepared.keys()):
            self.result.max_tid = max(self.result.max_tid, tid)
            blocks = sorted(prepared.get(tid, []))
            if tid in active:
                for path in active[tid]:
                    ops.remove(path)
                for _sequence, name, block in blocks:
                    if tid in branches or block.flags & FLAG_LOCAL:
                        ops.remove(ops.prepared / name)
                self.result.rolled_back += 1
                log.info("rolled back transaction %x: it never finished preparing", tid)
            elif tid in branches:
                continue  # a prepared XA branch: read once the roll-forward is done
            elif blocks:
                forward.append([(name, block.type, block.message_id, block.info)
                                for _sequence, name, block in blocks])
                self.result.rolled_forward += 1
                log.info("rolling forward transaction %x: prepared, commit was cut short", tid)
        if forward:
            ops.commit(forward)
        if active or prepared:
            ops.sync_directories(ops.active, ops.prepared)
        self._read_branches()

    def _prepared_blocks(self) -> Iterator[tuple[str, Block]]:
        """The valid blocks in ``prepared/`` (the others are quarantined)."""
        prepared = self.ops.prepared
        for name in sorted(os.listdir(prepared)):
            path = prepared / name
            local = parse_block_name(name)
            branch = parse_branch_block_name(name)
            if local is None and branch is None:
                stem = name.removesuffix(REWRITE_SUFFIX)
                if stem != name and parse_branch_block_name(stem) is not None:
                    # The copy of a heuristic outcome's rewrite a crash interrupted: the
                    # block itself is whole (the copy is renamed over it, atomically),
                    # and the RESOLVE, still prepared, writes the copy again.
                    log.info("%s: removed the copy of an interrupted rewrite", path)
                    self.ops.remove(path)
                else:
                    self.quarantine(path, _foreign(name))
                continue
            block = self._read_block(path)
            if isinstance(block, str):
                self.quarantine(path, f"damaged prepared block: {block}")
            elif block.flags & FLAG_XA:
                if branch is None:
                    self.quarantine(path, "an XA branch's block under a local block name")
                elif block.type not in (BlockType.DUMMY, BlockType.NEW, BlockType.DELETE):
                    self.quarantine(path, f"a {block.type.name} block in an XA branch")
                else:
                    yield name, block
            elif local is None or (block.tid, block.sequence) != local:
                detail = (f"transaction {block.tid:x} block {block.sequence}" if local is not None
                          else "a local transaction's block")
                self.quarantine(path, f"block header says {detail}, unlike its name")
            else:
                yield name, block

    def _read_branches(self) -> None:
        """The XA branches left in ``prepared/`` once the local transactions are done:
        each must be whole (every block of its prepare), start with its Xid, and be
        named after that Xid's gtrid; anything else is quarantined."""
        groups: dict[int, list[tuple[int, str, Block]]] = {}
        for name, block in self._prepared_blocks():
            if block.flags & FLAG_XA:
                groups.setdefault(block.tid, []).append((block.sequence, name, block))
            else:  # every local transaction was rolled back or forward just now
                self.quarantine(self.ops.prepared / name, "a local transaction's block left "
                                                          "behind after recovery")
        seen: set[str] = set()
        for tid in sorted(groups):
            blocks = sorted(groups[tid])
            problem, branch = _branch_of(tid, blocks)
            if branch is not None and branch.xid in seen:
                problem, branch = f"a second copy of XA branch {branch.xid}", None
            if branch is None:
                for _sequence, name, _block in blocks:
                    self.quarantine(self.ops.prepared / name, problem)
                continue
            seen.add(branch.xid)
            self.result.branches.append(branch)
            self.result.max_tid = max(self.result.max_tid, tid)
            self.result.next_branch_block = max(self.result.next_branch_block,
                                                branch.first + len(blocks))

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


def _branch_of(tid: int, blocks: list[tuple[int, str, Block]]
               ) -> tuple[str, RecoveredBranch | None]:
    """The branch a group of XA blocks (one transaction id, by sequence) makes, or
    why it makes none."""
    sequence, name, first_block = blocks[0]
    count = first_block.count
    parsed = parse_branch_block_name(name)
    if sequence != 0 or first_block.type is not BlockType.DUMMY or parsed is None:
        return (f"XA blocks of transaction {tid:x} without their first block (the Xid): "
                f"a file for an unknown Xid"), None
    try:
        header = BranchHeader.decode(first_block.info)
        xid, state = header.xid, header.state
        gtrid = Xid.parse(xid).gtrid.hex().upper()
    except Exception as exc:
        return f"XA branch of transaction {tid:x} with an unreadable header (the Xid): {exc}", None
    gtrid_name, first = parsed
    if gtrid != gtrid_name:
        return f"XA branch {xid} under another gtrid's name ({gtrid_name})", None
    if state not in (PREPARED_STATE, *HEURISTIC_OUTCOMES) or (state != PREPARED_STATE
                                                              and count != 1):
        return f"XA branch {xid} in an unknown state {state!r}", None
    numbers = [parse_branch_block_name(n) for _s, n, _b in blocks]
    if ([s for s, _n, _b in blocks] != list(range(count))
            or any(b.count != count for _s, _n, b in blocks)
            or numbers != [(gtrid, first + s) for s, _n, _b in blocks]):
        return (f"XA branch {xid} has {len(blocks)} of its {count} blocks (a prepare cut "
                f"short by a crash, or a lost file)"), None
    sends: list[RecoveredMessage] = []
    locations: list[str] = []
    consumed: list[tuple[int, int]] = []
    for _sequence, block_name_, block in blocks[1:]:
        if block.type is BlockType.NEW:
            problem = _message_problem(block, block.message_id, in_branch=True)
            if problem:
                return f"XA branch {xid}: {problem}", None
            sends.append(RecoveredMessage(block.message_id, tid, block.sequence, block.info,
                                          len(block.body), block_size(len(block.info),
                                                                      len(block.body))))
            locations.append(block_name_)
        elif block.type is BlockType.DELETE:
            count_ = records.unpack(block.info) if block.info else 0
            consumed.append((block.message_id, int(count_)))
        else:
            return f"XA branch {xid}: a second {block.type.name} block", None
    return "", RecoveredBranch(xid, gtrid, first, tid, state, header.discards,
                               header.created_ms, header.prepared_ms, sends, locations, consumed)


def _foreign(name: str) -> str:
    """Why a file in ``active/`` or ``prepared/`` that has no block name is refused."""
    if parse_message_name(name) is not None:
        return "a message file (named by a message id) in the wrong directory"
    return "foreign file (not a command block name)"


def _valid_snapshot(info: bytes) -> bool:
    try:
        meta = records.unpack(info)
    except Exception:
        return False
    return isinstance(meta, dict) and isinstance(meta.get("queues"), dict) \
        and isinstance(meta.get("next_id"), int)


def _message_problem(block: Block, message_id: int, *, in_branch: bool = False) -> str | None:
    """Why a committed file (or a NEW block of an XA branch) is not a loadable
    message, or None."""
    if block.type is not BlockType.NEW:
        return f"a {block.type.name} block where only message files belong"
    if block.flags & FLAG_XA and not in_branch:
        return "a block of a prepared XA branch, in committed/ (the wrong directory)"
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
        follow = [records.entry(records.Move([message_id], target, "recovered", [seq]))]
        if msg[records.MSG_DELIVER_AT]:
            follow.append(records.entry(records.Update(
                message_id, msg[records.MSG_DELIVERY_COUNT], msg[records.MSG_DELIVER_AT])))
        extra[position] = follow
        if msg[records.MSG_QUEUE] not in definitions:
            phantom = True
            msg = [*msg]
            msg[records.MSG_QUEUE] = PHANTOM_QUEUE
            entries[position] = records.entry(records.Add(msg), (message_id,))
    result: list[StoredEntry] = []
    for position, entry in enumerate(entries):
        result.append(entry)
        result += extra.get(position, ())
    if phantom:
        result.append(records.entry(records.QueueDelete(PHANTOM_QUEUE)))
    return result
