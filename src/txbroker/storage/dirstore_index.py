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
store transaction and updates the index and the metadata model at once (the
writer commits later; the broker sees nothing before the commit):

* each message added — a NEW block;
* each message acked, dropped, or in a deleted queue — a DELETE block;
* each header change (delivery count, delay, a move) — an UPDATE block;
* any change to the metadata — one METADATA block with the whole model,
  also whenever a new message id passes ``next_id`` (kept
  :data:`ID_RESERVATION` ahead);
* nothing at all — one DUMMY block (the seed's read-only transaction).

A message leaves the index when it is both deleted (a DELETE was planned) and
released (the broker is done with its body), whichever comes last. A deleted
message that carried a client id marks the duplicate-id windows unsaved: the
store writes the metadata again from ``maintain`` or ``close``.

Threading: the broker's thread only.
"""

from __future__ import annotations

import time
from typing import Any, Final

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.storage.dirstore_format import BlockType, block_size
from txbroker.storage.dirstore_model import MetadataModel, Operation, unpack_message_info
from txbroker.storage.dirstore_recovery import PHANTOM_QUEUE, RecoveredDirectory, replay_moves
from txbroker.storage.dirstore_writer import BlockOp
from txbroker.storage.interface import BodyRef, StoredEntry

#: Message ids the metadata keeps in reserve: ``next_id`` is written ahead of the
#: ids in use, so that ids are never reused after a crash even when the newest
#: messages were consumed; one metadata write per 65,536 messages.
ID_RESERVATION: Final = 1 << 16


class IndexedMessage:
    """What the store keeps in memory per stored message."""

    __slots__ = ("deleted", "file_bytes", "has_message_id", "origin", "queue", "released", "size")

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


class MessageIndex:
    """The stored messages by id, the metadata model and the space counters."""

    def __init__(self) -> None:
        self.messages: dict[int, IndexedMessage] = {}
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
            model.apply_snapshot(records.unpack(found.metadata))
            entries.append(StoredEntry(int(Kind.SNAPSHOT), found.metadata, ()))
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
            info = message.info if moved_to is None else records.pack(msg)
            entries.append(StoredEntry(int(Kind.ADD), info, (message.message_id,)))
        self.stored_files = len(found.messages)
        entries = replay_moves(entries, moved, model.definitions)
        for entry in entries:  # duplicate ids as the broker's replay remembers them
            if entry.kind == Kind.ADD:
                msg = records.unpack(entry.meta)
                queue, client_id = msg[records.MSG_QUEUE], msg[records.MSG_MESSAGE_ID]
                if client_id is not None and queue != PHANTOM_QUEUE:
                    model.ensure_queue(queue)
                    model.remember(queue, client_id)
        return entries

    def new_message_ids(self, operation: Operation) -> list[int]:
        """The ids of the messages ``operation`` adds (its body refs); ``ValueError``
        if one is repeated or already stored."""
        new_ids = [msg[records.MSG_ID] for msg, _info, _body in operation.adds]
        if len(set(new_ids)) != len(new_ids) or any(i in self.messages for i in new_ids):
            raise ValueError(f"message ids {new_ids} are already stored (or repeated)")
        return new_ids

    def plan(self, operation: Operation) -> list[BlockOp]:
        """The blocks of one operation; updates the index and the metadata model."""
        model = self.model
        blocks: list[BlockOp] = []
        metadata = False
        for msg, info, body in operation.adds:
            message_id, queue = msg[records.MSG_ID], msg[records.MSG_QUEUE]
            client_id = msg[records.MSG_MESSAGE_ID]
            blocks.append(BlockOp(BlockType.NEW, message_id, info, body))
            file_bytes = block_size(len(info), len(body))
            self.messages[message_id] = IndexedMessage(
                queue, queue, len(body), file_bytes, client_id is not None
            )
            self.live_bodies += 1
            self.live_bytes += len(body)
            self.stored_files += 1
            self.stored_bytes += file_bytes
            if client_id is not None:  # replay creates the queue to remember the id
                metadata |= model.ensure_queue(queue)
                model.remember(queue, client_id)
            if message_id >= model.next_id:
                model.next_id = message_id + 1 + ID_RESERVATION
                metadata = True
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
        return blocks

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
            if entry.deleted:
                continue
            if entry.queue in names:
                self._delete(message_id, blocks)
            elif entry.origin in names:
                entry.origin = None
                patch = records.pack({records.MSG_QUEUE: None})
                blocks.append(BlockOp(BlockType.UPDATE, message_id, patch))

    def _delete(self, message_id: int, blocks: list[BlockOp]) -> None:
        entry = self.messages.get(message_id)
        if entry is None or entry.deleted:
            return  # unknown or already deleted: replay would ignore it too
        entry.deleted = True
        blocks.append(BlockOp(BlockType.DELETE, message_id))
        self.stored_files -= 1
        self.stored_bytes -= entry.file_bytes
        if entry.has_message_id:
            self.duplicate_ids_unsaved = True
        if entry.released:
            del self.messages[message_id]
