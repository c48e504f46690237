"""The STOMP listener's connections: STOMP 1.2 (and 1.0/1.1) on the broker core.

Theory of operation
-------------------
The edge loop is thin, like the native connection's (``server/edges/native/connection.py``):
``data_received`` hands bytes to the sans-IO codec (``protocol/stomp.py``),
each frame goes to :class:`~txbroker.server.edges.stomp.frames.StompFrames`, which
turns it into operations of the connection's session (``server/ops/operations.py``), and
the server's effect runner hands back what comes later (receipts once durable,
deliveries). Replies of one read are written in one ``write``. This module
owns what needs a socket or a clock: writing, pausing, the timers.

* Any error — a frame the codec refuses, or a refusal of the operation layer —
  is an ERROR frame (``message``, ``receipt-id``), then close. The core rolls
  back the connection's open transactions and redelivers its unacknowledged
  messages (``Session.end``); stored data is never touched by a bad frame.
* ``ack:auto`` deliveries are acknowledged right after their MESSAGE frames
  were handed to the socket, and only while the socket's write buffer is below
  its high-water mark: credit (``prefetch-count``) plus TCP back-pressure bound
  what is in flight.
* Heart-beats: negotiated in CONNECT/CONNECTED (``negotiate_heartbeat``); a
  timer writes an EOL when nothing else was written for half the agreed
  interval, another drops a client silent for ``heartbeat_grace`` × its
  interval. A connection without CONNECT is closed after ``connect_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Final, Protocol, cast

from txbroker.errors import BrokerError, TxBrokerError
from txbroker.protocol.stomp import (
    DEFAULT_MAX_HEADER_SIZE,
    DEFAULT_MAX_HEADERS,
    Frame,
    Role,
    StompConnection,
    StompProtocolError,
    encode_error,
)
from txbroker.server.edges.stomp.frames import Refused, StompFrames
from txbroker.server.ops import Delivery, Operations, Session
from txbroker.server.ops.seams import abort_transport, hold_reading
from txbroker.server.security.tls import looks_like_tls

log = logging.getLogger("txbroker.stomp")

#: The STOMP port (IANA-registered ``stomp``; RabbitMQ, ActiveMQ and Artemis use it).
DEFAULT_STOMP_PORT: Final = 61613
#: The server can send a heart-beat every 1 s at best and does not want to
#: hear from a client more often than that (RabbitMQ and ActiveMQ accept any
#: client value; a floor keeps a client asking for 1 ms from flooding us).
DEFAULT_HEARTBEAT_MIN_MS: Final = 1000
#: A client is dropped after this many agreed intervals of silence (ActiveMQ's
#: ``transport.hbGracePeriodMultiplier`` is 1.5).
DEFAULT_HEARTBEAT_GRACE: Final = 1.5
#: A connection that sends no CONNECT frame within this time is closed
#: (ActiveMQ's ``transport.connectAttemptTimeout`` is 30 s).
DEFAULT_CONNECT_TIMEOUT_S: Final = 30.0
_CONNECT_TIMER, _BEAT_TIMER, _ALIVE_TIMER = 0, 1, 2


@dataclass(frozen=True, slots=True)
class StompSettings:
    """The STOMP listener's settings (defaults above; limits of the codec)."""

    heartbeat_send_min_ms: int = DEFAULT_HEARTBEAT_MIN_MS
    heartbeat_receive_min_ms: int = DEFAULT_HEARTBEAT_MIN_MS
    heartbeat_grace: float = DEFAULT_HEARTBEAT_GRACE
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    max_headers: int = DEFAULT_MAX_HEADERS
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE

    def validate(self) -> None:
        """Raise ValueError on settings that cannot work."""
        if self.heartbeat_send_min_ms < 1 or self.heartbeat_receive_min_ms < 1:
            raise ValueError("heart-beat minimums must be >= 1 ms")
        if self.heartbeat_grace < 1.0:
            raise ValueError("heartbeat_grace must be >= 1.0")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be > 0")


def _refusal_frame(error: BrokerError) -> bytes:
    """The ERROR frame of a connection refused before any version was agreed."""
    return encode_error(error.message, None, "1.0", f"{error.code.name}: {error.message}")


class StompServerConnection(asyncio.Protocol):
    """asyncio protocol for one STOMP client; a ``SessionSink`` of the operation layer."""

    def __init__(self, ops: Operations, settings: StompSettings | None = None) -> None:
        self.ops = ops
        self.settings = settings or StompSettings()
        self.codec = StompConnection(
            Role.SERVER, max_frame_size=ops.config.max_frame_size,
            max_headers=self.settings.max_headers, max_header_size=self.settings.max_header_size)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.session: Session | None = None
        self.frames: StompFrames | None = None
        self.closed = False
        self.peer = "?"
        self._auto_scheduled = False
        self._write_paused = False
        self._heartbeat_out_s = 0.0
        self._heartbeat_in_s = 0.0
        self.last_read = 0.0
        self.last_write = 0.0
        self._first_read = True
        self._timers: list[asyncio.TimerHandle | None] = [None, None, None]

    # ------------------------------------------------------------- asyncio side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection (or refuse it); arm the CONNECT timer."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.last_read = self.last_write = self.loop.time()
        try:
            session = self.ops.open(self, peer[0] if peer else None, protocol="stomp",
                                    address=f"{peer[0]}:{peer[1]}" if peer else None)
        except BrokerError as exc:
            self.transport.write(_refusal_frame(exc))
            self.transport.close()
            self.closed = True
            return
        self.session = session
        settings = self.settings
        self.frames = StompFrames(
            self.codec, session, (settings.heartbeat_send_min_ms,
                                  settings.heartbeat_receive_min_ms),
            self._connected, self._close)
        self._timers[_CONNECT_TIMER] = self.loop.call_later(settings.connect_timeout_s,
                                                            self._connect_timeout)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived, run each frame, write the replies."""
        frames = self.frames
        if self.closed or frames is None or frames.disconnecting:
            return
        if self._first_read:
            self._first_read = False
            # A TLS client on this port (no STOMP frame begins so): close now; its
            # ClientHello holds no frame end, so it would wait for the CONNECT timeout.
            if looks_like_tls(data):
                log.warning("STOMP: %s began a TLS handshake on this plaintext port; "
                            "closing (STOMP over TLS is on stomp_tls_port)", self.peer)
                self._close()
                return
        self.last_read = self.loop.time()
        codec = self.codec
        codec.receive_data(data)
        now = self.ops.now()
        frame: Frame | None = None
        try:
            while batch := codec.drain():
                for frame in batch:
                    frames.handle(frame, now)
                    if self.closed or frames.disconnecting:
                        break
                if self.closed or frames.disconnecting:
                    break
            if not self.closed:
                frames.flush_acks(now)
        except StompProtocolError as exc:
            self._fail_after_acks(now, Refused(str(exc), exc.receipt_id))
        except Refused as exc:
            self._fail_after_acks(now, exc)
        except BrokerError as exc:
            receipt = frame.headers.get("receipt") if frame is not None else None
            self._fail_after_acks(now, Refused.of(exc, receipt))
        except TxBrokerError as exc:  # pragma: no cover - a core bug, not the client's
            log.exception("unexpected error on STOMP connection %s", self.peer)
            self._fail_after_acks(now, Refused(f"internal error: {exc}", None))
        self.after_read()

    def after_read(self) -> None:
        """Run the core's effects, write, and stop reading if too much is pending."""
        self.ops.run_effects()
        self.flush()
        session = self.session
        if session is not None and session.should_pause() and not self.closed \
                and self.transport is not None:
            self.transport.pause_reading()

    def _fail_after_acks(self, now: int, refusal: Refused) -> None:
        """Before an error: the ACKs of the valid frames before it still count (a
        refusal among them is the one reported: it came first)."""
        assert self.frames is not None
        if not self.closed:
            try:
                self.frames.flush_acks(now)
            except Refused as earlier:
                refusal = earlier
        self._fatal(str(refusal), refusal.receipt, refusal.detail)

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone: the session ends (the core rolls back, redelivers)."""
        self.closed = True
        self._cancel_timers()
        if self.session is not None:
            self.session.end()

    def pause_writing(self) -> None:
        """The socket's write buffer is full: stop acking ``ack:auto`` deliveries."""
        self._write_paused = True

    def resume_writing(self) -> None:
        """The write buffer drained: ack the ``ack:auto`` deliveries written meanwhile."""
        self._write_paused = False
        self._schedule_auto_ack()

    # ------------------------------------------------------------- SessionSink
    def answer(self, rid: int, result: Any) -> None:
        """A request is durable: write its receipts (and finish a waiting DISCONNECT)."""
        if self.frames is not None:
            self.frames.answered(rid)

    def refuse(self, rid: int, error: BrokerError) -> None:
        """A request failed once it reached the store: ERROR, then close."""
        receipt = self.frames.receipt_of(rid) if self.frames is not None else None
        self._fatal(error.message, receipt, f"{error.code.name}: {error.message}")

    def deliver(self, delivery: Delivery) -> None:
        """Encode a MESSAGE frame."""
        if self.frames is not None and not self.closed:
            self.frames.message(delivery)

    def cancelled(self, sub: int, reason: str) -> None:
        """The subscription's queue was deleted: ERROR, then close."""
        sub_id = self.frames.cancelled(sub) if self.frames is not None else None
        if sub_id is not None:
            self._fatal(f"subscription {sub_id!r} was cancelled by the broker: {reason}", None)

    def push(self, event: str, data: dict[str, Any]) -> None:
        """Router pushes: none reach a STOMP connection (it cannot register a controller)."""

    def flush(self) -> None:
        """Write everything gathered in one call; auto-ack what was written."""
        frames = self.frames
        if frames is None:
            return
        if frames.out:
            if not self.closed and self.transport is not None:
                self.transport.write(b"".join(frames.out))
                self.last_write = self.loop.time()
            frames.out.clear()
        self._schedule_auto_ack()
        session = self.session
        if session is not None and session.should_resume() and not self.closed \
                and self.transport is not None:
            self.transport.resume_reading()

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
        """Shutdown: write what is gathered, then close."""
        self.flush()
        self._close()

    # ------------------------------------------------------------- auto ack
    def _schedule_auto_ack(self) -> None:
        frames = self.frames
        if frames is not None and frames.auto_tags and not self._auto_scheduled \
                and not self._write_paused and not self.closed:
            self._auto_scheduled = True
            self.loop.call_soon(self._ack_auto)

    def _ack_auto(self) -> None:
        """Acknowledge ``ack:auto`` deliveries that were handed to the socket."""
        self._auto_scheduled = False
        if self.frames is not None and self.frames.auto_tags:
            self.frames.settle_auto(self.ops.now())
            self.ops.run_effects()

    # ------------------------------------------------------------- connecting, closing
    def _connected(self, send_every_ms: int, expect_every_ms: int) -> None:
        """CONNECTED was sent: stop the CONNECT timer, start the heart-beat timers."""
        self._cancel_timer(_CONNECT_TIMER)
        if send_every_ms:
            self._heartbeat_out_s = send_every_ms / 1000
            self._timers[_BEAT_TIMER] = self.loop.call_later(self._heartbeat_out_s / 2,
                                                             self._beat)
        if expect_every_ms:
            self._heartbeat_in_s = expect_every_ms * self.settings.heartbeat_grace / 1000
            self._timers[_ALIVE_TIMER] = self.loop.call_later(self._heartbeat_in_s,
                                                              self._check_alive)

    def _fatal(self, message: str, receipt: str | None, detail: str = "") -> None:
        """ERROR frame (after what is already gathered), then close."""
        if self.closed:
            return
        log.info("STOMP error to %s: %s", self.peer, message)
        error = encode_error(message, receipt, self.codec.version, detail)
        if self.frames is not None:
            self.frames.out.append(error)
        elif self.transport is not None:
            self.transport.write(error)
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.flush()
        self.closed = True
        self._cancel_timers()
        if self.transport is not None:
            self.transport.close()
        if self.session is not None:  # end (roll back, redeliver) soon, not from
            self.loop.call_soon(self.session.end)  # inside the effect runner

    def _cancel_timer(self, index: int) -> None:
        timer = self._timers[index]
        if timer is not None:
            timer.cancel()
            self._timers[index] = None

    def _cancel_timers(self) -> None:
        for index in range(len(self._timers)):
            self._cancel_timer(index)

    def _connect_timeout(self) -> None:
        self._timers[_CONNECT_TIMER] = None
        if not self.closed and (self.session is None or not self.session.authenticated):
            self._fatal(f"no CONNECT frame within {self.settings.connect_timeout_s:g} s", None)

    def _beat(self) -> None:
        """Write a heart-beat if nothing else was written for half the interval."""
        if self.closed or self.transport is None:
            return
        half = self._heartbeat_out_s / 2
        if self.loop.time() - self.last_write >= half:
            self.transport.write(self.codec.heartbeat())
            self.last_write = self.loop.time()
        self._timers[_BEAT_TIMER] = self.loop.call_later(half, self._beat)

    def _check_alive(self) -> None:
        """Drop a client that was silent for longer than the grace period."""
        if self.closed:
            return
        if self.session is not None and self.session.reading_paused:
            self.last_read = self.loop.time()  # we stopped reading: not the client's silence
        silent = self.loop.time() - self.last_read
        if silent >= self._heartbeat_in_s:
            log.info("STOMP client %s silent for %.1f s: dropped", self.peer, silent)
            self._fatal(f"no heart-beat from the client for {silent * 1000:.0f} ms "
                        f"(agreed interval x grace = {self._heartbeat_in_s * 1000:.0f} ms)", None)
            return
        self._timers[_ALIVE_TIMER] = self.loop.call_later(self._heartbeat_in_s - silent,
                                                          self._check_alive)


class Listening(Protocol):
    """What :func:`start_stomp_listener` needs: a server that opens listeners."""

    async def listen_stomp(self, host: str, port: int,
                           settings: StompSettings | None = None) -> asyncio.Server:
        """Open a STOMP listener on ``host:port`` (0: any free port)."""


async def start_stomp_listener(server: Listening, host: str, port: int,
                               settings: StompSettings | None = None) -> asyncio.Server:
    """Listen for STOMP clients on ``host:port`` (0 = any free port) for ``server``.

    Call after ``await server.start()``; close the returned server on shutdown
    (its connections are closed by ``server.stop``). The listener is opened by
    the server (``BrokerServer.listen_stomp``), where every listener is.
    """
    return await server.listen_stomp(host, port, settings)
