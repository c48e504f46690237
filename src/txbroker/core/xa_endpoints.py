"""XA endpoint rules (seed 002): can a branch's queues take its outcome?

A branch names two kinds of endpoint: the queues of the messages it consumed
and the target queues of the messages it sent. Seed 002 says what happens
when one of them is shut down (ingress or egress off), deleted or over its
quota at ``end``, ``prepare`` and ``commit``; ``core/xa_branches.py`` says
when each check runs. Each function here returns a reason (a refusal: the
branch rolls back with XA_RBROLLBACK) or ``""``; messages that the rules say
to drop instead go to ``branch.discards``.
"""

from __future__ import annotations

from collections import Counter

from txbroker.core.messages import State
from txbroker.core.queue_index import QueueIndex
from txbroker.core.xa import Branch


def consumed_problem(index: QueueIndex, branch: Branch, *, check_quota: bool) -> str:
    """Why the branch's consumed messages cannot be taken, or ''."""
    for message in branch.work.acks.values():
        queue = index.queues.get(message.queue)
        if queue is None or message.state is State.GONE:
            return f"queue {message.queue!r} of a consumed message was deleted"
        if not queue.settings.egress:
            return f"queue {message.queue!r} of a consumed message is shut down (egress)"
        limit = queue.settings.max_messages
        if check_quota and limit and queue.messages > limit:
            return f"queue {message.queue!r} of a consumed message is over its quota"
    return ""


def send_problem(index: QueueIndex, branch: Branch, *, prepare: bool) -> str:
    """Check the branch's target queues (prepare / one-phase commit). Messages that
    may be dropped go to ``branch.discards``; a refusal is returned as a reason."""
    if sends_fit(index, branch, prepare=prepare):
        return ""
    adding: dict[str, list[int]] = {}
    for message in branch.work.sends:
        queue = index.queues.get(message.queue)
        if queue is None:
            return f"target queue {message.queue!r} was deleted"
        reason = ""
        if not queue.settings.ingress:
            reason = f"target queue {message.queue!r} is shut down (ingress)"
        elif prepare:
            counts = adding.setdefault(queue.name, [0, 0])
            counts[0] += 1
            counts[1] += message.size
            # the quota counts the queue's messages and this branch's, not those of
            # other branches (prepared or not) nor sends still on their way to disk
            messages = queue.messages + counts[0]
            size = queue.bytes + counts[1]
            limit, max_bytes = queue.settings.max_messages, queue.settings.max_bytes
            if (limit and messages > limit) or (max_bytes and size > max_bytes):
                reason = f"target queue {message.queue!r} is over its quota"
        if reason:
            if queue.settings.reject_to_sender_on_discard:
                return reason
            branch.discards.add(message.id)
    return ""


def sends_fit(index: QueueIndex, branch: Branch, *, prepare: bool) -> bool:
    """The fast path of :func:`send_problem`: every target queue exists, takes
    messages and has room for all of this branch's (checked per queue, not per
    message; a Spark sink branch holds 50,000)."""
    sends = branch.work.sends
    per_queue = Counter(m.queue for m in sends)
    for name, count in per_queue.items():
        queue = index.queues.get(name)
        if queue is None or not queue.settings.ingress:
            return False
        if not prepare:
            continue
        limit, max_bytes = queue.settings.max_messages, queue.settings.max_bytes
        if limit and queue.messages + count > limit:
            return False
        if max_bytes and queue.bytes + sum(m.size for m in sends if m.queue == name) \
                > max_bytes:
            return False
    return True


def commit_discards(index: QueueIndex, branch: Branch) -> set[int]:
    """Two-phase commit: sends to a shut or deleted queue are dropped (seed 002)."""
    for message in branch.work.sends:
        queue = index.queues.get(message.queue)
        if queue is None or not queue.settings.ingress:
            branch.discards.add(message.id)
    return branch.discards


__all__ = ["commit_discards", "consumed_problem", "send_problem", "sends_fit"]
