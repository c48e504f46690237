"""The AMQP 0-9-1 listener's connections (docs/amqp.md).

Theory of operation
-------------------
The edge loop is thin, like the STOMP one (``server/edges/stomp/connection.py``):
``data_received`` hands bytes to the sans-IO codec (``protocol/amqp/``); each
event is a step of the connection's handshake (a method of channel 0,
``server/edges/amqp/connection_methods.py``) or a method of a channel, routed by
``server/edges/amqp/channel_routing.py`` to its channel (``server/edges/amqp/channel.py``),
which turns it into operations of the connection's session
(``server/ops/operations.py``). The server's effect runner hands back
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

from txbroker.errors import BrokerError, TxBrokerError
from txbroker.protocol.amqp import (
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
from txbroker.server.edges.amqp.channel import Channel, Pending
from txbroker.server.edges.amqp.channel_routing import (
    channel_method,
    guard,
    named_channel,
)
from txbroker.server.edges.amqp.connection_methods import connection_method, start
from txbroker.server.edges.amqp.consuming import flush_acks
from txbroker.server.edges.amqp.content import PropertyTexts
from txbroker.server.edges.amqp.handshake import (
    CLOSE_WAIT_S,
    DEFAULT_AMQP_PORT,
    AmqpSettings,
    Phase,
)
from txbroker.server.edges.amqp.publishing import publish, take_confirms
from txbroker.server.edges.amqp.state import AmqpState
from txbroker.server.ops import Delivery, Operations, Session
from txbroker.server.ops.seams import abort_transport, hold_reading

log = logging.getLogger("txbroker.amqp")

#: connection.blocked's reason: the session's requests waiting for the store are above
#: ``max_pending_requests``; reading resumes (connection.unblocked) at half of it.
BLOCKED_REASON: Final = "too many publishes waiting for the store (max_pending_requests)"

__all__ = ["DEFAULT_AMQP_PORT", "AmqpServerConnection", "AmqpSettings"]

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
        #: the channel whose basic.acks are staged (``consuming.flush_acks``)
        self._acking: Channel | None = None
        #: the channels with publisher confirms gathered, written before any other bytes
        self._confirms: list[Channel] = []
        #: the properties' conversions of the messages this connection sees (content.py)
        self.texts = PropertyTexts()
        #: why the operation layer refused the connection (told after the protocol header)
        self.refusal: BrokerError | None = None
        #: request id -> the (channel, pending output) waiting for its answer
        self.rids: dict[int, list[tuple[Channel, Pending]]] = {}
        self._subs: dict[int, Channel] = {}
        #: the queues this connection's consumers read (their exclusive use ends with it)
        self.queues_consumed: set[str] = set()
        self._auto_tags: list[int] = []
        self._auto_scheduled = False
        self._write_paused = False
        #: the client said it understands connection.blocked (its capabilities)
        self.blocked_capable = False
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
            self.refusal = exc
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
                self._flush_acks(now)
        except ProtocolHeaderMismatch:
            self.write(PROTOCOL_HEADER)  # spec 4.2.2: our header, then close
            self.shut()
        except AmqpProtocolError as exc:
            with contextlib.suppress(AmqpProtocolError):
                self._flush_acks(now)  # (the acks read before the error count)
            self.close_connection(exc.reply_code, f"{exc.reply_code.name} - {exc.text}",
                                  exc.class_id, exc.method_id)
        except TxBrokerError as exc:  # pragma: no cover - a core bug, not the client's
            log.exception("unexpected error on AMQP connection %s", self.peer)
            self.close_connection(ReplyCode.INTERNAL_ERROR, f"INTERNAL_ERROR - {exc}")
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
            if self.blocked_capable:  # tell the client why its publishes wait
                self.write(self.codec.send_method(0, commands.Connection.Blocked(
                    BLOCKED_REASON)))

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone: channels release, the session ends, exclusive queues go."""
        self.phase = Phase.CLOSED
        self._cancel_timers()
        for channel in self.channels.values():
            for consumer in channel.consumers.values():
                self.queues_consumed.add(consumer.queue)
            channel.release(self.ops.now(), session_alive=False)
        self.channels.clear()
        session = self.session
        if session is not None:
            authenticated = session.authenticated
            session.end()
            if authenticated:
                self.state.connection_closed(session.id, self.queues_consumed)

    # ------------------------------------------------------------- events
    def _event(self, event: Any, now: int) -> None:
        acking = self._acking
        if acking is not None and not (
                isinstance(event, MethodReceived) and event.channel == acking.number
                and event.method.name == "Basic.Ack"):
            self._flush_acks(now)
        if self.phase is Phase.CLOSING and not (
                isinstance(event, MethodReceived) and event.channel == 0):
            return  # spec 2.3.5: after our connection.close only close-ok counts
        if isinstance(event, ProtocolHeaderReceived):
            start(self)
        elif isinstance(event, HeartbeatReceived):
            return
        elif isinstance(event, MethodReceived):
            if event.channel == 0:
                connection_method(self, event.method)
            else:
                channel_method(self, event.channel, event.method, now)
        elif isinstance(event, ContentReceived):
            channel = named_channel(self, event.channel, event.method)
            if channel is not None:
                guard(self, channel, lambda: publish(
                    channel, event.method, event.properties, event.body, now,
                    event.raw_properties), event.method)

    def acks_staged(self, channel: Channel) -> None:
        """``channel`` staged basic.acks (``consuming.basic_ack``)."""
        self._acking = channel

    def _flush_acks(self, now: int) -> None:
        channel = self._acking
        if channel is not None:
            self._acking = None
            guard(self, channel, lambda: flush_acks(channel, now), commands.Basic.Ack)

    def describe_channels(self) -> list[dict[str, Any]]:
        """The open channels, for the connections list (console, REST, CLI, metrics)."""
        return [channel.describe() for _, channel in sorted(self.channels.items())]

    # ------------------------------------------------------------- ConnectionPort
    def write(self, data: bytes) -> None:
        """Queue bytes; they are written at the end of this loop turn."""
        if self._confirms:
            self._take_confirms()
        self._out.append(data)
        if not self._flush_soon:
            self._flush_soon = True
            self.loop.call_soon(self.flush)

    def confirm_later(self, channel: Channel) -> None:
        """``channel`` gathered publisher confirms (``publishing.py``): they are
        written before the next bytes, or at the end of this loop turn."""
        self._confirms.append(channel)
        if not self._flush_soon:
            self._flush_soon = True
            self.loop.call_soon(self.flush)

    def _take_confirms(self) -> None:
        for channel in self._confirms:
            self._out.append(take_confirms(channel))
        self._confirms.clear()

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
        self.rids.setdefault(rid, []).append((channel, pending))

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
        self._safely(self._answered, rid, result, None)

    def refuse(self, rid: int, error: BrokerError) -> None:
        """A request the core refused later."""
        self._safely(self._answered, rid, None, error)

    def run_guarded(self, channel: Channel, run: Callable[[], None]) -> None:
        """Run a later callback for ``channel`` (a definitions save that became
        durable): a refusal closes the channel, never the effect runner."""
        self._safely(lambda: guard(self, channel, run, None))

    def _safely(self, run: Any, *args: Any) -> None:
        """Run a callback of the effect runner (``run(*args)``): a failure of this
        connection's code closes this connection (541), never the effects of the others."""
        try:
            run(*args)
        except AmqpProtocolError as exc:
            self.close_connection(exc.reply_code, f"{exc.reply_code.name} - {exc.text}",
                                  exc.class_id, exc.method_id)
        except Exception as exc:
            log.exception("AMQP connection %s failed on a later answer", self.peer)
            self.close_connection(ReplyCode.INTERNAL_ERROR, f"INTERNAL_ERROR - {exc}")

    def _answered(self, rid: int, result: Any, error: BrokerError | None,
                  delivery: Delivery | None = None) -> None:
        owners = self.rids.pop(rid, None)
        if owners is None:
            return
        owners[0][0].publishing.discard(rid)
        for channel, pending in owners:
            if delivery is not None:
                pending.delivery = delivery
            guard(self, channel, lambda c=channel, p=pending: c.answered(p, result, error),
                        None)

    def deliver(self, delivery: Delivery) -> None:
        """basic.deliver for a consumer, or the basic.get-ok waiting for it."""
        self._safely(self._deliver, delivery)

    def _deliver(self, delivery: Delivery) -> None:
        if delivery.sub == 0:
            self._answered(delivery.rid, None, None, delivery)
            return
        channel = self._subs.get(delivery.sub)
        if channel is not None:
            for consumer in channel.consumers.values():
                if consumer.sub == delivery.sub:
                    channel.deliver(delivery, consumer.tag, consumer.no_ack)
                    return
        self._give_back(delivery)

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
        if self._confirms:
            self._take_confirms()
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
            if self.blocked_capable:
                self.transport.write(self.codec.send_method(0, commands.Connection.Unblocked()))

    def hold_input(self, held: bool) -> None:
        """Stop (``held``) or go on reading this client (``SessionSink``: a replication
        dump is being described, ``server/ha/joining.py``; a recovery checkpoint is
        taken, ``server/recovery.py``); a client paused for its pending requests stays
        paused until they are answered."""
        session = self.session
        hold_reading(self.transport, held or (session is not None and session.reading_paused))

    def abort(self) -> None:
        """Cut the connection at once, nothing more written (``SessionSink``: a fenced
        primary)."""
        abort_transport(self.transport)

    def close(self) -> None:
        """Shutdown: connection.close 320 CONNECTION_FORCED, then close."""
        self.close_connection(ReplyCode.CONNECTION_FORCED,
                              "CONNECTION_FORCED - broker shutdown")
        self.flush()
        self.shut()

    # ------------------------------------------------------------- closing, timers
    def close_connection(self, code: ReplyCode, text: str, class_id: int = 0,
                         method_id: int = 0) -> None:
        """connection.close with ``code``; the socket closes on close-ok or after
        :data:`CLOSE_WAIT_S`."""
        if self.phase in (Phase.CLOSING, Phase.CLOSED):
            return
        log.info("AMQP connection %s closed by the broker: %s", self.peer, text)
        self.write(self.codec.send_method(0, commands.Connection.Close(
            int(code), text[:255], class_id, method_id)))
        self.phase = Phase.CLOSING
        self.cancel_timer()
        self._close_timer = self.loop.call_later(CLOSE_WAIT_S, self.shut)

    def shut(self) -> None:
        """Close the socket now (after writing what is queued)."""
        self.phase = Phase.CLOSED
        self.flush()
        self._cancel_timers()
        if self.transport is not None:
            self.transport.close()

    def cancel_timer(self) -> None:
        """Stop the handshake or heartbeat timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_timers(self) -> None:
        self.cancel_timer()
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
                self.shut()
            else:
                self.close_connection(ReplyCode.CONNECTION_FORCED,
                                      "CONNECTION_FORCED - handshake timeout")
            self.flush()

    def arm_heartbeat(self) -> None:
        """Start the heartbeat timer (if tune-ok asked for heartbeats)."""
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
            self.shut()
            return
        if now - self.last_write >= self.heartbeat_s / 2:
            self.write(self.codec.send_heartbeat())
        self.arm_heartbeat()
