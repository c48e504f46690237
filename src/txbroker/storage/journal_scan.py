"""Reading the journal's bytes back: scanning segment files and index files.

The byte format is ``storage/journal_format.py``'s (its docstring draws every
field); this module turns those bytes back into :class:`StoredEntry` s with body
refs. :func:`scan_entries` is the hot loop of recovery and of the reader: it walks a
segment's entries, checks each with one CRC call against
:data:`~txbroker.storage.journal_format.CRC32C_RESIDUE`, skips pads and stops at the
first damage (:class:`Damage`), counting bodies in a :class:`Tally`.
:func:`read_index` reads the same entries from a sealed segment's index file
instead; :func:`find_next_entry` tells a torn tail from damage in the middle.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Final

import google_crc32c

from txbroker.storage.interface import BodyRef, StoredEntry
from txbroker.storage.journal_format import (
    CRC32C_RESIDUE,
    ENTRY_HEADER,
    ENTRY_MAGIC,
    ENTRY_OVERHEAD,
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_RECORD,
    INDEX_VERSION,
    MIN_PAD,
    PAD_HEADER,
    PAD_MAGIC,
    REF_LENGTH_BITS,
    REF_SEGMENT_SHIFT,
    SEGMENT_HEADER,
    U32,
    lengths_struct,
)

#: An entry header and the 4 bytes after it (the first body length when n >= 1).
HEADER_AND_FIRST_LENGTH: Final = struct.Struct("<4sIHHII")
#: An index record's header and the 4 bytes after it (read with one unpack).
INDEX_RECORD_AND_FIRST_LENGTH: Final = struct.Struct("<IHHII")
assert HEADER_AND_FIRST_LENGTH.size == ENTRY_HEADER.size + U32.size
assert INDEX_RECORD_AND_FIRST_LENGTH.size == INDEX_RECORD.size + U32.size


@dataclass(slots=True)
class Damage:
    """Where and why a scan stopped before the end of the region."""

    offset: int
    reason: str


@dataclass(slots=True)
class Tally:
    """Bodies counted while scanning a segment."""

    bodies: int = 0
    body_bytes: int = 0
    #: bytes of the entries that carry bodies, less the bodies (headers, message records)
    overhead: int = 0


#: What the scanners read: a whole file's bytes, or an mmap of it (slicing either gives bytes).
Buffer = bytes | mmap.mmap


def scan_entries(
    buf: Buffer,
    offset: int,
    end: int,
    segment_id: int,
    tally: Tally,
    out: list[StoredEntry],
    limit: int,
) -> tuple[int, Damage | None]:
    """Append up to ``limit`` entries of ``buf[offset:end]`` to ``out``.

    Returns the offset after the last entry read and the damage that stopped
    the scan (None if it stopped at ``end`` or after ``limit`` entries). Pads
    are skipped. Each entry is sliced out once (the C CRC binding takes only
    ``bytes``) and checked with one CRC call against :data:`CRC32C_RESIDUE`;
    ``meta`` is a slice of that copy and bodies are never kept: their refs
    point into the segment. This is the hot loop of recovery, so it fills a
    list (no generator hop per entry) and reads the header and first body
    length with one ``unpack_from``.
    """
    unpack_head = HEADER_AND_FIRST_LENGTH.unpack_from
    crc32c = google_crc32c.value
    append = out.append
    base = segment_id << REF_SEGMENT_SHIFT
    header_size = ENTRY_HEADER.size
    bodies = body_bytes = overhead = 0
    stop_at = len(out) + limit
    damage = None
    while offset < end and len(out) < stop_at:
        if end - offset < ENTRY_OVERHEAD:
            damage = Damage(offset, f"short entry ({end - offset} bytes left)")
            break
        magic, length, kind, count, meta_length, first_length = unpack_head(buf, offset)
        if magic != ENTRY_MAGIC:
            if magic == PAD_MAGIC and pad_ok(buf, offset, end):
                offset += length
                continue
            damage = Damage(offset, f"bad entry magic {magic!r}")
            break
        stop = offset + length
        if length < ENTRY_OVERHEAD or stop > end:
            damage = Damage(offset, f"entry length {length} runs past the end ({end})")
            break
        raw = buf[offset:stop]
        if crc32c(raw) != CRC32C_RESIDUE:
            damage = Damage(offset, "entry CRC mismatch")
            break
        table_end = header_size + 4 * count
        body = offset + table_end + meta_length
        if count == 1:
            if body + first_length + 4 != stop:
                damage = Damage(offset, "entry length disagrees with its contents")
                break
            refs: tuple[BodyRef, ...] = (base | body << REF_LENGTH_BITS | first_length,)
            body_bytes += first_length
            overhead += length - first_length
        elif count:
            lengths = lengths_struct(count).unpack_from(raw, header_size)
            carried = sum(lengths)
            if body + carried + 4 != stop:
                damage = Damage(offset, "entry length disagrees with its contents")
                break
            ref_list = []
            for body_length in lengths:
                ref_list.append(base | body << REF_LENGTH_BITS | body_length)
                body += body_length
            refs = tuple(ref_list)
            body_bytes += carried
            overhead += length - carried
        else:
            if body + 4 != stop:
                damage = Damage(offset, "entry length disagrees with its contents")
                break
            refs = ()
        bodies += count
        append(StoredEntry(kind, raw[table_end : table_end + meta_length], refs))
        offset = stop
    tally.bodies += bodies
    tally.body_bytes += body_bytes
    tally.overhead += overhead
    return offset, damage


def collect_entries(
    buf: Buffer, offset: int, end: int, segment_id: int
) -> tuple[list[StoredEntry], Damage | None]:
    """All entries of ``buf[offset:end]`` up to the first damage, and that damage."""
    entries: list[StoredEntry] = []
    _offset, damage = scan_entries(buf, offset, end, segment_id, Tally(), entries, end)
    return entries, damage


def pad_ok(buf: Buffer, offset: int, end: int) -> bool:
    """Whether a valid pad starts at ``offset``."""
    if end - offset < PAD_HEADER.size:
        return False
    magic, length, crc = PAD_HEADER.unpack_from(buf, offset)
    return bool(
        magic == PAD_MAGIC
        and length >= MIN_PAD
        and offset + length <= end
        and google_crc32c.value(bytes(buf[offset : offset + 8])) == crc
    )


def entry_ok(buf: Buffer, offset: int, end: int) -> bool:
    """Whether a valid entry (or pad) starts at ``offset``."""
    if pad_ok(buf, offset, end):
        return True
    found: list[StoredEntry] = []
    scan_entries(buf, offset, end, 0, Tally(), found, 1)
    return bool(found)


def find_next_entry(buf: Buffer, start: int, end: int) -> int | None:
    """The offset of the first valid entry or pad at or after ``start``, if any.

    Used to tell a torn tail (nothing valid follows) from damage in the middle,
    and by repair to find where readable data resumes.
    """
    position = start
    while position < end:
        candidates = [
            found
            for found in (buf.find(ENTRY_MAGIC, position, end), buf.find(PAD_MAGIC, position, end))
            if found >= 0
        ]
        if not candidates:
            return None
        found = min(candidates)
        if entry_ok(buf, found, end):
            return found
        position = found + 1
    return None


def entry_spans(data: bytes) -> list[tuple[int, int]]:
    """``(offset, length)`` of each valid entry of a whole segment file's bytes.

    For tools and crash-injection tests; stops at the first damage.
    """
    spans = []
    offset = SEGMENT_HEADER.size
    while offset < len(data):
        if not entry_ok(data, offset, len(data)):
            break
        (length,) = U32.unpack_from(data, offset + 4)
        if data[offset : offset + 4] == ENTRY_MAGIC:
            spans.append((offset, length))
        offset += length
    return spans


def read_index(
    buf: bytes, segment_id: int, data_size: int, tally: Tally, out: list[StoredEntry]
) -> tuple[int, str | None]:
    """Append the entries an index file's bytes describe to ``out``, counting bodies in
    ``tally``; returns ``(lead, None)``, or ``(0, why)`` if the index cannot be
    trusted for a segment of ``data_size`` bytes (then ``out`` is left as it was)."""
    if len(buf) < INDEX_HEADER.size + 4:
        return 0, "short index"
    if google_crc32c.value(buf) != CRC32C_RESIDUE:
        return 0, "index CRC mismatch"
    magic, version, _flags, stored_id, size, count, lead, _reserved = \
        INDEX_HEADER.unpack_from(buf, 0)
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        return 0, f"bad index magic or version {magic!r} {version}"
    if stored_id != segment_id or size != data_size:
        return 0, f"index of segment {stored_id} ({size} bytes), not {segment_id} ({data_size})"
    # the record header and the 4 bytes after it (the first body length when n >= 1;
    # the CRC trailer guarantees 4 bytes after any record) in one unpack
    unpack_record = INDEX_RECORD_AND_FIRST_LENGTH.unpack_from
    base = segment_id << REF_SEGMENT_SHIFT
    found: list[StoredEntry] = []
    append = found.append
    position, end = INDEX_HEADER.size, len(buf) - 4
    offset = SEGMENT_HEADER.size  # where the entry starts in the segment
    bodies = body_bytes = overhead = 0
    record_size = INDEX_RECORD.size
    entry_header = ENTRY_HEADER.size
    for _ in range(count):
        if position + record_size > end:
            return 0, "index records run past its end"
        length, kind, body_count, meta_length, first_length = unpack_record(buf, position)
        meta_start = position + record_size + 4 * body_count
        position = meta_start + meta_length
        if position > end:
            return 0, "index records run past its end"
        body = offset + entry_header + 4 * body_count + meta_length
        if body_count == 1:
            refs: tuple[BodyRef, ...] = (base | body << REF_LENGTH_BITS | first_length,)
            carried = first_length
        elif body_count:
            lengths = lengths_struct(body_count).unpack_from(buf, meta_start - 4 * body_count)
            ref_list = []
            carried = 0
            for body_length in lengths:
                ref_list.append(base | (body + carried) << REF_LENGTH_BITS | body_length)
                carried += body_length
            refs = tuple(ref_list)
        else:
            refs = ()
            carried = 0
        offset += length
        if body + carried + 4 != offset:
            return 0, f"index record {len(found)} disagrees with its lengths"
        if body_count:
            bodies += body_count
            body_bytes += carried
            overhead += length - carried
        append(StoredEntry(kind, buf[meta_start:position], refs))
    if position != end or offset != data_size:
        return 0, f"index covers {offset} of {data_size} bytes"
    out.extend(found)
    tally.bodies += bodies
    tally.body_bytes += body_bytes
    tally.overhead += overhead
    return lead, None
