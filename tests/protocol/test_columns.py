"""The packed page of ``stream_read`` (protocol/columns.py): exact bytes, and
every malformed page refused with a ProtocolError."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from txbroker.client.streams import StreamChunk
from txbroker.errors import ProtocolError
from txbroker.protocol.columns import I64, U32, check_page, encode_page, pack_ints, split_bodies


def page() -> dict[str, Any]:
    return encode_page("q", 12, seqs=[10, 11], timestamps=[1_700_000_000_000, 5],
                       delivery_counts=[0, 3], message_ids=[None, "m-2"],
                       headers=[None, None], body_data=b"abcde", body_lengths=[2, 3])


def test_columns_are_little_endian_fixed_width() -> None:
    assert pack_ints(I64, [1, -2]) == b"\x01" + bytes(7) + b"\xfe" + b"\xff" * 7
    assert pack_ints(U32, [1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    encoded = page()
    assert encoded == {
        "queue": "q", "next": 12, "count": 2,
        "seqs": pack_ints(I64, [10, 11]), "timestamps": pack_ints(I64, [1_700_000_000_000, 5]),
        "delivery_counts": pack_ints(U32, [0, 3]), "message_ids": [None, "m-2"],
        "headers": None,  # no message has headers: one nil instead of a column
        "body_lengths": pack_ints(U32, [2, 3]), "bodies": b"abcde",
    }
    assert split_bodies(b"abcde", [2, 0, 3]) == [b"ab", b"", b"cde"]


def test_a_page_round_trips_through_msgpack() -> None:
    wire = msgpack.unpackb(msgpack.packb(page(), use_bin_type=True), raw=False)
    chunk = StreamChunk.from_page(wire)
    assert (chunk.queue, chunk.next, len(chunk)) == ("q", 12, 2)
    assert chunk.seqs == [10, 11] and chunk.timestamps == [1_700_000_000_000, 5]
    assert chunk.delivery_counts == [0, 3] and chunk.message_ids == [None, "m-2"]
    assert chunk.headers == [None, None] and chunk.bodies == [b"ab", b"cde"]
    empty = StreamChunk.of("q", 5, seqs=[], bodies=[])
    assert (len(empty), empty.bodies, empty.seqs) == (0, [], [])


@pytest.mark.parametrize("change", [
    {"count": 3},
    {"count": -1},
    {"count": None},
    {"queue": 7},
    {"seqs": b"\x00" * 15},
    {"timestamps": [1, 2]},
    {"delivery_counts": b"\x00" * 4},
    {"body_lengths": pack_ints(U32, [2, 2])},
    {"bodies": b"abcdef"},
    {"bodies": "abcde"},
    {"message_ids": ["only one"]},
    {"headers": {"k": "v"}},
])
def test_a_malformed_page_is_refused(change: dict[str, Any]) -> None:
    bad = {**page(), **change}
    with pytest.raises(ProtocolError):
        check_page(bad)
    with pytest.raises(ProtocolError):
        StreamChunk.from_page(bad)


def test_not_a_map_is_refused() -> None:
    with pytest.raises(ProtocolError, match="map"):
        check_page([1, 2])
