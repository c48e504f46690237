"""Replayed messages settled ahead of :meth:`Replay.finish` (issue 29, warm standby).

Theory of operation
-------------------
A replay keeps every surviving message as a ``msg`` list in ``Replay.raw`` (log
order) and :meth:`Replay.finish` walks them all into their queues: about a
microsecond per live message, paid when a warm standby takes over. A standby
that follows the journal for minutes can do most of that walk while it waits:
:meth:`Settled.settle` takes out of ``raw`` the messages that ``finish`` would
keep as compact chunk slots whatever the takeover's clock and whatever later
records say of their queue (no client id, no headers, no expiry, no delivery
time, a body ref and size that fit a slot), and files them per *level* (queue,
priority) as :class:`Run` columns: arrays of the typecodes of a
``core/messages.py`` :class:`Chunk`. ``finish`` first copies them into their
queues' chunks as they are (:meth:`Settled.fill`: a few memory copies per
4,096 messages, no Python object per message) and then walks only what is left
in ``raw``.

What keeps the result equal to a cold recovery's:

* **Order in a level.** ``finish`` puts a level's messages in log order. A
  message settles only while no message of its level stays behind in ``raw``
  (a *blocked* level), so every settled message of a level precedes, in the
  log, every message of that level left in ``raw``; a message that must go
  back to ``raw`` behind settled ones of its level (a move into the level, an
  update that makes it an object) takes the whole level back with it
  (:meth:`Settled.take_level`), and ``raw`` is sorted by ordinal again.
* **The log order across queues** (``MessageIndex`` ordinals): every replayed
  message carries its ordinal (``RAW_ORD``, given when it enters ``raw``; a
  relocated copy keeps its original's), settled or not.
* **What depends on later records** is settled at ``finish``: a queue's
  counters, its ``next_seq`` and the delivery count of a message at or below
  its ``delivered_seq`` (``fill``); a record that touches a settled message
  (ack, drop, move, update, relocation, a prepared branch's consume) finds it
  through :attr:`Settled.at` (:meth:`take`, :meth:`relocate`, :meth:`set_count`).

Nothing here is used by an ordinary (cold) recovery: ``settle`` is called only
by the warm standby between two slices of what it follows.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from txbroker.core.messages import (
    CHUNK_SIZE,
    COMPACT_REF_LIMIT,
    COMPACT_SIZE_LIMIT,
    Chunk,
    Columns,
    Message,
    MessageIndex,
)
from txbroker.core.queues import Queue

#: Positions in a replayed ``msg`` list (``core/replay.py``): the queue's seq, the
#: body ref and the log-order ordinal are appended to the record's fields.
RAW_SEQ, RAW_REF, RAW_ORD = 9, 10, 11
#: Messages per :class:`Run` at most: a removal moves at most this many items of
#: each column (the size of a ``core/messages.py`` chunk).
RUN_SIZE: Final = 4096
#: A level, ``(queue name, priority)``.
Level = tuple[str, int]
_LOW = (1 << 32) - 1


class Run(Columns):
    """Settled compact messages of one level, in log order with ascending ids: a
    chunk's columns (:class:`~txbroker.core.messages.Columns`)."""

    __slots__ = ()

    def slot(self, message_id: int) -> int:
        """The position of ``message_id`` (it is here: :attr:`Settled.at` says so)."""
        slot = bisect_left(self.ids, message_id)
        assert self.ids[slot] == message_id
        return slot


def settles(msg: list[Any], size: int) -> bool:
    """Would ``finish`` keep this replayed message as a compact slot whatever its
    clock and whatever its queue's ``delivered_seq`` turn out to be?"""
    (message_id, _, client_id, headers, priority, _, expires, deliver_at, count, seq, ref,
     _) = msg
    return (client_id is None and headers is None and not expires and not deliver_at
            and ref is not None and 0 <= priority < 10 and 0 <= ref >> 32 < COMPACT_REF_LIMIT
            and 0 <= size < COMPACT_SIZE_LIMIT and 0 <= count < 65536 and message_id > 0
            and seq >= 0)


class Settled:
    """The settled messages of a replay, by level (see the module docstring)."""

    def __init__(self) -> None:
        #: runs by level, in log order
        self.levels: dict[Level, list[Run]] = {}
        #: the run of every settled message, by id (see :attr:`at`)
        self._at: dict[int, Run] = {}
        #: runs added whole (:meth:`add_run`) that :attr:`at` does not list yet
        self._unlisted: list[Run] = []
        #: per level, the highest ordinal settled there (an upper bound after takes)
        self.last_ord: dict[Level, int] = {}

    @property
    def at(self) -> dict[int, Run]:
        """The run of every settled message, by id (a checkpoint's runs are listed
        only when a later record needs them: after a checkpoint, nothing does)."""
        if self._unlisted:
            at = self._at
            for run in self._unlisted:
                at.update(dict.fromkeys(run.ids, run))
            self._unlisted = []
        return self._at

    def add_run(self, run: Run) -> None:
        """Settle a whole run (a checkpoint's, ``core/checkpoint.py``): behind the
        level's runs, with ordinals above every ordinal settled before."""
        level = (run.queue, run.priority)
        self.levels.setdefault(level, []).append(run)
        self.last_ord[level] = run.ords[-1]
        self._unlisted.append(run)

    def settle(self, raw: dict[int, list[Any]], body_size_of: Callable[[int], int]
               ) -> dict[int, list[Any]]:
        """Take what settles out of ``raw`` (sorted by ordinal); what is left of it."""
        levels, at, last_ord = self.levels, self.at, self.last_ord
        blocked: set[Level] = set()
        kept: dict[int, list[Any]] = {}
        for message_id, msg in raw.items():
            priority = msg[4]
            level = (msg[1], priority)
            ref = msg[RAW_REF]
            if level not in blocked and ref is not None:
                size = body_size_of(ref)
                if settles(msg, size):
                    runs = levels.get(level)
                    if runs is None:
                        runs = levels[level] = []
                    run = runs[-1] if runs else None
                    if run is None or len(run.ids) >= RUN_SIZE \
                            or (run.ids and run.ids[-1] >= message_id):
                        run = Run(level[0], priority)
                        runs.append(run)
                    run.add_row(message_id, msg[RAW_SEQ], ref, size, msg[5], msg[8],
                               msg[RAW_ORD])
                    last_ord[level] = msg[RAW_ORD]
                    at[message_id] = run
                    continue
            if 0 <= priority < 10:
                blocked.add(level)
            kept[message_id] = msg
        return kept

    def take(self, message_id: int) -> list[Any]:
        """Take a settled message out: its replayed ``msg`` list."""
        run = self.at.pop(message_id)
        slot = run.slot(message_id)
        ref = run.ref_hi.pop(slot) << 32 | run.ref_lo.pop(slot)
        msg = [message_id, run.queue, None, None, run.priority, run.stamps.pop(slot), 0, 0,
               run.counts.pop(slot), run.seqs.pop(slot), ref, run.ords.pop(slot)]
        del run.ids[slot]
        del run.sizes[slot]
        return msg

    def relocate(self, msg: list[Any], size: int) -> int | None:
        """A relocated copy of a settled message (``msg`` with its ordinal) takes its
        place when it settles in the same level: the old copy's ref; else None."""
        message_id = msg[0]
        run = self.at[message_id]
        if msg[1] != run.queue or msg[4] != run.priority or not settles(msg, size):
            return None
        slot = run.slot(message_id)
        old = run.ref_hi[slot] << 32 | run.ref_lo[slot]
        ref = msg[RAW_REF]
        run.ref_hi[slot] = ref >> 32
        run.ref_lo[slot] = ref & _LOW
        run.sizes[slot] = size
        run.seqs[slot] = msg[RAW_SEQ]
        run.stamps[slot] = msg[5]
        run.counts[slot] = msg[8]
        return old

    def set_count(self, message_id: int, count: int) -> bool:
        """A settled message's new delivery count, when a slot can keep it."""
        if not 0 <= count < 65536:
            return False
        run = self.at[message_id]
        run.counts[run.slot(message_id)] = count
        return True

    def take_level(self, level: Level) -> list[list[Any]]:
        """Take a whole level out (log order)."""
        taken: list[list[Any]] = []
        self.last_ord.pop(level, None)
        for run in self.levels.pop(level, []):
            for message_id in list(run.ids):
                taken.append(self.take(message_id))
        return taken

    def take_queue(self, name: str) -> list[list[Any]]:
        """Take every level of queue ``name`` out."""
        taken: list[list[Any]] = []
        for level in [level for level in self.levels if level[0] == name]:
            taken.extend(self.take_level(level))
        return taken

    def take_all(self) -> list[list[Any]]:
        """Take everything out (not in log order: the caller sorts)."""
        taken: list[list[Any]] = []
        for level in list(self.levels):
            taken.extend(self.take_level(level))
        return taken

    def fill(self, queues: dict[str, Queue], home: MessageIndex) -> None:
        """Put the settled levels into their queues (first: everything settled precedes
        what is left in ``raw`` in its level), counted in, their ``next_seq`` and
        delivery counts settled; every level's queue exists (the caller checked)."""
        for (name, priority), runs in self.levels.items():
            queue = queues[name]
            level = queue.ready_level(priority)
            for run in runs:
                if run.ids:
                    _count_in(queue, run)
                    _into_chunks(queue, home, level, run)
        self.levels, self._at, self._unlisted, self.last_ord = {}, {}, [], {}


def _count_in(queue: Queue, run: Run) -> None:
    """Count a run's messages in their queue (``Replay.finish`` does it per message)."""
    seqs = run.seqs
    queue.messages += len(seqs)
    queue.bytes += sum(run.sizes)
    top = max(seqs)
    if top >= queue.next_seq:
        queue.next_seq = top + 1
    delivered = queue.delivered_seq
    if min(seqs) <= delivered:  # may have been delivered before the crash
        run.counts = array("H", [1 if seq <= delivered and not count else count
                                 for seq, count in zip(seqs, run.counts, strict=True)])


def _into_chunks(queue: Queue, home: MessageIndex, level: deque[Message | Chunk],
                 run: Run) -> None:
    """Append a run to its level's chunks as ``Queue.put_compact`` would one message
    at a time: a new chunk when the last is full or an id does not follow its last."""
    columns = run.columns()
    ids = run.ids
    total = len(ids)
    start = 0
    while start < total:
        last = level[-1] if level else None
        if not isinstance(last, Chunk) or not last.takes(ids[start]):
            last = Chunk(home, queue.name, priority=run.priority)
            level.append(last)
        stop = min(total, start + CHUNK_SIZE - len(last.ids))
        if start == 0 and stop == total:
            last.extend_arrays(*columns)
        else:
            last.extend_arrays(*[column[start:stop] for column in columns])
        start = stop
    queue.ready_count += total


__all__ = ["RAW_ORD", "RAW_REF", "RAW_SEQ", "RUN_SIZE", "Level", "Run", "Settled", "settles"]
