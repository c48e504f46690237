"""The router's constants, message decoding and the local key check (no broker)."""

from __future__ import annotations

import pytest

from txbroker.errors import BadRequest, ProtocolError
from txbroker.router import (
    ALL_ROUTER_EVENTS,
    EXCEPTION,
    ROUTER_EVENT_MAX,
    ROUTER_EVENT_MIN,
    SERVER_UP,
    USER_EVENT_MAX,
    MessageType,
    PartitionMap,
    Role,
    RouterMessage,
    event_ranges,
)


def test_numbers_and_names() -> None:
    assert (USER_EVENT_MAX, ROUTER_EVENT_MIN, SERVER_UP, EXCEPTION, ROUTER_EVENT_MAX) == (
        255, 256, 256, 262, 511)
    assert [t.value for t in MessageType] == ["MSG1", "MSG", "PREPARE", "ACCEPTED", "REJECTED",
                                              "UNCERTAIN", "USER_EVENT", "ROUTER_EVENT"]
    assert [r.value for r in Role] == ["primary", "standby", "concurrent", "shadow"]


def test_event_ranges() -> None:
    assert event_ranges([5, (10, 20), ALL_ROUTER_EVENTS]) == [[5, 5], [10, 20], [256, 511]]
    with pytest.raises(ValueError, match=r"not within 0\.\.511"):
        event_ranges([(20, 10)])
    with pytest.raises(ValueError):
        event_ranges([512])
    with pytest.raises(TypeError):
        event_ranges([("a", "b")])  # type: ignore[list-item]


def test_message_from_push() -> None:
    message = RouterMessage.from_push({"controller": 1, "type": "REJECTED", "tid": "t",
                                       "reason": "SRVDIED"})
    assert message == RouterMessage(MessageType.REJECTED, tid="t", reason="SRVDIED")
    assert message.is_outcome and not message.is_event
    with pytest.raises(ProtocolError, match="malformed rtr push"):
        RouterMessage.from_push({"controller": 1, "type": "NOPE"})


def test_partition_map_checks_keys_locally() -> None:
    ints = PartitionMap.from_reply({"facility": "BANK", "key_type": "int", "partitions": [
        {"name": "A", "low": 0, "high": 99}, {"name": "B", "low": 100, "high": 199}]})
    assert (ints.partition_of(0), ints.partition_of(99), ints.partition_of(100)) == (
        "A", "A", "B")
    with pytest.raises(BadRequest, match=r"^key 200 is outside every partition of facility "
                                         r"'BANK'$"):
        ints.partition_of(200)
    with pytest.raises(BadRequest, match="key type"):
        ints.partition_of(True)
    strs = PartitionMap.from_reply({"facility": "N", "key_type": "str", "partitions": [
        {"name": "AM", "low": "a", "high": "m"}]})
    assert strs.partition_of("kate") == "AM"
    with pytest.raises(BadRequest, match=r"^key 'zed' is outside"):
        strs.partition_of("zed")
