"""Body relocation: what compaction of the store asks of the core.

Theory of operation
-------------------
The store drops a segment once every body in it is released. A mostly-dead
old segment is emptied by relocation: the edge reads the bodies of the live
messages it holds, a slice at a time (``server/app.py``), and the core
writes fresh copies of each slice in one entry (``RELOCATE_MANY``); once
durable each message points at its copy and the old ref is released. A
message acked in the meantime (GONE) or consumed by an open transaction or a
prepared XA branch (HELD) is never copied: a copy written after its ack
would bring it back on replay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from txbroker.core import records
from txbroker.core.effects import Release
from txbroker.core.messages import COMPACT_REF_LIMIT, Message, State
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import QueueIndex
from txbroker.core.records import (
    Add,
    Kind,
    Relocate,
    RelocateMany,
    StoredEntry,
    Tx,
    XaPrepare,
)

#: Record kinds that carry message bodies (and the ids of their messages).
BODY_KINDS = frozenset({Kind.ADD, Kind.TX, Kind.RELOCATE, Kind.RELOCATE_MANY, Kind.XA_PREPARE})


def message_ids(kind: int, meta: bytes) -> list[int]:
    """The ids of the messages whose bodies an entry of ``kind`` (one of
    :data:`BODY_KINDS`) holds, in body order."""
    record = records.decode(kind, meta)
    if isinstance(record, (Add, Relocate)):
        return [record.msg[records.MSG_ID]]
    if isinstance(record, Tx):
        return [msg[records.MSG_ID] for msg in record.adds]
    if isinstance(record, XaPrepare):  # committed sends of a branch (else unindexed)
        return [msg[records.MSG_ID] for msg in record.sends]
    if isinstance(record, RelocateMany):
        return [msg[records.MSG_ID] for msg in record.msgs]
    return []


class Compaction:
    """Relocation of live bodies (see the module docstring)."""

    def __init__(self, index: QueueIndex, outbox: Outbox) -> None:
        self.index = index
        self.outbox = outbox

    def live_refs(self, entries: Iterable[StoredEntry]) -> list[tuple[int, int]]:
        """``(message id, ref)`` of messages whose current body lives in ``entries``."""
        found: list[tuple[int, int]] = []
        for entry in entries:
            if entry.kind in BODY_KINDS and entry.refs:
                found.extend(zip(message_ids(entry.kind, entry.meta), entry.refs, strict=False))
        return self.still_live(found)

    def still_live(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those ``(message id, ref)`` of a relocation whose message still has that
        body and may be copied (the edge reads only their bodies). A compact slot
        (a plain READY message of a chunk) is checked in place, never promoted."""
        messages, deleting = self.index.messages, self.index.deleting
        objects = messages.objects
        found = []
        for message_id, ref in pairs:
            message = objects.get(message_id)
            if message is None:
                slot = messages.compact_slot(message_id)
                if slot is not None and slot[0].ref_at(slot[1]) == ref and \
                        (not deleting or slot[0].queue not in deleting):
                    found.append((message_id, ref))
                continue
            # GONE: its ack is in the log; HELD: consumed by an open transaction or a
            # prepared XA branch — never copied (a rollback brings it back); a queue
            # being deleted: its QUEUE_DELETE record is in the log (core/drop_jobs.py)
            if message.ref == ref and \
                    message.state is not State.GONE and message.state is not State.HELD \
                    and (not deleting or message.queue not in deleting):
                found.append((message_id, ref))
        return found

    def relocate_many(self, pairs: list[tuple[int, int]], bodies: list[bytes]) -> None:
        """Write fresh copies of live messages' bodies in one entry (compaction).

        ``pairs`` are ``(message id, old ref)`` with the bodies read at the old refs;
        a message gone or changed since is skipped. Once durable, each message
        that still has its old body points at the copy and the old ref is
        released (else the copy is released). Compact slots are copied and
        re-pointed in place: relocating a million parked messages must not turn
        them into a million objects (47 bytes a message become ~400).
        """
        messages = self.index.messages
        objects = messages.objects
        copied: list[tuple[int, int, Message | None]] = []  # (id, old ref, object)
        relocated: list[list[Any]] = []
        kept: list[bytes] = []
        for (message_id, old_ref), body in zip(pairs, bodies, strict=True):
            message = objects.get(message_id)
            if message is not None:
                relocated.append(message.to_record())
            else:
                slot = messages.compact_slot(message_id)
                if slot is None:
                    continue  # gone meanwhile
                relocated.append(slot[0].record_at(slot[1]))
            copied.append((message_id, old_ref, message))
            kept.append(body)
        if not copied:
            return
        new_refs: list[int] = []
        emit = self.outbox.emit

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self.outbox.storage_failed(error)
                return
            for (message_id, old_ref, message), new_ref in zip(copied, new_refs, strict=True):
                current = objects.get(message_id)
                if message is not None:  # an object when copied: the same one still
                    moved = current is message and message.ref == old_ref
                elif current is not None:  # a slot promoted (or taken) meanwhile
                    moved = current.ref == old_ref and current.state is not State.GONE
                    message = current
                else:
                    slot = messages.compact_slot(message_id)
                    if slot is None or slot[0].ref_at(slot[1]) != old_ref:
                        emit(Release(new_ref))
                        continue
                    if new_ref >> 32 < COMPACT_REF_LIMIT:
                        slot[0].set_ref(slot[1], new_ref)
                        emit(Release(old_ref))
                        continue
                    message = slot[0].message_at(slot[1])  # a ref a slot cannot hold
                    moved = message is not None
                if moved and message is not None:
                    message.ref = new_ref
                    emit(Release(old_ref))
                else:
                    emit(Release(new_ref))

        self.outbox.write(RelocateMany(relocated), on_durable, kept, new_refs.extend)


__all__ = ["BODY_KINDS", "Compaction", "message_ids"]
