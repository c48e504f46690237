"""The recovery checkpoint: what a replay of the whole log would hold, written at a
clean shutdown (issue 29: a restart that follows the live data, not the history).

Theory of operation
-------------------
A cold restart replays every entry of the log (``core/replay.py``) and then walks
every surviving message into its queue: a few microseconds per message, 2–3 s for
a million. When the broker stops cleanly, nothing more will be written after its
last entry, so its live state at that moment *is* what that replay would build. At
the shutdown (``server/app.py``: input held, the store flushed, every completion
run) :func:`take_checkpoint` writes that state in the replay's own form, and the
journal keeps it next to the log (``storage/journal.py``, which hands it back
instead of the log it covers only while that log is exactly as it was; the file
is deleted before anything is appended again). The next start replays that one
entry (kind ``CHECKPOINT``, :func:`load_checkpoint`) and ``Replay.finish``
does the rest as after any replay:

* the metadata is the snapshot the store writes first in every segment
  (:meth:`Replay.snapshot`): queues, topics, duplicate windows, the next id, sinks;
* the plain messages at the head of every priority level are the settled
  :class:`~txbroker.core.replay_settled.Run` columns a warm standby builds while it
  follows (``core/replay_settled.py``), one run per chunk: loading them copies arrays,
  no Python object per message;
* every other message that a replay would find alive — ready ones with a client id,
  headers, a TTL or a delay, and those out to consumers or held by an open
  transaction (their acks are not in the log: a replay would bring them back) — is a
  replayed ``msg`` list behind the runs of its level, in queue order.

**Order in a level.** A level's messages are in seq order (the queue's commit order,
the order a replay restores) with the scheduled ones last (the live queue appends
them when they come due); the runs take the longest prefix that compact slots can
hold, the lists the rest. **Delivery counts** are the live ones: a clean restart
keeps them exactly, where a crash's replay counts a maybe-delivered message once.

No checkpoint is taken (the next start replays the log, as after a crash) while
something lives outside what a checkpoint holds: prepared XA branches, a queue
deletion still dropping messages, a message not yet durable, a replicated backup's
log position, or a replay not finished.

**A replay's checkpoint** (``form: "replay"``, :func:`take_replay_checkpoint`). A
replicated backup never finishes its replay: it goes on replaying what its primary
sends until it is promoted (``server/ha/replica.py``), and its log counts the
primary's LSNs. Its checkpoint is the unfinished :class:`Replay` itself: the snapshot
(with ``replica``, the LSN the log counts to), the settled runs *with* their ordinals,
every message left in ``raw`` as its replayed ``msg`` list (seq, body ref, ordinal),
the ordinal counter and the Xids completed during the replay. Loading it restores
that replay as it was, so the log after it replays on top exactly as it did the first
time, and a promotion finishes it as it would have. Not taken while XA branches live
(their held messages and pending sends are not in that form).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any, Final, Literal

from txbroker.core.messages import COMPACT, Chunk, Message, State
from txbroker.core.queue_index import QueueIndex
from txbroker.core.queues import PRIORITIES, Queue
from txbroker.core.records.common import (
    MSG_FIELDS_MAX,
    Kind,
    MalformedRecord,
    StoredEntry,
    check_dict,
    check_msg,
    malformed,
    pack,
    unpack,
)
from txbroker.core.replay import Replay
from txbroker.core.replay_settled import RAW_ORD, RAW_REF, RUN_SIZE, Run, settles
from txbroker.core.replay_xa import pack_ref, unpack_ref
from txbroker.core.xa_branches import XaBranches
from txbroker.errors import CorruptStore
from txbroker.xid import Xid

#: The checkpoint's format version (a value a start does not know is refused).
VERSION: Final = 1
#: The array layout the columns were written in: byte order and item sizes of the
#: :class:`Run` typecodes, in column order (a start elsewhere converts them).
_TYPECODES: Final = tuple(column.typecode for column in Run("", 0).columns()[:7])
LAYOUT: Final = sys.byteorder[0] + "".join(str(array(code).itemsize) for code in _TYPECODES)
#: A replay's runs keep their ordinals too: the eighth column.
_REPLAY_TYPECODES: Final = tuple(column.typecode for column in Run("", 0).columns())
REPLAY_LAYOUT: Final = LAYOUT + str(array(_REPLAY_TYPECODES[-1]).itemsize)
#: The forms (module docstring): a finished broker's state, an unfinished replay's.
STATE, REPLAY = "state", "replay"
_NAME = "CHECKPOINT"


def take_checkpoint(index: QueueIndex, xa: XaBranches, replay: Replay) -> bytes | None:
    """The checkpoint of the broker's state (the meta of a ``CHECKPOINT`` entry), or
    None when one cannot be taken now (see the module docstring)."""
    if replay.raw or replay.settled.levels or replay.replica is not None or xa.branches \
            or index.deleting:
        return None
    home = index.messages
    objects: dict[tuple[str, int], list[Message]] = {}
    for message in home.objects.values():
        if message.state is State.PENDING:
            return None  # (not durable yet: the shutdown flushes first)
        if message.state is State.GONE or message.ref is None or not message.persistent:
            continue
        objects.setdefault((message.queue, message.priority), []).append(message)
    runs: list[list[Any]] = []
    msgs: list[list[Any]] = []
    compact = 0
    for name, queue in index.queues.items():
        for priority in range(PRIORITIES):
            level = queue.ready_level(priority)
            found = objects.pop((name, priority), None)
            if found:
                compact += _mixed_level(name, priority, level, found, runs, msgs)
            else:  # (the common case: only compact slots, copied a chunk at a time)
                for item in level:
                    if isinstance(item, Chunk):
                        compact += _chunk_run(item, runs)
    if compact != home.compact:
        return None  # (a compact slot outside every queue: never expected, never lost)
    for (_, _), left in sorted(objects.items()):  # a queue the index does not list
        msgs.extend(_msg(message) for message in sorted(left, key=_seq_of))
    value = {"v": VERSION, "layout": LAYOUT, "snapshot": replay.snapshot()[1],
             "runs": runs, "msgs": msgs}
    return pack(value)


def take_replay_checkpoint(index: QueueIndex, xa: XaBranches, replay: Replay) -> bytes | None:
    """The checkpoint of a replay not finished (a replicated backup's: module docstring),
    or None while XA branches live or a queue deletion is dropping messages. Call
    :meth:`Replay.settle` first, so that most messages are columns, not lists."""
    if xa.branches or index.deleting:
        return None
    replay.sort_raw()
    runs = [[run.queue, run.priority, *(column.tobytes() for column in run.columns())]
            for level in replay.settled.levels.values() for run in level if run.ids]
    msgs = [[*msg[:RAW_REF], pack_ref(msg[RAW_REF]), msg[RAW_ORD]] for msg in replay.raw.values()]
    value = {"v": VERSION, "form": REPLAY, "layout": REPLAY_LAYOUT,
             "snapshot": replay.snapshot()[1], "runs": runs, "msgs": msgs,
             "ordinal": replay.ordinal, "completed": sorted(map(str, replay.completed))}
    return pack(value)


def _chunk_run(chunk: Chunk, runs: list[list[Any]]) -> int:
    """A chunk's compact slots as one run (ids ascend within a chunk); how many."""
    head, marks = chunk.head, chunk.marks
    total = len(chunk.ids)
    if head >= total:
        return 0
    columns = (chunk.ids, chunk.seqs, chunk.ref_hi, chunk.ref_lo, chunk.sizes, chunk.stamps,
               chunk.counts)
    if marks.count(COMPACT, head) == total - head:
        picked = [column[head:] for column in columns]
    else:  # (some slots taken or promoted: their objects are elsewhere)
        slots = [slot for slot in range(head, total) if marks[slot] == COMPACT]
        if not slots:
            return 0
        picked = [array(column.typecode, [column[slot] for slot in slots])
                  for column in columns]
    runs.append([chunk.queue, chunk.priority, *(column.tobytes() for column in picked)])
    return len(picked[0])


def _mixed_level(name: str, priority: int, level: Iterable[Message | Chunk],
                 found: list[Message], runs: list[list[Any]], msgs: list[list[Any]]) -> int:
    """A level with objects: every message in seq order (the scheduled ones last), the
    compact prefix as runs, the rest as ``msg`` lists; how many compact slots it had."""
    rows: list[tuple[int, int, list[Any], int]] = []  # (seq, id, msg with ref, size)
    compact = 0
    for item in level:
        if isinstance(item, Chunk):
            for slot in range(item.head, len(item.ids)):
                if item.marks[slot] == COMPACT:
                    msg = item.record_at(slot)
                    msg.append(pack_ref(item.ref_at(slot)))
                    rows.append((msg[9], msg[0], msg, item.sizes[slot]))
                    compact += 1
    scheduled: list[Message] = []
    for message in found:
        if message.state is State.READY and message.deliver_at_ms:
            scheduled.append(message)
        else:
            rows.append((message.seq, message.id, _msg(message), message.size))
    rows.sort(key=_row_order)
    run: Run | None = None
    at = 0
    for at, (_, message_id, msg, size) in enumerate(rows):  # noqa: B007 (at: after the loop)
        if not settles([*msg[:10], unpack_ref(msg[10]), 0], size):
            break
        if run is None or len(run.ids) >= RUN_SIZE or run.ids[-1] >= message_id:
            if run is not None:
                runs.append(_run_value(run))
            run = Run(name, priority)
        ref = unpack_ref(msg[10])
        assert ref is not None  # (settles: a compact slot has a body)
        run.add_row(message_id, msg[9], ref, size, msg[5], msg[8], 0)  # (no ordinal kept)
    else:
        at = len(rows)
    if run is not None:
        runs.append(_run_value(run))
    msgs.extend(row[2] for row in rows[at:])
    msgs.extend(_msg(message) for message in sorted(scheduled, key=_seq_of))
    return compact


def _run_value(run: Run) -> list[Any]:
    return [run.queue, run.priority, *(column.tobytes() for column in run.columns()[:7])]


def _row_order(row: tuple[int, int, list[Any], int]) -> tuple[int, int]:
    return row[0], row[1]


def _seq_of(message: Message) -> tuple[int, int]:
    return message.seq, message.id


def _msg(message: Message) -> list[Any]:
    """A message as a checkpoint keeps it: its record, then its body ref (as bytes: a
    ref may be wider than msgpack's ints, ``core/replay_xa.py``)."""
    msg = message.to_record()
    msg.append(pack_ref(message.ref))
    return msg


def load_checkpoint(replay: Replay, meta: bytes) -> None:
    """Replay a ``CHECKPOINT`` entry, the first of its log (``Broker.replay``): its
    snapshot as a ``SNAPSHOT`` entry, its runs settled, its other messages in ``raw``
    behind them — numbered in that order, or, a replay's checkpoint, as they were
    numbered. Raises ``CorruptStore`` on a malformed one."""
    try:
        if replay.raw or replay.settled.levels:
            malformed(_NAME, "it follows other entries")
        value = unpack(meta)
        snapshot, runs, msgs = read_checkpoint(value)
        replay.replay(StoredEntry(Kind.SNAPSHOT, snapshot, ()))
        if value.get("form") == REPLAY:
            _load_replay(replay, runs, msgs, value)
            return
    except (MalformedRecord, ValueError, TypeError) as exc:
        raise CorruptStore("<checkpoint>", 0, f"undecodable checkpoint: {exc}") from exc
    ordinal = replay.ordinal
    for run in runs:
        run.ords = array("I", range(ordinal + 1, ordinal + 1 + len(run.ids)))
        ordinal += len(run.ids)
        replay.settled.add_run(run)
    for msg in msgs:  # (its record and ref, distinct from the runs' messages)
        ordinal += 1
        msg.append(ordinal)
    _into_raw(replay, runs, msgs)
    replay.ordinal = ordinal


def _load_replay(replay: Replay, runs: list[Run], msgs: list[list[Any]],
                 value: dict[Any, Any]) -> None:
    """The rest of a replay's checkpoint: runs and messages as they were numbered."""
    ordinal, completed = value.get("ordinal"), value.get("completed")
    if type(ordinal) is not int or type(completed) is not list \
            or not all(type(xid) is str for xid in completed):
        malformed(_NAME, "a replay's ordinal or completed Xids are missing")
    if any(run.ords[-1] > ordinal for run in runs) or any(msg[RAW_ORD] > ordinal
                                                           for msg in msgs):
        malformed(_NAME, "an ordinal above the replay's")
    for run in runs:
        replay.settled.add_run(run)
    _into_raw(replay, runs, msgs)
    replay.ordinal = ordinal
    replay.completed = {Xid.parse(xid) for xid in completed}


def _into_raw(replay: Replay, runs: list[Run], msgs: list[list[Any]]) -> None:
    """The messages behind the runs into ``raw`` (numbered already), the next id past
    every message's, their client ids remembered."""
    raw, queues, next_id = replay.raw, replay.index.queues, replay.index.next_id
    for msg in msgs:
        raw[msg[0]] = msg
        next_id = max(next_id, msg[0] + 1)
        if msg[2] is not None:
            (queues.get(msg[1]) or queues.setdefault(msg[1], Queue(msg[1]))).remember(msg[2])
    replay.index.next_id = max([next_id, *(run.ids[-1] + 1 for run in runs)])


def read_checkpoint(meta: Any) -> tuple[bytes, list[Run], list[list[Any]]]:
    """Decode a ``CHECKPOINT`` entry's unpacked meta: its snapshot's meta, its runs
    (without ordinals: the replay numbers them; a replay's with theirs) and its other
    messages (``msg`` lists with their body refs, as ints, appended; a replay's with
    their ordinals after). Raises ``MalformedRecord`` on anything else (the snapshot's
    own checks come when it is replayed)."""
    value = check_dict(meta, _NAME, "the checkpoint")
    if value.get("v") != VERSION:
        malformed(_NAME, f"version {value.get('v')!r}, expected {VERSION}")
    form = value.get("form", STATE)
    if form not in (STATE, REPLAY):
        malformed(_NAME, f"unknown form {form!r}")
    codes = _REPLAY_TYPECODES if form == REPLAY else _TYPECODES
    snapshot = value.get("snapshot")
    if type(snapshot) is not bytes:
        malformed(_NAME, "the snapshot is not a SNAPSHOT entry's meta")
    layout = value.get("layout")
    runs: list[Run] = []
    items = value.get("runs")
    if type(items) is not list:
        malformed(_NAME, "the runs are not a list")
    for item in items:
        if type(item) is not list or len(item) != 2 + len(codes) \
                or type(item[0]) is not str or type(item[1]) is not int \
                or not all(type(data) is bytes for data in item[2:]):
            malformed(_NAME, f"a run is [queue, priority, {len(codes)} columns]")
        run = Run(item[0], item[1])
        columns = run.columns()[:len(codes)]
        for column, data in zip(columns, item[2:], strict=True):
            _fill(column, data, layout, codes)
        total = len(run.ids)
        if not total or any(len(column) != total for column in columns):
            malformed(_NAME, "a run's columns differ in length")
        runs.append(run)
    msgs = value.get("msgs")
    if type(msgs) is not list:
        malformed(_NAME, "the msgs are not a list")
    fields = MSG_FIELDS_MAX + (2 if form == REPLAY else 1)
    for msg in msgs:
        if type(msg) is not list or len(msg) != fields \
                or not (type(msg[RAW_REF]) is bytes or (form == REPLAY and msg[RAW_REF] is None)) \
                or (form == REPLAY and type(msg[-1]) is not int):
            malformed(_NAME, "a msg is its record and its body ref" +
                      (" and its ordinal" if form == REPLAY else ""))
        check_msg(msg[:MSG_FIELDS_MAX], _NAME)
        msg[RAW_REF] = unpack_ref(msg[RAW_REF])
    return snapshot, runs, msgs


def _fill(column: array[int], data: bytes, layout: Any, codes: tuple[str, ...]) -> None:
    """A column from the bytes a checkpoint holds (converted when it was written with
    another layout: byte order, item sizes; ``codes``: the typecodes of its columns)."""
    if layout == _layout(codes):
        if len(data) % column.itemsize:
            malformed(_NAME, "a column's bytes are not whole items")
        column.frombytes(data)
        return
    if type(layout) is not str or len(layout) != 1 + len(codes) \
            or layout[0] not in "bl" or not layout[1:].isdigit():
        malformed(_NAME, f"unknown array layout {layout!r}")
    size = int(layout[1 + codes.index(column.typecode)])
    if size not in (1, 2, 4, 8) or len(data) % size:
        malformed(_NAME, f"unknown array layout {layout!r}")
    signed = column.typecode.islower()
    order: Literal["big", "little"] = "big" if layout[0] == "b" else "little"
    column.extend(int.from_bytes(data[at:at + size], order, signed=signed)
                  for at in range(0, len(data), size))


def _layout(codes: tuple[str, ...]) -> str:
    return REPLAY_LAYOUT if len(codes) == len(_REPLAY_TYPECODES) else LAYOUT


__all__ = ["LAYOUT", "REPLAY", "REPLAY_LAYOUT", "STATE", "VERSION", "load_checkpoint",
           "read_checkpoint", "take_checkpoint", "take_replay_checkpoint"]
