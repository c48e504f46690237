"""AMQP 0-9-1 declarations: ``exchange.*`` and ``queue.*`` methods of a channel.

Each function takes the :class:`~txbroker.server.edges.amqp.channel.Channel` the method
came on and the method (a pamqp command); what it changes is the shared
definitions (``server/edges/amqp/model.py``, stored by ``server/edges/amqp/state.py``) and
the core's queues, through the channel's session (``server/ops/operations.py``: every
declare, delete, bind and purge is an ``admin`` action on its queue). Replies
go through the channel's ordered output: a declare-ok waits until the queue's
record and the definitions snapshot are durable, counts wait for the channel's
earlier publishes (``Channel.after_publishes``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Final

from pamqp import commands

from txbroker.protocol.amqp import ReplyCode
from txbroker.server.edges.amqp.channel import SERVER_NAMED_PREFIX, Channel, Pending
from txbroker.server.edges.amqp.content import queue_settings
from txbroker.server.edges.amqp.model import Binding, ChannelError, Exchange, QueueFlags, plain

__all__ = ["DECLARE_METHODS"]


def exchange_declare(channel: Channel, m: Any, now: int) -> None:
    """exchange.declare: create, or check (passive, or equivalent redeclare)."""
    wanted = Exchange(m.exchange, m.exchange_type, bool(m.durable), bool(m.auto_delete),
                      bool(m.internal), dict(m.arguments or {}))
    if not m.passive:
        channel.session.ops.require_admin(channel.session, "declare", f"exchange:{m.exchange}")
    new = channel.conn.state.definitions.declare_exchange(wanted, passive=bool(m.passive))
    channel.reply(m.nowait, commands.Exchange.DeclareOk(), saves=1 if new else 0)


def exchange_delete(channel: Channel, m: Any, now: int) -> None:
    """exchange.delete, with its bindings."""
    channel.session.ops.require_admin(channel.session, "delete", f"exchange:{m.exchange}")
    channel.conn.state.definitions.delete_exchange(m.exchange, if_unused=bool(m.if_unused))
    channel.reply(m.nowait, commands.Exchange.DeleteOk(), saves=1)


def queue_declare(channel: Channel, m: Any, now: int) -> None:
    """queue.declare: a new core queue (durable with the definitions), an existing one
    checked for equivalence, or a passive check."""
    state = channel.conn.state
    if m.passive:
        queue = channel.existing_queue(m.queue)
        channel.last_queue = queue  # a passive check does not renew x-expires
        counted_reply(channel, bool(m.nowait), queue)
        return
    name = m.queue or f"{SERVER_NAMED_PREFIX}{uuid.uuid4().hex}"
    if m.queue:
        channel.queue_name(name)
        if name.startswith("amq."):
            raise ChannelError(ReplyCode.ACCESS_REFUSED,
                               f"ACCESS_REFUSED - queue name '{name}' contains reserved "
                               "prefix 'amq.*'")
    owner = state.exclusive_owner.get(name)
    if owner is not None and owner != channel.session.id:
        raise ChannelError(ReplyCode.RESOURCE_LOCKED,
                           f"RESOURCE_LOCKED - cannot obtain exclusive access to locked "
                           f"queue '{name}' in vhost '/'")
    arguments = dict(m.arguments or {})
    settings, _ = queue_settings(name, arguments)
    flags = QueueFlags(name, bool(m.durable), bool(m.exclusive), bool(m.auto_delete),
                       arguments, channel.session.id if m.exclusive else 0)
    core = channel.session.core
    channel.last_queue = name
    if name in core.queues:
        have = state.definitions.queues.get(name)
        if have is not None:
            _check_equivalent(have, flags)
        state.queue_used(name)
        counted_reply(channel, bool(m.nowait), name)
        return
    if name in core.topics:
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           f"PRECONDITION_FAILED - '{name}' is a txbroker topic, not a queue")
    rid = channel.conn.new_rid()
    started = channel.session.started(rid, channel.session.declare(rid, name, now,
                                                             settings=settings))
    state.definitions.queues[name] = flags
    if m.exclusive:
        state.exclusive_owner[name] = channel.session.id
    if "x-dead-letter-exchange" in arguments:
        state.watch_dead_letters(name)
    state.queue_used(name)
    reply = None if m.nowait else name
    channel.later([rid] if started else [],
                  lambda p: channel.ok(p, None if reply is None else declare_ok(channel, reply)),
                  saves=1)


def counted_reply(channel: Channel, nowait: bool, queue: str) -> None:
    """declare-ok with counts that include this channel's earlier publishes."""
    """declare-ok with counts that include this channel's earlier publishes."""
    if not nowait:
        channel.after_publishes(lambda at_head: channel.reply_now(at_head,
                                                            declare_ok(channel, queue)))


def declare_ok(channel: Channel, queue: str) -> Any:
    """declare-ok with the queue's ready messages and consumers now."""
    info = channel.session.core.queues.get(queue)
    ready = info.ready_count if info is not None else 0
    consumers = len(info.consumers) if info is not None else 0
    return commands.Queue.DeclareOk(queue, ready, consumers)


def queue_bind(channel: Channel, m: Any, now: int, *, bind: bool = True) -> None:
    """queue.bind (or, ``bind`` False, queue.unbind)."""
    queue = channel.existing_queue(m.queue)
    binding = Binding(m.exchange, queue, m.routing_key, dict(m.arguments or {}))
    channel.session.ops.require_admin(channel.session, "update", queue)
    definitions = channel.conn.state.definitions
    changed = definitions.bind(binding) if bind else definitions.unbind(binding)
    ok = commands.Queue.BindOk() if bind else commands.Queue.UnbindOk()
    channel.reply(getattr(m, "nowait", False), ok, saves=1 if changed else 0)


def queue_unbind(channel: Channel, m: Any, now: int) -> None:
    """queue.unbind (unbinding what is not bound is no error)."""
    queue_bind(channel, m, now, bind=False)


def queue_purge(channel: Channel, m: Any, now: int) -> None:
    """queue.purge, after the channel's earlier publishes."""
    queue = channel.existing_queue(m.queue)
    nowait = bool(m.nowait)
    channel.after_publishes(lambda at_head: purge_now(channel, queue, nowait, at_head))


def purge_now(channel: Channel, queue: str, nowait: bool, at_head: bool) -> None:
    """The purge itself; ``at_head``: it runs at the head of the output queue."""
    rid = channel.conn.new_rid()
    session = channel.session
    result = session.purge(rid, queue, session.ops.now())
    if session.started(rid, result):
        pending = Pending(1, lambda p: channel.ok(p, None if nowait else commands.Queue.PurgeOk(
            int(p.results[0].get("purged", 0)) if p.results else 0)))
        channel.conn.expect(rid, channel, pending)
        if at_head:
            channel.out.appendleft(pending)
        else:
            channel.out.append(pending)
    elif not nowait:
        channel.reply_now(at_head, commands.Queue.PurgeOk(int(result.get("purged", 0))))


def queue_delete(channel: Channel, m: Any, now: int) -> None:
    """queue.delete (if-unused, if-empty), with its flags and bindings."""
    name = channel.queue_name(m.queue)
    queue = channel.session.core.queues.get(name)
    if queue is None:
        channel.reply(m.nowait, commands.Queue.DeleteOk(0))
        return
    channel.existing_queue(name)
    if m.if_unused and queue.consumers:
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           f"PRECONDITION_FAILED - queue '{name}' in vhost '/' in use")
    if m.if_empty and queue.messages:
        raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                           f"PRECONDITION_FAILED - queue '{name}' in vhost '/' is not empty")
    count = queue.ready_count
    rid = channel.conn.new_rid()
    started = channel.session.started(rid, channel.session.delete(rid, name, now))
    channel.conn.state.forget_queue(name)
    reply = None if m.nowait else commands.Queue.DeleteOk(count)
    channel.later([rid] if started else [], lambda p: channel.ok(p, reply), saves=1)


def _check_equivalent(have: QueueFlags, wanted: QueueFlags) -> None:
    """406 unless a redeclare asks for what the queue is (RabbitMQ's wording)."""
    for what, a, b in (("durable", have.durable, wanted.durable),
                       ("exclusive", have.exclusive, wanted.exclusive),
                       ("auto_delete", have.auto_delete, wanted.auto_delete)):
        if a != b:
            raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                               f"PRECONDITION_FAILED - inequivalent arg '{what}' for queue "
                               f"'{have.name}' in vhost '/': received '{str(b).lower()}' but "
                               f"current is '{str(a).lower()}'")
    had, asked = plain(have.arguments), plain(wanted.arguments)
    for key in sorted(set(had) | set(asked)):
        if had.get(key) != asked.get(key):
            raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                               f"PRECONDITION_FAILED - inequivalent arg '{key}' for queue "
                               f"'{have.name}' in vhost '/': received "
                               f"{asked.get(key)!r} but current is {had.get(key)!r}")


#: The declaration methods, by pamqp name.
DECLARE_METHODS: Final[dict[str, Callable[[Channel, Any, int], None]]] = {
    "Exchange.Declare": exchange_declare,
    "Exchange.Delete": exchange_delete,
    "Queue.Declare": queue_declare,
    "Queue.Bind": queue_bind,
    "Queue.Unbind": queue_unbind,
    "Queue.Purge": queue_purge,
    "Queue.Delete": queue_delete,
}
