"""One AMQP channel: its methods as operations of the connection's session.

Theory of operation
-------------------
A connection (``connection.py``) has one core session (``server/ops``) and up to
``channel_max`` channels; each :class:`Channel` turns the methods of its channel into
operations of that session and their outcomes into methods. What
the channel owns:

* **ordered replies**: AMQP answers a channel's synchronous methods in order,
  and some answers wait for the store (``queue.declare-ok`` once the queue's
  record is durable, ``tx.commit-ok``, a publisher confirm). Every output of the
  channel goes through one queue of :class:`Pending` entries; an entry waits for
  the request ids it names and is written, in order, once all are answered.
* **delivery tags** are per channel (1, 2, …) and map to the session's core tags;
  ``multiple`` acks cover every unacked tag up to the one named. As in RabbitMQ,
  the unacked messages of a cancelled consumer (``basic.cancel``) stay with the
  channel, and so do those whose ack or reject a ``tx.rollback`` undid: acking them
  later works; they go back to their queue when the channel closes (or on
  ``basic.recover``, or a nack with requeue). A tag whose message went back
  (``basic.recover``) may still be acked: that ack does nothing, the message is
  redelivered. Any other unknown tag is 406, as in RabbitMQ.
* **consumers**: one core subscription each, prefetch from ``basic.qos`` (per
  consumer); a ``no_ack`` consumer's deliveries are acknowledged by the edge once
  written to the socket, while its write buffer is below the high-water mark (as
  STOMP's ``ack:auto``), so TCP back-pressure bounds what is in flight.
* **transactions** (``tx.select``): one core local transaction at a time, begun
  again after each commit or rollback; publishes and acks of the channel go
  into it. **Confirms** (``confirm.select``): ``basic.ack`` once every queue the
  message was routed to has it durably (``basic.nack`` if one refused it).

The methods themselves: cancelling and closing here; ``basic.publish`` and
publisher confirms in ``publishing.py``; ``basic.qos/consume/get``, the
acknowledgements and ``tx.*`` in ``consuming.py``; declarations in ``declares.py``
(each a function of the channel).

A refusal raises :class:`~txbroker.server.edges.amqp.model.ChannelError`; the
connection closes the channel (or, ``hard``, itself) with its reply code.
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from pamqp import commands

from txbroker.errors import (
    AlreadyExists,
    BadRequest,
    BrokerError,
    Disabled,
    Forbidden,
    IllegalState,
    MessageTooLarge,
    NotAuthenticated,
    NotFound,
    QuotaExceeded,
    ShuttingDown,
    TooManyUnacked,
    TransactionError,
)
from txbroker.protocol.amqp import AmqpConnection, ReplyCode
from txbroker.server.edges.amqp.content import (
    PropertyTexts,
    delivery_facts,
    delivery_wire,
)
from txbroker.server.edges.amqp.model import ChannelError
from txbroker.server.edges.amqp.state import INTERNAL_PREFIX, AmqpState
from txbroker.server.ops import Delivery, Session

#: Prefixes of the names the server makes (RabbitMQ's).
SERVER_NAMED_PREFIX: Final = "amq.gen-"
CONSUMER_TAG_PREFIX: Final = "amq.ctag-"


class ConnectionPort(Protocol):
    """What a channel needs from its connection."""

    codec: AmqpConnection
    session: Session | None
    state: AmqpState
    texts: PropertyTexts

    def write(self, data: bytes) -> None:
        """Queue bytes for the socket."""

    def new_rid(self) -> int:
        """A request id, unique on the connection."""

    def new_sub(self) -> int:
        """A core subscription number, unique on the connection."""

    def expect(self, rid: int, channel: Channel, pending: Pending) -> None:
        """Route the core's later answer to ``rid`` to ``pending`` of ``channel``."""

    def own_sub(self, sub: int, channel: Channel | None) -> None:
        """Route deliveries of subscription ``sub`` to ``channel`` (None: forget it)."""

    def settle_when_written(self, core_tag: int) -> None:
        """A ``no_ack`` delivery: acknowledge it once handed to the socket."""

    def acks_staged(self, channel: Channel) -> None:
        """``channel`` staged acks (``consuming.basic_ack``): acknowledge them before
        the next method of another kind or channel, and at the end of the read."""

    def confirm_later(self, channel: Channel) -> None:
        """``channel`` has publisher confirms to write (:meth:`Channel.take_confirms`)
        before the next bytes of the connection."""

    def run_guarded(self, channel: Channel, run: Callable[[], None]) -> None:
        """Run a callback of the effect runner for ``channel``: a refusal closes the
        channel (or the connection), never the effect runner."""


class ChannelState(enum.Enum):
    """A channel's life."""

    OPEN = "open"
    #: we sent channel.close: everything but close / close-ok is dropped (spec 2.3.5)
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(slots=True)
class Pending:
    """Output waiting for ``waiting`` answers; ``render`` writes it once they are in."""

    waiting: int
    render: Callable[[Pending], None]
    results: list[Any] = field(default_factory=list)
    error: BrokerError | None = None
    delivery: Delivery | None = None


@dataclass(slots=True)
class Consumer:
    """A ``basic.consume`` of the channel."""

    tag: str
    sub: int
    queue: str
    no_ack: bool


def reply_code_of(error: BrokerError) -> tuple[ReplyCode, bool]:
    """The AMQP reply code for a refusal of the core or the operation layer, and
    whether it closes the connection (hard) rather than the channel."""
    if isinstance(error, NotFound):
        return ReplyCode.NOT_FOUND, False
    if isinstance(error, Forbidden | NotAuthenticated):
        return ReplyCode.ACCESS_REFUSED, False
    if isinstance(error, AlreadyExists | BadRequest | IllegalState | MessageTooLarge |
                  QuotaExceeded | Disabled | TooManyUnacked | TransactionError):
        return ReplyCode.PRECONDITION_FAILED, False
    if isinstance(error, ShuttingDown):
        return ReplyCode.CONNECTION_FORCED, True
    return ReplyCode.INTERNAL_ERROR, True


def as_channel_error(error: BrokerError) -> ChannelError:
    """A core refusal as the ChannelError its client is told."""
    code, hard = reply_code_of(error)
    return ChannelError(code, f"{code.name} - {error.message}", hard=hard)


class Channel:
    """One open channel of a connection (module docstring)."""

    def __init__(self, conn: ConnectionPort, number: int) -> None:
        self.conn = conn
        self.number = number
        self.state = ChannelState.OPEN
        self.out: deque[Pending] = deque()
        self.prefetch = 0
        self.consumers: dict[str, Consumer] = {}
        #: channel delivery tag -> (core tag, core subscription or 0 for basic.get)
        self.unacked: dict[int, tuple[int, int]] = {}
        #: channel tags whose messages went back to their queue (acks of them: no-op)
        self.given_back: set[int] = set()
        self.next_tag = 1
        self.tx: int | None = None
        #: the (channel tag, core tag, subscription) of each ack, nack or reject staged in
        #: the open transaction: unacked again if it rolls back (as RabbitMQ)
        self.tx_settled: list[tuple[int, int, int]] = []
        self.confirming = False
        self.next_confirm = 1
        #: the highest publish sequence number confirmed (basic.ack) on the wire, and
        #: the highest one confirmed but not yet written (``take_confirms``)
        self.confirmed = 0
        self.confirm_upto = 0
        self.last_queue = ""
        #: request ids of this channel's publishes not yet answered by the core
        self.publishing: set[int] = set()
        #: basic.acks read and checked, not yet given to the core: the core tags of each
        #: and the channel tags they settled (``consuming.flush_acks``)
        self.staged_acks: list[tuple[list[int], dict[int, tuple[int, int]]]] = []

    @property
    def session(self) -> Session:
        """The connection's (authenticated) core session."""
        session = self.conn.session
        assert session is not None
        return session

    # ------------------------------------------------------------------ output
    def send(self, method: Any) -> None:
        """A method frame, in order after what is pending."""
        self.emit(self.conn.codec.send_method(self.number, method))

    def emit(self, data: bytes) -> None:
        """Bytes for the socket, in order after what is pending."""
        if self.out:
            self.out.append(Pending(0, lambda _: self._write(data)))
        else:
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.state is ChannelState.OPEN:
            self.conn.write(data)

    def later(self, rids: list[int], render: Callable[[Pending], None],
              saves: int = 0) -> Pending:
        """Output written once the core answered ``rids`` and ``saves`` definition
        snapshots are durable."""
        pending = Pending(len(rids) + saves, render)
        for rid in rids:
            self.conn.expect(rid, self, pending)
        self.out.append(pending)
        if saves:
            self.conn.state.save(lambda error: self.conn.run_guarded(
                self, lambda: self.answered(pending, None, error)))
        self.pump()
        return pending

    def answered(self, pending: Pending, result: Any, error: BrokerError | None) -> None:
        """One of ``pending``'s answers arrived."""
        pending.waiting -= 1
        if error is not None and pending.error is None:
            pending.error = error
        if result is not None:
            pending.results.append(result)
        self.pump()

    def pump(self) -> None:
        """Write the ready entries at the head of the queue."""
        out = self.out
        while out and out[0].waiting <= 0:
            pending = out.popleft()
            if self.state is not ChannelState.OPEN:
                continue
            pending.render(pending)

    def after_publishes(self, run: Callable[[bool], None]) -> None:
        """Run ``run`` once this channel's earlier publishes are in their queues (a
        message published before a ``basic.get``, a purge or a count on the same
        channel is seen by it, as in RabbitMQ). ``run(True)``: it runs at the head
        of the output queue and may write directly."""
        if not self.publishing:
            run(False)
            return
        pending = Pending(len(self.publishing), lambda _: run(True))
        for rid in self.publishing:
            self.conn.expect(rid, self, pending)
        self.out.append(pending)

    def reply_now(self, at_head: bool, method: Any) -> None:
        """A method written at once (``at_head``) or in order after what is pending."""
        if at_head:
            self._write(self.conn.codec.send_method(self.number, method))
        else:
            self.send(method)

    # ------------------------------------------------------------------ helpers of the methods
    def reply(self, nowait: Any, method: Any, *, rids: list[int] | None = None,
               saves: int = 0) -> None:
        """``method`` as the reply (none if ``nowait``), once ``rids`` are answered and
        ``saves`` definition snapshots are durable."""
        if not rids and not saves:
            if not nowait:
                self.send(method)
            return
        self.later(rids or [], lambda p: self.ok(p, None if nowait else method), saves)

    def ok(self, pending: Pending, method: Any) -> None:
        """Render a reply that waited: ``method``, or the refusal one answer brought."""
        if pending.error is not None:
            raise as_channel_error(pending.error)
        if method is not None:
            self.conn.write(self.conn.codec.send_method(self.number, method))

    def queue_name(self, name: str) -> str:
        """The queue a method names ("" = the channel's last declared queue)."""
        if not name:
            if not self.last_queue:
                raise ChannelError(ReplyCode.NOT_FOUND,
                                   "NOT_FOUND - no previously declared queue")
            return self.last_queue
        if name.startswith(INTERNAL_PREFIX):
            raise ChannelError(ReplyCode.ACCESS_REFUSED,
                               f"ACCESS_REFUSED - queue '{name}' is the broker's own")
        return name

    def existing_queue(self, name: str) -> str:
        """An existing queue's name (404 if none; 405 if another connection's
        exclusive queue)."""
        queue = self.queue_name(name)
        if queue not in self.session.core.queues:
            raise ChannelError(ReplyCode.NOT_FOUND,
                               f"NOT_FOUND - no queue '{queue}' in vhost '/'")
        owner = self.conn.state.exclusive_owner.get(queue)
        if owner is not None and owner != self.session.id:
            raise ChannelError(ReplyCode.RESOURCE_LOCKED,
                               f"RESOURCE_LOCKED - cannot obtain exclusive access to locked "
                               f"queue '{queue}' in vhost '/'")
        return queue

    # ------------------------------------------------------------------ consuming
    def _basic_cancel(self, m: Any, now: int) -> None:
        consumer = self.consumers.get(m.consumer_tag)
        if consumer is not None:
            self.cancel_consumer(consumer, now, keep_unacked=True)
        if not m.nowait:
            self.send(commands.Basic.CancelOk(m.consumer_tag))

    def cancel_consumer(self, consumer: Consumer, now: int, *,
                        keep_unacked: bool = False) -> None:
        """End a consumer: its unacked messages go back to the queue, or, with
        ``keep_unacked`` (``basic.cancel``, as RabbitMQ), stay the channel's to ack."""
        del self.consumers[consumer.tag]
        self.conn.own_sub(consumer.sub, None)
        session = self.session
        if not keep_unacked or session.ended:  # (kept: the channel's unacked tags stay)
            self.give_back(sub=consumer.sub)
        self.conn.state.consumer_ended(consumer.queue, session.id, consumer.sub)
        if not session.ended:
            with contextlib.suppress(NotFound):
                session.unsubscribe(consumer.sub, now, keep_unacked=keep_unacked)
        self.conn.state.consumer_gone(consumer.queue, now)

    def give_back(self, *, sub: int | None = None) -> list[int]:
        """Forget unacked tags (of subscription ``sub``, or all); the core tags of
        those the core still has (not gone with a deleted queue), newest first: nacked
        in that order, each goes to the front of its queue, so the oldest is first
        again (the order they were delivered in, as RabbitMQ)."""
        tags = [t for t, (_, s) in self.unacked.items() if sub is None or s == sub]
        core_tags = []
        for tag in tags:
            core_tags.append(self.unacked.pop(tag)[0])
            self.given_back.add(tag)
        core_tags = self.still_delivered(core_tags)
        core_tags.sort(reverse=True)
        return core_tags

    def still_delivered(self, core_tags: list[int]) -> list[int]:
        """The core tags that are still unacked deliveries of the session (a deleted
        queue takes its delivered messages with it)."""
        session = self.session
        core = session.core.sessions.get(session.id)
        if core is None:  # (the session ended)
            return core_tags
        delivered = core.deliveries
        return [t for t in core_tags if t in delivered]

    def deliver(self, delivery: Delivery, consumer_tag: str,
                no_ack: bool | None = None) -> None:
        """A message for one of this channel's consumers: basic.deliver (``no_ack``:
        the consumer's, if the caller knows it)."""
        auto = self._no_ack(delivery.sub) if no_ack is None else no_ack
        tag = self.tag_for(delivery, delivery.sub, auto=auto)
        if auto:
            self.conn.settle_when_written(delivery.tag)
        wire = delivery_wire(delivery.message, self.conn.texts)
        data = None if wire is None else self.conn.codec.send_deliver(
            self.number, consumer_tag, tag, delivery.redelivered, wire[1], wire[2], wire[0],
            delivery.body)
        if data is None:  # (the message's properties are made, or pamqp writes the method)
            properties, exchange, key = delivery_facts(delivery.message)
            data = self.conn.codec.send_content(
                self.number, commands.Basic.Deliver(consumer_tag, tag, delivery.redelivered,
                                                    exchange, key), properties, delivery.body)
        self.emit(data)

    def _no_ack(self, sub: int) -> bool:
        return any(c.no_ack for c in self.consumers.values() if c.sub == sub)

    def tag_for(self, delivery: Delivery, sub: int, *, auto: bool) -> int:
        """The channel's next delivery tag for ``delivery`` (of subscription ``sub``, 0
        for basic.get), unacked until settled unless ``auto`` (no_ack)."""
        tag = self.next_tag
        self.next_tag += 1
        if not auto:
            self.unacked[tag] = (delivery.tag, sub)
        return tag

    def _flow(self, m: Any, now: int) -> None:
        self.send(commands.Channel.FlowOk(bool(m.active)))

    def describe(self) -> dict[str, Any]:
        """What the connections list shows of this channel (``Operations.connections``)."""
        return {
            "number": self.number,
            "state": self.state.value,
            "consumers": len(self.consumers),
            "consumer_tags": sorted(self.consumers),
            "prefetch": self.prefetch,
            "unacked": len(self.unacked),
            "mode": "tx" if self.tx is not None else "confirm" if self.confirming else "none",
        }

    # ------------------------------------------------------------------ closing
    def release(self, now: int, *, session_alive: bool) -> None:
        """The channel closes: consumers end, unacked messages go back, an open
        transaction rolls back (with ``session_alive`` False the session's end
        does the core's part)."""
        self.state = ChannelState.CLOSED
        self.out.clear()
        for consumer in list(self.consumers.values()):
            if session_alive:
                self.cancel_consumer(consumer, now)
            else:
                del self.consumers[consumer.tag]
                self.conn.own_sub(consumer.sub, None)
                self.conn.state.consumer_ended(consumer.queue, self.session.id, consumer.sub)
        if session_alive:
            core_tags = self.give_back()
            if core_tags:
                self.session.nack(core_tags, now, requeue=True)
            if self.tx is not None:
                self.session.tx_rollback(self.tx, now)
        self.tx = None


CHANNEL_METHODS: Final[dict[str, Callable[[Channel, Any, int], None]]] = {
    "Basic.Cancel": Channel._basic_cancel,
    "Channel.Flow": Channel._flow,
}
