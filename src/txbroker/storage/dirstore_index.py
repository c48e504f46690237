"""The directory store's in-memory index, and the blocks each operation becomes.

Theory of operation
-------------------
The directory store keeps state, not a log, so it needs to know what is
stored without reading the directories: :class:`MessageIndex` holds one
:class:`IndexedMessage` per stored message (its queue now, the queue it was
sent to, its body and file sizes), the :class:`~txbroker.storage.dirstore_model.MetadataModel`
(queue definitions, duplicate-id windows, next id) and the space counters.

:meth:`MessageIndex.load` fills it from what recovery found and returns the
entries ``recover`` yields: a ``SNAPSHOT`` (the metadata), then one ``ADD``
per message in commit order, a moved message as ``ADD`` + ``MOVE``.

:meth:`MessageIndex.plan` turns one decoded
:class:`~txbroker.storage.dirstore_model.Operation` into the blocks of one
store transaction (:class:`TxnPlan`; an XA prepare may need a metadata
transaction first) and updates the index and the metadata model at once (the
writer commits later; the broker sees nothing before the commit):

* each message added — a NEW block;
* each message acked, dropped, or in a deleted queue — a DELETE block;
* each header change (delivery count, delay, a move) — an UPDATE block;
* any change to the metadata — one METADATA block with the whole model,
  also whenever a new message id passes ``next_id`` (kept
  :data:`ID_RESERVATION` ahead);
* nothing at all — one DUMMY block (the seed's read-only transaction);
* an XA prepare — an XA branch of its own (:class:`IndexedBranch`): a DUMMY
  with the Xid, a NEW per send (indexed at once, with the ``location`` of its
  block in ``prepared/``), a DELETE per consumed message, named
  ``<GTRID>-<n>`` from a store-wide counter;
* an XA outcome (commit, rollback, heuristic, forget, or each branch of a
  sink commit) — a RESOLVE block naming the branch's blocks; the index
  follows the outcome at once (sends committed or deleted, consumed messages
  deleted, the branch gone or kept as heuristic).

A message leaves the index when it is both deleted (a DELETE was planned) and
released (the broker is done with its body), whichever comes last. A deleted
message that carried a client id marks the duplicate-id windows unsaved: the
store writes the metadata again from ``maintain`` or ``close``.

Threading: the broker's thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.storage.dirstore_blocks import BranchHeader, ResolveInfo
from txbroker.storage.dirstore_format import (
    FLAG_LOCAL,
    FLAG_XA,
    BlockType,
    block_size,
    branch_block_name,
)
from txbroker.storage.dirstore_model import (
    COMMITTING_OUTCOMES,
    FORGET,
    HEURISTIC_COMMIT,
    HEURISTIC_OUTCOMES,
    PREPARED_STATE,
    BranchPrepare,
    BranchResolve,
    MetadataModel,
    Operation,
    unpack_message_info,
)
from txbroker.storage.dirstore_recovery import (
    PHANTOM_QUEUE,
    RecoveredBranch,
    RecoveredDirectory,
    replay_moves,
)
from txbroker.storage.dirstore_writer import BlockOp
from txbroker.storage.interface import BodyRef, StoredEntry
from txbroker.xid import Xid

#: Message ids the metadata keeps in reserve: ``next_id`` is written ahead of the
#: ids in use, so that ids are never reused after a crash even when the newest
#: messages were consumed; one metadata write per 65,536 messages.
ID_RESERVATION: Final = 1 << 16


class IndexedMessage:
    """What the store keeps in memory per stored message."""

    __slots__ = ("deleted", "file_bytes", "has_message_id", "location", "origin", "queue",
                 "released", "size")

    def __init__(
        self, queue: str, origin: str | None, size: int, file_bytes: int, has_message_id: bool
    ) -> None:
        self.queue = queue  #: where it is now
        #: The queue it was sent to (whose duplicate-id window holds its client id),
        #: or None once that queue was deleted while the message lived elsewhere.
        self.origin = origin
        self.size = size
        self.file_bytes = file_bytes
        self.has_message_id = has_message_id
        self.deleted = False  #: a DELETE for it was appended
        self.released = False  #: the broker released its body
        #: The name of its NEW block in ``prepared/`` while an XA branch that sends it is
        #: prepared; None once it is (or is being) committed: ``committed/<id>``.
        self.location: str | None = None


class IndexedBranch:
    """A prepared (or heuristically completed) XA branch: where its blocks are."""

    __slots__ = ("client_ids", "consumed", "count", "first", "gtrid", "sends", "state", "tid",
                 "xid")

    def __init__(self, xid: str, gtrid: str, first: int, count: int, tid: int,
                 sends: list[int], state: str) -> None:
        self.xid = xid  #: the Xid's text form
        self.gtrid = gtrid  #: the gtrid in uppercase hex: its blocks' name prefix
        self.first = first  #: the number in the name of its first block
        self.count = count  #: its blocks (1 once heuristically completed)
        self.tid = tid  #: the store transaction id in its blocks' headers
        self.sends = sends  #: ids of the messages it sends (prepared NEW blocks)
        self.state = state  #: PREPARED_STATE, HEURISTIC_COMMIT or HEURISTIC_ROLLBACK
        self.consumed: list[int] = []  #: ids of the messages it consumed
        #: client message ids of its sends (their queues remember them at commit)
        self.client_ids: dict[int, str] = {}

    def block_names(self) -> list[str]:
        """The file names of its blocks in ``prepared/``."""
        return [branch_block_name(self.gtrid, self.first + i) for i in range(self.count)]


@dataclass(slots=True)
class TxnPlan:
    """The blocks of one store transaction, as :meth:`MessageIndex.plan` made them."""

    tid: int
    blocks: list[BlockOp]
    flags: int = FLAG_LOCAL
    prefix: str | None = None  #: an XA branch's gtrid (its block names), else None
    first: int = 0  #: the number in the name of its first block (XA)


class MessageIndex:
    """The stored messages by id, the metadata model and the space counters."""

    def __init__(self) -> None:
        self.messages: dict[int, IndexedMessage] = {}
        #: Prepared and heuristically completed XA branches by Xid text.
        self.branches: dict[str, IndexedBranch] = {}
        #: The next store transaction id (block headers, local block names).
        self.next_tid = 1
        #: The number in the next XA block's name (store-wide, so that branches of
        #: one gtrid never share a name, not even with one whose removal is queued).
        self.next_branch_block = 0
        self.model = MetadataModel()
        self.live_bodies = self.live_bytes = 0  #: bodies not released yet
        self.stored_files = self.stored_bytes = 0  #: message files (committed or queued)
        #: a message with a client id was deleted since the metadata was last written
        self.duplicate_ids_unsaved = False
        self.metadata_saved_at = time.monotonic()  #: when the last METADATA block was planned

    def load(self, found: RecoveredDirectory) -> list[StoredEntry]:
        """Index what recovery found; the entries ``recover`` yields."""
        model = self.model
        entries: list[StoredEntry] = []
        if found.metadata is not None:
            model.apply_snapshot(records.Snapshot.decode(found.metadata))
            entries.append(StoredEntry(Kind.SNAPSHOT, found.metadata, ()))
        moved: list[tuple[int, list[Any], str]] = []
        for message in found.messages:
            msg, moved_to = unpack_message_info(message.info)
            queue, client_id = msg[records.MSG_QUEUE], msg[records.MSG_MESSAGE_ID]
            self.messages[message.message_id] = IndexedMessage(
                moved_to or queue, queue, message.body_length, message.file_bytes,
                client_id is not None,
            )
            if moved_to is not None:
                moved.append((len(entries), msg, moved_to))
            model.next_id = max(model.next_id, message.message_id + 1)
            self.live_bodies += 1
            self.live_bytes += message.body_length
            self.stored_bytes += message.file_bytes
            if moved_to is None:  # the info is the ADD's meta as it came
                entries.append(StoredEntry(Kind.ADD, message.info,
                                           (message.message_id,)))
            else:
                entries.append(records.entry(records.Add(msg), (message.message_id,)))
        self.stored_files = len(found.messages)
        entries = replay_moves(entries, moved, model.definitions)
        for branch in found.branches:
            entries += self._load_branch(branch)
        self.next_tid = found.max_tid + 1
        self.next_branch_block = found.next_branch_block
        for entry in entries:  # duplicate ids as the broker's replay remembers them
            if entry.kind == Kind.ADD:
                msg = records.Add.decode(entry.meta).msg
                queue, client_id = msg[records.MSG_QUEUE], msg[records.MSG_MESSAGE_ID]
                if client_id is not None and queue != PHANTOM_QUEUE:
                    model.ensure_queue(queue)
                    model.remember(queue, client_id)
        return entries

    def _load_branch(self, found: RecoveredBranch) -> list[StoredEntry]:
        """Index a recovered XA branch; its ``XA_PREPARE`` (+ ``XA_HEURISTIC``) entry."""
        model = self.model
        count = 1 + len(found.sends) + len(found.consumed)
        branch = IndexedBranch(found.xid, found.gtrid, found.first, count, found.tid,
                               [m.message_id for m in found.sends], found.state)
        branch.consumed = [message_id for message_id, _count in found.consumed]
        msgs: list[Any] = []
        for message, location in zip(found.sends, found.locations, strict=True):
            msg, _moved = unpack_message_info(message.info)
            msgs.append(msg)
            entry = IndexedMessage(msg[records.MSG_QUEUE], msg[records.MSG_QUEUE],
                                   message.body_length, message.file_bytes,
                                   msg[records.MSG_MESSAGE_ID] is not None)
            entry.location = location
            self.messages[message.message_id] = entry
            if msg[records.MSG_MESSAGE_ID] is not None:
                branch.client_ids[message.message_id] = msg[records.MSG_MESSAGE_ID]
            model.next_id = max(model.next_id, message.message_id + 1)
            self.live_bodies += 1
            self.live_bytes += message.body_length
            self.stored_files += 1
            self.stored_bytes += message.file_bytes
        self.branches[found.xid] = branch
        prepare = records.XaPrepare(found.xid, msgs, [list(pair) for pair in found.consumed],
                                    found.discards, found.created_ms, found.prepared_ms)
        entries = [records.entry(prepare, tuple(branch.sends))]
        if found.state != PREPARED_STATE:
            outcome = "commit" if found.state == HEURISTIC_COMMIT else "rollback"
            entries.append(records.entry(records.XaHeuristic(found.xid, outcome, [], [], 0)))
        return entries

    def new_message_ids(self, operation: Operation) -> list[int]:
        """The ids of the messages ``operation`` adds (its body refs); ``ValueError``
        if one is repeated or already stored."""
        adds = operation.prepare.sends if operation.prepare is not None else operation.adds
        new_ids = [msg[records.MSG_ID] for msg, _info, _body in adds]
        if len(set(new_ids)) != len(new_ids) or any(i in self.messages for i in new_ids):
            raise ValueError(f"message ids {new_ids} are already stored (or repeated)")
        return new_ids

    def take_tid(self) -> int:
        """A new store transaction id."""
        tid = self.next_tid
        self.next_tid += 1
        return tid

    def plan(self, operation: Operation) -> list[TxnPlan]:
        """The store transactions of one operation (in commit order; most are one
        local transaction, an XA prepare is a branch, preceded by a metadata
        transaction when its message ids pass ``next_id``); updates the index and
        the metadata model. ``ValueError`` for an XA request the index cannot take
        (a branch prepared twice; an outcome for a branch that is not prepared)."""
        if operation.prepare is not None:
            return self._plan_prepare(operation.prepare)
        for resolve in operation.resolves:  # all checked before anything changes
            self._check_resolve(resolve)
        model = self.model
        blocks: list[BlockOp] = []
        metadata = False
        for msg, info, body in operation.adds:
            metadata |= self._add(msg, len(info), len(body))
            blocks.append(BlockOp(BlockType.NEW, msg[records.MSG_ID], info, body))
        for message_id in operation.deletes:
            self._delete(message_id, blocks)
        if operation.move_target is not None:
            metadata |= model.ensure_queue(operation.move_target)
        for message_id, patch, target in operation.updates:
            entry = self.messages.get(message_id)
            if entry is None or entry.deleted:
                continue  # replay would ignore it too
            if target is not None:
                entry.queue = target
            blocks.append(BlockOp(BlockType.UPDATE, message_id, records.pack(patch)))
        for resolve in operation.resolves:
            metadata |= self._resolve(resolve, blocks)
        if operation.sink is not None:
            model.set_sink(*operation.sink)
            metadata = True
        if operation.put is not None:
            model.put(operation.put)
            metadata = True
        gone: list[str] = []
        if operation.delete_queue is not None:
            metadata = True
            if model.delete(operation.delete_queue):  # a queue (known or not): its messages go
                gone.append(operation.delete_queue)
        if operation.snapshot is not None:
            metadata = True
            gone += model.apply_snapshot(operation.snapshot)
        if gone:
            self._delete_queues(set(gone), blocks)
        if metadata:
            blocks.append(self.metadata_block())
        if not blocks:
            blocks.append(BlockOp(BlockType.DUMMY, 0))
        return [TxnPlan(self.take_tid(), blocks)]

    def _add(self, msg: list[Any], info_length: int, body_length: int,
             location: str | None = None) -> bool:
        """Index a new message (committed, or sent by a branch being prepared: then
        ``location`` names its block). True if the metadata must be written."""
        message_id, queue = msg[records.MSG_ID], msg[records.MSG_QUEUE]
        client_id = msg[records.MSG_MESSAGE_ID]
        file_bytes = block_size(info_length, body_length)
        entry = IndexedMessage(queue, queue, body_length, file_bytes, client_id is not None)
        entry.location = location
        self.messages[message_id] = entry
        self.live_bodies += 1
        self.live_bytes += body_length
        self.stored_files += 1
        self.stored_bytes += file_bytes
        metadata = False
        if client_id is not None and location is None:  # replay creates the queue
            metadata = self.model.ensure_queue(queue)
            self.model.remember(queue, client_id)
        if message_id >= self.model.next_id:
            self.model.next_id = message_id + 1 + ID_RESERVATION
            metadata = True
        return metadata

    # -- XA branches -------------------------------------------------------------------

    def _plan_prepare(self, prepare: BranchPrepare) -> list[TxnPlan]:
        """An XA branch: a DUMMY block with the Xid and the branch's own data, a NEW
        block per message it sends and a DELETE block per message it consumed, named
        ``<GTRID>-<n>`` and flagged XA (they stay in ``prepared/`` until resolved)."""
        if prepare.xid in self.branches:
            raise ValueError(f"XA branch {prepare.xid} is prepared already")
        gtrid = Xid.parse(prepare.xid).gtrid.hex().upper()
        first = self.next_branch_block
        count = 1 + len(prepare.sends) + len(prepare.consumed)
        self.next_branch_block += count
        header = BranchHeader(prepare.xid, prepare.discards, prepare.created_ms,
                              prepare.prepared_ms, PREPARED_STATE)
        blocks = [BlockOp(BlockType.DUMMY, 0, header.encode())]
        metadata = False
        for offset, (msg, info, body) in enumerate(prepare.sends, start=1):
            name = branch_block_name(gtrid, first + offset)
            metadata |= self._add(msg, len(info), len(body), location=name)
            blocks.append(BlockOp(BlockType.NEW, msg[records.MSG_ID], info, body))
        for message_id, delivery_count in prepare.consumed:
            blocks.append(BlockOp(BlockType.DELETE, message_id, records.pack(delivery_count)))
        sends = [msg[records.MSG_ID] for msg, _info, _body in prepare.sends]
        branch = IndexedBranch(prepare.xid, gtrid, first, count, self.take_tid(), sends,
                               PREPARED_STATE)
        branch.consumed = [message_id for message_id, _count in prepare.consumed]
        branch.client_ids = {msg[records.MSG_ID]: msg[records.MSG_MESSAGE_ID]
                             for msg, _info, _body in prepare.sends
                             if msg[records.MSG_MESSAGE_ID] is not None}
        self.branches[prepare.xid] = branch
        plans = [TxnPlan(branch.tid, blocks, FLAG_XA, gtrid, first)]
        if metadata:  # message ids passed next_id: keep the reservation ahead, first
            plans.insert(0, TxnPlan(self.take_tid(), [self.metadata_block()]))
        return plans

    def _check_resolve(self, resolve: BranchResolve) -> IndexedBranch:
        """The branch an outcome completes; ``ValueError`` if it cannot take it."""
        branch = self.branches.get(resolve.xid)
        if branch is None:
            raise ValueError(f"XA branch {resolve.xid} is not prepared in this store")
        if (resolve.outcome == FORGET) != (branch.state != PREPARED_STATE):
            raise ValueError(f"XA branch {resolve.xid} is {branch.state}: it cannot take "
                             f"{resolve.outcome}")
        return branch

    def _resolve(self, resolve: BranchResolve, blocks: list[BlockOp]) -> bool:
        """A RESOLVE block completing a branch; the index follows the outcome (the
        files follow when the writer commits the block). True if the metadata
        changed (client ids of committed sends)."""
        branch = self._check_resolve(resolve)
        outcome = resolve.outcome
        seqs: list[list[int]] = []
        if outcome in COMMITTING_OUTCOMES:  # every send the commit keeps, seq or not
            seq_of = {pair[0]: pair[1] for pair in resolve.seqs}
            dropped = set(resolve.discards)
            kept = [i for i in branch.sends if i not in dropped]
            seqs = [[message_id, seq_of.get(message_id, 0)] for message_id in kept]
        blocks.append(BlockOp(BlockType.RESOLVE, 0, ResolveInfo(
            outcome, branch.xid, branch.gtrid, branch.first, branch.count, branch.tid,
            seqs, resolve.discards).encode()))
        metadata = False
        if outcome in COMMITTING_OUTCOMES:
            discards = set(resolve.discards)
            for message_id in branch.sends:
                entry = self.messages.get(message_id)
                if entry is None:
                    continue
                if message_id in discards:
                    entry.location = None
                    self._delete(message_id, None)
                elif entry.location is not None:
                    entry.location = None
                    client_id = branch.client_ids.get(message_id)
                    if client_id is not None:
                        metadata |= self.model.ensure_queue(entry.queue)
                        self.model.remember(entry.queue, client_id)
        elif outcome != FORGET:
            for message_id in branch.sends:
                entry = self.messages.get(message_id)
                if entry is not None:
                    entry.location = None
                    self._delete(message_id, None)
        if outcome in COMMITTING_OUTCOMES:
            for message_id in branch.consumed:
                self._delete(message_id, None)  # the branch's own DELETE block removes it
        branch.sends, branch.consumed, branch.client_ids = [], [], {}
        if outcome in HEURISTIC_OUTCOMES:
            branch.state = outcome
            branch.count = 1
        else:
            del self.branches[branch.xid]
        return metadata

    def metadata_block(self) -> BlockOp:
        """A METADATA block with the whole model; the duplicate ids count as saved."""
        self.duplicate_ids_unsaved = False
        self.metadata_saved_at = time.monotonic()
        return BlockOp(BlockType.METADATA, 0, self.model.pack())

    def body_size(self, ref: BodyRef) -> int:
        """The body length of message ``ref``; KeyError if unknown."""
        return self.messages[ref].size

    def release(self, ref: BodyRef) -> bool:
        """The broker is done with message ``ref``'s body; False if it was already
        released or is unknown."""
        entry = self.messages.get(ref)
        if entry is None or entry.released:
            return False
        entry.released = True
        self.live_bodies -= 1
        self.live_bytes -= entry.size
        if entry.deleted:
            del self.messages[ref]
        return True

    def _delete_queues(self, names: set[str], blocks: list[BlockOp]) -> None:
        """Queues are gone: delete their messages; forget the origin of messages
        moved out of them (their client ids went with the queue's window)."""
        for message_id, entry in list(self.messages.items()):
            if entry.deleted or entry.location is not None:  # (a prepared send: not stored yet)
                continue
            if entry.queue in names:
                self._delete(message_id, blocks)
            elif entry.origin in names:
                entry.origin = None
                patch = records.pack({records.MSG_QUEUE: None})
                blocks.append(BlockOp(BlockType.UPDATE, message_id, patch))

    def _delete(self, message_id: int, blocks: list[BlockOp] | None) -> None:
        """The message is gone: a DELETE block in ``blocks`` (None: the caller's
        blocks remove its file already, e.g. a RESOLVE)."""
        entry = self.messages.get(message_id)
        if entry is None or entry.deleted:
            return  # unknown or already deleted: replay would ignore it too
        entry.deleted = True
        if blocks is not None:
            blocks.append(BlockOp(BlockType.DELETE, message_id))
        self.stored_files -= 1
        self.stored_bytes -= entry.file_bytes
        if entry.has_message_id:
            self.duplicate_ids_unsaved = True
        if entry.released:
            del self.messages[message_id]
