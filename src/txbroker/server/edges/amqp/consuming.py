"""A channel's consuming methods: ``basic.qos``, ``basic.consume``, ``basic.get``,
the acknowledgements (``basic.ack/nack/reject/recover``) and ``tx.*``.

Each function takes the :class:`~txbroker.server.edges.amqp.channel.Channel` the
method came on and the method (a pamqp command), as ``declares.py`` does. What
they keep on the channel: its unacked delivery tags (``Channel.unacked``, channel
tag -> core tag and subscription), the tags whose message went back
(``Channel.given_back``: acking one does nothing), and the open transaction with
what it settled (``Channel.tx``, ``Channel.tx_settled``). As in RabbitMQ, a
``tx.rollback`` leaves the messages whose ack, nack or reject it undoes unacked on
the channel under their tags (``core/local_tx.py``, ``keep_delivered``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Final

from pamqp import commands

from txbroker.errors import BrokerError
from txbroker.protocol.amqp import ReplyCode
from txbroker.server.edges.amqp.channel import (
    CONSUMER_TAG_PREFIX,
    Channel,
    Consumer,
    Pending,
    as_channel_error,
)
from txbroker.server.edges.amqp.content import delivery_facts
from txbroker.server.edges.amqp.model import ChannelError
from txbroker.server.security.acl import CONSUME

__all__ = ["CONSUMING_METHODS", "flush_acks"]


def basic_qos(channel: Channel, m: Any, now: int) -> None:
    """basic.qos: the prefetch of the channel's next consumers (per consumer)."""
    if m.prefetch_size:
        raise ChannelError(ReplyCode.NOT_IMPLEMENTED,
                           "NOT_IMPLEMENTED - prefetch_size!=0 "
                           f"({m.prefetch_size})", hard=True)
    channel.prefetch = int(m.prefetch_count)
    channel.send(commands.Basic.QosOk())


def basic_consume(channel: Channel, m: Any, now: int) -> None:
    """basic.consume: one core subscription, with the channel's prefetch."""
    queue = channel.existing_queue(m.queue)
    tag = m.consumer_tag or f"{CONSUMER_TAG_PREFIX}{uuid.uuid4().hex}"
    if tag in channel.consumers:
        raise ChannelError(ReplyCode.NOT_ALLOWED,
                           f"NOT_ALLOWED - attempt to reuse consumer tag '{tag}'", hard=True)
    state = channel.conn.state
    if queue in state.exclusive_consumer or (
            m.exclusive and channel.session.core.queues[queue].consumers):
        raise ChannelError(ReplyCode.ACCESS_REFUSED,
                           f"ACCESS_REFUSED - queue '{queue}' in vhost '/' in exclusive use")
    limit = channel.session.core.limits.max_unacked_per_consumer
    prefetch = min(channel.prefetch, limit) if channel.prefetch else None
    sub = channel.conn.new_sub()
    channel.conn.own_sub(sub, channel)
    try:
        channel.session.subscribe(sub, queue, now, prefetch=prefetch, ack="client")
    except BrokerError:
        channel.conn.own_sub(sub, None)
        raise
    if m.exclusive:
        state.exclusive_consumer[queue] = (channel.session.id, sub)
    channel.consumers[tag] = Consumer(tag, sub, queue, bool(m.no_ack))
    state.queue_used(queue)  # a consumer keeps an x-expires queue
    if not m.nowait:
        channel.send(commands.Basic.ConsumeOk(tag))


def basic_get(channel: Channel, m: Any, now: int) -> None:
    """basic.get: one message, after the channel's earlier publishes."""
    queue = channel.existing_queue(m.queue)
    channel.session.authorize(CONSUME, queue, "receive")
    channel.conn.state.queue_used(queue)
    no_ack = bool(m.no_ack)
    channel.after_publishes(lambda at_head: get_now(channel, queue, no_ack, at_head))


def get_now(channel: Channel, queue: str, no_ack: bool, at_head: bool) -> None:
    """The receive of a basic.get; ``at_head``: it runs at the head of the output."""
    session = channel.session
    if queue not in session.core.queues:  # deleted meanwhile
        channel.reply_now(at_head, commands.Basic.GetEmpty())
        return
    rid = channel.conn.new_rid()
    result = session.core.receive(session.id, rid, queue, channel.session.ops.now(), 0)
    if result is None:
        channel.reply_now(at_head, commands.Basic.GetEmpty())
        return
    session.started(rid, result)
    pending = Pending(1, lambda p: get_ok(channel, p, queue, no_ack))
    channel.conn.expect(rid, channel, pending)
    if at_head:
        channel.out.appendleft(pending)
    else:
        channel.out.append(pending)


def get_ok(channel: Channel, pending: Pending, queue: str, no_ack: bool) -> None:
    """basic.get-ok (or get-empty) once the core answered."""
    delivery = pending.delivery
    if delivery is None:
        channel.conn.write(channel.conn.codec.send_method(channel.number,
                                                          commands.Basic.GetEmpty()))
        return
    tag = channel.tag_for(delivery, 0, auto=no_ack)
    if no_ack:
        channel.session.ack(0, [delivery.tag], channel.session.ops.now())
    found = channel.session.core.queues.get(queue)
    left = found.ready_count if found is not None else 0
    properties, exchange, key = delivery_facts(delivery.message)
    channel.conn.write(channel.conn.codec.send_content(
        channel.number, commands.Basic.GetOk(tag, delivery.redelivered, exchange, key, left),
        properties, delivery.body))


# ---------------------------------------------------------------------- acknowledging


def settled(channel: Channel, tag: int, multiple: bool,
            taken: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """The core tags an ack/nack/reject names (406 for an unknown tag); in a
    transaction they are remembered, unacked again if it rolls back. A tag whose
    message went with its deleted queue (an auto-delete queue whose last consumer
    was cancelled, say) is settled without a word, as in RabbitMQ. ``taken`` gets
    the channel tags settled, with their core tag and subscription."""
    if multiple:
        tags = [t for t in channel.unacked if tag == 0 or t <= tag]
        if tag and not tags and tag not in channel.given_back and tag >= channel.next_tag:
            raise _unknown_tag(tag)
    elif tag in channel.unacked:
        tags = [tag]
    elif tag in channel.given_back:
        tags = []
    else:
        raise _unknown_tag(tag)
    core_tags = []
    for each in tags:
        channel.given_back.discard(each)
        core_tag, sub = channel.unacked.pop(each)
        core_tags.append(core_tag)
        if taken is not None:
            taken[each] = (core_tag, sub)
        if channel.tx is not None:
            channel.tx_settled.append((each, core_tag, sub))
    kept = channel.still_delivered(core_tags)
    if len(kept) != len(core_tags) and channel.tx is not None:
        channel.tx_settled = [s for s in channel.tx_settled if s[1] in kept]
    return kept


def basic_ack(channel: Channel, m: Any, now: int) -> None:
    """basic.ack (single or ``multiple``), staged in the transaction if any. Outside
    one, the acks a channel gets in a row are acknowledged together, by ONE core
    operation (hence one ``ACK`` record), as the STOMP edge does with its ACK frames:
    the connection calls :func:`flush_acks` before any other method and at the end of
    each read."""
    if channel.tx is not None:
        core_tags = settled(channel, m.delivery_tag, bool(m.multiple))
        if core_tags:
            channel.session.ack(0, core_tags, now, tx=channel.tx)
        return
    taken: dict[int, tuple[int, int]] = {}
    core_tags = settled(channel, m.delivery_tag, bool(m.multiple), taken)
    if core_tags:
        if len(taken) != len(core_tags):  # (only those the core still has count)
            kept = set(core_tags)
            taken = {t: entry for t, entry in taken.items() if entry[0] in kept}
        channel.staged_acks.append((core_tags, taken))
        channel.conn.acks_staged(channel)


def flush_acks(channel: Channel, now: int) -> None:
    """Acknowledge the channel's staged acks in one core operation. If the core
    refuses one, those before it count, and the channel's messages of those after it
    are unacked on the channel again (as if each ack had been its own operation: the
    channel then closes, giving them back)."""
    staged, channel.staged_acks = channel.staged_acks, []
    if not staged:
        return
    outcome = channel.session.ack_groups(0, [core_tags for core_tags, _ in staged], now)
    if outcome.error is None:
        return
    for _, taken in staged[outcome.refused + 1:]:
        channel.unacked.update(taken)
    raise as_channel_error(outcome.error)


def basic_nack(channel: Channel, m: Any, now: int) -> None:
    """basic.nack: requeue, or dead-letter (``requeue`` false)."""
    core_tags = settled(channel, m.delivery_tag, bool(m.multiple))
    if core_tags:
        channel.session.nack(core_tags, now, requeue=bool(m.requeue), tx=channel.tx)


def basic_reject(channel: Channel, m: Any, now: int) -> None:
    """basic.reject: one tag, as basic.nack."""
    core_tags = settled(channel, m.delivery_tag, False)
    if core_tags:
        channel.session.nack(core_tags, now, requeue=bool(m.requeue), tx=channel.tx)


def basic_recover(channel: Channel, m: Any, now: int) -> None:
    """basic.recover (and recover-async) with ``requeue``: every unacked message
    of the channel goes back; ``requeue=false`` is 540, as in RabbitMQ."""
    if not m.requeue:  # RabbitMQ 3.x (rabbit_channel.erl): not_implemented, "requeue=false"
        raise ChannelError(ReplyCode.NOT_IMPLEMENTED, "NOT_IMPLEMENTED - requeue=false",
                           hard=True)
    core_tags = channel.give_back()
    if core_tags:
        channel.session.nack(core_tags, now, requeue=True)
    if m.name == "Basic.Recover":
        channel.send(commands.Basic.RecoverOk())


# ---------------------------------------------------------------------- transactions


def tx_select(channel: Channel, m: Any, now: int) -> None:
    """tx.select: the channel's first local transaction."""
    if channel.confirming:
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           "PRECONDITION_FAILED - cannot switch from confirm to tx mode")
    if channel.tx is None:
        channel.tx = channel.session.tx_begin()
    channel.send(commands.Tx.SelectOk())


def tx_commit(channel: Channel, m: Any, now: int) -> None:
    """tx.commit: one record; commit-ok once durable; the next transaction begins."""
    tx = transaction(channel)
    rid = channel.conn.new_rid()
    result = channel.session.tx_commit(rid, tx, now)
    channel.tx = channel.session.tx_begin()
    channel.tx_settled = []
    channel.later([rid] if channel.session.started(rid, result) else [],
               lambda p: channel.ok(p, commands.Tx.CommitOk()))


def tx_rollback(channel: Channel, m: Any, now: int) -> None:
    """Staged publishes are dropped; the messages whose ack, nack or reject it
    undoes are unacked on the channel again, under their tags (RabbitMQ's
    ``tx.rollback``), and go back to their queue only when the channel closes."""
    tx = transaction(channel)
    session = channel.session
    session.tx_rollback(tx, now, keep_delivered=True)
    channel.tx = session.tx_begin()
    still = set(channel.still_delivered([core for _, core, _ in channel.tx_settled]))
    for tag, core_tag, sub in channel.tx_settled:
        if core_tag in still:
            channel.unacked[tag] = (core_tag, sub)
            channel.given_back.discard(tag)
        else:  # (its queue was deleted meanwhile)
            channel.given_back.add(tag)
    channel.tx_settled = []
    channel.send(commands.Tx.RollbackOk())


def transaction(channel: Channel) -> int:
    """The channel's transaction (406 if the channel is not transactional)."""
    if channel.tx is None:
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           "PRECONDITION_FAILED - channel is not transactional")
    return channel.tx


def _unknown_tag(tag: int) -> ChannelError:
    return ChannelError(ReplyCode.PRECONDITION_FAILED,
                        f"PRECONDITION_FAILED - unknown delivery tag {tag}")


#: The methods of this module, by pamqp name.
CONSUMING_METHODS: Final[dict[str, Callable[[Channel, Any, int], None]]] = {
    "Basic.Qos": basic_qos,
    "Basic.Consume": basic_consume,
    "Basic.Get": basic_get,
    "Basic.Ack": basic_ack,
    "Basic.Nack": basic_nack,
    "Basic.Reject": basic_reject,
    "Basic.Recover": basic_recover,
    "Basic.RecoverAsync": basic_recover,
    "Tx.Select": tx_select,
    "Tx.Commit": tx_commit,
    "Tx.Rollback": tx_rollback,
}
