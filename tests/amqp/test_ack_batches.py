"""basic.acks that arrive together are acknowledged by one core operation
(``consuming.flush_acks``), with the outcome of acknowledging them one by one: the
acks before a refused one count, what comes after it on the closed channel is
ignored, and its other unacked messages go back to the queue. Frames by hand, in
one write, so that they arrive in one read."""

from __future__ import annotations

import uuid

from pamqp import body, commands, frame, header

from tests.amqp.support import AmqpBroker, RawAmqp


def _publish(queue: str, text: bytes) -> bytes:
    return (frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
            + frame.marshal(header.ContentHeader(0, len(text), commands.Basic.Properties(
                delivery_mode=2)), 1)
            + frame.marshal(body.ContentBody(text), 1))


def _deliveries(raw: RawAmqp, count: int) -> list[tuple[int, bytes]]:
    """(delivery tag, body) of the next ``count`` deliveries."""
    found: list[tuple[int, bytes]] = []
    tag = 0
    while len(found) < count:
        got = raw.read()
        assert got is not None
        value = got[1]
        if getattr(value, "name", None) == "Basic.Deliver":
            tag = value.delivery_tag
        elif isinstance(value, body.ContentBody):
            found.append((tag, bytes(value.value)))
    return found


def test_acks_of_one_read_before_a_refused_one_count(amqp_broker: AmqpBroker) -> None:
    queue = f"ab-{uuid.uuid4().hex[:10]}"
    raw = RawAmqp(amqp_broker.amqp_port)
    try:
        raw.handshake()
        raw.expect("Connection.OpenOk")
        raw.method(1, commands.Channel.Open())
        raw.expect("Channel.OpenOk")
        raw.method(1, commands.Queue.Declare(queue=queue, durable=True))
        raw.expect("Queue.DeclareOk")
        raw.send(b"".join(_publish(queue, b"m%d" % i) for i in range(6)))
        raw.method(1, commands.Basic.Consume(queue=queue, consumer_tag="c"))
        raw.expect("Basic.ConsumeOk")
        got = _deliveries(raw, 6)
        assert [b for _, b in got] == [b"m%d" % i for i in range(6)]
        tags = [t for t, _ in got]
        acks = [commands.Basic.Ack(tags[0]), commands.Basic.Ack(tags[1]),
                commands.Basic.Ack(tags[2], multiple=True), commands.Basic.Ack(999),
                commands.Basic.Ack(tags[3])]  # (after the refusal: the channel is closing)
        raw.send(b"".join(frame.marshal(ack, 1) for ack in acks))
        close = raw.expect("Channel.Close")
        assert (close.reply_code, close.reply_text) == \
            (406, "PRECONDITION_FAILED - unknown delivery tag 999")
        raw.method(1, commands.Channel.CloseOk())
        raw.method(2, commands.Channel.Open())
        raw.expect("Channel.OpenOk")
        raw.method(2, commands.Queue.Declare(queue=queue, passive=True))
        assert raw.expect("Queue.DeclareOk").message_count == 3
        bodies = []
        for _ in range(3):
            raw.method(2, commands.Basic.Get(queue=queue, no_ack=True))
            get_ok = raw.expect("Basic.GetOk")
            assert get_ok.redelivered
            bodies.append(_deliveries_of_get(raw))
        assert bodies == [b"m3", b"m4", b"m5"]
    finally:
        raw.close()


def _deliveries_of_get(raw: RawAmqp) -> bytes:
    while True:
        got = raw.read()
        assert got is not None
        if isinstance(got[1], body.ContentBody):
            return bytes(got[1].value)


def test_confirms_of_one_read_say_each_publishs_outcome(amqp_broker: AmqpBroker) -> None:
    """Publishes of one write to a queue that takes 2 (``reject-publish``): whether
    the acks come single or ``multiple``, publishes 1-2 are acked, 3-5 nacked, 6-7
    (to another queue) acked, each exactly once, in sequence order."""
    full = f"ab-{uuid.uuid4().hex[:10]}"
    other = f"ab-{uuid.uuid4().hex[:10]}"
    raw = RawAmqp(amqp_broker.amqp_port)
    try:
        raw.handshake()
        raw.expect("Connection.OpenOk")
        raw.method(1, commands.Channel.Open())
        raw.expect("Channel.OpenOk")
        raw.method(1, commands.Queue.Declare(queue=full, durable=True, arguments={
            "x-max-length": 2, "x-overflow": "reject-publish"}))
        raw.expect("Queue.DeclareOk")
        raw.method(1, commands.Queue.Declare(queue=other, durable=True))
        raw.expect("Queue.DeclareOk")
        raw.method(1, commands.Confirm.Select())
        raw.expect("Confirm.SelectOk")
        raw.send(b"".join(_publish(full, b"f%d" % i) for i in range(5))
                 + _publish(other, b"o1") + _publish(other, b"o2"))
        outcome: dict[int, str] = {}
        while len(outcome) < 7:
            got = raw.read()
            assert got is not None
            value = got[1]
            if value.name not in ("Basic.Ack", "Basic.Nack"):
                continue
            seqs = range(max(outcome, default=0) + 1, value.delivery_tag + 1) \
                if value.multiple else [value.delivery_tag]
            for seq in seqs:
                assert seq not in outcome and seq == max(outcome, default=0) + 1
                outcome[seq] = value.name
        assert outcome == {1: "Basic.Ack", 2: "Basic.Ack", 3: "Basic.Nack", 4: "Basic.Nack",
                           5: "Basic.Nack", 6: "Basic.Ack", 7: "Basic.Ack"}
    finally:
        raw.close()
