"""The router's journal: records kept as messages of the internal queue ``$router``.

Theory of operation
-------------------
The router writes every step it must not forget into the broker's own store,
with the broker's group commit and durability contract, and without a record
kind of its own: each router record is one persistent message of the internal
queue :data:`ROUTER_QUEUE` whose body is one msgpack map (the byte format is
in ``records.py``). It is the way Kafka's transaction coordinator logs to its internal
``__transaction_state`` topic, and it means every store (``journal`` and
``dir``), compaction, snapshots and anything that copies the store carry the
router's journal as they carry messages.

There is at most one live record per facility and per transaction: a state
change *replaces* the record (:meth:`RouterLog.write`: one ``TX`` store entry
that adds the new message and consumes the old one, atomic), and the end of a
transaction consumes it (:meth:`RouterLog.remove`). On start the server reads
the queue's messages (their bodies come from the store) and hands them to
:func:`~txbroker.core.router.journal.restore`.

Nobody consumes ``$router``: clients may not name a destination beginning with
``$router`` (the broker core's front refuses it, :func:`refuse_reserved`; the
operation layer refuses it first, and audits the refusal), so the queue is never
dispatched, and the slots its consumed records leave in the ready list are
trimmed here (:meth:`Queue.trim`).

Record bodies: a typed class per kind (a facility, a transaction, a tombstone) in
``records.py``, with the byte format; :meth:`RouterLog.write` takes the record and
writes ``record.encode()``.
"""

from __future__ import annotations

from typing import Any, Final

from txbroker.core.messages import Message, State
from txbroker.core.outbox import OnDurable, Outbox
from txbroker.core.queue_index import QueueIndex
from txbroker.core.queues import Queue
from txbroker.core.records import QueuePut, Tx
from txbroker.core.router.records import RouterRecord
from txbroker.core.sending import build_messages
from txbroker.errors import Forbidden, StorageFailed

#: The internal queue that holds the router's journal.
ROUTER_QUEUE: Final = "$router"
#: Destinations beginning with this are the router's: clients may not use them.
RESERVED_PREFIX: Final = "$router"


def is_reserved(destination: Any) -> bool:
    """A destination name clients may not use (it begins with :data:`RESERVED_PREFIX`)."""
    return isinstance(destination, str) and destination.startswith(RESERVED_PREFIX)


def reserved_refusal(destination: str, op: str) -> Forbidden:
    """The error of request ``op`` naming a reserved destination."""
    return Forbidden(f"forbidden: {destination!r} is the transaction router's journal; "
                     "clients may not use destinations beginning with "
                     f"{RESERVED_PREFIX!r} ({op})")


def refuse_reserved(destination: Any, op: str) -> None:
    """Raise :func:`reserved_refusal` if ``destination`` is reserved."""
    if is_reserved(destination):
        raise reserved_refusal(destination, op)


class RouterLog:
    """Writes and consumes the router's records (see the module docstring)."""

    def __init__(self, index: QueueIndex, outbox: Outbox) -> None:
        self.index = index
        self.outbox = outbox
        #: ids of records on their way to disk that a later record already replaces
        self.superseded: set[int] = set()
        #: ids of records on their way to disk that are to be consumed once written
        self.doomed: set[int] = set()

    def _queue(self) -> Queue:
        queue = self.index.queues.get(ROUTER_QUEUE)
        if queue is None:  # created on first use, whatever auto_create says
            queue = Queue(ROUTER_QUEUE)
            self.index.queues[ROUTER_QUEUE] = queue
            self.outbox.write(QueuePut(queue.definition()), self.outbox.ignore_durable)
        return queue

    def records(self) -> list[Message]:
        """The live records, in log order (``journal.restore`` reads them)."""
        queue = self.index.queues.get(ROUTER_QUEUE)
        if queue is None:
            return []
        return sorted(queue.ready_messages(), key=lambda m: m.id)

    def write(self, record: RouterRecord, replaces: Message | None, now: int,
              on_durable: OnDurable) -> Message:
        """Write ``record`` (replacing the record ``replaces``, atomically); call
        ``on_durable`` once it is on disk. Returns the new record's message.

        ``replaces`` may still be on its way to disk: its own completion comes first
        (completions arrive in append order) and takes it out of the queue at once,
        so that compaction never copies a record whose consumption is already in
        the log."""
        self.outbox.check_writable()
        index, outbox = self.index, self.outbox
        queue = self._queue()
        body = record.encode()
        made, _ = build_messages(index, [queue], [body], [len(body)], now)
        message = made[0]
        index.messages[message.id] = message
        index.assign_seqs(made)
        old = replaces
        if old is not None and old.state is State.READY:
            queue.discard(old)  # out of the queue now; consumed once the record is durable
        elif old is not None and old.state is State.PENDING:
            self.superseded.add(old.id)
        else:
            old = None

        def on_refs(refs: list[int]) -> None:
            message.ref = refs[0]

        def durable(error: BaseException | None) -> None:
            if error is not None:
                outbox.storage_failed(error)
                index.drop_pending(message)
                on_durable(error)
                return
            index.apply_adds([message], outbox.now)
            if message.id in self.superseded:  # a later record replaces it (and consumes it)
                self.superseded.discard(message.id)
                queue.discard(message)
            elif message.id in self.doomed:  # removed while it was on its way
                self.doomed.discard(message.id)
                self.remove(message)
            if old is not None:
                index.count_acked(old)
            queue.trim()
            on_durable(None)

        entry = Tx([message.to_record()], [] if old is None else [old.id], now)
        outbox.write(entry, durable, [body], on_refs)
        return message

    def remove(self, record: Message | None) -> None:
        """Consume a record nobody needs any more (no one waits for it to be durable)."""
        if record is None:
            return
        if record.state is State.PENDING:  # consumed as soon as it is written
            self.doomed.add(record.id)
            return
        if record.state is not State.READY:
            return
        queue = self.index.queues.get(ROUTER_QUEUE)
        if queue is None:
            return
        queue.discard(record)
        try:
            self.index.consume([record], None)
        except StorageFailed:
            return  # the store failed: nothing more is written (the record stays)
        queue.trim()

__all__ = ["RESERVED_PREFIX", "ROUTER_QUEUE", "RouterLog", "is_reserved", "refuse_reserved",
           "reserved_refusal"]
