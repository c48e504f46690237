"""The sans-IO STOMP codec: bytes whole, byte by byte and with trailing bytes;
client and server codecs talking in memory; hypothesis round trips and fuzzing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txbroker.protocol.native import LocalProtocolError
from txbroker.protocol.stomp import (
    NEED_DATA,
    REQUIRED_HEADERS,
    TRANSITIONS,
    ConnectionState,
    Frame,
    Role,
    StompConnection,
    StompFrameTooLarge,
    StompProtocolError,
    encode_error,
    encode_message,
    encode_receipt,
    escape,
    message_head,
    negotiate_heartbeat,
    negotiate_version,
    parse_heartbeat,
    unescape,
)

CONNECT = b"CONNECT\naccept-version:1.2\nhost:x\n\n\x00"
CONNECTED_12 = Frame("CONNECTED", {"version": "1.2"})


def server(version: str | None = "1.2", **limits: int) -> StompConnection:
    """A server codec; with ``version``, already past CONNECT / CONNECTED."""
    codec = StompConnection(Role.SERVER, **limits)
    if version is not None:
        codec.receive_data(CONNECT)
        assert codec.drain()[0].command == "CONNECT"
        codec.send(Frame("CONNECTED", {"version": version}))
    return codec


def client(version: str | None = "1.2") -> StompConnection:
    codec = StompConnection(Role.CLIENT)
    if version is not None:
        codec.receive_data(f"CONNECTED\nversion:{version}\n\n\x00".encode())
        assert codec.drain()[0].command == "CONNECTED"
    return codec


def feed_whole(codec: StompConnection, data: bytes) -> list[Frame]:
    codec.receive_data(data)
    frames: list[Frame] = []
    while batch := codec.drain():
        frames += batch
    return frames


def feed_bytewise(codec: StompConnection, data: bytes) -> list[Frame]:
    frames: list[Frame] = []
    for index in range(len(data)):
        codec.receive_data(data[index:index + 1])
        while batch := codec.drain():
            frames += batch
    return frames


def feed_with_next_frame_started(codec: StompConnection, data: bytes) -> list[Frame]:
    """``data`` followed by the first bytes of another frame: those stay buffered."""
    trailing = b"SEND\ndestination:/queue/next\ncontent-le"
    codec.receive_data(data + trailing)
    frames: list[Frame] = []
    while batch := codec.drain():
        frames += batch
    assert codec.buffered == len(trailing)
    assert codec.next_event() is NEED_DATA
    return frames


FEEDERS: list[Callable[[StompConnection, bytes], list[Frame]]] = [
    feed_whole, feed_bytewise, feed_with_next_frame_started]
feeders = pytest.mark.parametrize("feed", FEEDERS, ids=["whole", "bytewise", "trailing"])


# ---------------------------------------------------------------- parsing valid frames
VALID_CASES = [
    # (id, bytes after CONNECT/CONNECTED 1.2, expected frames)
    ("send-nul-terminated", b"SEND\ndestination:/queue/a\n\nhello\x00",
     [Frame("SEND", {"destination": "/queue/a"}, b"hello")]),
    ("send-content-length-with-nuls",
     b"SEND\ndestination:/queue/a\ncontent-length:5\n\na\x00b\x00c\x00",
     [Frame("SEND", {"destination": "/queue/a", "content-length": "5"}, b"a\x00b\x00c")]),
    ("empty-body", b"SEND\ndestination:/queue/a\n\n\x00",
     [Frame("SEND", {"destination": "/queue/a"}, b"")]),
    ("crlf-line-ends", b"SEND\r\ndestination:/queue/a\r\nx:1\r\n\r\nbody\x00",
     [Frame("SEND", {"destination": "/queue/a", "x": "1"}, b"body")]),
    ("repeated-header-first-wins", b"SEND\ndestination:/queue/a\nx:first\nx:second\n\n\x00",
     [Frame("SEND", {"destination": "/queue/a", "x": "first"}, b"")]),
    ("escapes-1.2", b"SEND\ndestination:/queue/a\nk\\cey:a\\nb\\rc\\cd\\\\e\n\n\x00",
     [Frame("SEND", {"destination": "/queue/a", "k:ey": "a\nb\rc:d\\e"}, b"")]),
    ("value-with-colons-and-spaces", b"SEND\ndestination:/queue/a\nx: a:b \n\n\x00",
     [Frame("SEND", {"destination": "/queue/a", "x": " a:b "}, b"")]),
    ("heartbeats-between-frames",
     b"\n\r\n\nBEGIN\ntransaction:t\n\n\x00\n\n\r\nABORT\ntransaction:t\n\n\x00\n",
     [Frame("BEGIN", {"transaction": "t"}), Frame("ABORT", {"transaction": "t"})]),
    ("utf8-headers", "SEND\ndestination:/queue/ü\nnote:héllo ✓\n\n\x00".encode(),
     [Frame("SEND", {"destination": "/queue/ü", "note": "héllo ✓"}, b"")]),
    ("every-client-command",
     b"SUBSCRIBE\ndestination:/queue/a\nid:1\nack:client\n\n\x00"
     b"ACK\nid:7\ntransaction:t\n\n\x00NACK\nid:8\n\n\x00UNSUBSCRIBE\nid:1\n\n\x00"
     b"COMMIT\ntransaction:t\nreceipt:r\n\n\x00",
     [Frame("SUBSCRIBE", {"destination": "/queue/a", "id": "1", "ack": "client"}),
      Frame("ACK", {"id": "7", "transaction": "t"}), Frame("NACK", {"id": "8"}),
      Frame("UNSUBSCRIBE", {"id": "1"}), Frame("COMMIT", {"transaction": "t", "receipt": "r"})]),
]


@feeders
@pytest.mark.parametrize(("data", "expected"), [c[1:] for c in VALID_CASES],
                         ids=[c[0] for c in VALID_CASES])
def test_valid_frames(feed: Callable[[StompConnection, bytes], list[Frame]], data: bytes,
                      expected: list[Frame]) -> None:
    assert feed(server(), data) == expected


@feeders
def test_connect_is_never_unescaped(feed: Callable[[StompConnection, bytes], list[Frame]]) -> None:
    codec = server(version=None)
    frames = feed(codec, b"CONNECT\naccept-version:1.2\nlogin:a\\cb\npasscode:x\\y\n\n\x00")
    assert frames == [Frame("CONNECT", {"accept-version": "1.2", "login": "a\\cb",
                                        "passcode": "x\\y"})]


def test_frames_after_connect_wait_for_the_version() -> None:
    codec = StompConnection(Role.SERVER)
    codec.receive_data(CONNECT + b"SEND\ndestination:/queue/a\nx:a\\cb\n\n\x00")
    assert [f.command for f in codec.drain()] == ["CONNECT"]  # stops: version not agreed yet
    codec.send(CONNECTED_12)
    assert codec.drain() == [Frame("SEND", {"destination": "/queue/a", "x": "a:b"}, b"")]


@pytest.mark.parametrize(("version", "raw", "decoded"), [
    ("1.0", "a\\cb\\n", "a\\cb\\n"),  # 1.0: no escaping at all
    ("1.1", "a\\cb\\nc\\\\", "a:b\nc\\"),
    ("1.2", "a\\cb\\nc\\\\\\r", "a:b\nc\\\r"),
])
def test_unescaping_by_version(version: str, raw: str, decoded: str) -> None:
    codec = server(version)
    frames = feed_whole(codec, f"SEND\ndestination:/queue/a\nx:{raw}\n\n\x00".encode())
    assert frames[0].headers["x"] == decoded


def test_heartbeats_are_counted() -> None:
    codec = server()
    assert feed_whole(codec, b"\n\n\r\n") == []
    assert codec.heartbeats_received == 3
    assert codec.buffered == 0


# ---------------------------------------------------------------- errors
ERROR_CASES = [
    ("unknown-command", b"HELLO\n\n\x00", "unknown command 'HELLO'", None),
    ("server-command-from-client", b"MESSAGE\ndestination:x\nmessage-id:1\n\n\x00",
     "unknown command 'MESSAGE'", None),
    ("missing-destination", b"SEND\nreceipt:r\n\n\x00", "required header 'destination'", "r"),
    ("missing-sub-id", b"SUBSCRIBE\ndestination:/queue/a\nreceipt:r\n\n\x00",
     "required header 'id'", "r"),
    ("missing-ack-id", b"ACK\nreceipt:r\n\n\x00", "required header 'id'", "r"),
    ("missing-transaction", b"BEGIN\n\n\x00", "required header 'transaction'", None),
    ("bad-escape", b"SEND\ndestination:/queue/a\nreceipt:r\nx:a\\tb\n\n\x00", "undefined escape",
     "r"),
    ("trailing-backslash", b"SEND\ndestination:/queue/a\nx:a\\\n\n\x00", "undefined escape", None),
    ("body-on-ack", b"ACK\nid:1\nreceipt:r\n\nbody\x00", "must not have a body", "r"),
    ("no-nul-after-content-length", b"SEND\ndestination:/q\ncontent-length:1\n\nab\x00",
     "not followed by NUL", None),
    ("bad-content-length", b"SEND\ndestination:/q\ncontent-length:-1\n\n\x00",
     "content-length must be a non-negative integer", None),
    ("malformed-header", b"SEND\ndestination:/q\njunk\n\n\x00", "malformed header line", None),
    ("empty-header-name", b"SEND\ndestination:/q\n:v\n\n\x00", "empty name", None),
    ("connect-twice", CONNECT, "already connected", None),
    ("not-utf8", b"SEND\ndestination:/q\nx:\xff\xfe\n\n\x00", "not valid UTF-8", None),
]


@feeders
@pytest.mark.parametrize(("data", "message", "receipt"), [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_protocol_errors(feed: Callable[[StompConnection, bytes], list[Frame]], data: bytes,
                         message: str, receipt: str | None) -> None:
    codec = server()
    with pytest.raises(StompProtocolError) as info:
        feed(codec, data)
    assert message in str(info.value)
    assert info.value.receipt_id == receipt
    assert codec.state is ConnectionState.ERROR
    with pytest.raises(StompProtocolError, match="ERROR state"):
        codec.drain()
    codec.receive_data(b"SEND\ndestination:/q\n\n\x00")  # ignored from now on
    assert codec.buffered == 0
    assert codec.send(Frame("ERROR", {"message": "bye"})).startswith(b"ERROR\n")


def test_error_after_valid_frames_comes_on_the_next_drain() -> None:
    codec = server()
    codec.receive_data(b"SEND\ndestination:/q\n\na\x00SEND\ndestination:/q\n\nb\x00BAD\n\n\x00")
    assert [f.body for f in codec.drain()] == [b"a", b"b"]
    with pytest.raises(StompProtocolError, match="unknown command"):
        codec.drain()


def test_first_frame_must_be_connect() -> None:
    codec = StompConnection(Role.SERVER)
    codec.receive_data(b"SEND\ndestination:/q\nreceipt:r\n\nx\x00")
    with pytest.raises(StompProtocolError, match="first frame must be CONNECT") as info:
        codec.drain()
    assert info.value.receipt_id == "r"


def test_nothing_after_disconnect() -> None:
    codec = server()
    codec.receive_data(b"DISCONNECT\n\n\x00")
    assert [f.command for f in codec.drain()] == ["DISCONNECT"]
    assert codec.state is ConnectionState.DISCONNECTED
    codec.receive_data(b"SEND\ndestination:/q\n\n\x00")
    with pytest.raises(StompProtocolError, match="after DISCONNECT"):
        codec.drain()


@pytest.mark.parametrize("feed", [feed_whole, feed_bytewise], ids=["whole", "bytewise"])
def test_frame_size_limits(feed: Callable[[StompConnection, bytes], list[Frame]]) -> None:
    # declared too large: refused as soon as the head is read, before the body
    with pytest.raises(StompFrameTooLarge, match="max frame size") as info:
        feed(server(max_frame_size=1024),
             b"SEND\ndestination:/q\nreceipt:r\ncontent-length:2000\n\n")
    assert info.value.receipt_id == "r"
    # no content-length and no NUL within the limit
    with pytest.raises(StompFrameTooLarge, match="max frame size"):
        feed(server(max_frame_size=1024), b"SEND\ndestination:/q\n\n" + b"x" * 1100)
    # a head that never ends
    with pytest.raises(StompFrameTooLarge, match="max headers x max header size"):
        feed(server(max_headers=4, max_header_size=64), b"SEND\n" + b"h:v\n" * 100)
    with pytest.raises(StompFrameTooLarge, match="max headers"):
        feed(server(max_headers=4), b"SEND\ndestination:/q\n" + b"h:v\n" * 4 + b"\n\x00")
    with pytest.raises(StompFrameTooLarge, match="max header size"):
        feed(server(max_header_size=32), b"SEND\ndestination:/q\nh:" + b"v" * 40 + b"\n\n\x00")
    # exactly at the limit is fine
    head = b"SEND\ndestination:/q\ncontent-length:%d\n\n"
    body_len = 1024 - len(head % 1000)
    frame = head % body_len + b"y" * body_len + b"\x00"
    assert feed(server(max_frame_size=1024), frame)[0].body == b"y" * body_len


def test_large_body_in_chunks_is_not_rescanned() -> None:
    codec = server()
    body = b"z" * 1_000_000
    data = b"SEND\ndestination:/q\n\n" + body + b"\x00"
    frames: list[Frame] = []
    for start in range(0, len(data), 4096):
        codec.receive_data(data[start:start + 4096])
        frames += codec.drain()
    assert len(frames) == 1 and frames[0].body == body


# ---------------------------------------------------------------- the client side
def test_client_receives_server_frames() -> None:
    codec = StompConnection(Role.CLIENT)
    data = (b"CONNECTED\nversion:1.1\nheart-beat:0,0\n\n\x00"
            b"MESSAGE\ndestination:/queue/a\nmessage-id:9\nsubscription:s\nx:a\\cb\n"
            b"content-length:2\n\nhi\x00RECEIPT\nreceipt-id:r\n\n\x00")
    frames = feed_whole(codec, data)
    assert codec.version == "1.1"
    assert frames[1].headers["x"] == "a:b" and frames[1].body == b"hi"
    assert frames[2] == Frame("RECEIPT", {"receipt-id": "r"})
    codec.receive_data(b"ERROR\nmessage:boom\n\n\x00")
    assert codec.drain()[0].command == "ERROR"
    assert codec.state is ConnectionState.CLOSED


def test_client_refuses_frames_out_of_order() -> None:
    codec = StompConnection(Role.CLIENT)
    codec.receive_data(b"RECEIPT\nreceipt-id:r\n\n\x00")
    with pytest.raises(StompProtocolError, match="must be CONNECTED or ERROR"):
        codec.drain()
    codec = client()
    codec.receive_data(b"MESSAGE\ndestination:/q\n\n\x00")
    with pytest.raises(StompProtocolError, match="required header 'message-id'"):
        codec.drain()


# ---------------------------------------------------------------- sending
def test_send_escapes_for_the_version() -> None:
    codec = server("1.2")
    data = codec.send(Frame("MESSAGE", {"destination": "/queue/a", "message-id": "1",
                                        "subscription": "s", "x": "a:b\nc\\\r"}, b"\x00"))
    assert data == (b"MESSAGE\ndestination:/queue/a\nmessage-id:1\nsubscription:s\n"
                    b"x:a\\cb\\nc\\\\\\r\ncontent-length:1\n\n\x00\x00")
    codec11 = server("1.1")
    assert b"x:a\\cb\n" in codec11.send(Frame("RECEIPT", {"receipt-id": "r", "x": "a:b"}))


def test_connected_is_not_escaped_and_sets_the_version() -> None:
    codec = server(version=None)
    data = codec.send(Frame("CONNECTED", {"version": "1.1", "heart-beat": "0,0"}))
    assert data == b"CONNECTED\nversion:1.1\nheart-beat:0,0\n\n\x00"
    assert codec.version == "1.1"
    with pytest.raises(LocalProtocolError):
        codec.send(Frame("CONNECTED", {"version": "1.1", "x": "a\nb"}))
    with pytest.raises(LocalProtocolError):
        codec.send(Frame("CONNECTED", {"version": "9.9"}))


def test_local_misuse_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError, match="cannot send SEND"):
        server().send(Frame("SEND", {"destination": "/q"}))
    with pytest.raises(LocalProtocolError, match="cannot send MESSAGE"):
        client().send(Frame("MESSAGE", {}))
    with pytest.raises(LocalProtocolError, match="must not have a body"):
        client().send(Frame("ACK", {"id": "1"}, b"x"))


def test_encode_error() -> None:
    data = encode_error("bad: thing\nhere", "r:1", "1.2", "detail")
    codec = client()
    codec.receive_data(data)
    frame = codec.drain()[0]
    assert frame.headers["message"] == "bad: thing\nhere"
    assert frame.headers["receipt-id"] == "r:1"
    assert frame.body == b"detail\n"
    plain = encode_error("line1\nline2", version="1.0")
    assert b"message:line1 line2\n" in plain


MESSAGE_HEADERS = {"x-odd": "a:b\nc\\d", "content-type": "text/plain", "destination": "/q/x",
                   "ack": "forged", "content-length": "99", "bad:name": "v"}
MESSAGE_BODY = b"bin\x00ary\n"


@feeders
@pytest.mark.parametrize("version", ["1.2", "1.1", "1.0"])
def test_encode_message_round_trips(feed: Callable[[StompConnection, bytes], list[Frame]],
                                    version: str) -> None:
    """The server's MESSAGE encoder, read back by the client codec of each version."""
    head = message_head("/queue/a:b", "sub:1", version)
    data = encode_message(head, "42", MESSAGE_BODY, version, ack="7", redelivered=True,
                          headers=MESSAGE_HEADERS) + encode_receipt("r:1", version)
    frames = feed(client(version), data)
    assert [f.command for f in frames] == ["MESSAGE", "RECEIPT"]
    message, receipt = frames
    assert message.body == MESSAGE_BODY
    expected = {"destination": "/queue/a:b", "subscription": "sub:1", "message-id": "42",
                "ack": "7", "redelivered": "true", "content-type": "text/plain",
                "content-length": str(len(MESSAGE_BODY))}
    if version != "1.0":  # 1.0 cannot escape: such headers cannot travel
        expected |= {"x-odd": "a:b\nc\\d", "bad:name": "v"}
    assert message.headers == expected  # protocol headers of the message are not repeated
    assert receipt.headers == {"receipt-id": "r:1"}


def test_encode_message_minimal() -> None:
    head = message_head("/queue/a", "s", "1.2")
    data = encode_message(head, "1", b"", "1.2")
    assert data == (b"MESSAGE\ndestination:/queue/a\nsubscription:s\nmessage-id:1\n"
                    b"content-length:0\n\n\x00")


# ---------------------------------------------------------------- negotiation
@pytest.mark.parametrize(("offered", "agreed"), [
    (None, "1.0"), ("1.0", "1.0"), ("1.1", "1.1"), ("1.2", "1.2"), ("1.0,1.1,1.2", "1.2"),
    ("1.1, 1.0", "1.1"), ("2.0", None), ("", None),
])
def test_negotiate_version(offered: str | None, agreed: str | None) -> None:
    assert negotiate_version(offered) == agreed


@pytest.mark.parametrize(("client_hb", "send_min", "receive_min", "agreed"), [
    ((0, 0), 1000, 1000, (0, 0)),
    ((0, 500), 1000, 1000, (1000, 0)),  # the client wants beats: no faster than we can
    ((0, 5000), 1000, 1000, (5000, 0)),
    ((500, 0), 1000, 1000, (0, 1000)),  # the client offers beats: no faster than we want
    ((5000, 7000), 1000, 1000, (7000, 5000)),
    ((100, 100), 100, 100, (100, 100)),
])
def test_negotiate_heartbeat(client_hb: tuple[int, int], send_min: int, receive_min: int,
                             agreed: tuple[int, int]) -> None:
    assert negotiate_heartbeat(client_hb, send_min, receive_min) == agreed


@pytest.mark.parametrize("bad", ["", "1", "1,2,3", "a,b", "-1,0", "1.5,2"])
def test_parse_heartbeat_refuses_garbage(bad: str) -> None:
    with pytest.raises(StompProtocolError, match="heart-beat"):
        parse_heartbeat(bad)


def test_parse_heartbeat() -> None:
    assert parse_heartbeat(None) == (0, 0)
    assert parse_heartbeat("10,20") == (10, 20)


# ---------------------------------------------------------------- the tables
def test_tables_are_consistent() -> None:
    for (_role, _state, command), _after in TRANSITIONS.items():
        assert command.isupper()
    for (_command, version), names in REQUIRED_HEADERS.items():
        assert version in ("1.0", "1.1", "1.2") and names


# ---------------------------------------------------------------- in memory pair + hypothesis
header_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
header_names = header_text.filter(lambda s: s not in ("", "content-length"))


@settings(max_examples=150, deadline=None)
@given(
    version=st.sampled_from(["1.1", "1.2"]),
    headers=st.dictionaries(header_names, header_text, max_size=6),
    body=st.binary(max_size=300),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
)
def test_round_trip_client_to_server(version: str, headers: dict[str, str], body: bytes,
                                     cuts: list[int]) -> None:
    if version == "1.1":  # 1.1 cannot escape CR
        headers = {k: v for k, v in headers.items() if "\r" not in k + v}
    sending = client(version)
    receiving = server(version)
    frame = Frame("SEND", {"destination": "/queue/x", **headers}, body)
    data = sending.send(frame) + b"\n" + sending.send(Frame("DISCONNECT", {"receipt": "z"}))
    frames: list[Frame] = []
    start = 0
    for cut in [*sorted({min(c, len(data)) for c in cuts}), len(data)]:
        receiving.receive_data(data[start:cut])
        start = cut
        while batch := receiving.drain():
            frames += batch
    got = frames[0]
    assert got.body == body
    expected = {"destination": "/queue/x", **headers, "content-length": str(len(body))}
    assert got.headers == expected
    assert frames[1] == Frame("DISCONNECT", {"receipt": "z"})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=1, max_value=64))
def test_fuzz_random_bytes_only_raise_protocol_errors(data: bytes, chunk: int) -> None:
    for codec in (server(), server(version=None), client()):
        try:
            for start in range(0, len(data), chunk):
                codec.receive_data(data[start:start + chunk])
                while codec.drain():
                    pass
        except StompProtocolError:
            assert codec.state is ConnectionState.ERROR


frame_parts = st.lists(st.sampled_from([
    b"SEND", b"SUBSCRIBE", b"ACK", b"NACK", b"BEGIN", b"COMMIT", b"ABORT", b"UNSUBSCRIBE",
    b"DISCONNECT", b"CONNECT", b"\n", b"\r\n", b":", b"\\", b"\\c", b"\\n", b"\x00",
    b"destination:/queue/a", b"id:1", b"transaction:t", b"content-length:3", b"content-length:",
    b"receipt:r", b"abc", b"\xff",
]), max_size=40)


@settings(max_examples=300, deadline=None)
@given(frame_parts)
def test_fuzz_frame_like_bytes(parts: list[bytes]) -> None:
    codec = server()
    codec.receive_data(b"".join(parts))
    try:
        while frames := codec.drain():
            for frame in frames:
                assert isinstance(frame.command, str) and isinstance(frame.body, bytes)
    except StompProtocolError:
        pass


@given(st.text(max_size=30))
def test_escape_round_trip(value: str) -> None:
    assert unescape(escape(value, "1.2"), "1.2") == value
    if "\r" not in value:
        assert unescape(escape(value, "1.1"), "1.1") == value
