"""The sans-IO AMQP codec, fed bytes: whole, one byte at a time, with trailing bytes
(h11's ``tr()`` style); no socket, loop or clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import body, commands, frame, header, heartbeat

from txbroker.protocol.amqp import (
    FRAME_MIN_SIZE,
    PROTOCOL_HEADER,
    AmqpConnection,
    AmqpProtocolError,
    CodecState,
    ContentReceived,
    MethodReceived,
    ProtocolHeaderMismatch,
    ProtocolHeaderReceived,
    ReplyCode,
)
from txbroker.protocol.native import NEED_DATA, LocalProtocolError


def m(channel: int, method: Any) -> bytes:
    return frame.marshal(method, channel)


def content(channel: int, payload: bytes, props: commands.Basic.Properties | None = None,
            *, chunk: int = 1000, exchange: str = "x", key: str = "k") -> bytes:
    parts = [m(channel, commands.Basic.Publish(exchange=exchange, routing_key=key)),
             frame.marshal(header.ContentHeader(0, len(payload),
                                                props or commands.Basic.Properties()),
                           channel)]
    parts += [frame.marshal(body.ContentBody(payload[i:i + chunk]), channel)
              for i in range(0, len(payload), chunk)]
    return b"".join(parts)


def feed_whole(data: bytes, codec: AmqpConnection) -> list[Any]:
    codec.receive_data(data)
    return codec.drain()


def feed_bytewise(data: bytes, codec: AmqpConnection) -> list[Any]:
    events: list[Any] = []
    for i in range(len(data)):
        codec.receive_data(data[i:i + 1])
        events += codec.drain()
    return events


FEEDERS: list[Callable[[bytes, AmqpConnection], list[Any]]] = [feed_whole, feed_bytewise]


def summary(event: Any) -> tuple[Any, ...]:
    if isinstance(event, MethodReceived):
        return ("method", event.channel, event.method.name)
    if isinstance(event, ContentReceived):
        return ("content", event.channel, event.method.exchange, event.method.routing_key,
                event.properties.content_type, event.body)
    return (type(event).__name__,)


def tr(data: bytes, expected: list[tuple[Any, ...]]) -> None:
    """``data`` gives ``expected`` fed whole and byte by byte; with trailing bytes of a
    next frame, the same events and the trailing frame stays buffered."""
    for feeder in FEEDERS:
        assert [summary(e) for e in feeder(data, AmqpConnection())] == expected, feeder
        codec = AmqpConnection()
        trailing = m(5, commands.Channel.Open())
        events = feeder(data + trailing[:9], codec)
        assert [summary(e) for e in events] == expected
        assert codec.next_event() is NEED_DATA
        codec.receive_data(trailing[9:])
        assert [summary(e) for e in codec.drain()] == [("method", 5, "Channel.Open")]


START_OK = commands.Connection.StartOk(client_properties={"product": "t"}, mechanism="PLAIN",
                                       response="\0u\0p", locale="en_US")


def test_header_and_methods() -> None:
    tr(PROTOCOL_HEADER + m(0, START_OK) + m(1, commands.Channel.Open()),
       [("ProtocolHeaderReceived",), ("method", 0, "Connection.StartOk"),
        ("method", 1, "Channel.Open")])


def test_content_assembled_from_many_body_frames() -> None:
    payload = bytes(range(256)) * 20
    props = commands.Basic.Properties(content_type="text/plain")
    tr(PROTOCOL_HEADER + content(1, payload, props, chunk=777),
       [("ProtocolHeaderReceived",), ("content", 1, "x", "k", "text/plain", payload)])


def test_empty_body_needs_no_body_frame() -> None:
    tr(PROTOCOL_HEADER + content(3, b""), [("ProtocolHeaderReceived",),
                                            ("content", 3, "x", "k", None, b"")])


def test_interleaved_channels_and_heartbeats() -> None:
    a = content(1, b"one" * 500, chunk=100)
    b = content(2, b"two", exchange="y")
    # frames of channel 2 and a heartbeat between channel 1's body frames
    split = len(m(1, commands.Basic.Publish(exchange="x", routing_key="k"))) + 30
    data = PROTOCOL_HEADER + a[:split]
    tr(PROTOCOL_HEADER + a + heartbeat.Heartbeat.marshal() + b,
       [("ProtocolHeaderReceived",), ("content", 1, "x", "k", None, b"one" * 500),
        ("HeartbeatReceived",), ("content", 2, "y", "k", None, b"two")])
    assert data  # the split above is only for readability of the case


def test_heartbeat_event() -> None:
    tr(PROTOCOL_HEADER + heartbeat.Heartbeat.marshal(),
       [("ProtocolHeaderReceived",), ("HeartbeatReceived",)])


def error_of(data: bytes, make: Callable[[], AmqpConnection] = AmqpConnection
             ) -> AmqpProtocolError:
    """The error ``data`` raises, of the same kind and code fed whole and byte by byte
    (fed byte by byte, a wrong header is refused at its first wrong byte)."""
    found = []
    for feeder in FEEDERS:
        made = make()
        with pytest.raises(AmqpProtocolError) as caught:
            feeder(data, made)
            made.next_event()
        assert made.state is CodecState.ERROR
        with pytest.raises(AmqpProtocolError):  # and stays so
            made.next_event()
        found.append((type(caught.value), caught.value.reply_code))
    assert found[0] == found[1]
    return caught.value


@pytest.mark.parametrize("data", [b"GET / HTTP/1.1\r\n", b"AMQP\x00\x00\x08\x00",
                                  b"AMQP\x01\x01\x00\x0a", b"\x16\x03\x01"])
def test_wrong_protocol_header(data: bytes) -> None:
    error = error_of(data)
    assert isinstance(error, ProtocolHeaderMismatch)
    assert error.text.startswith("expected the AMQP 0-9-1 protocol header")


def test_garbage_is_refused_at_its_first_byte() -> None:
    codec = AmqpConnection()
    codec.receive_data(b"X")
    with pytest.raises(ProtocolHeaderMismatch):
        codec.next_event()


def test_frame_above_frame_max_is_501_before_its_payload_arrives() -> None:
    codec = AmqpConnection(frame_max=FRAME_MIN_SIZE)
    big = content(1, b"z" * 5000, chunk=5000)
    codec.receive_data(PROTOCOL_HEADER)
    assert isinstance(codec.next_event(), ProtocolHeaderReceived)
    # only the body frame's 7-byte head is needed to refuse it
    head_end = len(big) - 5000 - 1
    codec.receive_data(big[:head_end])
    with pytest.raises(AmqpProtocolError) as caught:
        codec.drain()
        codec.next_event()
    assert caught.value.reply_code is ReplyCode.FRAME_ERROR
    assert caught.value.text == f"frame of 5008 bytes exceeds frame_max {FRAME_MIN_SIZE}"


def test_set_frame_max() -> None:
    codec = AmqpConnection()
    codec.set_frame_max(0)
    assert codec.frame_max == 131072
    codec.set_frame_max(8192)
    assert codec.frame_max == 8192
    with pytest.raises(LocalProtocolError):
        codec.set_frame_max(100)
    with pytest.raises(LocalProtocolError):
        AmqpConnection(frame_max=100)


@pytest.mark.parametrize(("data", "code", "text"), [
    (b"\x09\x00\x00", ReplyCode.FRAME_ERROR, "unknown frame type 9"),
    (m(1, commands.Channel.Open())[:-1] + b"\x00", ReplyCode.FRAME_ERROR,
     "frame end octet is 0x00, not 0xce"),
    (b"\x01\x00\x01\x00\x00\x00\x04\xff\xff\xff\xff\xce", ReplyCode.SYNTAX_ERROR, None),
    (frame.marshal(body.ContentBody(b"orphan"), 1), ReplyCode.UNEXPECTED_FRAME,
     "content body on channel 1 without a content header before it"),
    (frame.marshal(header.ContentHeader(0, 3, commands.Basic.Properties()), 1),
     ReplyCode.UNEXPECTED_FRAME,
     "content header on channel 1 without a content-bearing method before it"),
    (m(1, commands.Basic.Publish()) + m(1, commands.Channel.Close(200, "bye", 0, 0)),
     ReplyCode.UNEXPECTED_FRAME,
     "method Channel.Close on channel 1 while its content was still arriving"),
    (m(1, commands.Basic.Publish()) + frame.marshal(
        header.ContentHeader(0, 2, commands.Basic.Properties()), 1) +
     frame.marshal(body.ContentBody(b"abc"), 1), ReplyCode.FRAME_ERROR,
     "content body on channel 1 is longer than the 2 bytes its header announced"),
    (m(0, commands.Connection.Start()), ReplyCode.COMMAND_INVALID,
     "Connection.Start is a method only a server sends"),
    (b"\x08\x00\x02\x00\x00\x00\x00\xce", ReplyCode.COMMAND_INVALID,
     "heartbeat frame on channel 2, not 0"),
    (PROTOCOL_HEADER, ReplyCode.UNEXPECTED_FRAME, "a second protocol header"),
])
def test_protocol_errors(data: bytes, code: ReplyCode, text: str | None) -> None:
    error = error_of(PROTOCOL_HEADER + data)
    assert error.reply_code is code
    if text is not None:
        assert error.text == text
    else:
        assert error.text.startswith("malformed frame")


def test_body_above_max_body_size() -> None:
    error = error_of(PROTOCOL_HEADER + content(1, b"y" * 11),
                     lambda: AmqpConnection(max_body_size=10))
    assert (error.reply_code, error.text) == (
        ReplyCode.FRAME_ERROR, "message body of 11 bytes exceeds the limit of 10")


def test_error_after_valid_events_is_raised_by_the_next_drain() -> None:
    codec = AmqpConnection()
    codec.receive_data(PROTOCOL_HEADER + m(1, commands.Channel.Open()) + b"\x09")
    assert len(codec.drain()) == 2
    with pytest.raises(AmqpProtocolError):
        codec.drain()


def test_forget_channel_drops_half_a_content() -> None:
    codec = AmqpConnection()
    codec.receive_data(PROTOCOL_HEADER + m(1, commands.Basic.Publish()))
    codec.drain()
    codec.forget_channel(1)
    codec.receive_data(m(1, commands.Channel.Close(200, "bye", 0, 0)))
    assert [summary(e) for e in codec.drain()] == [("method", 1, "Channel.Close")]


def test_send_content_splits_bodies_by_frame_max() -> None:
    server = AmqpConnection(frame_max=FRAME_MIN_SIZE)
    payload = b"q" * 10_000
    data = server.send_content(1, commands.Basic.Deliver("c", 1, False, "", "q"),
                               commands.Basic.Properties(app_id="a"), payload)
    frames = []
    while data:
        used, _channel, value = frame.unmarshal(data)
        assert used <= FRAME_MIN_SIZE
        frames.append(value)
        data = data[used:]
    assert frames[0].name == "Basic.Deliver"
    assert frames[1].body_size == 10_000 and frames[1].properties.app_id == "a"
    assert b"".join(f.value for f in frames[2:]) == payload
    assert len(frames) == 2 + 3  # 4088 + 4088 + 1824
    assert AmqpConnection.send_heartbeat() == heartbeat.Heartbeat.marshal()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_give_events_or_a_protocol_error(data: bytes) -> None:
    """Random bytes after the header: events or AmqpProtocolError, nothing else."""
    codec = AmqpConnection(frame_max=FRAME_MIN_SIZE, max_body_size=1000)
    codec.receive_data(PROTOCOL_HEADER + data)
    try:
        while codec.drain():
            pass
    except AmqpProtocolError as exc:
        assert isinstance(exc.reply_code, ReplyCode)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 2000))
def test_mutated_valid_stream(noise: bytes, at: int) -> None:
    """A valid stream with bytes overwritten somewhere: the same contract."""
    valid = PROTOCOL_HEADER + m(0, START_OK) + m(1, commands.Channel.Open()) + \
        content(1, b"p" * 1500, chunk=500)
    at %= len(valid)
    data = valid[:at] + noise + valid[at + len(noise):]
    codec = AmqpConnection()
    codec.receive_data(data)
    try:
        while codec.drain():
            pass
    except AmqpProtocolError:
        pass


def unchecked(cls: Any, **values: Any) -> Any:
    """A pamqp method with values its constructor's validate() would refuse."""
    method = cls()
    for key, value in values.items():
        setattr(method, key, value)
    return method


@pytest.mark.parametrize("method", [
    unchecked(commands.Queue.DeclareOk, queue="orders$eu é", message_count=3,
              consumer_count=1),
    unchecked(commands.Basic.Deliver, consumer_tag="ctag", delivery_tag=7, redelivered=True,
              exchange="x" * 200, routing_key="key"),
    unchecked(commands.Basic.Return, reply_code=312, reply_text="NO_ROUTE",
              exchange="weird exchange!", routing_key="k"),
    unchecked(commands.Basic.GetOk, delivery_tag=1, redelivered=False, exchange="ex%",
              routing_key="rk", message_count=0),
    commands.Queue.Declare(queue="q", passive=True, durable=True, exclusive=False,
                           auto_delete=True, nowait=False),
    commands.Basic.Consume(queue="q", consumer_tag="t", no_local=True, no_ack=False,
                           exclusive=True, nowait=True, arguments={"a": 1}),
])
def test_names_pamqp_would_refuse_are_still_written(method: Any) -> None:
    """pamqp refuses to marshal names outside the spec's pattern; the codec writes
    them anyway (another protocol may have named the queue) and they decode back;
    bit fields pack as pamqp packs them."""
    data = AmqpConnection().send_method(1, method)
    _, channel, value = frame.unmarshal(data)
    assert (channel, value.name) == (1, method.name)
    for slot in method.__slots__:
        assert getattr(value, slot) == getattr(method, slot), slot
    from txbroker.protocol.amqp.hot import method_payload as _method_payload

    try:
        expected = frame.marshal(method, 1)
    except ValueError:
        return
    assert data == expected
    assert _method_payload(method) == expected[7:-1]
