"""The STOMP listener: one STOMP 1.2 (1.0/1.1) connection per client, on the core.

Theory of operation
-------------------
The edge loop is thin, like the native connection's (``server/connection.py``):
``data_received`` hands bytes to the sans-IO codec (``protocol/stomp.py``),
each frame becomes one or two broker-core commands, and the server's effect
runner writes back what comes later (receipts once durable, deliveries).
Replies of one read are written in one ``write``.

Mapping onto the core (see ``docs/stomp.md``):

* ``/queue/NAME`` is the core queue ``NAME``; ``/topic/NAME`` is the core
  topic ``NAME`` (declared on first use). SUBSCRIBE to a topic makes a
  subscription queue ``NAME::stomp-<session>-<n>`` owned by this connection,
  or a durable one ``NAME::<durable-subscription-name>``.
* Each frame that the core may answer later (a persistent SEND, a COMMIT,
  ACKs, a durable topic subscription) gets a request id; its RECEIPT is
  written when the core's reply arrives (``answer_later``), i.e. once the
  record is durable. DISCONNECT's receipt waits until nothing is pending.
* Consecutive ACK frames of one read (outside transactions) are acknowledged
  with ONE core call, hence one ``ACK`` record.
* Transactions are core transactions: BEGIN = ``tx_begin``, COMMIT =
  ``tx_commit`` (one atomic ``TX`` record), ABORT = ``tx_rollback``.
* ``ack:auto`` subscriptions are client-ack subscriptions in the core, acked
  by this edge right after the MESSAGE frames were handed to the socket and
  only while the socket's write buffer is below its high-water mark: credit
  (``prefetch-count``) plus TCP back-pressure bound what is in flight.
* Any error: an ERROR frame (``message``, ``receipt-id``), then close. The
  core rolls back the connection's open transactions and redelivers its
  unacknowledged messages (``Broker.close_session``); stored data is never
  touched by a bad frame.

Heart-beats: negotiated in CONNECT/CONNECTED (``negotiate_heartbeat``); a
timer writes an EOL when nothing else was written for half the agreed
interval, another drops a client silent for ``heartbeat_grace`` × its
interval.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

from txbroker import __version__
from txbroker.core import LATER
from txbroker.core.engine import SUBSCRIPTION_SEPARATOR
from txbroker.errors import BrokerError, TxBrokerError
from txbroker.protocol.stomp import (
    DEFAULT_MAX_HEADER_SIZE,
    DEFAULT_MAX_HEADERS,
    Frame,
    Role,
    StompConnection,
    StompProtocolError,
    encode_error,
    escape,
    negotiate_heartbeat,
    negotiate_version,
    parse_heartbeat,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from txbroker.server.app import BrokerServer

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
#: Names of the SUBSCRIBE header that makes a topic subscription durable:
#: Artemis' name first, then ActiveMQ classic's.
DURABLE_SUBSCRIPTION_HEADERS: Final = ("durable-subscription-name", "activemq.subscriptionName")
#: Names of the SUBSCRIBE header giving the credit (unacked MESSAGE frames):
#: RabbitMQ's name first, then ActiveMQ classic's.
PREFETCH_HEADERS: Final = ("prefetch-count", "activemq.prefetchSize")
#: SEND headers that are the protocol's, not the message's: they are not stored.
SEND_RESERVED_HEADERS: Final = frozenset(
    ["destination", "transaction", "receipt", "content-length", "persistent", "message-id",
     "subscription", "ack", "redelivered"]
)
QUEUE_PREFIX: Final = "/queue/"
TOPIC_PREFIX: Final = "/topic/"
_NO_RECEIPT: Final[tuple[str, ...]] = ()


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


class AckMode(enum.Enum):
    """The SUBSCRIBE ``ack`` header."""

    AUTO = "auto"
    CLIENT = "client"  #: an ACK acknowledges every earlier message of the subscription
    CLIENT_INDIVIDUAL = "client-individual"


class _Refused(Exception):
    """A frame the broker refuses: ERROR frame, then close."""

    def __init__(self, message: str, receipt: str | None, detail: str = "") -> None:
        super().__init__(message)
        self.receipt = receipt
        self.detail = detail


class _Subscription:
    """One SUBSCRIBE of this connection."""

    __slots__ = ("dest_queue", "destination", "durable", "header", "id", "mode", "number",
                 "owned", "unacked")

    def __init__(self, sub_id: str, number: int, destination: str, dest_queue: str,
                 mode: AckMode, version: str, *, owned: bool, durable: bool) -> None:
        self.id = sub_id
        self.number = number  #: the core's subscription number
        self.destination = destination
        self.dest_queue = dest_queue  #: the core queue consumed
        self.mode = mode
        self.owned = owned  #: a non-durable topic subscription queue of this connection
        self.durable = durable  #: a durable topic subscription
        #: unacked delivery tag -> its message-id (tags increase: delivery order)
        self.unacked: dict[int, str] = {}
        self.header = (f"MESSAGE\ndestination:{escape(destination, version)}\n"
                       f"subscription:{escape(sub_id, version)}\n")


def _receipt_frame(receipt: str, version: str) -> bytes:
    return f"RECEIPT\nreceipt-id:{escape(receipt, version)}\n\n\x00".encode()


class StompServerConnection(asyncio.Protocol):
    """asyncio protocol for one STOMP client; a ``SessionSink`` of the server."""

    def __init__(self, server: BrokerServer, session_id: int,
                 settings: StompSettings | None = None) -> None:
        self.server = server
        self.session_id = session_id
        self.settings = settings or StompSettings()
        self.codec = StompConnection(
            Role.SERVER, max_frame_size=server.config.max_frame_size,
            max_headers=self.settings.max_headers, max_header_size=self.settings.max_header_size)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.authenticated = False
        self.user: str | None = None
        self.closed = False
        self.peer = "?"
        self._out: list[bytes] = []
        self._subs: dict[str, _Subscription] = {}
        self._subs_by_number: dict[int, _Subscription] = {}
        self._next_sub = 1
        self._unacked: dict[int, _Subscription] = {}  #: delivery tag -> subscription
        self._by_message_id: dict[str, int] = {}  #: STOMP 1.0/1.1 ack by message-id
        self._transactions: dict[str, int] = {}  #: STOMP name -> core tx id
        #: request id -> receipts due when the core answers it
        self._pending: dict[int, Sequence[str]] = {}
        self._next_rid = 1
        self._ack_batch: list[int] = []
        self._ack_receipts: list[str] = []
        self._auto_tags: list[int] = []
        self._auto_scheduled = False
        self._write_paused = False
        self._read_paused = False
        self._disconnecting = False
        self._disconnect_receipt: str | None = None
        self._heartbeat_out_s = 0.0
        self._heartbeat_in_s = 0.0
        self.last_read = 0.0
        self.last_write = 0.0
        self._timers: list[asyncio.TimerHandle | None] = [None, None, None]
        self._handlers: dict[str, Callable[[Frame, int], None]] = {
            "CONNECT": self._on_connect,
            "STOMP": self._on_connect,
            "SEND": self._on_send,
            "SUBSCRIBE": self._on_subscribe,
            "UNSUBSCRIBE": self._on_unsubscribe,
            "ACK": self._on_ack,
            "NACK": self._on_ack,
            "BEGIN": self._on_begin,
            "COMMIT": self._on_commit,
            "ABORT": self._on_abort,
            "DISCONNECT": self._on_disconnect,
        }

    # ------------------------------------------------------------- asyncio side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection (or refuse it over max_connections); arm the CONNECT timer."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.last_read = self.last_write = self.loop.time()
        if not self.server.admit(self):
            self.transport.write(encode_error("too many connections (max_connections)",
                                              version="1.0"))
            self.transport.close()
            self.closed = True
            return
        self._timers[0] = self.loop.call_later(self.settings.connect_timeout_s,
                                               self._connect_timeout)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived, run each frame against the core, write the replies."""
        if self.closed or self._disconnecting:
            return
        self.last_read = self.loop.time()
        codec = self.codec
        codec.receive_data(data)
        now = self.server.now()
        handlers = self._handlers
        frame: Frame | None = None
        try:
            while frames := codec.drain():
                for frame in frames:
                    command = frame.command
                    if self._ack_batch and (command != "ACK" or "transaction" in frame.headers):
                        self._flush_acks(now)
                    handlers[command](frame, now)
                    if self.closed or self._disconnecting:
                        break
                if self.closed or self._disconnecting:
                    break
            if self._ack_batch and not self.closed:
                self._flush_acks(now)
        except StompProtocolError as exc:
            self._end_batch(now)
            self._fatal(str(exc), exc.receipt_id)
        except _Refused as exc:
            self._end_batch(now)
            self._fatal(str(exc), exc.receipt, exc.detail)
        except BrokerError as exc:
            self._end_batch(now)
            receipt = frame.headers.get("receipt") if frame is not None else None
            self._fatal(exc.message, receipt, f"{exc.code.name}: {exc.message}")
        except TxBrokerError as exc:  # pragma: no cover - a core bug, not the client's
            log.exception("unexpected error on STOMP connection %s", self.peer)
            self._end_batch(now)
            self._fatal(f"internal error: {exc}", None)
        self.after_read()

    def after_read(self) -> None:
        """Run the core's effects, write, and stop reading if too much is pending."""
        self.server.run_effects()
        self.flush()
        if (len(self._pending) > self.server.config.max_pending_requests
                and not self._read_paused and not self.closed and self.transport is not None):
            self._read_paused = True
            self.transport.pause_reading()

    def _end_batch(self, now: int) -> None:
        """Before an error: the ACKs of the valid frames before it still count."""
        if self._ack_batch and not self.closed:
            try:
                self._flush_acks(now)
            except TxBrokerError:  # pragma: no cover - validated before batching
                log.exception("acks before an error failed")

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone: the core rolls back and redelivers (``forget``)."""
        self.closed = True
        self._cancel_timers()
        self.server.forget(self)

    def pause_writing(self) -> None:
        """The socket's write buffer is full: stop acking ``ack:auto`` deliveries."""
        self._write_paused = True

    def resume_writing(self) -> None:
        """The write buffer drained: ack the ``ack:auto`` deliveries written meanwhile."""
        self._write_paused = False
        if self._auto_tags and not self._auto_scheduled and not self.closed:
            self._auto_scheduled = True
            self.loop.call_soon(self._ack_auto)

    # ------------------------------------------------------------- frames
    def _on_connect(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        version = negotiate_version(headers.get("accept-version"))
        if version is None:
            supported = "1.0,1.1,1.2"
            self._out.append(self.codec.send(Frame("ERROR", {
                "version": supported,
                "message": f"Supported protocol versions are {supported}",
            }, f"unsupported accept-version {headers.get('accept-version')!r}\n".encode())))
            self._close()
            return
        try:
            client_heartbeat = parse_heartbeat(headers.get("heart-beat"))
        except StompProtocolError as exc:
            raise _Refused(str(exc), None) from None
        login, passcode = headers.get("login"), headers.get("passcode")
        if not self.server.auth.check(login, passcode):
            log.warning("STOMP authentication failed for user %r from %s", login, self.peer)
            raise _Refused("wrong login or passcode", None,
                           "AUTHENTICATION_FAILED: wrong login or passcode")
        settings = self.settings
        out_ms, in_ms = negotiate_heartbeat(client_heartbeat, settings.heartbeat_send_min_ms,
                                            settings.heartbeat_receive_min_ms)
        self.authenticated = True
        self.user = login
        self.server.broker.open_session(self.session_id, login)
        self._out.append(self.codec.send(Frame("CONNECTED", {
            "version": version,
            "heart-beat": f"{out_ms},{in_ms}",
            "session": str(self.session_id),
            "server": f"txbroker/{__version__}",
        })))
        self._cancel_timer(0)
        if out_ms:
            self._heartbeat_out_s = out_ms / 1000
            self._timers[1] = self.loop.call_later(self._heartbeat_out_s / 2, self._beat)
        if in_ms:
            self._heartbeat_in_s = in_ms * settings.heartbeat_grace / 1000
            self._timers[2] = self.loop.call_later(self._heartbeat_in_s, self._check_alive)

    def _on_send(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        receipt = headers.get("receipt")
        destination = headers["destination"]
        if destination.startswith(QUEUE_PREFIX) and len(destination) > len(QUEUE_PREFIX):
            is_topic, name = False, destination[len(QUEUE_PREFIX):]  # the common case
        else:
            is_topic, name = self._destination(destination, receipt)
        tx_name = headers.get("transaction")
        tx = None if tx_name is None else self._transaction(tx_name, receipt)
        user_headers = None
        priority = 4
        if not headers.keys() <= SEND_RESERVED_HEADERS:
            user_headers = {k: v for k, v in headers.items() if k not in SEND_RESERVED_HEADERS}
            text = user_headers.get("priority")
            if text is not None:
                if not (text.isdigit() and 0 <= int(text) <= 9):
                    raise _Refused(f"priority must be 0 to 9, not {text[:20]!r}", receipt)
                priority = int(text)
        broker = self.server.broker
        if is_topic:
            self._ensure_topic(name, now, receipt)
        elif name in broker.topics:
            raise _Refused(f"{name!r} is a topic: send to /topic/{name}", receipt)
        rid = self._next_rid
        self._next_rid = rid + 1
        result = broker.send(self.session_id, rid, name, frame.body, now, headers=user_headers,
                             persistent=headers.get("persistent") == "true", priority=priority,
                             tx=tx)
        if result is LATER:
            self._pending[rid] = _NO_RECEIPT if receipt is None else (receipt,)
        elif receipt is not None:
            self._out.append(_receipt_frame(receipt, self.codec.version))

    def _on_subscribe(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        receipt = headers.get("receipt")
        destination = headers["destination"]
        sub_id = headers.get("id", destination)  # STOMP 1.0: id is optional
        if sub_id in self._subs:
            raise _Refused(f"subscription id {sub_id!r} is already in use on this connection",
                           receipt)
        try:
            mode = AckMode(headers.get("ack", "auto"))
        except ValueError:
            raise _Refused(f"ack must be auto, client or client-individual, not "
                           f"{headers.get('ack', '')[:40]!r}", receipt) from None
        prefetch = self._prefetch(headers, receipt)
        is_topic, name = self._destination(destination, receipt)
        broker = self.server.broker
        number = self._next_sub
        self._next_sub += 1
        later_rid = 0
        durable = owned = False
        if is_topic:
            self._ensure_topic(name, now, receipt)
            durable_name = next((headers[h] for h in DURABLE_SUBSCRIPTION_HEADERS
                                 if headers.get(h)), None)
            durable = durable_name is not None
            owned = not durable
            sub_name = durable_name or f"stomp-{self.session_id}-{number}"
            rid = self._new_rid()
            if broker.topic_subscribe(self.session_id, rid, name, sub_name, now,
                                      durable=durable) is LATER:
                later_rid = rid
            queue = f"{name}{SUBSCRIPTION_SEPARATOR}{sub_name}"
        else:
            if name in broker.topics:
                raise _Refused(f"{name!r} is a topic: subscribe to /topic/{name}", receipt)
            queue = name
        sub = _Subscription(sub_id, number, destination, queue, mode, self.codec.version,
                            owned=owned, durable=durable)
        self._subs[sub_id] = sub
        self._subs_by_number[number] = sub
        broker.subscribe(self.session_id, number, queue, now, prefetch=prefetch, ack="client")
        if later_rid:
            self._pending[later_rid] = _NO_RECEIPT if receipt is None else (receipt,)
        elif receipt is not None:
            self._out.append(_receipt_frame(receipt, self.codec.version))

    def _on_unsubscribe(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        receipt = headers.get("receipt")
        sub_id = headers.get("id", headers.get("destination"))
        if sub_id is None:
            raise _Refused("UNSUBSCRIBE needs an id (or, in STOMP 1.0, a destination)", receipt)
        sub = self._subs.pop(sub_id, None)
        if sub is None:
            raise _Refused(f"unknown subscription {sub_id!r}: no such SUBSCRIBE on this "
                           f"connection", receipt)
        del self._subs_by_number[sub.number]
        broker = self.server.broker
        if sub.mode is AckMode.AUTO:
            self._ack_auto()
        for tag, message_id in sub.unacked.items():
            self._unacked.pop(tag, None)
            self._by_message_id.pop(message_id, None)
        sub.unacked.clear()
        broker.unsubscribe(self.session_id, sub.number, now)
        result: Any = {}
        rid = self._new_rid()
        if sub.owned:
            broker.queue_delete(self.session_id, rid, sub.dest_queue, now)
        elif sub.durable and any(h in headers for h in DURABLE_SUBSCRIPTION_HEADERS):
            result = broker.queue_delete(self.session_id, rid, sub.dest_queue, now)
        self._answer(rid, result, receipt)

    def _on_ack(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        receipt = headers.get("receipt")
        version = self.codec.version
        ack_id = headers["id"] if version == "1.2" else headers["message-id"]
        tag = self._tag(ack_id)
        if tag is None:
            raise _Refused(f"unknown ack id {ack_id!r}: not an unacknowledged message of this "
                           f"connection", receipt)
        sub = self._unacked[tag]
        if sub.mode is AckMode.CLIENT:  # cumulative: this one and every earlier one
            tags = []
            for earlier in sub.unacked:
                if earlier > tag:
                    break
                tags.append(earlier)
        else:
            tags = [tag]
        unacked = sub.unacked
        for each in tags:
            message_id = unacked.pop(each)
            del self._unacked[each]
            if version != "1.2":
                self._by_message_id.pop(message_id, None)
        tx_name = headers.get("transaction")
        tx = self._transaction(tx_name, receipt) if tx_name is not None else None
        broker = self.server.broker
        if frame.command == "NACK":
            broker.nack(self.session_id, tags, now, requeue=True, tx=tx)
        elif tx is None:
            self._ack_batch.extend(tags)  # written as one record with its neighbours
            if receipt is not None:
                self._ack_receipts.append(receipt)
            return
        else:
            broker.ack(self.session_id, 0, tags, now, tx=tx)
        if receipt is not None:
            self._out.append(_receipt_frame(receipt, version))

    def _on_begin(self, frame: Frame, now: int) -> None:
        name = frame.headers["transaction"]
        receipt = frame.headers.get("receipt")
        if name in self._transactions:
            raise _Refused(f"transaction {name!r} is already open on this connection", receipt)
        self._transactions[name] = self.server.broker.tx_begin(self.session_id)["tx"]
        if receipt is not None:
            self._out.append(_receipt_frame(receipt, self.codec.version))

    def _on_commit(self, frame: Frame, now: int) -> None:
        name = frame.headers["transaction"]
        receipt = frame.headers.get("receipt")
        tx = self._transaction(name, receipt)
        del self._transactions[name]
        rid = self._new_rid()
        self._answer(rid, self.server.broker.tx_commit(self.session_id, rid, tx, now), receipt)

    def _on_abort(self, frame: Frame, now: int) -> None:
        name = frame.headers["transaction"]
        receipt = frame.headers.get("receipt")
        tx = self._transaction(name, receipt)
        del self._transactions[name]
        self.server.broker.tx_rollback(self.session_id, tx, now)
        if receipt is not None:
            self._out.append(_receipt_frame(receipt, self.codec.version))

    def _on_disconnect(self, frame: Frame, now: int) -> None:
        self._disconnecting = True
        self._disconnect_receipt = frame.headers.get("receipt")
        self._ack_auto()
        self._finish_disconnect()

    def _finish_disconnect(self) -> None:
        """Once nothing is pending: the DISCONNECT receipt, then close."""
        if self._pending or self.closed:
            return
        if self._disconnect_receipt is not None:
            self._out.append(_receipt_frame(self._disconnect_receipt, self.codec.version))
            self._disconnect_receipt = None
        self._close()

    # ------------------------------------------------------------- helpers
    def _new_rid(self) -> int:
        rid = self._next_rid
        self._next_rid = rid + 1
        return rid

    def _answer(self, rid: int, result: Any, receipt: str | None) -> None:
        if result is LATER:
            self._pending[rid] = _NO_RECEIPT if receipt is None else (receipt,)
        elif receipt is not None:
            self._out.append(_receipt_frame(receipt, self.codec.version))

    def _flush_acks(self, now: int) -> None:
        tags, self._ack_batch = self._ack_batch, []
        receipts, self._ack_receipts = self._ack_receipts, []
        rid = self._new_rid()
        result = self.server.broker.ack(self.session_id, rid, tags, now)
        if result is LATER:
            self._pending[rid] = receipts
        else:
            version = self.codec.version
            self._out.extend(_receipt_frame(r, version) for r in receipts)

    def _destination(self, destination: str, receipt: str | None) -> tuple[bool, str]:
        """``(is_topic, core name)`` of ``/queue/NAME`` or ``/topic/NAME``."""
        if destination.startswith(QUEUE_PREFIX):
            name, is_topic = destination[len(QUEUE_PREFIX):], False
        elif destination.startswith(TOPIC_PREFIX):
            name, is_topic = destination[len(TOPIC_PREFIX):], True
        else:
            raise _Refused(f"unsupported destination {destination[:80]!r}: use /queue/NAME or "
                           f"/topic/NAME", receipt)
        if not name:
            raise _Refused(f"destination {destination!r} has an empty name", receipt)
        return is_topic, name

    def _ensure_topic(self, name: str, now: int, receipt: str | None) -> None:
        broker = self.server.broker
        if name in broker.topics:
            return
        if name in broker.queues:
            raise _Refused(f"{name!r} is a queue: use /queue/{name}", receipt)
        rid = self._new_rid()
        if broker.queue_declare(self.session_id, rid, name, now, kind="topic") is LATER:
            self._pending[rid] = _NO_RECEIPT

    def _transaction(self, name: str, receipt: str | None) -> int:
        tx = self._transactions.get(name)
        if tx is None:
            raise _Refused(f"unknown transaction {name!r}: no BEGIN for it on this connection",
                           receipt)
        return tx

    def _prefetch(self, headers: dict[str, str], receipt: str | None) -> int | None:
        text = next((headers[h] for h in PREFETCH_HEADERS if h in headers), None)
        if text is None:
            return None
        if not text.isdigit() or int(text) < 1:
            raise _Refused(f"prefetch-count must be a positive integer, not {text[:20]!r}",
                           receipt)
        return min(int(text), self.server.broker.limits.max_unacked_per_consumer)

    def _tag(self, ack_id: str) -> int | None:
        if self.codec.version != "1.2":
            return self._by_message_id.get(ack_id)
        if not ack_id.isdigit():
            return None
        tag = int(ack_id)
        return tag if tag in self._unacked else None

    # ------------------------------------------------------------- SessionSink
    def answer_later(self, rid: int, result: Any) -> None:
        """A request is durable: write its receipts (and finish a waiting DISCONNECT)."""
        receipts = self._pending.pop(rid, None)
        if receipts:
            version = self.codec.version
            self._out.extend(_receipt_frame(r, version) for r in receipts)
        if self._disconnecting and not self._pending:
            self._finish_disconnect()

    def fail_later(self, rid: int, error: BrokerError) -> None:
        """A request failed once it reached the store: ERROR, then close."""
        receipts = self._pending.pop(rid, None)
        receipt = receipts[0] if receipts else None
        self._fatal(error.message, receipt, f"{error.code.name}: {error.message}")

    def deliver(self, sub: int, data: dict[str, Any]) -> None:
        """Encode a MESSAGE frame for subscription number ``sub``."""
        subscription = self._subs_by_number.get(sub)
        if subscription is None or self.closed:
            return
        tag: int = data["tag"]
        body: bytes = data["body"]
        message_id = str(data["seq"])
        version = self.codec.version
        parts = [subscription.header, "message-id:", message_id, "\n"]
        if subscription.mode is AckMode.AUTO:
            self._auto_tags.append(tag)
        else:
            subscription.unacked[tag] = message_id
            self._unacked[tag] = subscription
            if version == "1.2":
                parts += ("ack:", str(tag), "\n")
            else:
                self._by_message_id[message_id] = tag
        if data["redelivered"]:
            parts.append("redelivered:true\n")
        user_headers: dict[str, str] = data["headers"]
        if user_headers:
            for name, value in user_headers.items():
                if name in SEND_RESERVED_HEADERS:
                    continue
                if version == "1.0" and ("\n" in value or "\n" in name or ":" in name):
                    continue  # STOMP 1.0 cannot escape: such a header cannot travel
                parts += (escape(name, version), ":", escape(value, version), "\n")
        parts += ("content-length:", str(len(body)), "\n\n")
        self._out.append("".join(parts).encode() + body + b"\x00")

    def push(self, event: str, data: dict[str, Any]) -> None:
        """``cancelled`` (the subscription's queue was deleted): ERROR, then close."""
        if event != "cancelled":
            return
        sub = self._subs_by_number.pop(data.get("sub", 0), None)
        if sub is None:
            return
        self._subs.pop(sub.id, None)
        self._fatal(f"subscription {sub.id!r} was cancelled by the broker: "
                    f"{data.get('reason', '')}", None)

    def flush(self) -> None:
        """Write everything gathered in one call; auto-ack what was written."""
        if self._out:
            if not self.closed and self.transport is not None:
                self.transport.write(b"".join(self._out))
                self.last_write = self.loop.time()
            self._out.clear()
        if self._auto_tags and not self._auto_scheduled and not self._write_paused \
                and not self.closed:
            self._auto_scheduled = True
            self.loop.call_soon(self._ack_auto)
        if (self._read_paused and not self.closed and self.transport is not None
                and len(self._pending) <= self.server.config.max_pending_requests // 2):
            self._read_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Shutdown: write what is gathered, then close."""
        self.flush()
        self._close()

    # ------------------------------------------------------------- auto ack
    def _ack_auto(self) -> None:
        """Acknowledge ``ack:auto`` deliveries that were handed to the socket."""
        self._auto_scheduled = False
        tags, self._auto_tags = self._auto_tags, []
        if not tags or not self.authenticated:
            return
        try:
            self.server.broker.ack(self.session_id, 0, tags, self.server.now())
        except TxBrokerError:  # the session is gone (closing): the core requeued them
            return
        self.server.run_effects()

    # ------------------------------------------------------------- closing
    def _fatal(self, message: str, receipt: str | None, detail: str = "") -> None:
        """ERROR frame (after what is already gathered), then close."""
        if self.closed:
            return
        log.info("STOMP error to %s: %s", self.peer, message)
        self._out.append(encode_error(message, receipt, self.codec.version, detail))
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.flush()
        self.closed = True
        self._cancel_timers()
        if self.transport is not None:
            self.transport.close()
        # forget (roll back, redeliver) soon, not from inside the effect runner
        self.loop.call_soon(self.server.forget, self)

    def _cancel_timer(self, index: int) -> None:
        timer = self._timers[index]
        if timer is not None:
            timer.cancel()
            self._timers[index] = None

    def _cancel_timers(self) -> None:
        for index in range(len(self._timers)):
            self._cancel_timer(index)

    def _connect_timeout(self) -> None:
        self._timers[0] = None
        if not self.authenticated and not self.closed:
            self._fatal(f"no CONNECT frame within {self.settings.connect_timeout_s:g} s", None)

    def _beat(self) -> None:
        """Write a heart-beat if nothing else was written for half the interval."""
        if self.closed or self.transport is None:
            return
        half = self._heartbeat_out_s / 2
        if self.loop.time() - self.last_write >= half:
            self.transport.write(b"\n")
            self.last_write = self.loop.time()
        self._timers[1] = self.loop.call_later(half, self._beat)

    def _check_alive(self) -> None:
        """Drop a client that was silent for longer than the grace period."""
        if self.closed:
            return
        if self._read_paused:  # we stopped reading (back-pressure): not the client's silence
            self.last_read = self.loop.time()
        silent = self.loop.time() - self.last_read
        if silent >= self._heartbeat_in_s:
            log.info("STOMP client %s silent for %.1f s: dropped", self.peer, silent)
            self._fatal(f"no heart-beat from the client for {silent * 1000:.0f} ms "
                        f"(agreed interval x grace = {self._heartbeat_in_s * 1000:.0f} ms)", None)
            return
        self._timers[2] = self.loop.call_later(self._heartbeat_in_s - silent, self._check_alive)


async def start_stomp_listener(server: BrokerServer, host: str, port: int,
                               settings: StompSettings | None = None) -> asyncio.Server:
    """Listen for STOMP clients on ``host:port`` (0 = any free port) for ``server``.

    Call after ``await server.start()``; close the returned server on shutdown
    (its connections are in ``server.connections`` and closed by ``server.stop``).
    """
    from txbroker.server.app import is_loopback

    settings = settings or StompSettings()
    settings.validate()
    if server.auth.open and not is_loopback(host):
        raise ValueError(f"no users are configured: the broker runs open and only on "
                         f"loopback; refusing to listen for STOMP on {host}")
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(
        lambda: StompServerConnection(server, server.new_session_id(), settings),
        host, port, reuse_address=True, backlog=1024)
    bound = listener.sockets[0].getsockname()
    log.info("STOMP on %s:%d", bound[0], bound[1])
    return listener
