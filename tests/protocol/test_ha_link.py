"""The HA link codec (``protocol/ha.py``): lines of JSON with a version; anything
else is named as "not a txbroker HA port"."""

from __future__ import annotations

import pytest

from txbroker.errors import ProtocolError
from txbroker.protocol.ha import MAX_LINE, HaDecoder, encode


def test_round_trip_in_any_split() -> None:
    data = encode("standby", node="h:1", lock="pid 1") + encode("heartbeat", seq=7)
    assert data == (b'{"txbroker_ha":1,"type":"standby","node":"h:1","lock":"pid 1"}\n'
                    b'{"txbroker_ha":1,"type":"heartbeat","seq":7}\n')
    for cut in range(len(data) + 1):
        decoder = HaDecoder()
        messages = decoder.feed(data[:cut]) + decoder.feed(data[cut:])
        assert messages == [
            {"txbroker_ha": 1, "type": "standby", "node": "h:1", "lock": "pid 1"},
            {"txbroker_ha": 1, "type": "heartbeat", "seq": 7},
        ]


@pytest.mark.parametrize("data, text", [
    (b"CONNECTED\nversion:1.2\n\n\x00\n",
     "the peer is not a txbroker HA port (it sent b'CONNECTED'"),
    (b"HTTP/1.1 400 Bad Request\r\n", "not a txbroker HA port"),
    (b'{"type":"heartbeat"}\n', "not a txbroker HA port"),
    (b"[1,2]\n", "not a txbroker HA port"),
    (b'{"txbroker_ha":2,"type":"standby"}\n', "the peer speaks HA link version 2"),
    (b'{"txbroker_ha":1,"type":"gossip"}\n', "unknown HA message type 'gossip'"),
    (b"x" * (MAX_LINE + 1), "not a txbroker HA port"),
])
def test_anything_else_is_a_clear_protocol_error(data: bytes, text: str) -> None:
    with pytest.raises(ProtocolError, match=None) as info:
        HaDecoder().feed(data)
    assert text in str(info.value)


def test_encode_refuses_unknown_types() -> None:
    with pytest.raises(ValueError, match="unknown HA message type"):
        encode("gossip")
