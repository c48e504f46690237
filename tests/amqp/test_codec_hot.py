"""The hand-read and hand-written per-message frames (``protocol/amqp/hot.py``) against
pamqp, byte for byte; the codec fed them whole, one byte at a time and with trailing
bytes; the properties' conversions kept per connection (``content.PropertyTexts``);
and publisher confirms gathered into ``multiple`` acks (``publishing.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import body, commands, frame, header

from tests.amqp.test_codec import FEEDERS, m, tr
from txbroker.core.messages import Message
from txbroker.protocol.amqp import (
    PROTOCOL_HEADER,
    AmqpConnection,
    AmqpProtocolError,
    ContentReceived,
    MethodReceived,
    ProtocolHeaderReceived,
    ReplyCode,
)
from txbroker.protocol.amqp.hot import (
    PROPERTIES_CACHE_SIZE,
    PropertiesCache,
    ack_frame,
    method_payload,
    read_ack,
    read_publish,
)
from txbroker.server.edges.amqp.channel import Channel
from txbroker.server.edges.amqp.content import (
    PROPERTIES_HEADER,
    PropertyTexts,
    decode_properties,
    delivery_wire,
    encode_properties,
    message_headers,
)
from txbroker.server.edges.amqp.publishing import confirm, take_confirms

NAMES = st.text(max_size=40) | st.text(alphabet="abc.-_:", max_size=127)


def payload_of(method: Any) -> bytes:
    return frame.marshal(method, 1)[7:-1]


def pamqp_method(payload: bytes) -> Any:
    whole = frame.marshal(commands.Basic.Qos(), 1)[:3] + len(payload).to_bytes(4, "big") \
        + payload + b"\xce"
    return frame.unmarshal(whole)[2]


def same_method(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    for name in theirs.__slots__:
        assert getattr(ours, name) == getattr(theirs, name), name
        assert type(getattr(ours, name)) is type(getattr(theirs, name)), name


# ---------------------------------------------------------------------- reading


@settings(max_examples=200, deadline=None)
@given(NAMES, NAMES, st.booleans(), st.booleans())
def test_publish_is_read_as_pamqp_reads_it(exchange: str, key: str, mandatory: bool,
                                          immediate: bool) -> None:
    method = commands.Basic.Publish.__new__(commands.Basic.Publish)
    method.ticket, method.exchange, method.routing_key = 0, exchange, key
    method.mandatory, method.immediate = mandatory, immediate
    payload = method_payload(method)
    if len(exchange.encode()) > 255 or len(key.encode()) > 255:
        return
    ours = read_publish(payload)
    assert ours is not None
    same_method(ours, pamqp_method(payload))


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=8, max_size=8), st.integers(0, 255))
def test_ack_is_read_as_pamqp_reads_it(tag: bytes, bits: int) -> None:
    payload = payload_of(commands.Basic.Ack(1))[:4] + tag + bytes((bits,))
    ours = read_ack(payload)
    assert ours is not None
    same_method(ours, pamqp_method(payload))


def test_shapes_other_than_the_exact_one_are_left_to_pamqp() -> None:
    publish = payload_of(commands.Basic.Publish(exchange="x", routing_key="k"))
    ack = payload_of(commands.Basic.Ack(7))
    assert read_publish(publish + b"\0") is None  # trailing bytes (pamqp ignores them)
    assert read_publish(publish[:-1]) is None  # truncated
    assert read_publish(publish[:6]) is None
    bad_utf8 = publish[:7] + b"\xff" + publish[8:]
    assert read_publish(bad_utf8) is None
    assert read_ack(ack + b"\0") is None
    assert read_ack(ack[:-1]) is None


def test_the_codec_gives_pamqps_outcome_for_odd_shapes() -> None:
    """A publish with trailing bytes is what pamqp makes of it; one whose exchange is
    not UTF-8 is 502, as before."""
    payload = payload_of(commands.Basic.Publish(exchange="x", routing_key="k")) + b"\0\0"
    odd = b"\x01\x00\x01" + len(payload).to_bytes(4, "big") + payload + b"\xce"
    rest = frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1) \
        + frame.marshal(body.ContentBody(b"z"), 1)
    tr(PROTOCOL_HEADER + odd + rest,
       [("ProtocolHeaderReceived",), ("content", 1, "x", "k", None, b"z")])
    bad = payload_of(commands.Basic.Publish(exchange="x", routing_key="k"))
    bad = bad[:7] + b"\xff" + bad[8:]
    codec = AmqpConnection()
    codec.receive_data(PROTOCOL_HEADER + b"\x01\x00\x01" + len(bad).to_bytes(4, "big")
                       + bad + b"\xce")
    assert isinstance(codec.next_event(), ProtocolHeaderReceived)
    with pytest.raises(AmqpProtocolError) as caught:
        codec.next_event()
    assert caught.value.reply_code == ReplyCode.SYNTAX_ERROR


PROPS = [commands.Basic.Properties(),
         commands.Basic.Properties(delivery_mode=2),
         commands.Basic.Properties(content_type="text/plain", delivery_mode=2, priority=3,
                                   correlation_id="c-1", reply_to="r", expiration="1000",
                                   message_id="m", message_type="t", app_id="a",
                                   headers={"n": 1, "s": "v", "t": {"x": True}})]


@pytest.mark.parametrize("props", PROPS)
@pytest.mark.parametrize("size", [0, 1, 5000])
def test_publishes_fed_whole_bytewise_and_with_trailing_bytes(
        props: commands.Basic.Properties, size: int) -> None:
    """Two publishes with the same properties (the second's are the kept ones) and an
    ack: the same events as pamqp's decoding, in every feeding."""
    payload = bytes(range(256)) * (size // 256) + b"q" * (size % 256)
    one = frame.marshal(commands.Basic.Publish(exchange="ex", routing_key="rk",
                                               mandatory=True), 3) \
        + frame.marshal(header.ContentHeader(0, size, props), 3)
    one += b"".join(frame.marshal(body.ContentBody(payload[i:i + 4000]), 3)
                    for i in range(0, size, 4000))
    ack = m(3, commands.Basic.Ack(2**40, multiple=True))
    data = PROTOCOL_HEADER + one + one + ack
    for feeder in FEEDERS:
        codec = AmqpConnection()
        events = feeder(data + m(5, commands.Channel.Open())[:9], codec)[1:]
        assert len(events) == 3
        for event in events[:2]:
            assert isinstance(event, ContentReceived)
            assert event.channel == 3 and event.body == payload
            same_method(event.method, commands.Basic.Publish(exchange="ex", routing_key="rk",
                                                             mandatory=True))
            assert event.properties == props
            assert event.raw_properties == header.ContentHeader(0, size, props).marshal()[12:]
        assert events[0].properties is events[1].properties  # (kept)
        assert isinstance(events[2], MethodReceived)
        same_method(events[2].method, commands.Basic.Ack(2**40, multiple=True))
        assert codec.drain() == []


def test_a_truncated_content_header_is_still_a_syntax_error() -> None:
    codec = AmqpConnection()
    codec.receive_data(PROTOCOL_HEADER + m(1, commands.Basic.Publish(exchange="", routing_key="q"))
                       + b"\x02\x00\x01\x00\x00\x00\x0d" + bytes(13) + b"\xce")
    assert isinstance(codec.next_event(), ProtocolHeaderReceived)
    with pytest.raises(AmqpProtocolError) as caught:
        codec.drain()
    assert caught.value.reply_code == ReplyCode.SYNTAX_ERROR


def test_the_properties_cache_is_bounded() -> None:
    cache = PropertiesCache(size=2)
    one, two, three = (commands.Basic.Properties(priority=p) for p in (1, 2, 3))
    cache.put(b"1", one)
    cache.put(b"2", two)
    assert cache.get(b"1") is one
    cache.put(b"3", three)  # full: starts again
    assert cache.get(b"1") is None and cache.get(b"3") is three
    assert PropertiesCache().size == PROPERTIES_CACHE_SIZE


# ---------------------------------------------------------------------- writing


@pytest.mark.parametrize("channel", [1, 65535])
@pytest.mark.parametrize("tag", [1, 2**63 - 1])
@pytest.mark.parametrize("multiple", [False, True])
def test_ack_frame_is_pamqps(channel: int, tag: int, multiple: bool) -> None:
    assert ack_frame(channel, tag, multiple) == frame.marshal(
        commands.Basic.Ack(tag, multiple), channel)
    assert AmqpConnection.send_ack(channel, tag, multiple) == ack_frame(channel, tag, multiple)


@pytest.mark.parametrize("props", PROPS)
@pytest.mark.parametrize("size", [0, 1, 4096 - 8, 4096 - 7, 3 * 4088 + 5])
@pytest.mark.parametrize("names", [("ctag", "", "q"), ("amq.ctag-é", "ex.1", "ключ"),
                                   ("t", "a" * 127, "k" * 255)])
def test_deliver_is_written_as_send_content_writes_it(
        props: commands.Basic.Properties, size: int, names: tuple[str, str, str]) -> None:
    codec = AmqpConnection(frame_max=4096)
    payload = b"b" * size
    consumer_tag, exchange, key = names
    for redelivered in (False, True):
        ours = codec.send_deliver(7, consumer_tag, 2**33, redelivered, exchange, key,
                                  props.marshal(), payload)
        assert ours == codec.send_content(7, commands.Basic.Deliver(
            consumer_tag, 2**33, redelivered, exchange, key), props, payload)


@pytest.mark.parametrize("exchange", ["a" * 128, "has space?", "x!"])
def test_deliver_names_pamqp_refuses_are_left_to_it(exchange: str) -> None:
    codec = AmqpConnection()
    assert codec.send_deliver(1, "t", 1, False, exchange, "k", b"\0\0", b"") is None
    assert codec.send_deliver(1, "t", 1, False, "", "k" * 256, b"\0\0", b"") is None


# ---------------------------------------------------------------------- properties


@pytest.mark.parametrize("props", PROPS)
def test_property_texts_are_the_conversions(props: commands.Basic.Properties) -> None:
    texts = PropertyTexts()
    raw = props.marshal()
    assert texts.text(raw, props) == encode_properties(props)
    assert texts.text(raw, props) is texts.text(raw, props)
    headers = message_headers("ex", "rk", props, texts.text(raw, props))
    assert headers == message_headers("ex", "rk", props)
    marshalled = texts.marshalled(headers[PROPERTIES_HEADER])
    assert marshalled == decode_properties(headers[PROPERTIES_HEADER]).marshal()
    message = Message(1, "q", 1, message_id="m1", headers=headers)
    assert delivery_wire(message, texts) == (marshalled, "ex", "rk")


def test_a_properties_header_we_did_not_write_is_left_to_delivery_facts() -> None:
    texts = PropertyTexts(size=1)
    message = Message(1, "q", 1, message_id="m1",
                      headers={PROPERTIES_HEADER: "not base64 !"})
    assert delivery_wire(message, texts) is None
    assert delivery_wire(Message(2, "q", 1, message_id="m2"), texts) is None
    assert texts.marshalled(encode_properties(PROPS[1])) == PROPS[1].marshal()  # (bounded)


# ---------------------------------------------------------------------- confirms


class _Port:
    """What ``publishing.confirm`` needs of a connection: a codec, writes, and the
    note that confirms were gathered (the connection takes them before its next bytes)."""

    def __init__(self) -> None:
        self.codec = AmqpConnection()
        self.out: list[bytes] = []
        self.gathered: list[Channel] = []

    def write(self, data: bytes) -> None:
        for channel in self.gathered:
            self.out.append(take_confirms(channel))
        self.gathered.clear()
        self.out.append(data)

    def confirm_later(self, channel: Channel) -> None:
        self.gathered.append(channel)


def decoded(data: list[bytes]) -> list[tuple[str, int, bool]]:
    found = []
    for each in data:
        while each:
            used, _, method = frame.unmarshal(each)
            found.append((method.name, method.delivery_tag, method.multiple))
            each = each[used:]
    return found


def test_acks_ready_together_go_out_as_one_multiple_ack() -> None:
    port = _Port()
    channel = Channel(port, 2)  # type: ignore[arg-type]
    for seq in (1, 2, 3):
        confirm(channel, seq, True)
    assert port.gathered == [channel]  # noted once
    port.write(b"")  # the connection writes: the gathered acks first
    confirm(channel, 4, True)
    confirm(channel, 5, True)
    confirm(channel, 6, False)  # a nack: the acks before it first, then it
    confirm(channel, 7, True)
    port.write(b"")
    assert take_confirms(channel) == b""
    assert decoded(port.out) == [("Basic.Ack", 3, True), ("Basic.Ack", 5, True),
                                 ("Basic.Nack", 6, False), ("Basic.Ack", 7, False)]


# ---------------------------------------------------------------------- fuzzing


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.sampled_from([b"\x00\x3c\x00\x28", b"\x00\x3c\x00\x50"]))
def test_any_payload_the_readers_take_is_read_as_pamqp_reads_it(rest: bytes,
                                                                index: bytes) -> None:
    """Whatever bytes follow the index: the hand readers give up (None), or give
    exactly what pamqp decodes from them."""
    payload = index + rest
    ours = read_publish(payload) if index.endswith(b"\x28") else read_ack(payload)
    if ours is not None:
        same_method(ours, pamqp_method(payload))


def _stream() -> bytes:
    props = commands.Basic.Properties(delivery_mode=2, content_type="t")
    one = m(1, commands.Basic.Publish(exchange="e", routing_key="k")) \
        + frame.marshal(header.ContentHeader(0, 3, props), 1) \
        + frame.marshal(body.ContentBody(b"abc"), 1)
    return PROTOCOL_HEADER + one + one + m(1, commands.Basic.Ack(5))


@settings(max_examples=300, deadline=None)
@given(st.integers(8, len(_stream()) - 1), st.integers(0, 255), st.booleans())
def test_a_corrupted_stream_gives_events_or_a_protocol_error(at: int, byte: int,
                                                             bytewise: bool) -> None:
    """One byte of the per-message frames changed: events, or AmqpProtocolError
    (a clear connection error), never another exception."""
    data = bytearray(_stream())
    data[at] = byte
    codec = AmqpConnection()
    try:
        FEEDERS[1 if bytewise else 0](bytes(data), codec)
        codec.drain()
    except AmqpProtocolError as exc:
        assert exc.reply_code in set(ReplyCode)
