"""STOMP frames into operations, operation results into STOMP frames (no I/O).

Theory of operation
-------------------
:class:`StompFrames` is the translating half of one STOMP connection
(``stomp.py`` is the asyncio half: socket, timers, heart-beats). Each client
frame becomes one or two calls on the connection's session (``ops.Session``);
every decision about the request — credentials, acks, back-pressure, the
broker's refusals — is the operation layer's, and a refusal
(:class:`~txbroker.errors.BrokerError`) becomes an ERROR frame whose body
starts with the error code. What is STOMP's own is kept here:

* ``/queue/NAME`` is the core queue ``NAME``; ``/topic/NAME`` the core topic
  ``NAME`` (declared on first use). SUBSCRIBE to a topic makes a subscription
  queue ``NAME::stomp-<session>-<n>`` owned by this connection, or a durable
  one ``NAME::<durable-subscription-name>``.
* Each frame the core may answer later (a persistent SEND, a COMMIT, ACKs, a
  durable topic subscription) gets a request id; its RECEIPT is written when
  the core's answer arrives (:meth:`StompFrames.answered`), i.e. once the
  record is durable. DISCONNECT's receipt waits until nothing is pending.
* Consecutive ACK frames of one read (outside transactions) are acknowledged
  with ONE operation (``Session.ack_groups``), hence one ``ACK`` record.
* Ack ids: in STOMP 1.2 a MESSAGE's ``ack`` header is its delivery tag behind
  a random prefix of this connection (``3f9a0c1e-17``), so an ACK's ``id`` is
  read as the tag, and an id of another connection — a client that failed
  over, whose new connection's tags start at 1 again — names no delivery of
  this one; STOMP 1.0/1.1 acknowledge by ``message-id``, so for them this
  connection keeps ``message-id -> tag`` (the only thing it keeps about
  deliveries). Whether a tag is an unacked delivery is the core's decision; an
  id that stands for no tag is refused by the same rule
  (``ops.unknown_delivery``). ``ack:client`` is cumulative: the operation layer
  expands a tag to the subscription's earlier ones (``Session.covered``).
* Transactions are core transactions: BEGIN = ``tx_begin``, COMMIT =
  ``tx_commit`` (one atomic ``TX`` record), ABORT = ``tx_rollback``.
* ``ack:auto`` subscriptions are client-ack subscriptions in the core; the
  MESSAGE frames' tags wait in :attr:`StompFrames.auto_tags` until the edge
  has handed them to the socket (``Session.settle_written``).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Final

from txbroker._version import __version__
from txbroker.core.queue_index import SUBSCRIPTION_SEPARATOR
from txbroker.errors import BrokerError
from txbroker.protocol.stomp import (
    PROTOCOL_HEADERS,
    Frame,
    StompConnection,
    StompProtocolError,
    encode_message_head,
    encode_receipt,
    message_head,
    negotiate_heartbeat,
    negotiate_version,
    parse_heartbeat,
)
from txbroker.server.ops import Delivery, Session, unknown_delivery
from txbroker.server.security.acl import CONSUME, SEND

#: Names of the SUBSCRIBE header that makes a topic subscription durable:
#: Artemis' name first, then ActiveMQ classic's.
DURABLE_SUBSCRIPTION_HEADERS: Final = ("durable-subscription-name", "activemq.subscriptionName")
#: Names of the SUBSCRIBE header giving the credit (unacked MESSAGE frames):
#: RabbitMQ's name first, then ActiveMQ classic's.
PREFETCH_HEADERS: Final = ("prefetch-count", "activemq.prefetchSize")
#: SEND headers that are the protocol's, not the message's: they are not stored.
SEND_RESERVED_HEADERS: Final = PROTOCOL_HEADERS
QUEUE_PREFIX: Final = "/queue/"
TOPIC_PREFIX: Final = "/topic/"
#: The versions offered in the ERROR of a CONNECT without a common version.
SUPPORTED: Final = "1.0,1.1,1.2"


class AckMode(enum.Enum):
    """The SUBSCRIBE ``ack`` header."""

    AUTO = "auto"
    CLIENT = "client"  #: an ACK acknowledges every earlier message of the subscription
    CLIENT_INDIVIDUAL = "client-individual"


class Refused(Exception):
    """A frame the broker refuses: ERROR frame (``message``, ``receipt-id``, a body
    of ``detail`` or the message), then close."""

    def __init__(self, message: str, receipt: str | None, detail: str = "") -> None:
        super().__init__(message)
        self.receipt = receipt
        self.detail = detail

    @classmethod
    def of(cls, error: BrokerError, receipt: str | None) -> Refused:
        """A refusal of the operation layer: the body starts with its code."""
        return cls(error.message, receipt, f"{error.code.name}: {error.message}")


class Subscription:
    """One SUBSCRIBE of this connection."""

    __slots__ = ("dest_queue", "destination", "durable", "head", "id", "mode", "number",
                 "owned")

    def __init__(self, sub_id: str, number: int, destination: str, dest_queue: str,
                 mode: AckMode, version: str, *, owned: bool, durable: bool) -> None:
        self.id = sub_id
        self.number = number  #: the core's subscription number
        self.destination = destination
        self.dest_queue = dest_queue  #: the core queue consumed
        self.mode = mode
        self.owned = owned  #: a non-durable topic subscription queue of this connection
        self.durable = durable  #: a durable topic subscription
        self.head = message_head(destination, sub_id, version)


class StompFrames:
    """Frames of one STOMP connection into operations of its session. See the
    module docstring. ``out`` gathers the bytes to write; ``on_connected(send_ms,
    expect_ms)`` is called after CONNECTED with the agreed heart-beats, and
    ``on_close()`` when the connection must close once ``out`` is written."""

    def __init__(self, codec: StompConnection, session: Session,
                 heartbeat_mins: tuple[int, int], on_connected: Callable[[int, int], None],
                 on_close: Callable[[], None]) -> None:
        self.codec = codec
        self.session = session
        self.out: list[bytes] = []
        self.auto_tags: list[int] = []  #: ``ack:auto`` deliveries to settle once written
        self.disconnecting = False
        self._heartbeat_mins = heartbeat_mins
        self._on_connected = on_connected
        self._on_close = on_close
        self._subs: dict[str, Subscription] = {}
        self._subs_by_number: dict[int, Subscription] = {}
        self._next_sub = 1
        #: STOMP 1.0/1.1: a MESSAGE's message-id -> (delivery tag, subscription number)
        self._ack_ids: dict[str, tuple[int, int]] = {}
        #: STOMP 1.2 ack ids are "<this prefix><tag>": tags restart at 1 on every
        #: connection (and broker), so a stale id from an earlier connection — a client
        #: that failed over — must not name a delivery of this one
        self._ack_prefix = secrets.token_hex(4) + "-"
        self._transactions: dict[str, int] = {}  #: STOMP name -> core tx id
        #: request id -> receipts due when the core answers it
        self._receipts: dict[int, Sequence[str]] = {}
        self._next_rid = 1
        self._ack_groups: list[list[int]] = []
        self._ack_receipts: list[str | None] = []
        self._disconnect_receipt: str | None = None
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

    # ------------------------------------------------------------- frames in
    def handle(self, frame: Frame, now: int) -> None:
        """Run one client frame (raises Refused or BrokerError to refuse it)."""
        if self._ack_groups and (frame.command != "ACK" or "transaction" in frame.headers):
            self.flush_acks(now)
        self._handlers[frame.command](frame, now)

    @property
    def pending(self) -> bool:
        """Requests still wait for the core's answer."""
        return bool(self._receipts)

    def _on_connect(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        version = negotiate_version(headers.get("accept-version"))
        if version is None:
            self.out.append(self.codec.send(Frame("ERROR", {
                "version": SUPPORTED,
                "message": f"Supported protocol versions are {SUPPORTED}",
            }, f"unsupported accept-version {headers.get('accept-version')!r}\n".encode())))
            self._on_close()
            return
        try:
            client_heartbeat = parse_heartbeat(headers.get("heart-beat"))
        except StompProtocolError as exc:
            raise Refused(str(exc), None) from None
        self.session.authenticate(headers.get("login"), headers.get("passcode"))
        out_ms, in_ms = negotiate_heartbeat(client_heartbeat, *self._heartbeat_mins)
        self.out.append(self.codec.send(Frame("CONNECTED", {
            "version": version,
            "heart-beat": f"{out_ms},{in_ms}",
            "session": str(self.session.id),
            "server": f"txbroker/{__version__}",
        })))
        self._on_connected(out_ms, in_ms)

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
                    raise Refused(f"priority must be 0 to 9, not {text[:20]!r}", receipt)
                priority = int(text)
        if is_topic:
            self._ensure_topic(name, now, receipt, SEND)
        elif name in self.session.core.topics:
            raise Refused(f"{name!r} is a topic: send to /topic/{name}", receipt)
        rid = self._new_rid()
        result = self.session.send(rid, name, frame.body, now, headers=user_headers,
                                   persistent=headers.get("persistent") == "true",
                                   priority=priority, tx=tx)
        self._answer(rid, result, receipt)

    def _on_subscribe(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        receipt = headers.get("receipt")
        destination = headers["destination"]
        sub_id = headers.get("id", destination)  # STOMP 1.0: id is optional
        if sub_id in self._subs:
            raise Refused(f"subscription id {sub_id!r} is already in use on this connection",
                          receipt)
        try:
            mode = AckMode(headers.get("ack", "auto"))
        except ValueError:
            raise Refused(f"ack must be auto, client or client-individual, not "
                          f"{headers.get('ack', '')[:40]!r}", receipt) from None
        prefetch = self._prefetch(headers, receipt)
        is_topic, name = self._destination(destination, receipt)
        session = self.session
        number = self._next_sub
        self._next_sub += 1
        later_rid = 0
        durable = owned = False
        if is_topic:
            self._ensure_topic(name, now, receipt, CONSUME)
            durable_name = next((headers[h] for h in DURABLE_SUBSCRIPTION_HEADERS
                                 if headers.get(h)), None)
            durable = durable_name is not None
            owned = not durable
            sub_name = durable_name or f"stomp-{session.id}-{number}"
            rid = self._new_rid()
            if session.started(rid, session.topic_subscribe(rid, name, sub_name, now,
                                                            durable=durable)):
                later_rid = rid
            queue = f"{name}{SUBSCRIPTION_SEPARATOR}{sub_name}"
        else:
            if name in session.core.topics:
                raise Refused(f"{name!r} is a topic: subscribe to /topic/{name}", receipt)
            queue = name
        sub = Subscription(sub_id, number, destination, queue, mode, self.codec.version,
                           owned=owned, durable=durable)
        self._subs[sub_id] = sub
        self._subs_by_number[number] = sub
        session.subscribe(number, queue, now, prefetch=prefetch, ack="client",
                          cumulative=mode is AckMode.CLIENT)
        if later_rid:
            self._receipts[later_rid] = () if receipt is None else (receipt,)
        elif receipt is not None:
            self.out.append(encode_receipt(receipt, self.codec.version))

    def _on_unsubscribe(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        receipt = headers.get("receipt")
        sub_id = headers.get("id", headers.get("destination"))
        if sub_id is None:
            raise Refused("UNSUBSCRIBE needs an id (or, in STOMP 1.0, a destination)", receipt)
        sub = self._subs.pop(sub_id, None)
        if sub is None:
            raise Refused(f"unknown subscription {sub_id!r}: no such SUBSCRIBE on this "
                          f"connection", receipt)
        del self._subs_by_number[sub.number]
        if sub.mode is AckMode.AUTO:
            self.settle_auto(now)
        self._forget_ack_ids(sub.number)
        session = self.session
        session.unsubscribe(sub.number, now)
        result: Any = {}
        rid = self._new_rid()
        if sub.owned:
            session.started(rid, session.delete_subscription(rid, sub.dest_queue, now))
        elif sub.durable and any(h in headers for h in DURABLE_SUBSCRIPTION_HEADERS):
            result = session.delete_subscription(rid, sub.dest_queue, now)
        self._answer(rid, result, receipt)

    def _on_ack(self, frame: Frame, now: int) -> None:
        headers = frame.headers
        receipt = headers.get("receipt")
        version = self.codec.version
        if version == "1.2":
            ack_id = headers["id"]
            number = ack_id.removeprefix(self._ack_prefix)
            tag = int(number) if number != ack_id and number.isdigit() and number.isascii() \
                else None
        else:
            ack_id = headers["message-id"]
            entry = self._ack_ids.pop(ack_id, None)
            tag = None if entry is None else entry[0]
        if tag is None:
            raise unknown_delivery(ack_id)
        session = self.session
        tags = session.covered(tag)
        if len(tags) > 1 and self._ack_ids:
            covered = set(tags)
            for message_id in [m for m, (t, _) in self._ack_ids.items() if t in covered]:
                del self._ack_ids[message_id]
        tx_name = headers.get("transaction")
        tx = self._transaction(tx_name, receipt) if tx_name is not None else None
        if frame.command == "NACK":
            session.nack(tags, now, requeue=True, tx=tx)
        elif tx is None:
            self._ack_groups.append(tags)  # written as one record with its neighbours
            self._ack_receipts.append(receipt)
            return
        else:
            session.ack(0, tags, now, tx=tx)
        if receipt is not None:
            self.out.append(encode_receipt(receipt, version))

    def _on_begin(self, frame: Frame, now: int) -> None:
        name = frame.headers["transaction"]
        receipt = frame.headers.get("receipt")
        if name in self._transactions:
            raise Refused(f"transaction {name!r} is already open on this connection", receipt)
        self._transactions[name] = self.session.tx_begin()
        if receipt is not None:
            self.out.append(encode_receipt(receipt, self.codec.version))

    def _on_commit(self, frame: Frame, now: int) -> None:
        name = frame.headers["transaction"]
        receipt = frame.headers.get("receipt")
        tx = self._transaction(name, receipt)
        del self._transactions[name]
        rid = self._new_rid()
        self._answer(rid, self.session.tx_commit(rid, tx, now), receipt)

    def _on_abort(self, frame: Frame, now: int) -> None:
        name = frame.headers["transaction"]
        receipt = frame.headers.get("receipt")
        tx = self._transaction(name, receipt)
        del self._transactions[name]
        self.session.tx_rollback(tx, now)
        if receipt is not None:
            self.out.append(encode_receipt(receipt, self.codec.version))

    def _on_disconnect(self, frame: Frame, now: int) -> None:
        self.disconnecting = True
        self._disconnect_receipt = frame.headers.get("receipt")
        self.settle_auto(now)
        self._finish_disconnect()

    def _finish_disconnect(self) -> None:
        """Once nothing is pending: the DISCONNECT receipt, then close."""
        if self._receipts:
            return
        if self._disconnect_receipt is not None:
            self.out.append(encode_receipt(self._disconnect_receipt, self.codec.version))
            self._disconnect_receipt = None
        self._on_close()

    # ------------------------------------------------------------- acks
    def flush_acks(self, now: int) -> None:
        """Acknowledge the batched ACK frames in one operation; Refused names the
        first refused frame's receipt (the frames before it count)."""
        if not self._ack_groups:
            return
        groups, self._ack_groups = self._ack_groups, []
        receipts, self._ack_receipts = self._ack_receipts, []
        rid = self._new_rid()
        outcome = self.session.ack_groups(rid, groups, now)
        if outcome.error is not None:
            raise Refused.of(outcome.error, receipts[outcome.refused])
        self._answer(rid, outcome.result, [r for r in receipts if r is not None])

    def settle_auto(self, now: int) -> None:
        """Acknowledge the ``ack:auto`` deliveries written so far."""
        tags, self.auto_tags = self.auto_tags, []
        if tags:
            self.session.settle_written(tags, now)

    # ------------------------------------------------------------- results out
    def message(self, delivery: Delivery) -> None:
        """A MESSAGE frame for a delivery (nothing if its subscription is gone)."""
        sub = self._subs_by_number.get(delivery.sub)
        if sub is None:
            return
        tag = delivery.tag
        message = delivery.message
        message_id = str(message.id)
        version = self.codec.version
        ack = None
        if sub.mode is AckMode.AUTO:
            self.auto_tags.append(tag)
        elif version == "1.2":
            ack = f"{self._ack_prefix}{tag}"
        else:
            self._ack_ids[message_id] = (tag, sub.number)
        self.out.extend((encode_message_head(  # head, body, NUL: one join copies the body once
            sub.head, message_id, len(delivery.body), version, ack=ack, headers=message.headers,
            redelivered=delivery.redelivered), delivery.body, b"\x00"))

    def answered(self, rid: int) -> None:
        """The core answered request ``rid``: its receipts (and a waiting DISCONNECT)."""
        receipts = self._receipts.pop(rid, None)
        if receipts:
            version = self.codec.version
            self.out.extend(encode_receipt(r, version) for r in receipts)
        if self.disconnecting and not self._receipts:
            self._finish_disconnect()

    def receipt_of(self, rid: int) -> str | None:
        """The (first) receipt waiting on request ``rid``, forgotten."""
        receipts = self._receipts.pop(rid, None)
        return receipts[0] if receipts else None

    def cancelled(self, number: int) -> str | None:
        """The broker ended subscription ``number``: its STOMP id (None: unknown)."""
        sub = self._subs_by_number.pop(number, None)
        if sub is None:
            return None
        self._subs.pop(sub.id, None)
        self._forget_ack_ids(number)
        return sub.id

    # ------------------------------------------------------------- helpers
    def _new_rid(self) -> int:
        rid = self._next_rid
        self._next_rid = rid + 1
        return rid

    def _answer(self, rid: int, result: Any, receipt: str | Sequence[str] | None) -> None:
        receipts: Sequence[str] = (() if receipt is None else
                                   (receipt,) if isinstance(receipt, str) else receipt)
        if self.session.started(rid, result):
            self._receipts[rid] = receipts
        else:
            version = self.codec.version
            self.out.extend(encode_receipt(r, version) for r in receipts)

    def _forget_ack_ids(self, number: int) -> None:
        if self._ack_ids:
            for message_id in [m for m, (_, n) in self._ack_ids.items() if n == number]:
                del self._ack_ids[message_id]

    def _destination(self, destination: str, receipt: str | None) -> tuple[bool, str]:
        """``(is_topic, core name)`` of ``/queue/NAME`` or ``/topic/NAME``."""
        if destination.startswith(QUEUE_PREFIX):
            name, is_topic = destination[len(QUEUE_PREFIX):], False
        elif destination.startswith(TOPIC_PREFIX):
            name, is_topic = destination[len(TOPIC_PREFIX):], True
        else:
            raise Refused(f"unsupported destination {destination[:80]!r}: use /queue/NAME or "
                          f"/topic/NAME", receipt)
        if not name:
            raise Refused(f"destination {destination!r} has an empty name", receipt)
        return is_topic, name

    def _ensure_topic(self, name: str, now: int, receipt: str | None, action: str) -> None:
        """Create topic ``name`` on first use, as allowed by ``action`` (send, consume)."""
        core = self.session.core
        if name in core.topics:
            return
        if name in core.queues:
            raise Refused(f"{name!r} is a queue: use /queue/{name}", receipt)
        rid = self._new_rid()
        if self.session.started(rid, self.session.ensure_topic(rid, name, now, action)):
            self._receipts[rid] = ()

    def _transaction(self, name: str, receipt: str | None) -> int:
        tx = self._transactions.get(name)
        if tx is None:
            raise Refused(f"unknown transaction {name!r}: no BEGIN for it on this connection",
                          receipt)
        return tx

    def _prefetch(self, headers: dict[str, str], receipt: str | None) -> int | None:
        text = next((headers[h] for h in PREFETCH_HEADERS if h in headers), None)
        if text is None:
            return None
        if not text.isdigit() or int(text) < 1:
            raise Refused(f"prefetch-count must be a positive integer, not {text[:20]!r}",
                          receipt)
        return min(int(text), self.session.core.limits.max_unacked_per_consumer)
