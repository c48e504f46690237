"""The directory store's writer thread: group commit of queued transactions.

The one :class:`DirWriter` thread takes *everything* ``DirStore.append`` queued (a
batch) and moves the batch's transactions through the three disk steps of
:class:`~txbroker.storage.dirstore_writer.DirOps` together (write, prepare, and
commit of the local ones), so that their directory syncs are shared; then it hands
the batch's completions to ``dispatch`` in one call. An ``OSError`` in any step
poisons the store: the batch and everything queued after it complete with
``StorageFailed`` and later appends are refused (``dirstore_writer.py`` says what
is left on disk).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from txbroker.errors import StorageFailed
from txbroker.storage.dirstore_format import FLAG_LOCAL
from txbroker.storage.dirstore_writer import DirOps, PreparedBlock, Txn
from txbroker.storage.writer_thread import (
    Barrier,
    PendingQueue,
    WriterThread,
    completion,
)

log = logging.getLogger("txbroker.dirstore")

WorkItem = Txn | Barrier


def prepared_blocks(txn: Txn) -> list[PreparedBlock]:
    """The blocks of a transaction as :meth:`DirOps.commit` takes them."""
    return [
        (txn.name(sequence), block.type, block.message_id, block.info)
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
                self.ops.commit([prepared_blocks(txn) for txn in txns
                                 if txn.flags & FLAG_LOCAL])
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
