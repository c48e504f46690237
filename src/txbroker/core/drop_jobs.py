"""Purging and deleting a big queue a slice at a time.

Theory of operation
-------------------
Dropping 1.8 million messages in one command held the loop — every client —
for seconds (each message is marked, counted out and its body released). A
:class:`DropJob` does it in slices of :data:`DROP_SLICE` messages, one slice
per loop turn: after each slice it emits a ``Continue`` effect and the edge
runs the next slice in a later turn, serving other clients in between (as
compaction does, ``server/app.py``).

The messages are taken out of the queue at once and in O(1)
(``Queue.detach_visible``): from the command on, consumers never see them and
new messages (which go to the queue's fresh lists) are not part of the job.

* **purge** writes one ``DROP`` record per slice (reason ``purged``) and
  releases each slice's bodies once its record is durable; the reply
  (``{"purged": n}``) goes out when the last record is durable. A crash in
  between leaves the slices not yet durable in the queue: the purge was not
  acknowledged.
* **deletion** writes nothing more: the ``QUEUE_DELETE`` record already
  drops every message of the queue on replay. Until its slice is reached a
  message is still in the index; the queue index lists the names being
  deleted (:attr:`QueueIndex.deleting`) so that compaction never copies such
  a message forward (a copy written after the ``QUEUE_DELETE`` record would
  bring it back on replay).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice

from txbroker.core.effects import Continue
from txbroker.core.messages import Message, State
from txbroker.core.outbox import OnDurable, Outbox
from txbroker.core.queues import Queue
from txbroker.core.records import Kind
from txbroker.errors import StorageFailed

#: Messages a purge or a deletion handles per loop turn. Measured on this machine
#: kind (loaded): 2-5 µs a message for marking, counting and releasing, so a slice
#: costs 10-25 ms, like one of compaction's slices (``RELOCATE_SLICE_MESSAGES``).
DROP_SLICE = 5_000


class DropJob:
    """Drops ``messages`` (taken out of ``queue``) a slice per loop turn."""

    def __init__(self, outbox: Outbox, forget: Callable[[Message], None], queue: Queue,
                 messages: Iterator[Message], *, reason: str | None,
                 done: OnDurable | None = None,
                 finished: Callable[[DropJob], None] | None = None) -> None:
        self.outbox = outbox
        self.forget = forget
        self.queue = queue
        self.messages = messages
        self.reason = reason  #: the DROP records' reason; None: write no records
        self.done = done  #: called once every record is durable (or failed)
        self.finished = finished  #: called once the last slice is taken
        self.outstanding = 0  #: DROP records not yet durable
        self.taken_all = False
        self.error: BaseException | None = None

    def step(self, now: int) -> None:
        """Drop the next slice; ask for another turn while messages remain."""
        batch = list(islice(self.messages, DROP_SLICE))
        stored: list[Message] = []
        queue, forget, keep = self.queue, self.forget, self.reason is not None
        for message in batch:
            if message.state is not State.READY:
                continue
            message.state = State.GONE
            queue.count_out(message)
            if message.persistent and keep:
                stored.append(message)
            else:
                forget(message)
        if stored:
            self._write(stored)
        if len(batch) == DROP_SLICE:
            self.outbox.emit(Continue(self.step))
            return
        self.taken_all = True
        if self.finished is not None:
            self.finished(self)
        self._maybe_done()

    def _write(self, stored: list[Message]) -> None:
        self.outstanding += 1

        def on_durable(error: BaseException | None) -> None:
            self.outstanding -= 1
            if error is not None:
                self.outbox.storage_failed(error)
                self.error = self.error or error
            else:
                for message in stored:
                    self.forget(message)
            self._maybe_done()

        try:
            self.outbox.persist(Kind.DROP, [[m.id for m in stored], self.reason], on_durable)
        except StorageFailed as error:  # the store failed: no more records
            on_durable(error)

    def _maybe_done(self) -> None:
        if self.taken_all and self.outstanding == 0 and self.done is not None:
            done, self.done = self.done, None
            done(self.error)


__all__ = ["DROP_SLICE", "DropJob"]
