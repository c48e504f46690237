"""The delivered mark: a delivery is held until a record says it may have happened.

Theory of operation
-------------------
A delivery is not a record, yet after a crash (or a shared-store failover) a
message that was delivered and not acked must come back flagged
``redelivered`` (seed 004). So each durable queue keeps a **delivered mark**,
``delivered_seq``: every message whose seq is at most the mark may have been
delivered. A delivery above the durable mark is held until a ``QUEUE_PUT``
carrying a new mark is durable; a mark reaches the queue's ``mark_reach``
(``queues.MARK_AHEAD`` at first) seqs past the delivery plus the consumers'
free credit (a prefetch window filling up in one dispatch does not wait
twice), and the next mark is written early, when less than half the reach is
left, so a steady stream of deliveries does not wait (a queue's first
delivery, and its first after a restart, wait for one sync). When an early
mark was not durable in time — deliveries faster than the store's syncs — the
reach doubles, up to :data:`MAX_MARK_REACH`. Replay keeps the largest mark and counts one
delivery for every surviving message at or below it (``core/replay.py``):
such a message comes back with ``redelivered`` set — at most the reach plus
the consumers' free credit (at most ``MAX_MARK_REACH + MAX_MARK_CREDIT``)
messages per queue that were never delivered are flagged too, which JMS allows
("likely, but not guaranteed, delivered before"). Auto-ack and non-persistent
deliveries take no mark (they cannot come back).

:class:`~txbroker.core.queue_index.QueueIndex` decides, per delivery, whether it goes
out at once, asks for the next mark early, or is held (``QueueIndex._deliver``);
this module writes the marks (:func:`write_mark`) and hands the held deliveries out
once a mark is durable (:func:`release_held`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from txbroker.core.queues import MARK_AHEAD, Queue
from txbroker.core.records import QueuePut

if TYPE_CHECKING:
    from txbroker.core.queue_index import QueueIndex

#: The most free consumer credit a delivered mark reaches past, and the longest
#: reach a queue's marks grow to (together they bound the messages flagged
#: redelivered without need after a crash).
MAX_MARK_CREDIT = 1000
MAX_MARK_REACH = 16 * MARK_AHEAD


def write_mark(index: QueueIndex, queue: Queue, seq: int) -> None:
    """Make sure a delivered mark of at least ``seq`` is on its way (see the module
    docstring)."""
    reach = queue.mark_reach
    if max(queue.delivered_seq, queue.reserving) >= seq + reach // 2 \
            or queue.name in index.deleting:
        return  # a mark on its way (or durable) reaches far enough
    # reach past what the consumers' free credit lets one dispatch hand out, so
    # that a burst (a prefetch window filling up) does not wait for the next mark
    credit = sum(max(0, c.prefetch - len(c.unacked)) for c in queue.consumers)
    mark = seq + reach + min(credit, MAX_MARK_CREDIT)
    queue.reserving = mark
    index.counters["delivered_marks"] += 1

    def durable(error: BaseException | None) -> None:
        if queue.reserving <= mark:
            queue.reserving = 0
        if error is not None:
            # the mark is not on disk: a delivery it was to cover would, after a
            # restart, go out again without the redelivered flag — so the held
            # deliveries stay held (the store failed: the broker takes no more
            # writes until it restarts; found by the simulator, queue-failing-fsync
            # seed 5)
            index.outbox.storage_failed(error)
            return
        queue.delivered_seq = max(queue.delivered_seq, mark)
        release_held(index, queue)

    index.outbox.write(QueuePut(queue.definition()), durable)


def release_held(index: QueueIndex, queue: Queue) -> None:
    """Hand out the held deliveries the durable mark now covers, in order; those
    whose consumer or session went away meanwhile are not sent (the message went
    back to its queue with them)."""
    held = queue.held_deliveries
    while held and held[0].message.seq <= queue.delivered_seq:
        deliver = held.popleft()
        session = index.sessions.get(deliver.session)
        if session is None:
            continue
        consumer = session.deliveries.get(deliver.tag)
        if consumer is None or consumer.unacked.get(deliver.tag) is not deliver.message:
            continue
        index.outbox.emit(deliver)
