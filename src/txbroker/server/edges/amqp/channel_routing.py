"""Routing the methods of channels 1..channel_max: channel.open and close, the
table of channel methods, and channel errors (docs/amqp.md).

Theory of operation
-------------------
The connection (``connection.py``) hands every method of a channel other than 0
to :func:`channel_method`. channel.open makes a :class:`Channel` (504 if the
number is taken, 530 above the negotiated ``channel_max``); channel.close
releases it; any other method runs the handler of :data:`METHODS` for the open
channel it names (:func:`named_channel`: 504 if none). :func:`guard` runs a
handler: a refusal (``ChannelError`` or a core ``BrokerError``) closes the channel
with its reply code (:func:`channel_error`), or the whole connection when the
error is ``hard``. Until the client's channel.close-ok, a closing channel drops
everything but close and close-ok (spec 2.3.5).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Final

from pamqp import commands

from txbroker.errors import BrokerError
from txbroker.protocol.amqp import AmqpProtocolError, ReplyCode
from txbroker.server.edges.amqp.channel import (
    CHANNEL_METHODS,
    Channel,
    ChannelState,
    as_channel_error,
)
from txbroker.server.edges.amqp.consuming import CONSUMING_METHODS, flush_acks
from txbroker.server.edges.amqp.declares import DECLARE_METHODS
from txbroker.server.edges.amqp.handshake import Phase
from txbroker.server.edges.amqp.model import ChannelError
from txbroker.server.edges.amqp.publishing import PUBLISHING_METHODS

if TYPE_CHECKING:
    from txbroker.server.edges.amqp.connection import AmqpServerConnection

log = logging.getLogger("txbroker.amqp")

__all__ = ["METHODS", "channel_error", "channel_method", "drop_channel", "guard",
           "named_channel"]

#: Every channel method we run, by pamqp name (anything else: 540 NOT_IMPLEMENTED).
METHODS: Final = {**CHANNEL_METHODS, **PUBLISHING_METHODS, **CONSUMING_METHODS,
                  **DECLARE_METHODS}


def channel_method(conn: AmqpServerConnection, number: int, method: Any, now: int) -> None:
    """Run a method of channel ``number`` (not 0) of ``conn``."""
    if conn.phase is Phase.CLOSING:
        return
    if conn.phase is not Phase.OPEN:
        raise AmqpProtocolError(ReplyCode.UNEXPECTED_FRAME,
                                f"{method.name} on channel {number} before "
                                "connection.open", channel=number)
    name = method.name
    if name.startswith("Connection."):
        raise AmqpProtocolError(ReplyCode.COMMAND_INVALID,
                                f"{name} on channel {number}, not 0", channel=number)
    if name == "Channel.Open":
        if number in conn.channels:
            raise AmqpProtocolError(ReplyCode.CHANNEL_ERROR,
                                    f"second 'channel.open' seen on channel {number}",
                                    channel=number)
        if number > conn.channel_max:
            raise AmqpProtocolError(ReplyCode.NOT_ALLOWED,
                                    f"channel {number} is above the negotiated "
                                    f"channel_max {conn.channel_max}", channel=number)
        conn.channels[number] = Channel(conn, number)
        conn.write(conn.codec.send_method(number, commands.Channel.OpenOk()))
        return
    channel = named_channel(conn, number, method)
    if channel is None:
        return
    if name == "Channel.Close":
        drop_channel(conn, channel, now)
        conn.write(conn.codec.send_method(number, commands.Channel.CloseOk()))
        return
    if name == "Channel.CloseOk":
        if channel.state is ChannelState.CLOSING:
            conn.channels.pop(number, None)
        return
    if channel.state is not ChannelState.OPEN:
        return
    handler = METHODS.get(name)
    if handler is None:
        raise AmqpProtocolError(ReplyCode.NOT_IMPLEMENTED,
                                f"{name} is not supported by txbroker (docs/amqp.md)",
                                channel=number, class_id=method.index >> 16,
                                method_id=method.index & 0xFFFF)
    guard(conn, channel, lambda: handler(channel, method, now), method)


def named_channel(conn: AmqpServerConnection, number: int, method: Any) -> Channel | None:
    """The open channel a frame names (504 if none)."""
    channel = conn.channels.get(number)
    if channel is None:
        raise AmqpProtocolError(ReplyCode.CHANNEL_ERROR,
                                f"expected 'channel.open' on channel {number} before "
                                f"{method.name}", channel=number)
    if channel.state is ChannelState.CLOSING and method.name not in (
            "Channel.Close", "Channel.CloseOk"):
        return None
    return channel


def guard(conn: AmqpServerConnection, channel: Channel, run: Any, method: Any) -> None:
    """Run a channel's method; a refusal closes the channel (or the connection)."""
    try:
        run()
    except ChannelError as exc:
        channel_error(conn, channel, exc, method)
    except BrokerError as exc:
        channel_error(conn, channel, as_channel_error(exc), method)


def channel_error(conn: AmqpServerConnection, channel: Channel, error: ChannelError,
                  method: Any) -> None:
    """channel.close with the error's reply code (a ``hard`` error: connection.close)."""
    class_id = method.index >> 16 if method is not None else 0
    method_id = method.index & 0xFFFF if method is not None else 0
    if error.hard:
        raise AmqpProtocolError(error.reply_code, error.text.split(" - ", 1)[-1],
                                channel=channel.number, class_id=class_id,
                                method_id=method_id)
    log.info("AMQP channel %d of %s closed: %s", channel.number, conn.peer, error.text)
    drop_channel(conn, channel, conn.ops.now())
    channel.state = ChannelState.CLOSING
    conn.channels[channel.number] = channel
    conn.codec.forget_channel(channel.number)
    conn.write(conn.codec.send_method(channel.number, commands.Channel.Close(
        int(error.reply_code), error.text[:255], class_id, method_id)))


def drop_channel(conn: AmqpServerConnection, channel: Channel, now: int) -> None:
    """Release ``channel`` (its consumers end, its unacked messages go back) and
    forget it and the answers it waited for. The acks it read before count, as if
    each had been its own operation (a refusal of one of them is not told: the
    channel closes anyway)."""
    if channel.staged_acks:
        with contextlib.suppress(ChannelError, BrokerError):
            flush_acks(channel, now)
    for consumer in channel.consumers.values():
        conn.queues_consumed.add(consumer.queue)
    channel.release(now, session_alive=True)
    conn.channels.pop(channel.number, None)
    for rid in [r for r, owners in conn.rids.items() if owners[0][0] is channel]:
        del conn.rids[rid]
