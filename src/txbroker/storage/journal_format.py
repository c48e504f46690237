"""Byte format of the journal: segment files, entries, padding, body refs.

Theory of operation
-------------------
The journal is a directory of *segment files* ``DIR/journal/<id>.seg``, where
``<id>`` is the segment id written as 20 decimal digits (``00000000000000000001.seg``)
so that names sort in log order. Ids are consecutive: segments are deleted
only from the oldest end, so a gap means a file went missing.

All integers are little-endian and unsigned. ``CRC32C`` is the Castagnoli CRC
(``google_crc32c.value``), the same checksum iSCSI, ext4 and Kafka use.

Segment header (``SEGMENT_HEADER``, 24 bytes, at offset 0 of every segment)::

    offset  size  field
    0       8     magic            b"TXBJRNL\\n"
    8       2     format version   1
    10      2     flags            0 (reserved)
    12      8     segment id       the id in the file name
    20      4     header CRC32C    of bytes 0..19

Entries follow the header back to back, from offset 24 to the end of the
file. An *entry* (``ENTRY_HEADER`` + tables + trailer; at least 20 bytes)::

    offset        size      field
    0             4         magic            b"TXBE"
    4             4         entry length     L: every byte of the entry, trailer included
    8             2         kind             record type (opaque to the store)
    10            2         body count       n
    12            4         meta length      m
    16            4 * n     body lengths     one u32 per body
    16 + 4n       m         meta             opaque bytes
    16 + 4n + m   sum(len)  bodies           back to back, in order
    L - 4         4         CRC32C           of bytes 0 .. L-5 (all of the entry but itself)

so ``L == 20 + 4n + m + sum(body lengths)``, which recovery checks as well.
(Recovery checks the CRC as ``CRC32C(bytes 0 .. L-1) == 0x48674BC7``, the
CRC32C residue, which holds exactly when the trailer is right.)

A *pad* (``PAD_HEADER``, at least 12 bytes) covers a damaged region that
``repair`` chose to drop, so that the next recovery skips it without
complaint. Recovery yields nothing for it::

    offset  size  field
    0       4     magic            b"TXBP"
    4       4     pad length       P: every byte of the pad, header included
    8       4     CRC32C           of bytes 0..7
    12      P-12  whatever was there (ignored)

A sealed segment may have a *recovery index* ``DIR/journal/<id>.idx`` (issue 29;
optional, ``recovery_index``): everything recovery needs of the segment's entries
but their bodies, so that a restart reads a few percent of the bytes. Written
once, by the writer, when it seals a segment it wrote from the start (to a
temporary name, synced, then renamed); never changed; deleted before its
segment. Index header (``INDEX_HEADER``, 40 bytes)::

    offset  size  field
    0       8     magic            b"TXBINDX\n"
    8       2     format version   1
    10      2     flags            0 (reserved)
    12      8     segment id       the id of the segment it indexes
    20      8     data size        the segment's size when sealed (its file size)
    28      4     entry count      the records that follow
    32      4     lead             bytes of the segment's first entry if it has no
                                   bodies (its snapshot), else 0
    36      4     reserved         0

then one record per entry, in log order (``INDEX_RECORD`` + tables)::

    offset  size   field
    0       4      entry length     L of the entry in the segment
    4       2      kind
    6       2      body count       n
    8       4      meta length      m
    12      4 * n  body lengths
    12 + 4n m      meta

and a CRC32C trailer of every byte before it (checked as the residue). The
first entry starts at offset 24 of the segment and each one where the last
ended (the writer never writes pads), so body refs follow from the lengths.
Recovery trusts an index only if its CRC holds, it names the segment, the
segment's file has exactly ``data size`` bytes and a valid header, and the
records add up to that size; otherwise it scans the segment. What the index
gives up: the entries' own CRCs (over their bodies) are not checked at start.

A :data:`~txbroker.storage.interface.BodyRef` packs where a body lives, so
that ``body_size`` needs no I/O and ``read_body`` is one ``pread``::

    ref = segment_id << 72 | body_offset << 32 | body_length

(``body_offset`` is the body's first byte in the segment file, 40 bits;
``body_length`` 32 bits). Refs are Python ints of up to 136 bits: they do
not fit a msgpack int64; keep them in memory only, as the interface intends.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

import google_crc32c

from txbroker.storage.interface import BodyRef, StoredEntry

SEGMENT_MAGIC: Final = b"TXBJRNL\n"
FORMAT_VERSION: Final = 1
SEGMENT_SUFFIX: Final = ".seg"
#: Digits of a segment id in its file name: u64 ids fit in 20 decimal digits.
SEGMENT_NAME_DIGITS: Final = 20

ENTRY_MAGIC: Final = b"TXBE"
PAD_MAGIC: Final = b"TXBP"

#: magic, version, flags, segment id, header CRC.
SEGMENT_HEADER: Final = struct.Struct("<8sHHQI")
#: magic, entry length, kind, body count, meta length.
ENTRY_HEADER: Final = struct.Struct("<4sIHHI")
#: magic, pad length, CRC of the first 8 bytes.
PAD_HEADER: Final = struct.Struct("<4sII")
#: One body length, and the CRC trailer of an entry.
U32: Final = struct.Struct("<I")
#: An entry header and the 4 bytes after it (the first body length when n >= 1).
_HEADER_AND_FIRST_LENGTH: Final = struct.Struct("<4sIHHII")

assert SEGMENT_HEADER.size == 24, SEGMENT_HEADER.size
assert ENTRY_HEADER.size == 16, ENTRY_HEADER.size
assert PAD_HEADER.size == 12, PAD_HEADER.size
assert U32.size == 4, U32.size
assert _HEADER_AND_FIRST_LENGTH.size == ENTRY_HEADER.size + U32.size

#: CRC32C of any data followed by its own little-endian CRC32C (a property of
#: the CRC): checking ``value(entry) == CRC32C_RESIDUE`` checks the trailer
#: with one call over one slice.
CRC32C_RESIDUE: Final = 0x48674BC7
#: Bytes of an entry with no meta and no bodies (header + CRC trailer).
ENTRY_OVERHEAD: Final = ENTRY_HEADER.size + U32.size
#: Smallest damaged region that repair can cover with a pad.
MIN_PAD: Final = PAD_HEADER.size

#: The entry length field is a u32, so an entry is at most 4 GiB - 1.
MAX_ENTRY_SIZE: Final = 2**32 - 1
#: The kind and body count fields are u16.
MAX_KIND: Final = 2**16 - 1
MAX_BODIES: Final = 2**16 - 1

INDEX_MAGIC: Final = b"TXBINDX\n"
INDEX_VERSION: Final = 1
INDEX_SUFFIX: Final = ".idx"
#: magic, version, flags, segment id, data size, entry count, lead, reserved.
INDEX_HEADER: Final = struct.Struct("<8sHHQQIII")
#: entry length, kind, body count, meta length.
INDEX_RECORD: Final = struct.Struct("<IHHI")
#: An index record's header and the 4 bytes after it (read with one unpack).
_INDEX_RECORD_AND_FIRST_LENGTH: Final = struct.Struct("<IHHII")
assert INDEX_HEADER.size == 40, INDEX_HEADER.size
assert INDEX_RECORD.size == 12, INDEX_RECORD.size

#: BodyRef bit layout (see the module docstring).
REF_LENGTH_BITS: Final = 32
REF_OFFSET_BITS: Final = 40
REF_SEGMENT_SHIFT: Final = REF_OFFSET_BITS + REF_LENGTH_BITS
_LENGTH_MASK: Final = (1 << REF_LENGTH_BITS) - 1
_OFFSET_MASK: Final = (1 << REF_OFFSET_BITS) - 1


def pack_ref(segment_id: int, offset: int, length: int) -> BodyRef:
    """The ref of a body of ``length`` bytes at ``offset`` in segment ``segment_id``."""
    return segment_id << REF_SEGMENT_SHIFT | offset << REF_LENGTH_BITS | length


def unpack_ref(ref: BodyRef) -> tuple[int, int, int]:
    """``(segment_id, offset, length)`` of a ref."""
    return ref >> REF_SEGMENT_SHIFT, (ref >> REF_LENGTH_BITS) & _OFFSET_MASK, ref & _LENGTH_MASK


def ref_length(ref: BodyRef) -> int:
    """The body length a ref names (no I/O)."""
    return ref & _LENGTH_MASK


def segment_name(segment_id: int) -> str:
    """The file name of a segment: ``00000000000000000001.seg``."""
    return f"{segment_id:0{SEGMENT_NAME_DIGITS}d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """The segment id of a file name, or None if it is not a segment file."""
    stem, dot, suffix = name.partition(".")
    if "." + suffix != SEGMENT_SUFFIX or not dot or len(stem) != SEGMENT_NAME_DIGITS:
        return None
    return int(stem) if stem.isdigit() else None


def encode_segment_header(segment_id: int) -> bytes:
    """The 24 header bytes of segment ``segment_id``."""
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, segment_id, 0)[:-4]
    return head + U32.pack(google_crc32c.value(head))


def check_segment_header(data: bytes, segment_id: int) -> str | None:
    """Why ``data`` (the first bytes of a file) is not the header of ``segment_id``, or None."""
    if len(data) < SEGMENT_HEADER.size:
        return f"short segment header ({len(data)} of {SEGMENT_HEADER.size} bytes)"
    magic, version, _flags, stored_id, crc = SEGMENT_HEADER.unpack_from(data)
    if magic != SEGMENT_MAGIC:
        return f"bad segment magic {magic!r}"
    if google_crc32c.value(bytes(data[: SEGMENT_HEADER.size - 4])) != crc:
        return "segment header CRC mismatch"
    if version != FORMAT_VERSION:
        return f"unsupported journal format version {version}"
    if stored_id != segment_id:
        return f"segment header names segment {stored_id}, file name says {segment_id}"
    return None


def entry_size(meta_length: int, body_lengths: list[int]) -> int:
    """Bytes an entry takes on disk."""
    return ENTRY_OVERHEAD + 4 * len(body_lengths) + meta_length + sum(body_lengths)


@lru_cache(maxsize=256)
def lengths_struct(count: int) -> struct.Struct:
    """The struct of a table of ``count`` u32 body lengths."""
    return struct.Struct(f"<{count}I")


def encode_entry(kind: int, meta: bytes, bodies: list[bytes], size: int) -> list[bytes]:
    """The entry as two parts, everything but the CRC and the CRC trailer.

    One join and one CRC call per entry: about half the cost of extending a
    running CRC part by part (the writer thread holds the GIL meanwhile).
    """
    count = len(bodies)
    header = ENTRY_HEADER.pack(ENTRY_MAGIC, size, kind, count, len(meta))
    if count == 1:
        table = U32.pack(len(bodies[0]))
    else:
        table = lengths_struct(count).pack(*[len(body) for body in bodies])
    data = b"".join([header, table, meta, *bodies])
    return [data, U32.pack(google_crc32c.value(data))]


def index_record(kind: int, meta: bytes, bodies: list[bytes], size: int) -> bytes:
    """The recovery-index record of an entry (see the module docstring)."""
    count = len(bodies)
    head = INDEX_RECORD.pack(size, kind, count, len(meta))
    if count == 0:
        return head + meta
    if count == 1:
        return b"".join([head, U32.pack(len(bodies[0])), meta])
    return b"".join([head, lengths_struct(count).pack(*[len(body) for body in bodies]), meta])


def encode_index(segment_id: int, data_size: int, lead: int, records: list[bytes]) -> bytes:
    """A whole index file: header, ``records``, CRC32C trailer."""
    head = INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, 0, segment_id, data_size,
                             len(records), lead, 0)
    data = b"".join([head, *records])
    return data + U32.pack(google_crc32c.value(data))


def index_name(segment_id: int) -> str:
    """The file name of a segment's recovery index: ``00000000000000000001.idx``."""
    return f"{segment_id:0{SEGMENT_NAME_DIGITS}d}{INDEX_SUFFIX}"


def encode_pad(length: int) -> bytes:
    """The 12-byte header of a pad covering ``length`` bytes (``length >= MIN_PAD``)."""
    head = PAD_HEADER.pack(PAD_MAGIC, length, 0)[:8]
    return head + U32.pack(google_crc32c.value(head))


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
    unpack_head = _HEADER_AND_FIRST_LENGTH.unpack_from
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
    unpack_record = _INDEX_RECORD_AND_FIRST_LENGTH.unpack_from
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
