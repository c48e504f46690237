"""Packed columns: how a ``stream_read`` page travels (docs/protocol.md).

Theory of operation
-------------------
A page of a stream reader holds up to 50,000 messages. Sent as msgpack lists
it costs the broker a Python object per message and column to build, and the
reader as many to decode, only for the reader to copy them into Arrow
columns. So the numeric columns travel as little-endian fixed-width arrays
in one msgpack ``bin`` each, and the bodies as one ``bin`` holding them back
to back plus a ``bin`` of their lengths — the layout of an Arrow binary
column, and of the bodies of one journal record, which the store reads with
one ``pread`` (``storage/journal.py``). The page map::

    key              msgpack  contents
    queue            str      the queue read
    next             int      the seq to continue from
    count            int      N, the messages in the page
    seqs             bin      N × i64 little-endian
    timestamps       bin      N × i64 little-endian, ms since the epoch (sent)
    delivery_counts  bin      N × u32 little-endian
    message_ids      array    N × (str | nil), or nil when no message has one
    headers          array    N × (map | nil), or nil when no message has any
    body_lengths     bin      N × u32 little-endian
    bodies           bin      the N bodies back to back (sum of body_lengths bytes)

:func:`check_page` verifies a received page's shape, so a reader never
builds columns of different lengths from a bad reply.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Final

from txbroker.errors import ProtocolError

#: ``array`` type codes of the packed columns, and their widths on the wire.
I64: Final = "q"
U32: Final = "I"
_WIDTH: Final = {I64: 8, U32: 4}
assert array(I64).itemsize == 8 and array(U32).itemsize == 4
#: The wire is little-endian; a big-endian host swaps.
_SWAP: Final = sys.byteorder == "big"

#: Packed columns of a page and their type codes.
PACKED_COLUMNS: Final = {"seqs": I64, "timestamps": I64, "delivery_counts": U32,
                         "body_lengths": U32}


def pack_ints(typecode: str, values: Sequence[int]) -> bytes:
    """``values`` as a little-endian array of ``typecode`` (``I64`` or ``U32``)."""
    return struct.pack(f"<{len(values)}{typecode}", *values)


def unpack_ints(typecode: str, data: bytes) -> array[int]:
    """The ints of a packed column."""
    column = array(typecode)
    column.frombytes(data)
    if _SWAP:
        column.byteswap()
    return column


def split_bodies(data: bytes, lengths: Iterable[int]) -> list[bytes]:
    """Bodies packed back to back, as separate objects."""
    found: list[bytes] = []
    offset = 0
    for length in lengths:
        found.append(data[offset:offset + length])
        offset += length
    return found


def encode_page(queue: str, next_seq: int, *, seqs: Sequence[int],
                timestamps: Sequence[int], delivery_counts: Sequence[int],
                message_ids: list[str | None], headers: list[dict[str, str] | None],
                body_data: bytes, body_lengths: Sequence[int]) -> dict[str, Any]:
    """The page map of the module docstring (the broker's side): every column holds
    one value per body."""
    return {
        "queue": queue,
        "next": next_seq,
        "count": len(body_lengths),
        "seqs": pack_ints(I64, seqs),
        "timestamps": pack_ints(I64, timestamps),
        "delivery_counts": pack_ints(U32, delivery_counts),
        "message_ids": message_ids if message_ids.count(None) < len(message_ids) else None,
        "headers": headers if any(headers) else None,
        "body_lengths": pack_ints(U32, body_lengths),
        "bodies": body_data,
    }


def check_page(page: Any) -> dict[str, Any]:
    """A received page map, checked: every column holds ``count`` entries and the
    bodies are as long as their lengths say. Raises :class:`ProtocolError`."""
    if not isinstance(page, dict):
        raise ProtocolError(f"a stream page must be a map, not {type(page).__name__}")
    count = page.get("count")
    if not isinstance(count, int) or count < 0:
        raise ProtocolError("a stream page needs a count")
    if not isinstance(page.get("queue"), str) or not isinstance(page.get("next"), int):
        raise ProtocolError("a stream page needs 'queue' and 'next'")
    for name, typecode in PACKED_COLUMNS.items():
        data = page.get(name)
        if not isinstance(data, bytes) or len(data) != count * _WIDTH[typecode]:
            raise ProtocolError(f"stream page column {name!r} does not hold {count} values")
    for name in ("message_ids", "headers"):
        values = page.get(name)
        if values is not None and (not isinstance(values, list) or len(values) != count):
            raise ProtocolError(f"stream page column {name!r} does not hold {count} values")
    bodies = page.get("bodies")
    if not isinstance(bodies, bytes) or len(bodies) != sum(
            unpack_ints(U32, page["body_lengths"])):
        raise ProtocolError("stream page bodies do not match their lengths")
    return page


__all__ = ["I64", "PACKED_COLUMNS", "U32", "check_page", "encode_page", "pack_ints",
           "split_bodies", "unpack_ints"]
