"""The AMQP 0-9-1 listener's connections (docs/amqp.md).

Theory of operation
-------------------
The edge loop is thin, like the STOMP one (``server/edges/stomp/connection.py``):
``data_received`` hands bytes to the sans-IO codec (``protocol/amqp/``); each
event is a step of the connection's handshake or a method
of a channel (``server/edges/amqp/channel.py``), which turns it into operations of the
connection's session (``server/ops/operations.py``). The server's effect runner hands back
what comes later (answers once durable, deliveries) through the
``SessionSink`` methods below. This module owns what needs a socket or a clock:
writing, pausing, the heartbeat and handshake timers.

The handshake is one table of (phase, method) -> next phase, ``TRANSITIONS`` in
``server/edges/amqp/handshake.py`` (with what we offer and the SASL responses we read).

Errors: a connection error (bad framing, a method out of order, a refused login,
``hard`` channel errors) is ``connection.close`` with its reply code; the socket
closes when the client answers ``close-ok`` (or after :data:`CLOSE_WAIT_S`). A
channel error is ``channel.close`` on that channel; the connection goes on. The
core rolls back a closed connection's transactions and redelivers its unacked
messages (``Session.end``); stored data is never touched by bad input.

Back-pressure: as every edge, reading pauses while too many of the session's
requests wait for the store (``Session.should_pause``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Final, cast

from pamqp import commands

from txbroker._version import __version__
from txbroker.errors import BrokerError, TxBrokerError
from txbroker.protocol.amqp import (
    FRAME_MIN_SIZE,
    PROTOCOL_HEADER,
    AmqpConnection,
    AmqpProtocolError,
    ContentReceived,
    HeartbeatReceived,
    MethodReceived,
    ProtocolHeaderMismatch,
    ProtocolHeaderReceived,
    ReplyCode,
)
from txbroker.server.edges.amqp.channel import (
    CHANNEL_METHODS,
    Channel,
    ChannelState,
    Pending,
    as_channel_error,
)
from txbroker.server.edges.amqp.consuming import CONSUMING_METHODS
from txbroker.server.edges.amqp.declares import DECLARE_METHODS
from txbroker.server.edges.amqp.handshake import (
    CLOSE_WAIT_S,
    DEFAULT_AMQP_PORT,
    MECHANISMS,
    TRANSITIONS,
    AmqpSettings,
    Phase,
    credentials,
)
from txbroker.server.edges.amqp.model import ChannelError
from txbroker.server.edges.amqp.state import AmqpState
from txbroker.server.ops import Delivery, Operations, Session

log = logging.getLogger("txbroker.amqp")

#: connection.blocked's reason: the session's requests waiting for the store are above
#: ``max_pending_requests``; reading resumes (connection.unblocked) at half of it.
BLOCKED_REASON: Final = "too many publishes waiting for the store (max_pending_requests)"

__all__ = ["DEFAULT_AMQP_PORT", "METHODS", "AmqpServerConnection", "AmqpSettings"]

#: Every channel method we run, by pamqp name (anything else: 540 NOT_IMPLEMENTED).
METHODS: Final = {**CHANNEL_METHODS, **CONSUMING_METHODS, **DECLARE_METHODS}

class AmqpServerConnection(asyncio.Protocol):
    """asyncio protocol for one AMQP client; a ``SessionSink`` of the operation layer."""

    def __init__(self, ops: Operations, state: AmqpState,
                 settings: AmqpSettings | None = None) -> None:
        self.ops = ops
        self.state = state
        self.settings = settings or AmqpSettings()
        self.codec = AmqpConnection(frame_max=self.settings.frame_max,
                                    max_body_size=ops.broker.limits.max_message_size)
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.phase = Phase.AWAIT_HEADER
        self.peer = "?"
        self.channels: dict[int, Channel] = {}
        self.channel_max = self.settings.channel_max
        self.heartbeat_s = 0
        self._out: list[bytes] = []
        self._flush_soon = False
        self._refusal: BrokerError | None = None
        #: request id -> the (channel, pending output) waiting for its answer
        self._rids: dict[int, list[tuple[Channel, Pending]]] = {}
        self._subs: dict[int, Channel] = {}
        self._queues_consumed: set[str] = set()
        self._auto_tags: list[int] = []
        self._auto_scheduled = False
        self._write_paused = False
        #: the client said it understands connection.blocked (its capabilities)
        self._blocked_capable = False
        self._next_rid = 1
        self._next_sub = 1
        self.last_read = self.last_write = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------- asyncio side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection (a refusal is told after the protocol header)."""
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        try:
            self.session = self.ops.open(self, peer[0] if peer else None, protocol="amqp",
                                         address=self.peer if peer else None)
            self.session.channels = self.describe_channels
        except BrokerError as exc:
            self._refusal = exc
        self._timer = self.loop.call_later(self.settings.handshake_timeout_s,
                                           self._handshake_timeout)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived, run each event, write the replies."""
        if self.phase is Phase.CLOSED:
            return
        self.last_read = self.loop.time()
        self.codec.receive_data(data)
        now = self.ops.now()
        try:
            while not self._closed():
                events = self.codec.drain()
                if not events:
                    break
                for event in events:
                    self._event(event, now)
                    if self._closed():
                        break
        except ProtocolHeaderMismatch:
            self.write(PROTOCOL_HEADER)  # spec 4.2.2: our header, then close
            self._shut()
        except AmqpProtocolError as exc:
            self._close_connection(exc.reply_code, f"{exc.reply_code.name} - {exc.text}",
                                   exc.class_id, exc.method_id)
        except TxBrokerError as exc:  # pragma: no cover - a core bug, not the client's
            log.exception("unexpected error on AMQP connection %s", self.peer)
            self._close_connection(ReplyCode.INTERNAL_ERROR, f"INTERNAL_ERROR - {exc}")
        self.after_read()

    def _closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def after_read(self) -> None:
        """Run the core's effects, write, and stop reading if too much is pending."""
        self.ops.run_effects()
        self.flush()
        session = self.session
        if session is not None and session.should_pause() and self.transport is not None \
                and self.phase is not Phase.CLOSED:
            self.transport.pause_reading()
            if self._blocked_capable:  # tell the client why its publishes wait
                self.write(self.codec.send_method(0, commands.Connection.Blocked(
                    BLOCKED_REASON)))

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone: channels release, the session ends, exclusive queues go."""
        self.phase = Phase.CLOSED
        self._cancel_timers()
        for channel in self.channels.values():
            for consumer in channel.consumers.values():
                self._queues_consumed.add(consumer.queue)
            channel.release(self.ops.now(), session_alive=False)
        self.channels.clear()
        session = self.session
        if session is not None:
            authenticated = session.authenticated
            session.end()
            if authenticated:
                self.state.connection_closed(session.id, self._queues_consumed)

    # ------------------------------------------------------------- events
    def _event(self, event: Any, now: int) -> None:
        if self.phase is Phase.CLOSING and not (
                isinstance(event, MethodReceived) and event.channel == 0):
            return  # spec 2.3.5: after our connection.close only close-ok counts
        if isinstance(event, ProtocolHeaderReceived):
            self._start()
        elif isinstance(event, HeartbeatReceived):
            return
        elif isinstance(event, MethodReceived):
            if event.channel == 0:
                self._connection_method(event.method)
            else:
                self._channel_method(event.channel, event.method, now)
        elif isinstance(event, ContentReceived):
            channel = self._channel(event.channel, event.method)
            if channel is not None:
                self._guard(channel, lambda: channel.publish(
                    event.method, event.properties, event.body, now), event.method)

    def _start(self) -> None:
        if self._refusal is not None:
            error = self._refusal
            code = ReplyCode.NOT_ALLOWED if error.code.name == "TOO_MANY_CONNECTIONS" \
                else ReplyCode.ACCESS_REFUSED
            self._close_connection(code, f"{code.name} - {error.message}")
            return
        self.phase = Phase.AWAIT_START_OK
        self.write(self.codec.send_method(0, commands.Connection.Start(
            server_properties={
                "product": "txbroker", "version": __version__,
                "platform": "Python", "information": "docs/amqp.md",
                "capabilities": {
                    "publisher_confirms": True, "basic.nack": True,
                    "consumer_cancel_notify": True, "exchange_exchange_bindings": False,
                    "connection.blocked": True, "authentication_failure_close": True,
                    "per_consumer_qos": True, "direct_reply_to": False,
                },
            },
            mechanisms=" ".join(MECHANISMS), locales="en_US")))

    def _connection_method(self, method: Any) -> None:
        name = method.name
        if self.phase is Phase.CLOSING and name not in ("Connection.CloseOk",
                                                        "Connection.Close"):
            return  # spec 2.3.5: after close, the peer's frames are dropped
        following = TRANSITIONS.get((self.phase, name))
        if following is None:
            code = ReplyCode.COMMAND_INVALID if self.phase is Phase.OPEN \
                else ReplyCode.UNEXPECTED_FRAME
            if name.startswith("Connection.") and self.phase is Phase.OPEN:
                code = ReplyCode.NOT_IMPLEMENTED
            raise AmqpProtocolError(code, f"{name} is not expected now "
                                    f"({self.phase.value})", class_id=method.index >> 16,
                                    method_id=method.index & 0xFFFF)
        if name == "Connection.StartOk":
            self._start_ok(method)
            if self.phase is Phase.CLOSING:
                return
        elif name == "Connection.TuneOk":
            self._tune_ok(method)
        elif name == "Connection.Open":
            if method.virtual_host not in ("/", ""):
                self.phase = following
                self._close_connection(ReplyCode.NOT_ALLOWED,
                                       f"NOT_ALLOWED - vhost {method.virtual_host} not found",
                                       method.index >> 16, method.index & 0xFFFF)
                return
            self.write(self.codec.send_method(0, commands.Connection.OpenOk()))
            self._cancel_timer()
            self._arm_heartbeat()
        elif name == "Connection.Close":
            self.write(self.codec.send_method(0, commands.Connection.CloseOk()))
            self.phase = following
            self._shut()
            return
        elif name == "Connection.CloseOk":
            self.phase = following
            self._shut()
            return
        self.phase = following

    def _start_ok(self, method: Any) -> None:
        assert self.session is not None
        capabilities = (method.client_properties or {}).get("capabilities")
        self._blocked_capable = isinstance(capabilities, dict) and \
            capabilities.get("connection.blocked") is True
        mechanism = method.mechanism
        user, password = credentials(mechanism, method.response)
        if mechanism not in MECHANISMS or user is None:
            self._close_connection(ReplyCode.ACCESS_REFUSED,
                                   f"ACCESS_REFUSED - unsupported authentication mechanism "
                                   f"or malformed response ({mechanism!r})")
            return
        try:
            self.session.authenticate(user, password)
        except BrokerError:
            self._close_connection(ReplyCode.ACCESS_REFUSED,
                                   f"ACCESS_REFUSED - Login was refused using authentication "
                                   f"mechanism {mechanism}. For details see the broker "
                                   "logfile.")
            return
        settings = self.settings
        self.write(self.codec.send_method(0, commands.Connection.Tune(
            settings.channel_max, settings.frame_max, settings.heartbeat_s)))

    def _tune_ok(self, method: Any) -> None:
        settings = self.settings
        frame_max = int(method.frame_max)
        if frame_max and not FRAME_MIN_SIZE <= frame_max <= settings.frame_max:
            raise AmqpProtocolError(ReplyCode.NOT_ALLOWED,
                                    f"frame_max {frame_max} is outside {FRAME_MIN_SIZE}.."
                                    f"{settings.frame_max}")
        self.codec.set_frame_max(frame_max)
        channel_max = int(method.channel_max)
        if channel_max > settings.channel_max:
            raise AmqpProtocolError(ReplyCode.NOT_ALLOWED,
                                    f"channel_max {channel_max} is above "
                                    f"{settings.channel_max}")
        self.channel_max = channel_max or settings.channel_max
        self.heartbeat_s = int(method.heartbeat)

    def _channel_method(self, number: int, method: Any, now: int) -> None:
        if self.phase is Phase.CLOSING:
            return
        if self.phase is not Phase.OPEN:
            raise AmqpProtocolError(ReplyCode.UNEXPECTED_FRAME,
                                    f"{method.name} on channel {number} before "
                                    "connection.open", channel=number)
        name = method.name
        if name.startswith("Connection."):
            raise AmqpProtocolError(ReplyCode.COMMAND_INVALID,
                                    f"{name} on channel {number}, not 0", channel=number)
        if name == "Channel.Open":
            if number in self.channels:
                raise AmqpProtocolError(ReplyCode.CHANNEL_ERROR,
                                        f"second 'channel.open' seen on channel {number}",
                                        channel=number)
            if number > self.channel_max:
                raise AmqpProtocolError(ReplyCode.NOT_ALLOWED,
                                        f"channel {number} is above the negotiated "
                                        f"channel_max {self.channel_max}", channel=number)
            self.channels[number] = Channel(self, number)
            self.write(self.codec.send_method(number, commands.Channel.OpenOk()))
            return
        channel = self._channel(number, method)
        if channel is None:
            return
        if name == "Channel.Close":
            self._drop_channel(channel, now)
            self.write(self.codec.send_method(number, commands.Channel.CloseOk()))
            return
        if name == "Channel.CloseOk":
            if channel.state is ChannelState.CLOSING:
                self.channels.pop(number, None)
            return
        if channel.state is not ChannelState.OPEN:
            return
        handler = METHODS.get(name)
        if handler is None:
            raise AmqpProtocolError(ReplyCode.NOT_IMPLEMENTED,
                                    f"{name} is not supported by txbroker (docs/amqp.md)",
                                    channel=number, class_id=method.index >> 16,
                                    method_id=method.index & 0xFFFF)
        self._guard(channel, lambda: handler(channel, method, now), method)

    def _channel(self, number: int, method: Any) -> Channel | None:
        """The open channel a frame names (504 if none)."""
        channel = self.channels.get(number)
        if channel is None:
            raise AmqpProtocolError(ReplyCode.CHANNEL_ERROR,
                                    f"expected 'channel.open' on channel {number} before "
                                    f"{method.name}", channel=number)
        if channel.state is ChannelState.CLOSING and method.name not in (
                "Channel.Close", "Channel.CloseOk"):
            return None
        return channel

    def _guard(self, channel: Channel, run: Any, method: Any) -> None:
        """Run a channel's method; a refusal closes the channel (or the connection)."""
        try:
            run()
        except ChannelError as exc:
            self._channel_error(channel, exc, method)
        except BrokerError as exc:
            self._channel_error(channel, as_channel_error(exc), method)

    def _channel_error(self, channel: Channel, error: ChannelError, method: Any) -> None:
        class_id = method.index >> 16 if method is not None else 0
        method_id = method.index & 0xFFFF if method is not None else 0
        if error.hard:
            raise AmqpProtocolError(error.reply_code, error.text.split(" - ", 1)[-1],
                                    channel=channel.number, class_id=class_id,
                                    method_id=method_id)
        log.info("AMQP channel %d of %s closed: %s", channel.number, self.peer, error.text)
        self._drop_channel(channel, self.ops.now())
        channel.state = ChannelState.CLOSING
        self.channels[channel.number] = channel
        self.codec.forget_channel(channel.number)
        self.write(self.codec.send_method(channel.number, commands.Channel.Close(
            int(error.reply_code), error.text[:255], class_id, method_id)))

    def _drop_channel(self, channel: Channel, now: int) -> None:
        for consumer in channel.consumers.values():
            self._queues_consumed.add(consumer.queue)
        channel.release(now, session_alive=True)
        self.channels.pop(channel.number, None)
        for rid in [r for r, owners in self._rids.items() if owners[0][0] is channel]:
            del self._rids[rid]

    def describe_channels(self) -> list[dict[str, Any]]:
        """The open channels, for the connections list (console, REST, CLI, metrics)."""
        return [channel.describe() for _, channel in sorted(self.channels.items())]

    # ------------------------------------------------------------- ConnectionPort
    def write(self, data: bytes) -> None:
        """Queue bytes; they are written at the end of this loop turn."""
        self._out.append(data)
        if not self._flush_soon:
            self._flush_soon = True
            self.loop.call_soon(self.flush)

    def new_rid(self) -> int:
        """A request id for the core."""
        rid = self._next_rid
        self._next_rid = rid + 1
        return rid

    def new_sub(self) -> int:
        """A core subscription number."""
        sub = self._next_sub
        self._next_sub = sub + 1
        return sub

    def expect(self, rid: int, channel: Channel, pending: Pending) -> None:
        """The answer to ``rid`` goes to ``pending`` of ``channel``."""
        self._rids.setdefault(rid, []).append((channel, pending))

    def own_sub(self, sub: int, channel: Channel | None) -> None:
        """Deliveries of ``sub`` go to ``channel`` (None: the subscription ended)."""
        if channel is None:
            self._subs.pop(sub, None)
        else:
            self._subs[sub] = channel

    def settle_when_written(self, core_tag: int) -> None:
        """A ``no_ack`` delivery: acknowledged after the flush that writes it."""
        self._auto_tags.append(core_tag)

    def pause_writing(self) -> None:
        """The socket's write buffer is full: stop acknowledging ``no_ack`` deliveries."""
        self._write_paused = True

    def resume_writing(self) -> None:
        """The write buffer drained: acknowledge what was written meanwhile."""
        self._write_paused = False
        self._schedule_auto_ack()

    def _schedule_auto_ack(self) -> None:
        if self._auto_tags and not self._auto_scheduled and not self._write_paused \
                and not self._closed():
            self._auto_scheduled = True
            self.loop.call_soon(self._ack_auto)

    def _ack_auto(self) -> None:
        self._auto_scheduled = False
        tags, self._auto_tags = self._auto_tags, []
        if tags and self.session is not None:
            self.session.settle_written(tags, self.ops.now())
            self.ops.run_effects()

    # ------------------------------------------------------------- SessionSink
    def answer(self, rid: int, result: Any) -> None:
        """A request the core answered later."""
        self._safely(lambda: self._answered(rid, result, None))

    def refuse(self, rid: int, error: BrokerError) -> None:
        """A request the core refused later."""
        self._safely(lambda: self._answered(rid, None, error))

    def run_guarded(self, channel: Channel, run: Callable[[], None]) -> None:
        """Run a later callback for ``channel`` (a definitions save that became
        durable): a refusal closes the channel, never the effect runner."""
        self._safely(lambda: self._guard(channel, run, None))

    def _safely(self, run: Any) -> None:
        """Run a callback of the effect runner: a failure of this connection's code
        closes this connection (541), never the effects of the others."""
        try:
            run()
        except AmqpProtocolError as exc:
            self._close_connection(exc.reply_code, f"{exc.reply_code.name} - {exc.text}",
                                   exc.class_id, exc.method_id)
        except Exception as exc:
            log.exception("AMQP connection %s failed on a later answer", self.peer)
            self._close_connection(ReplyCode.INTERNAL_ERROR, f"INTERNAL_ERROR - {exc}")

    def _answered(self, rid: int, result: Any, error: BrokerError | None,
                  delivery: Delivery | None = None) -> None:
        owners = self._rids.pop(rid, None)
        if owners is None:
            return
        owners[0][0].publishing.discard(rid)
        for channel, pending in owners:
            if delivery is not None:
                pending.delivery = delivery
            self._guard(channel, lambda c=channel, p=pending: c.answered(p, result, error),
                        None)

    def deliver(self, delivery: Delivery) -> None:
        """basic.deliver for a consumer, or the basic.get-ok waiting for it."""
        self._safely(lambda: self._deliver(delivery))

    def _deliver(self, delivery: Delivery) -> None:
        if delivery.sub == 0:
            self._answered(delivery.rid, None, None, delivery)
            return
        channel = self._subs.get(delivery.sub)
        tag = None if channel is None else next(
            (c.tag for c in channel.consumers.values() if c.sub == delivery.sub), None)
        if channel is None or tag is None:
            self._give_back(delivery)
            return
        channel.deliver(delivery, tag)

    def _give_back(self, delivery: Delivery) -> None:
        """A delivery for a consumer that ended meanwhile (``basic.cancel`` keeps the
        unacked deliveries the client saw, not those still on their way to it): it
        goes back to its queue. (A subscription ended without keeping them already
        gave it back: the core no longer knows the tag.)"""
        session = self.session
        if session is None or session.ended:
            return
        with contextlib.suppress(TxBrokerError):
            session.nack([delivery.tag], self.ops.now(), requeue=True)

    def cancelled(self, sub: int, reason: str) -> None:
        """The consumer's queue was deleted: basic.cancel to the client."""
        channel = self._subs.pop(sub, None)
        if channel is None:
            return
        for consumer in list(channel.consumers.values()):
            if consumer.sub == sub:
                del channel.consumers[consumer.tag]
                if self.session is not None:
                    self.state.consumer_ended(consumer.queue, self.session.id, sub)
                channel.send(commands.Basic.Cancel(consumer.tag, nowait=True))

    def push(self, event: str, data: dict[str, Any]) -> None:
        """No router pushes reach an AMQP connection."""

    def flush(self) -> None:
        """Write what was gathered; resume reading once the store caught up."""
        self._flush_soon = False
        if self._out:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(b"".join(self._out))
                self.last_write = self.loop.time()
            self._out.clear()
        self._schedule_auto_ack()
        session = self.session
        if session is not None and session.should_resume() and self.transport is not None \
                and self.phase is not Phase.CLOSED:
            self.transport.resume_reading()
            if self._blocked_capable:
                self.transport.write(self.codec.send_method(0, commands.Connection.Unblocked()))

    def hold_input(self, held: bool) -> None:
        """Stop (``held``) or go on reading this client (``SessionSink``: a replication
        dump is being described, ``server/ha/joining.py``)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if held:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def abort(self) -> None:
        """Cut the connection at once, nothing more written (``SessionSink``: a fenced
        primary)."""
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Shutdown: connection.close 320 CONNECTION_FORCED, then close."""
        self._close_connection(ReplyCode.CONNECTION_FORCED,
                               "CONNECTION_FORCED - broker shutdown")
        self.flush()
        self._shut()

    # ------------------------------------------------------------- closing, timers
    def _close_connection(self, code: ReplyCode, text: str, class_id: int = 0,
                          method_id: int = 0) -> None:
        if self.phase in (Phase.CLOSING, Phase.CLOSED):
            return
        log.info("AMQP connection %s closed by the broker: %s", self.peer, text)
        self.write(self.codec.send_method(0, commands.Connection.Close(
            int(code), text[:255], class_id, method_id)))
        self.phase = Phase.CLOSING
        self._cancel_timer()
        self._close_timer = self.loop.call_later(CLOSE_WAIT_S, self._shut)

    def _shut(self) -> None:
        self.phase = Phase.CLOSED
        self.flush()
        self._cancel_timers()
        if self.transport is not None:
            self.transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_timers(self) -> None:
        self._cancel_timer()
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None

    def _handshake_timeout(self) -> None:
        self._timer = None
        if self.phase in (Phase.AWAIT_HEADER, Phase.AWAIT_START_OK, Phase.AWAIT_TUNE_OK,
                          Phase.AWAIT_OPEN):
            log.info("AMQP: %s did not open within %g s", self.peer,
                     self.settings.handshake_timeout_s)
            if self.phase is Phase.AWAIT_HEADER:
                self._shut()
            else:
                self._close_connection(ReplyCode.CONNECTION_FORCED,
                                       "CONNECTION_FORCED - handshake timeout")
            self.flush()

    def _arm_heartbeat(self) -> None:
        if self.heartbeat_s:
            self._timer = self.loop.call_later(self.heartbeat_s / 2, self._beat)

    def _beat(self) -> None:
        """Every half interval: a heartbeat if we were silent; close a client silent
        for two intervals (RabbitMQ's rule)."""
        self._timer = None
        if self.phase is not Phase.OPEN:
            return
        now = self.loop.time()
        if now - self.last_read > 2 * self.heartbeat_s:
            log.info("AMQP: %s missed heartbeats; closing", self.peer)
            self._shut()
            return
        if now - self.last_write >= self.heartbeat_s / 2:
            self.write(self.codec.send_heartbeat())
        self._arm_heartbeat()
