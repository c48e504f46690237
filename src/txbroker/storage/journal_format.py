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

Reading these bytes back (the entry scanner, index files) is ``journal_scan.py``'s.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import Final

import google_crc32c

from txbroker.storage.interface import BodyRef

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

assert SEGMENT_HEADER.size == 24, SEGMENT_HEADER.size
assert ENTRY_HEADER.size == 16, ENTRY_HEADER.size
assert PAD_HEADER.size == 12, PAD_HEADER.size
assert U32.size == 4, U32.size

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
assert INDEX_HEADER.size == 40, INDEX_HEADER.size
assert INDEX_RECORD.size == 12, INDEX_RECORD.size

MiB: Final = 1024 * 1024
#: The journal's subdirectory of a broker data directory.
JOURNAL_SUBDIR: Final = "journal"
#: Default segment size. Artemis uses 10 MiB journal files, Kafka 1 GiB log
#: segments; a 64 MiB segment replays in about 0.2 s and reclaims space in
#: reasonable steps.
DEFAULT_SEGMENT_SIZE: Final = 64 * MiB
#: Smallest segment size accepted (tests use tiny segments to force rolls).
MIN_SEGMENT_SIZE: Final = 1024
#: Largest segment size: body offsets in a ref have 40 bits; 4 GiB keeps far below.
MAX_SEGMENT_SIZE: Final = 4 * 1024 * MiB
#: Default bound of the body cache: enough for the bodies in flight to
#: consumers of a busy broker without holding the whole journal in memory.
DEFAULT_BODY_CACHE_BYTES: Final = 32 * MiB

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
