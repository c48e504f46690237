"""Queue and topic administration.

Declare, update (quotas, ingress/egress, dead-letter settings …), delete and
purge queues; declare topics and their durable or non-durable subscriptions.
Every change of a durable definition is written as a ``QUEUE_PUT`` /
``QUEUE_DELETE`` record and answered once durable.
"""

from __future__ import annotations

from typing import Any

from txbroker.core.drop_jobs import delete_queue, purge_queue
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import LATER, SUBSCRIPTION_SEPARATOR, QueueIndex, check_name
from txbroker.core.queues import Queue, QueueSettings
from txbroker.core.records import Kind
from txbroker.core.sessions import Session, Topic
from txbroker.errors import AlreadyExists, BadRequest, NotFound


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
        self.outbox.persist(Kind.QUEUE_PUT, queue.definition(),
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
        self.outbox.persist(Kind.QUEUE_PUT, topic.definition(),
                            self.outbox.reply_when_durable(session_id, rid, topic.info()))
        return LATER

    def topic_subscribe(
        self, session: Session, rid: int, topic_name: str, name: str, now: int, *,
        durable: bool = True, settings: dict[str, Any] | None = None,
    ) -> Any:
        """Create (or find) the subscription queue ``topic::name`` of a topic."""
        index = self.index
        topic = index.topics.get(check_name(topic_name, "topic"))
        if topic is None:
            raise NotFound(f"no topic {topic_name!r}")
        queue_name = check_name(f"{topic_name}{SUBSCRIPTION_SEPARATOR}{check_name(name)}")
        queue = index.queues.get(queue_name)
        if queue is not None:
            return queue.info()
        queue = Queue(queue_name, QueueSettings().updated(settings or {}), topic=topic_name)
        index.queues[queue_name] = queue
        topic.subscriptions.add(queue_name)
        if not durable:
            queue.durable = False
            queue.owner = session.id
            session.owned_queues.add(queue_name)
            return queue.info()
        self.outbox.persist(Kind.QUEUE_PUT, queue.definition(),
                            self.outbox.reply_when_durable(session.id, rid, queue.info()))
        return LATER

    def queue_update(
        self, session_id: int, rid: int, name: str, settings: dict[str, Any], now: int
    ) -> Any:
        """Change a queue's settings (quotas, ingress/egress, DLQ …)."""
        queue = self.index.existing_queue(name)
        queue.settings = queue.settings.updated(settings)
        info = queue.info()
        if queue.settings.egress:
            self.index.dispatch(queue, now)
        if not queue.durable:
            return info
        self.outbox.persist(Kind.QUEUE_PUT, queue.definition(),
                            self.outbox.reply_when_durable(session_id, rid, info))
        return LATER

    def queue_delete(self, session_id: int, rid: int, name: str, now: int) -> Any:
        """Delete a queue (and its messages) or a topic (and its subscriptions)."""
        index = self.index
        topic = index.topics.pop(name, None)
        if topic is not None:
            dropped = 0
            for sub in list(topic.subscriptions):
                dropped += delete_queue(index, sub, now)
            self.outbox.persist(Kind.QUEUE_DELETE, name, self.outbox.reply_when_durable(
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
        return purge_queue(self.index, self.index.existing_queue(name), session_id, rid)

    def queue_info(self, name: str) -> dict[str, Any]:
        """One queue's or topic's info (NotFound if there is none)."""
        index = self.index
        if name in index.topics:
            return index.topics[name].info()
        return index.existing_queue(name).info()

    def queue_list(self) -> list[dict[str, Any]]:
        """Every queue's and topic's info, by name."""
        found = [q.info() for q in self.index.queues.values()]
        found.extend(t.info() for t in self.index.topics.values())
        return sorted(found, key=lambda info: str(info["name"]))

    def stats(self) -> dict[str, Any]:
        """Broker-wide counts for ``txbroker stat``."""
        index = self.index
        return {
            "queues": len(index.queues),
            "topics": len(index.topics),
            "messages": len(index.messages),
            "sessions": len(index.sessions),
            "storage_failed": None if self.outbox.failed is None else str(self.outbox.failed),
            **index.counters,
        }


__all__ = ["Admin"]
