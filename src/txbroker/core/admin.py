"""Queue and topic administration.

Declare, update (quotas, ingress/egress, dead-letter settings …), delete and
purge queues; declare topics and their durable or non-durable subscriptions.
Every change of a durable definition is written as a ``QUEUE_PUT`` /
``QUEUE_DELETE`` record and answered once durable. Browse looks at a queue's
visible messages without taking them; move (re-drive) takes visible messages
of one queue to another with one ``MOVE`` record, answered once durable.
"""

from __future__ import annotations

from typing import Any

from txbroker.core.dead_letters import readdress
from txbroker.core.drop_jobs import delete_queue, purge_queue
from txbroker.core.messages import Message
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import (
    LATER,
    SUBSCRIPTION_SEPARATOR,
    QueueIndex,
    check_name,
)
from txbroker.core.queue_settings import QueueSettings
from txbroker.core.queues import Queue
from txbroker.core.records import Move, QueueDelete, QueuePut
from txbroker.core.router.log import RESERVED_PREFIX, refuse_reserved
from txbroker.core.sessions import Session, Topic
from txbroker.errors import AlreadyExists, BadRequest, NotFound

#: The most messages one browse or move request handles (a move of a larger DLQ is
#: several requests): bounds the loop time and the reply of one request.
MAX_BROWSE = 1_000
MAX_MOVE = 10_000


class Admin:
    """Administration commands over the queue index. Results are plain dicts."""

    def __init__(self, index: QueueIndex, outbox: Outbox) -> None:
        self.index = index
        self.outbox = outbox

    def queue_declare(
        self, session_id: int, rid: int, name: str, now: int, *, kind: str = "queue",
        settings: dict[str, Any] | None = None,
    ) -> Any:
        """Create a queue or topic; declaring an existing one with the same
        settings is a no-op, with other settings an AlreadyExists error."""
        refuse_reserved(name, "declare")  # the router's journal (core/router/log.py)
        check_name(name, kind)
        if kind == "topic":
            return self._declare_topic(session_id, rid, name)
        if kind != "queue":
            raise BadRequest("kind must be 'queue' or 'topic'")
        index = self.index
        if name in index.topics:
            raise AlreadyExists(f"{name!r} already exists as a topic")
        wanted = QueueSettings().updated(settings or {})
        queue = index.queues.get(name)
        if queue is not None:
            if settings and queue.settings != queue.settings.updated(settings):
                raise AlreadyExists(
                    f"queue {name!r} already exists with other settings (use queue_update)"
                )
            return queue.info()
        queue = Queue(name, wanted)
        index.queues[name] = queue
        self.outbox.write(QueuePut(queue.definition()),
                          self.outbox.reply_when_durable(session_id, rid, queue.info()))
        return LATER

    def _declare_topic(self, session_id: int, rid: int, name: str) -> Any:
        index = self.index
        if name in index.queues:
            raise AlreadyExists(f"{name!r} already exists as a queue")
        topic = index.topics.get(name)
        if topic is not None:
            return topic.info()
        topic = Topic(name)
        index.topics[name] = topic
        self.outbox.write(QueuePut(topic.definition()),
                          self.outbox.reply_when_durable(session_id, rid, topic.info()))
        return LATER

    def topic_subscribe(
        self, session: Session, rid: int, topic_name: str, name: str, now: int, *,
        durable: bool = True, settings: dict[str, Any] | None = None,
    ) -> Any:
        """Create (or find) the subscription queue ``topic::name`` of a topic."""
        refuse_reserved(topic_name, "topic_subscribe")
        index = self.index
        topic = index.topics.get(check_name(topic_name, "topic"))
        if topic is None:
            raise NotFound(f"no topic {topic_name!r}")
        queue_name = check_name(f"{topic_name}{SUBSCRIPTION_SEPARATOR}{check_name(name)}")
        queue = index.queues.get(queue_name)
        if queue is not None:
            if not durable and not queue.durable and queue.owner != session.id:
                # the last session to make it owns it: a client that reconnected before
                # the broker noticed its old connection ended keeps its subscription
                # (seed 004: topic subscribers carry on after a failover)
                previous = index.sessions.get(queue.owner)
                if previous is not None:
                    previous.owned_queues.discard(queue_name)
                queue.owner = session.id
                session.owned_queues.add(queue_name)
            return queue.info()
        queue = Queue(queue_name, QueueSettings().updated(settings or {}), topic=topic_name)
        index.queues[queue_name] = queue
        topic.subscriptions.add(queue_name)
        if not durable:
            queue.durable = False
            queue.owner = session.id
            session.owned_queues.add(queue_name)
            return queue.info()
        self.outbox.write(QueuePut(queue.definition()),
                          self.outbox.reply_when_durable(session.id, rid, queue.info()))
        return LATER

    def queue_update(
        self, session_id: int, rid: int, name: str, settings: dict[str, Any], now: int
    ) -> Any:
        """Change a queue's settings (quotas, ingress/egress, DLQ …)."""
        refuse_reserved(name, "update")  # the router's journal (core/router/log.py)
        queue = self.index.existing_queue(name)
        queue.settings = queue.settings.updated(settings)
        info = queue.info()
        if queue.settings.egress:
            self.index.dispatch(queue, now)
        if not queue.durable:
            return info
        self.outbox.write(QueuePut(queue.definition()),
                          self.outbox.reply_when_durable(session_id, rid, info))
        return LATER

    def queue_delete(self, session_id: int, rid: int, name: str, now: int) -> Any:
        """Delete a queue (and its messages) or a topic (and its subscriptions)."""
        refuse_reserved(name, "delete")  # the router's journal (core/router/log.py)
        index = self.index
        topic = index.topics.pop(name, None)
        if topic is not None:
            dropped = 0
            for sub in list(topic.subscriptions):
                dropped += delete_queue(index, sub, now)
            self.outbox.write(QueueDelete(name), self.outbox.reply_when_durable(
                session_id, rid, {"deleted": dropped}))
            return LATER
        queue = index.existing_queue(name)
        if not queue.durable:
            return {"deleted": delete_queue(index, name, now)}
        result: dict[str, int] = {}
        result["deleted"] = delete_queue(index,
            name, now, on_durable=self.outbox.reply_when_durable(session_id, rid, result))
        return LATER

    def queue_purge(self, session_id: int, rid: int, name: str, now: int) -> Any:
        """Drop every ready or scheduled message (in-flight ones are left alone)."""
        refuse_reserved(name, "purge")  # the router's journal (core/router/log.py)
        return purge_queue(self.index, self.index.existing_queue(name), session_id, rid)

    def queue_browse(self, name: str, limit: int) -> list[Message]:
        """The first ``limit`` (at most :data:`MAX_BROWSE`) visible messages of a
        queue in delivery order, left where they are."""
        refuse_reserved(name, "browse")  # the router's journal (core/router/log.py)
        if not 1 <= limit <= MAX_BROWSE:
            raise BadRequest(f"limit must be 1..{MAX_BROWSE}")
        return self.index.existing_queue(name).browse(limit)

    def redrive_target(self, source: str) -> str:
        """The queue whose dead-letter (or expiry) queue ``source`` is, when exactly
        one queue names it; BadRequest otherwise (the caller must say where)."""
        origins = sorted(q.name for q in self.index.queues.values()
                         if source in (q.settings.dead_letter_queue, q.settings.expiry_queue)
                         and q.name != source)
        if len(origins) != 1:
            found = ", ".join(origins) if origins else "none"
            raise BadRequest(f"say which queue to move to: queues dead-lettering to "
                             f"{source!r}: {found}")
        return origins[0]

    def queue_move(self, session_id: int, rid: int, source: str, target: str | None,
                   limit: int, now: int) -> Any:
        """Move the first ``limit`` visible messages of ``source`` (delivery order) to
        ``target`` (default: :meth:`redrive_target`), keeping their ids, bodies,
        headers and delivery counts; their TTL and delay are cleared (as for a
        dead-lettered message). In-flight messages stay. Replies ``{"moved": n,
        "to": target}``, once the MOVE record is durable."""
        refuse_reserved(source, "move")  # the router's journal (core/router/log.py)
        refuse_reserved(target, "move")
        if not 1 <= limit <= MAX_MOVE:
            raise BadRequest(f"limit must be 1..{MAX_MOVE}")
        index = self.index
        queue = index.existing_queue(source)
        target_name = target if target is not None else self.redrive_target(source)
        if target_name == source:
            raise BadRequest("cannot move a queue's messages to itself")
        into = index.existing_queue(target_name)
        chosen = queue.browse(limit)
        stored = [m for m in chosen if m.persistent]
        if stored:
            self.outbox.check_writable()
        for message in chosen:
            queue.discard(message)
            queue.count_out(message)
            readdress(message, into.name)
        result = {"moved": len(chosen), "to": into.name}
        if stored:
            into.assign_seqs(stored)
            first, count = stored[0].seq, len(stored)
            reply = self.outbox.reply_when_durable(session_id, rid, result)

            def durable(error: BaseException | None) -> None:
                settled = index.queues.get(into.name)
                if settled is not None:
                    settled.settle(first, count)
                reply(error)

            self.outbox.write(Move([m.id for m in stored], into.name, "moved",
                                   [m.seq for m in stored]), durable)
        for message in chosen:
            into.count_in(message)
            into.enqueued += 1
            into.put(message, now)
        index.dispatch(into, now)
        return LATER if stored else result

    def queue_info(self, name: str) -> dict[str, Any]:
        """One queue's or topic's info (NotFound if there is none)."""
        index = self.index
        if name in index.topics:
            return index.topics[name].info()
        return index.existing_queue(name).info()

    def queue_list(self) -> list[dict[str, Any]]:
        """Every queue's and topic's info, by name — the user's: the router's internal
        journal queue (``$router``) belongs to the router (``txbroker router show``),
        not among the user's queues (``queue_info`` still shows it by name)."""
        found = [q.info() for name, q in self.index.queues.items()
                 if not name.startswith(RESERVED_PREFIX)]
        found.extend(t.info() for t in self.index.topics.values())
        return sorted(found, key=lambda info: str(info["name"]))

    def stats(self) -> dict[str, Any]:
        """Broker-wide counts for ``txbroker stat``."""
        index = self.index
        internal = [q for name, q in index.queues.items() if name.startswith(RESERVED_PREFIX)]
        return {
            "queues": len(index.queues) - len(internal),
            "topics": len(index.topics),
            "messages": len(index.messages) - sum(q.messages for q in internal),
            "router_records": sum(q.messages for q in internal),
            "sessions": len(index.sessions),
            "storage_failed": None if self.outbox.failed is None else str(self.outbox.failed),
            **index.counters,
        }


__all__ = ["Admin"]
