"""Read-only journal scanning and record decoding, for audit tools.

Theory of operation
-------------------
:func:`journal_segments` lists ``DIR/journal/*.seg`` (oldest first) and checks
that the ids have no gap. :func:`read_segment` maps one segment read-only
(``O_RDONLY``, ``PROT_READ``; no lock is taken, nothing is ever written, so it
works on the directory of a live broker) and walks it with the same
:func:`~txbroker.storage.journal_scan.scan_entries` as recovery, so every
entry's CRC is checked. Where the scan stops at damage it applies recovery's
rule: if nothing valid follows in the **last** segment it is a torn tail or a
record still being written (a live broker): the segment ends there; anything
else is :class:`~txbroker.errors.CorruptStore` naming the file and offset. The
file size is taken once when the segment is opened, so records appended
meanwhile are simply not seen.

:func:`decode_record` turns an entry's ``kind`` and msgpack ``meta`` into one
flat row of plain Python values (the columns of the ``txbroker-journal``
Spark source). It decodes through the record classes of ``core/records``,
which accept every shape the records have had: the
9- and 10-field ``msg`` tuple (``seq``), optional trailing times on TX,
XA_PREPARE, XA_COMMIT, XA_ROLLBACK and XA_HEURISTIC, MOVE's optional
``[seq…]``, and kinds 16 SINK_COMMIT and 17 RELOCATE_MANY. A kind it does not
know gives a row with ``kind`` set and every decoded column null.

A record's *position* is ``segment_id << 40 | offset``: one integer that sorts
in log order (offsets fit 40 bits, as in a body ref; segment ids below 2**23 —
8 million segments — keep it a positive int64, Spark's BIGINT).
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.errors import CorruptStore, StoreError
from txbroker.storage.interface import StoredEntry
from txbroker.storage.journal_format import (
    JOURNAL_SUBDIR,
    REF_OFFSET_BITS,
    SEGMENT_HEADER,
    check_segment_header,
    entry_size,
    parse_segment_name,
    ref_length,
    segment_name,
)
from txbroker.storage.journal_scan import (
    Tally,
    find_next_entry,
    scan_entries,
)

#: Kind 16, the Spark sink's atomic commit of XA branches.
SINK_COMMIT: Final = int(Kind.SINK_COMMIT)
#: Name of every kind this reader decodes.
KIND_NAMES: Final[dict[int, str]] = {int(k): k.name for k in Kind}
#: Bits of the offset in a record position (the same 40 bits as a body ref's offset).
POSITION_OFFSET_BITS: Final = REF_OFFSET_BITS


class NoJournal(StoreError):
    """The directory holds no journal (no ``journal/`` or no segment files)."""


def position(segment_id: int, offset: int) -> int:
    """The log-order position of the record at ``offset`` of segment ``segment_id``."""
    return segment_id << POSITION_OFFSET_BITS | offset


def journal_dir_of(data_dir: Path) -> Path:
    """``DATA/journal``; or ``data_dir`` itself when it holds the segment files."""
    nested = data_dir / JOURNAL_SUBDIR
    if not nested.is_dir() and data_dir.is_dir() and any(
        parse_segment_name(name) is not None for name in os.listdir(data_dir)
    ):
        return data_dir
    return nested


def journal_segments(data_dir: Path) -> list[int]:
    """Ids of the segments of ``data_dir``'s journal, oldest first.

    Raises :class:`NoJournal` naming the path when there is none, and
    :class:`CorruptStore` when ids have a gap (as recovery does).
    """
    journal_dir = journal_dir_of(data_dir)
    if not journal_dir.is_dir():
        raise NoJournal(f"no journal in {data_dir}: {journal_dir} is not a directory")
    ids = sorted(
        found for found in (parse_segment_name(n) for n in os.listdir(journal_dir))
        if found is not None
    )
    if not ids:
        raise NoJournal(f"no journal in {data_dir}: {journal_dir} holds no *.seg files")
    for before, after in itertools.pairwise(ids):
        if after != before + 1:
            missing = f"segments {before + 1}..{after - 1} are missing (the log has a gap)"
            raise CorruptStore(str(journal_dir / segment_name(before + 1)), 0, missing)
    return ids


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One entry of a segment, where it is and what it holds (bodies stay on disk)."""

    segment_id: int
    offset: int
    length: int
    kind: int
    meta: bytes
    body_lengths: tuple[int, ...]


def read_segment(journal_dir: Path, segment_id: int, *, last: bool) -> Iterator[JournalEntry]:
    """Every valid entry of one segment, read-only, in order (see the module doc).

    A segment that vanished (a live broker deleted it after listing) yields nothing.
    """
    path = journal_dir / segment_name(segment_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, SEGMENT_HEADER.size, 0)
        problem = check_segment_header(head, segment_id)
        if problem is not None:
            if last and (len(head) < SEGMENT_HEADER.size or not any(head)):
                return  # a segment being created: its header is not written yet
            raise CorruptStore(str(path), 0, problem)
        if size <= SEGMENT_HEADER.size:
            return
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            yield from _scan(mapped, path, segment_id, size, last)
    finally:
        os.close(fd)


def _scan(mapped: mmap.mmap, path: Path, segment_id: int, size: int,
          last: bool) -> Iterator[JournalEntry]:
    offset = SEGMENT_HEADER.size
    tally = Tally()
    while offset < size:
        found: list[StoredEntry] = []
        after, damage = scan_entries(mapped, offset, size, segment_id, tally, found, 1)
        if found:
            entry = found[0]
            lengths = tuple(ref_length(ref) for ref in entry.refs)
            length = entry_size(len(entry.meta), list(lengths))
            # pads before the entry were skipped in the same call: it ends at ``after``
            yield JournalEntry(segment_id, after - length, length, entry.kind, entry.meta,
                               lengths)
        if damage is not None:
            following = find_next_entry(mapped, damage.offset + 1, size)
            if following is None and last:
                return  # torn tail, or a record a live broker is still writing
            where = (f"valid entries follow at offset {following}" if following is not None
                     else "not at the tail of the last segment")
            raise CorruptStore(str(path), damage.offset, f"{damage.reason}; {where}")
        if after == offset:
            return
        offset = after


# ---------------------------------------------------------------------- decoding
#: Every column of a decoded record, in order (see ``spark/journal_source.py``).
COLUMNS: Final = (
    "position", "segment_id", "offset", "length", "kind", "kind_name", "time_ms",
    "created_ms", "messages", "ids", "consumed", "discards", "seqs", "reason", "queue",
    "queue_kind", "topic", "xid", "outcome", "delivery_count", "deliver_at_ms", "next_id",
    "branches", "sink_id", "batch_id", "sink_branches", "rolled_back", "meta_json",
)


def _opt(meta: list[Any], index: int) -> Any:
    """``meta[index]``, or None when an older record shape stops before it."""
    return meta[index] if len(meta) > index else None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _time(value: Any) -> int | None:
    """A time field: 0 or absent means none."""
    return int(value) if value else None


def message_row(msg: list[Any], size: int | None) -> dict[str, Any]:
    """The columns of one ``msg`` tuple (9 fields, or 10 with ``seq``)."""
    headers = msg[records.MSG_HEADERS]
    return {
        "id": int(msg[records.MSG_ID]),
        "queue": _text(msg[records.MSG_QUEUE]),
        "message_id": _text(msg[records.MSG_MESSAGE_ID]),
        "headers": None if not headers else [(_text(k), _text(v)) for k, v in headers.items()],
        "priority": msg[records.MSG_PRIORITY],
        "timestamp_ms": _time(msg[records.MSG_TIMESTAMP]),
        "expires_ms": _time(msg[records.MSG_EXPIRES]),
        "deliver_at_ms": _time(msg[records.MSG_DELIVER_AT]),
        "delivery_count": msg[records.MSG_DELIVERY_COUNT],
        "seq": _time(_opt(msg, records.MSG_SEQ)),
        "size": size,
    }


def _messages(msgs: list[Any], body_lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    sizes: list[int | None] = list(body_lengths)
    if len(sizes) != len(msgs):  # bodies are the messages', in order; else sizes are unknown
        sizes = [None] * len(msgs)
    return [message_row(msg, size) for msg, size in zip(msgs, sizes, strict=True)]


def _seq_pairs(pairs: Any) -> list[dict[str, Any]] | None:
    return None if pairs is None else [{"id": int(i), "seq": int(s)} for i, s in pairs]


def _snapshot(row: dict[str, Any], record: records.Snapshot, _lengths: tuple[int, ...]) -> None:
    row["next_id"] = record.next_id
    row["branches"] = [
        {"xid": xid, "state": branch.state, "created_ms": _time(branch.created_ms)}
        for xid, branch in (record.xa or {}).items()
    ]


def _queue_put(row: dict[str, Any], record: records.QueuePut, _lengths: tuple[int, ...]) -> None:
    definition = record.definition
    row["queue"], row["queue_kind"] = definition["name"], _text(definition.get("kind"))
    row["topic"] = _text(definition.get("topic"))


def _queue_delete(row: dict[str, Any], record: records.QueueDelete,
                  _lengths: tuple[int, ...]) -> None:
    row["queue"] = record.name


def _add(row: dict[str, Any], record: records.Add | records.Relocate,
         lengths: tuple[int, ...]) -> None:
    row["messages"] = _messages([record.msg], lengths[:1])


def _tx(row: dict[str, Any], record: records.Tx, lengths: tuple[int, ...]) -> None:
    row["messages"] = _messages(record.adds, lengths)
    row["ids"] = list(record.acks)
    row["time_ms"] = _time(record.committed_ms)


def _relocate_many(row: dict[str, Any], record: records.RelocateMany,
                   lengths: tuple[int, ...]) -> None:
    row["messages"] = _messages(record.msgs, lengths)


def _ack(row: dict[str, Any], record: records.Ack, _lengths: tuple[int, ...]) -> None:
    row["ids"] = list(record.ids)


def _drop(row: dict[str, Any], record: records.Drop, _lengths: tuple[int, ...]) -> None:
    row["ids"], row["reason"] = list(record.ids), record.reason


def _move(row: dict[str, Any], record: records.Move, _lengths: tuple[int, ...]) -> None:
    row["ids"], row["queue"], row["reason"] = list(record.ids), record.queue, record.reason
    if record.seqs is not None:
        row["seqs"] = _seq_pairs(zip(record.ids, record.seqs, strict=True))


def _update(row: dict[str, Any], record: records.Update, _lengths: tuple[int, ...]) -> None:
    row["ids"], row["delivery_count"] = [record.id], record.delivery_count
    row["deliver_at_ms"] = _time(record.deliver_at_ms)


def _xa_prepare(row: dict[str, Any], record: records.XaPrepare,
                lengths: tuple[int, ...]) -> None:
    row["xid"], row["messages"] = record.xid, _messages(record.sends, lengths)
    row["consumed"] = [{"id": i, "delivery_count": c} for i, c in record.consumed]
    row["discards"] = list(record.discards)
    row["created_ms"], row["time_ms"] = _time(record.created_ms), _time(record.prepared_ms)


def _xa_commit(row: dict[str, Any], record: records.XaCommit,
               _lengths: tuple[int, ...]) -> None:
    row["xid"], row["discards"] = record.xid, list(record.discards)
    row["seqs"], row["time_ms"] = _seq_pairs(record.seqs), _time(record.committed_ms)


def _xa_rollback(row: dict[str, Any], record: records.XaRollback,
                 _lengths: tuple[int, ...]) -> None:
    row["xid"], row["time_ms"] = record.xid, _time(record.rolled_back_ms)


def _xa_heuristic(row: dict[str, Any], record: records.XaHeuristic,
                  _lengths: tuple[int, ...]) -> None:
    row["xid"], row["outcome"] = record.xid, record.outcome
    row["discards"] = list(record.discards)
    row["seqs"], row["time_ms"] = _seq_pairs(record.seqs), _time(record.at_ms)


def _xa_forget(row: dict[str, Any], record: records.XaForget, _lengths: tuple[int, ...]) -> None:
    row["xid"] = record.xid


def _sink_commit(row: dict[str, Any], record: records.SinkCommit,
                 _lengths: tuple[int, ...]) -> None:
    row["sink_id"], row["batch_id"] = record.sink, record.last_batch
    row["sink_branches"] = [
        {"xid": branch.xid, "seqs": _seq_pairs(branch.seqs),
         "discards": list(branch.discards or [])}
        for branch in record.commits
    ]
    row["rolled_back"] = list(record.rollbacks)
    row["time_ms"] = _time(record.at_ms)


#: How each known kind fills its columns from its record (``core/records``).
_DECODERS: Final[dict[int, Callable[[dict[str, Any], Any, tuple[int, ...]], None]]] = {
    Kind.SNAPSHOT: _snapshot, Kind.QUEUE_PUT: _queue_put, Kind.QUEUE_DELETE: _queue_delete,
    Kind.ADD: _add, Kind.TX: _tx, Kind.ACK: _ack, Kind.DROP: _drop, Kind.MOVE: _move,
    Kind.UPDATE: _update, Kind.RELOCATE: _add, Kind.XA_PREPARE: _xa_prepare,
    Kind.XA_COMMIT: _xa_commit, Kind.XA_ROLLBACK: _xa_rollback,
    Kind.XA_HEURISTIC: _xa_heuristic, Kind.XA_FORGET: _xa_forget, SINK_COMMIT: _sink_commit,
    Kind.RELOCATE_MANY: _relocate_many,
}


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def decode_record(entry: JournalEntry, path: str = "<journal>") -> dict[str, Any]:
    """The row of one entry: every column of :data:`COLUMNS` (None where it does not apply).

    Raises :class:`CorruptStore` naming ``path`` and the offset when the meta of a
    known kind cannot be decoded.
    """
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row["position"] = position(entry.segment_id, entry.offset)
    row["segment_id"], row["offset"] = entry.segment_id, entry.offset
    row["length"], row["kind"] = entry.length, entry.kind
    decoder = _DECODERS.get(entry.kind)
    if decoder is None:
        return row  # unknown kind: kept, with a null meta
    row["kind_name"] = KIND_NAMES[entry.kind]
    try:
        meta = records.unpack(entry.meta)
        decoder(row, records.from_value(entry.kind, meta), entry.body_lengths)
        row["meta_json"] = json.dumps(meta, default=_json_default, separators=(",", ":"))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise CorruptStore(path, entry.offset,
                           f"undecodable record of kind {entry.kind}: {exc!r}") from exc
    return row


def read_records(data_dir: Path, segment_ids: list[int] | None = None,
                 last_segment: int | None = None) -> Iterator[dict[str, Any]]:
    """Decoded rows of ``segment_ids`` (default: all) of ``data_dir``'s journal, in log order.

    ``last_segment`` is the newest segment id (the only one whose tail may be
    torn); by default the newest of the listing.
    """
    journal_dir = journal_dir_of(data_dir)
    if segment_ids is None:
        segment_ids = journal_segments(data_dir)
    if last_segment is None:
        last_segment = max(segment_ids, default=0)
    for segment_id in segment_ids:
        path = str(journal_dir / segment_name(segment_id))
        for entry in read_segment(journal_dir, segment_id, last=segment_id >= last_segment):
            yield decode_record(entry, path)
