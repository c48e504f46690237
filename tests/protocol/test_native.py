"""Tests of the sans-IO native codec: each case fed whole, byte by byte, with trailing bytes."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txbroker import _build
from txbroker.errors import ErrorCode, FrameTooLarge, ProtocolError
from txbroker.protocol.native import (
    DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA,
    ConnectionState,
    Err,
    Event,
    LocalProtocolError,
    NativeConnection,
    NeedData,
    Ok,
    Push,
    Request,
    Role,
    encode_error,
)


def frame(obj: Any) -> bytes:
    """Encode ``obj`` as a frame by hand (independent of the codec under test)."""
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def collect(conn: NativeConnection, out: list[Event] | None = None) -> list[Event]:
    """Read events one by one into ``out`` until NEED_DATA (an error leaves ``out`` filled)."""
    out = [] if out is None else out
    while True:
        event = conn.next_event()
        if isinstance(event, NeedData):
            assert event is NEED_DATA
            return out
        out.append(event)


def feeds(data: bytes) -> list[list[bytes]]:
    """The three ways of delivering ``data``: whole, one byte at a time, split in the middle."""
    middle = len(data) // 2
    return [[data], [data[i : i + 1] for i in range(len(data))], [data[:middle], data[middle:]]]


def tr(role: Role, data: bytes, expected: list[Event]) -> None:
    """Feed ``data`` whole, byte by byte, and with trailing bytes; expect ``expected``."""
    for chunks in feeds(data):
        conn = NativeConnection(role)
        got: list[Event] = []
        for chunk in chunks:
            conn.receive_data(chunk)
            got.extend(collect(conn))
        assert got == expected
        assert conn.buffered == 0
    # Same again with drain().
    for chunks in feeds(data):
        conn = NativeConnection(role)
        got = []
        for chunk in chunks:
            conn.receive_data(chunk)
            got.extend(conn.drain())
        assert got == expected
    # Trailing bytes: the start of another frame stays buffered (NEED_DATA).
    conn = NativeConnection(role)
    trailing = frame([0, 1, "ping", {}])[:7]
    conn.receive_data(data + trailing)
    assert collect(conn) == expected
    assert conn.buffered == len(trailing)
    assert conn.next_event() is NEED_DATA


def tr_error(role: Role, data: bytes, error: type[ProtocolError], before: list[Event]) -> None:
    """Feed ``data`` in all ways; expect events ``before`` then ``error`` (and ERROR state)."""
    for chunks in feeds(data):
        conn = NativeConnection(role)
        got: list[Event] = []
        with pytest.raises(error):
            for chunk in chunks:
                conn.receive_data(chunk)
                collect(conn, got)
        assert got == before
        assert conn.state is ConnectionState.ERROR
        with pytest.raises(error):
            conn.next_event()
        with pytest.raises(error):
            conn.drain()
    # drain(): valid events come first, the error on the next call.
    conn = NativeConnection(role)
    conn.receive_data(data)
    if before:
        assert conn.drain() == before
    with pytest.raises(error):
        conn.drain()


SEND_ARGS = {"dest": "q", "body": b"\x00\xff" * 10, "headers": {"a": "b"}, "priority": 9}

SERVER_CASES: list[tuple[Any, Event]] = [
    ([0, 1, "hello", {"version": 1}], Request(1, "hello", {"version": 1})),
    ([0, 0, "ack", {"tags": [1, 2]}], Request(0, "ack", {"tags": [1, 2]})),
    ([0, 7, "send", SEND_ARGS], Request(7, "send", SEND_ARGS)),
    ([0, 2**63, "ping", {}], Request(2**63, "ping", {})),
]

CLIENT_CASES: list[tuple[Any, Event]] = [
    ([1, 1, "", {"duplicate": False}], Ok(1, {"duplicate": False})),
    ([1, 5, "", None], Ok(5, None)),
    ([1, 5, "", [{"name": "q"}]], Ok(5, [{"name": "q"}])),
    ([2, 3, "", {"code": 10, "message": "no such queue"}], Err(3, 10, "no such queue")),
    ([2, 0, "", {"code": 2, "message": "bad"}], Err(0, 2, "bad")),
    ([3, 0, "deliver", {"sub": 1, "body": b"x"}], Push("deliver", {"sub": 1, "body": b"x"})),
]


@pytest.mark.parametrize(("obj", "event"), SERVER_CASES)
def test_server_receives_requests(obj: Any, event: Event) -> None:
    tr(Role.SERVER, frame(obj), [event])


@pytest.mark.parametrize(("obj", "event"), CLIENT_CASES)
def test_client_receives_replies_and_pushes(obj: Any, event: Event) -> None:
    tr(Role.CLIENT, frame(obj), [event])


def test_many_frames_in_one_buffer() -> None:
    data = b"".join(frame(obj) for obj, _ in SERVER_CASES)
    tr(Role.SERVER, data, [event for _, event in SERVER_CASES])


BAD_FRAMES: list[tuple[Role, bytes]] = [
    (Role.SERVER, b"\x00\x00\x00\x00"),  # length 0
    (Role.SERVER, frame([0, 1, "ping"])),  # 3 elements
    (Role.SERVER, frame([0, 1, "ping", {}, 5])),  # 5 elements
    (Role.SERVER, frame({"type": 0})),  # not an array
    (Role.SERVER, frame(5)),
    (Role.SERVER, frame([True, 1, "ping", {}])),  # bool is not an int
    (Role.SERVER, frame([0, "1", "ping", {}])),  # str rid
    (Role.SERVER, frame([0, -1, "ping", {}])),  # negative rid
    (Role.SERVER, frame([0, 1, b"ping", {}])),  # bin op name
    (Role.SERVER, frame([0, 1, "ping", []])),  # args not a map
    (Role.SERVER, frame([0, 1, "ping", {1: 2}])),  # non-str map key
    (Role.SERVER, frame([9, 1, "ping", {}])),  # unknown type
    (Role.SERVER, frame([1, 1, "", {}])),  # wrong direction: OK to a server
    (Role.SERVER, frame([3, 0, "deliver", {}])),  # wrong direction: PUSH to a server
    (Role.CLIENT, frame([0, 1, "ping", {}])),  # wrong direction: REQUEST to a client
    (Role.CLIENT, frame([1, 0, "", {}])),  # OK without rid
    (Role.CLIENT, frame([2, 1, "", {"code": "x", "message": "m"}])),  # ERR with str code
    (Role.CLIENT, frame([2, 1, "", {"message": "m"}])),  # ERR without code
    (Role.CLIENT, frame([2, 1, "", "boom"])),  # ERR body not a map
    (Role.CLIENT, frame([3, 1, "deliver", {}])),  # PUSH with a rid
    (Role.CLIENT, frame([3, 0, "", {}])),  # PUSH without name
    (Role.CLIENT, frame([3, 0, "deliver", [1]])),  # PUSH body not a map
    (Role.SERVER, b"\x00\x00\x00\x01\xc1"),  # 0xc1 is never valid msgpack
    (Role.SERVER, b"\x00\x00\x00\x02\xa1\xff"),  # invalid UTF-8 in a str
    (Role.SERVER, b"\x00\x00\x00\x02\x91\xc0" + b""),  # fine msgpack, wrong shape
    (Role.SERVER, struct.pack(">I", 3) + b"\x90\x90\x90"),  # extra data inside the frame
]


@pytest.mark.parametrize(("role", "data"), BAD_FRAMES)
def test_bad_frames_are_remote_protocol_errors(role: Role, data: bytes) -> None:
    tr_error(role, data, ProtocolError, [])


@pytest.mark.parametrize(("role", "data"), BAD_FRAMES)
def test_trailing_garbage_after_a_valid_frame(role: Role, data: bytes) -> None:
    good_obj, good_event = SERVER_CASES[0] if role is Role.SERVER else CLIENT_CASES[0]
    tr_error(role, frame(good_obj) + data, ProtocolError, [good_event])


def test_oversized_declared_length_fails_on_the_header() -> None:
    conn = NativeConnection(Role.SERVER, max_frame_size=100)
    conn.receive_data(struct.pack(">I", 101))  # no payload needed to know
    with pytest.raises(FrameTooLarge) as info:
        conn.next_event()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert conn.state is ConnectionState.ERROR
    conn.receive_data(b"more")  # ignored
    assert conn.buffered == 0
    tr_error(Role.SERVER, struct.pack(">I", DEFAULT_MAX_FRAME_SIZE + 1), FrameTooLarge, [])
    tr_error(Role.SERVER, b"\xff\xff\xff\xff", FrameTooLarge, [])


def test_frame_at_the_limit_is_accepted() -> None:
    payload = frame([0, 1, "send", {"body": b"x" * 50}])
    limit = len(payload) - 4
    conn = NativeConnection(Role.SERVER, max_frame_size=limit)
    conn.receive_data(payload)
    assert isinstance(conn.next_event(), Request)
    conn = NativeConnection(Role.SERVER, max_frame_size=limit - 1)
    conn.receive_data(payload)
    with pytest.raises(FrameTooLarge):
        conn.next_event()


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 20])
def test_truncated_frame_needs_data(cut: int) -> None:
    data = frame([0, 1, "send", SEND_ARGS])
    conn = NativeConnection(Role.SERVER)
    conn.receive_data(data[:cut])
    assert conn.next_event() is NEED_DATA
    assert conn.drain() == []
    assert conn.buffered == cut
    conn.receive_data(data[cut:])
    assert conn.next_event() == Request(1, "send", SEND_ARGS)


class ConnectionPair:
    """A client codec and a server codec wired to each other in memory."""

    def __init__(self) -> None:
        self.client = NativeConnection(Role.CLIENT)
        self.server = NativeConnection(Role.SERVER)

    def to_server(self, *events: Event) -> list[Event]:
        for event in events:
            self.server.receive_data(self.client.send(event))
        return self.server.drain()

    def to_client(self, *events: Event) -> list[Event]:
        self.client.receive_data(self.server.send_many(list(events)))
        return collect(self.client)


def test_connection_pair_conversation() -> None:
    pair = ConnectionPair()
    hello = Request(1, "hello", {"version": 1, "user": "u", "password": "p"})
    send = Request(2, "send", SEND_ARGS)
    ack = Request(0, "ack", {"tags": [1]})
    assert pair.to_server(hello, send, ack) == [hello, send, ack]
    replies: list[Event] = [
        Ok(2, {"duplicate": False}),  # out of order
        Ok(1, {"server": "txbroker", "version": 1}),
        Push("deliver", {"sub": 1, "tag": 1, "body": b"\x00"}),
        Err(0, ErrorCode.NOT_FOUND, "gone"),
    ]
    assert pair.to_client(*replies) == [
        Ok(2, {"duplicate": False}),
        Ok(1, {"server": "txbroker", "version": 1}),
        Push("deliver", {"sub": 1, "tag": 1, "body": b"\x00"}),
        Err(0, 10, "gone"),
    ]


# Events built lazily: the mypyc-compiled build (docs/performance.md) checks the
# constructor's argument types itself, so an ill-typed event (the `type: ignore` ones)
# raises TypeError there before it reaches `send`; the pure build's `send` raises
# LocalProtocolError. Either way nothing is encoded and the connection stays usable.
LOCAL_MISUSE: list[tuple[Role, Callable[[], Any]]] = [
    (Role.CLIENT, lambda: Ok(1, {})),
    (Role.CLIENT, lambda: Push("deliver", {})),
    (Role.CLIENT, lambda: Request(-1, "ping", {})),
    (Role.CLIENT, lambda: Request(1, "ping", [])),  # type: ignore[arg-type]
    (Role.CLIENT, lambda: Request(1, "send", {"body": object()})),
    (Role.CLIENT, lambda: Request(1, "send", {"n": 2**64})),
    (Role.CLIENT, lambda: "not an event"),
    (Role.SERVER, lambda: Request(1, "ping", {})),
    (Role.SERVER, lambda: Ok(0, {})),
    (Role.SERVER, lambda: Err(-1, 2, "x")),
    (Role.SERVER, lambda: Err(1, 2, b"x")),  # type: ignore[arg-type]
    (Role.SERVER, lambda: Push("", {})),
    (Role.SERVER, lambda: Push("deliver", [])),  # type: ignore[arg-type]
]
ILL_TYPED = {3, 6, 10, 12}  # indexes of the ill-typed events above


@pytest.mark.parametrize(("index", "role", "make"),
                         [(i, role, make) for i, (role, make) in enumerate(LOCAL_MISUSE)])
def test_local_misuse_raises_local_error_and_keeps_state(index: int, role: Role,
                                                          make: Callable[[], Any]) -> None:
    conn = NativeConnection(role)
    expected = (LocalProtocolError, TypeError) if index in ILL_TYPED else LocalProtocolError
    with pytest.raises(expected):
        conn.send(make())
    assert conn.state is ConnectionState.OPEN
    # The codec still works afterwards.
    good = Request(1, "ping", {}) if role is Role.CLIENT else Ok(1, {})
    assert conn.send(good) == frame([0, 1, "ping", {}] if role is Role.CLIENT else [1, 1, "", {}])


def test_bool_request_id() -> None:
    """A bool is not a request id for the pure codec; the compiled build stores the
    field as a C integer, so ``True`` arrives there as the id 1."""
    conn = NativeConnection(Role.CLIENT)
    if _build.MODE == "compiled":
        assert conn.send(Request(True, "ping", {})) == frame([0, 1, "ping", {}])
    else:
        with pytest.raises(LocalProtocolError):
            conn.send(Request(True, "ping", {}))


def test_local_error_is_not_a_remote_protocol_error() -> None:
    assert not issubclass(LocalProtocolError, ProtocolError)


def test_send_respects_peer_frame_limit() -> None:
    conn = NativeConnection(Role.CLIENT, peer_max_frame_size=100)
    with pytest.raises(LocalProtocolError):
        conn.send(Request(1, "send", {"body": b"x" * 200}))
    assert conn.send(Request(1, "send", {"body": b"x" * 10}))


def test_server_can_send_error_after_remote_error() -> None:
    server = NativeConnection(Role.SERVER)
    server.receive_data(frame("garbage"))
    with pytest.raises(ProtocolError) as info:
        server.next_event()
    data = encode_error(0, info.value.code, str(info.value))
    assert data == server.send(Err(0, ErrorCode.PROTOCOL, str(info.value)))
    client = NativeConnection(Role.CLIENT)
    client.receive_data(data)
    assert client.next_event() == Err(0, 2, str(info.value))


def test_max_frame_size_validated() -> None:
    with pytest.raises(ValueError):
        NativeConnection(Role.SERVER, max_frame_size=0)


# ------------------------------------------------------------------ fuzzing


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([Role.CLIENT, Role.SERVER]))
def test_fuzz_random_bytes_only_raise_protocol_error(data: bytes, role: Role) -> None:
    for chunks in ([data], [data[i : i + 3] for i in range(0, len(data), 3)]):
        conn = NativeConnection(role, max_frame_size=1000)
        try:
            for chunk in chunks:
                conn.receive_data(chunk)
                conn.drain()
        except ProtocolError:
            assert conn.state is ConnectionState.ERROR


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=100), st.sampled_from([Role.CLIENT, Role.SERVER]))
def test_fuzz_random_payload_with_valid_length(payload: bytes, role: Role) -> None:
    conn = NativeConnection(role)
    conn.receive_data(struct.pack(">I", len(payload)) + payload)
    try:
        conn.drain()
    except ProtocolError:
        assert conn.state is ConnectionState.ERROR


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
maps = st.dictionaries(st.text(max_size=8), msgpack_values, max_size=5)
rids = st.integers(min_value=0, max_value=2**64 - 1)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(msgpack_values, min_size=4, max_size=4) | msgpack_values,
    st.sampled_from([Role.CLIENT, Role.SERVER]),
)
def test_fuzz_random_msgpack_frames(obj: Any, role: Role) -> None:
    conn = NativeConnection(role)
    conn.receive_data(frame(obj))
    try:
        events = conn.drain()
    except ProtocolError:
        return
    assert len(events) == 1


requests = st.builds(Request, rids, st.text(max_size=12), maps)
replies = st.one_of(
    st.builds(Ok, st.integers(min_value=1, max_value=2**64 - 1), msgpack_values),
    st.builds(Err, rids, st.integers(min_value=-(2**31), max_value=2**31), st.text()),
    st.builds(Push, st.text(min_size=1, max_size=12), maps),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(requests, max_size=4), st.lists(replies, max_size=4), st.integers(1, 50))
def test_fuzz_valid_events_round_trip(
    reqs: list[Request], reps: list[Ok | Err | Push], chunk: int
) -> None:
    pair = ConnectionPair()
    data = b"".join(pair.client.send(r) for r in reqs)
    got: list[Event] = []
    for i in range(0, len(data), chunk):
        pair.server.receive_data(data[i : i + chunk])
        got.extend(pair.server.drain())
    assert got == reqs
    assert pair.to_client(*reps) == reps
