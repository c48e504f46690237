"""A channel's publishing methods: ``basic.publish`` and publisher confirms.

Each function takes the :class:`~txbroker.server.edges.amqp.channel.Channel` the
method came on, as ``consuming.py`` and ``declares.py`` do.

Theory of operation
-------------------
A publish is one core send per queue its exchange routes it to. On a channel in
confirm mode (``confirm.select``) it gets the channel's next sequence number, and
its confirm is an entry of the channel's output queue that waits for the core's
answers to those sends: ``basic.ack`` once every queue has it durably,
``basic.nack`` if one refused it. The output queue renders confirms in sequence
order; an ack is then gathered (:func:`confirm`) rather than written, and the
connection writes the gathered acks of a channel (:func:`take_confirms`) before
any other bytes and at the end of its loop turn: the acks that became ready
together go out as one ``basic.ack`` with ``multiple`` (as RabbitMQ coalesces
them), and the order of everything on the wire is otherwise what it would be with
one ack per publish.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from pamqp import commands

from txbroker.errors import BrokerError, Forbidden, QuotaExceeded
from txbroker.protocol.amqp import ReplyCode
from txbroker.server.edges.amqp.channel import (
    Channel,
    ChannelState,
    Pending,
    as_channel_error,
)
from txbroker.server.edges.amqp.content import (
    DEFAULT_PRIORITY,
    PERSISTENT,
    message_headers,
    ttl_of,
)
from txbroker.server.edges.amqp.model import ChannelError
from txbroker.server.edges.amqp.state import INTERNAL_PREFIX

__all__ = ["MAX_PRIORITY", "PUBLISHING_METHODS", "confirm", "emit_confirm", "publish",
           "take_confirms"]

#: txbroker's highest message priority (core/messages.py: 0-9, as JMS).
MAX_PRIORITY: Final = 9


def publish(channel: Channel, m: Any, properties: commands.Basic.Properties, body: bytes,
            now: int, raw: bytes = b"") -> None:
    """basic.publish with its content (``raw``: its properties as they came, if
    known): one core send per queue it is routed to."""
    if m.immediate:
        raise ChannelError(ReplyCode.NOT_IMPLEMENTED,
                           "NOT_IMPLEMENTED - immediate=true", hard=True)
    session = channel.session
    core = session.core
    queues = channel.conn.state.definitions.route(m.exchange, m.routing_key,
                                               properties.headers, core.queues)
    if queues and queues[0].startswith(INTERNAL_PREFIX):  # only the default exchange
        raise ChannelError(ReplyCode.ACCESS_REFUSED,  # routes to it (nothing binds it)
                           f"ACCESS_REFUSED - queue '{queues[0]}' is the broker's own")
    seq = 0
    if channel.confirming:
        seq = channel.next_confirm
        channel.next_confirm += 1
    if not queues:
        if m.mandatory:
            channel.emit(channel.conn.codec.send_content(
                channel.number, commands.Basic.Return(312, "NO_ROUTE", m.exchange,
                                                   m.routing_key), properties, body))
        if seq:
            emit_confirm(channel, seq)
        return
    headers = message_headers(m.exchange, m.routing_key, properties,
                              channel.conn.texts.text(raw, properties) if raw else None)
    ttl = ttl_of(properties)
    persistent = properties.delivery_mode == PERSISTENT
    rids: list[int] = []
    refused: BrokerError | None = None
    for queue in queues:
        priority = DEFAULT_PRIORITY
        flags = channel.conn.state.definitions.queues.get(queue)
        highest = flags.arguments.get("x-max-priority") if flags is not None else None
        if isinstance(highest, int) and highest > 0:  # above it counts as it (RabbitMQ)
            priority = min(int(properties.priority or 0), highest, MAX_PRIORITY)
        rid = channel.conn.new_rid()
        try:
            result = session.send(rid, queue, body, now, headers=headers,
                                  persistent=persistent, priority=priority, ttl_ms=ttl,
                                  tx=channel.tx)
        except BrokerError as exc:
            if isinstance(exc, Forbidden) or (not seq and not isinstance(exc, QuotaExceeded)):
                raise as_channel_error(exc) from None
            refused = exc  # reject-publish: nacked with confirms, dropped without
            continue
        if session.started(rid, result):
            rids.append(rid)
    channel.publishing.update(rids)
    if seq:
        if refused is not None:
            channel.later(rids, lambda p: confirm(channel, seq, False))
        else:
            channel.later(rids, lambda p: confirm(channel, seq, p.error is None))
    elif rids:
        channel.later(rids, _ignore_errors)

def emit_confirm(channel: Channel, seq: int) -> None:
    """basic.ack of publish ``seq``, in order after what is pending."""
    if channel.out:
        channel.out.append(Pending(0, lambda _: confirm(channel, seq, True)))
    elif channel.state is ChannelState.OPEN:
        confirm(channel, seq, True)

def confirm(channel: Channel, seq: int, ok: bool) -> None:
    """Publish ``seq`` is confirmed (``ok``: basic.ack) or refused (basic.nack).

    Confirms come in sequence order (the output queue's). An ack is not written
    at once: the acks that become ready before the connection writes anything
    else go out as one ``basic.ack`` with ``multiple`` (RabbitMQ does the same;
    spec 1.8.3.13: it confirms every publish up to ``seq``). A nack writes the
    acks gathered before it first."""
    if ok:
        if channel.confirm_upto <= channel.confirmed:
            channel.conn.confirm_later(channel)
        channel.confirm_upto = seq
        return
    channel.conn.write(channel.conn.codec.send_method(channel.number, commands.Basic.Nack(seq)))
    channel.confirmed = channel.confirm_upto = seq

def take_confirms(channel: Channel) -> bytes:
    """The one ``basic.ack`` of the confirms gathered since the last (single, or
    ``multiple`` when it covers several publishes); b"" if none."""
    upto = channel.confirm_upto
    if upto <= channel.confirmed:
        return b""
    multiple = upto - channel.confirmed > 1
    channel.confirmed = upto
    return channel.conn.codec.send_ack(channel.number, upto, multiple)

def confirm_select(channel: Channel, m: Any, now: int) -> None:
    """confirm.select: the channel's publishes are confirmed from now on (not in tx mode)."""
    if channel.tx is not None:
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           "PRECONDITION_FAILED - cannot switch from tx to confirm mode")
    channel.confirming = True
    if not m.nowait:
        channel.send(commands.Confirm.SelectOk())


def _ignore_errors(pending: Pending) -> None:
    """A publish without confirms: a later refusal is the broker's log's business."""


#: The methods of this module, by pamqp name (basic.publish comes with its content:
#: ``connection.py`` calls :func:`publish`).
PUBLISHING_METHODS: Final[dict[str, Callable[[Channel, Any, int], None]]] = {
    "Confirm.Select": confirm_select,
}
