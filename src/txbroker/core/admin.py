"""Queue and topic administration on top of the engine.

Declare, update (quotas, ingress/egress, dead-letter settings …), delete and
purge queues; declare topics and their durable or non-durable subscriptions.
Every change of a durable definition is written as a ``QUEUE_PUT`` /
``QUEUE_DELETE`` record and answered once durable.
"""

from __future__ import annotations

from typing import Any

from txbroker.core.engine import LATER, SUBSCRIPTION_SEPARATOR, Engine, check_name
from txbroker.core.messages import State
from txbroker.core.queues import Queue, QueueSettings
from txbroker.core.records import Kind
from txbroker.core.sessions import Topic
from txbroker.errors import AlreadyExists, BadRequest, NotFound


class Admin(Engine):
    """Administration commands. Results are plain dicts (queue info)."""

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
        if name in self.topics:
            raise AlreadyExists(f"{name!r} already exists as a topic")
        wanted = QueueSettings().updated(settings or {})
        queue = self.queues.get(name)
        if queue is not None:
            if settings and queue.settings != queue.settings.updated(settings):
                raise AlreadyExists(
                    f"queue {name!r} already exists with other settings (use queue_update)"
                )
            return queue.info()
        queue = Queue(name, wanted)
        self.queues[name] = queue
        self._persist(Kind.QUEUE_PUT, queue.definition(),
                      self._reply_when_durable(session_id, rid, queue.info()))
        return LATER

    def _declare_topic(self, session_id: int, rid: int, name: str) -> Any:
        if name in self.queues:
            raise AlreadyExists(f"{name!r} already exists as a queue")
        topic = self.topics.get(name)
        if topic is not None:
            return topic.info()
        topic = Topic(name)
        self.topics[name] = topic
        self._persist(Kind.QUEUE_PUT, topic.definition(),
                      self._reply_when_durable(session_id, rid, topic.info()))
        return LATER

    def topic_subscribe(
        self, session_id: int, rid: int, topic_name: str, name: str, now: int, *,
        durable: bool = True, settings: dict[str, Any] | None = None,
    ) -> Any:
        """Create (or find) the subscription queue ``topic::name`` of a topic."""
        session = self.session(session_id)
        topic = self.topics.get(check_name(topic_name, "topic"))
        if topic is None:
            raise NotFound(f"no topic {topic_name!r}")
        queue_name = check_name(f"{topic_name}{SUBSCRIPTION_SEPARATOR}{check_name(name)}")
        queue = self.queues.get(queue_name)
        if queue is not None:
            return queue.info()
        queue = Queue(queue_name, QueueSettings().updated(settings or {}), topic=topic_name)
        self.queues[queue_name] = queue
        topic.subscriptions.add(queue_name)
        if not durable:
            queue.durable = False
            queue.owner = session_id
            session.owned_queues.add(queue_name)
            return queue.info()
        self._persist(Kind.QUEUE_PUT, queue.definition(),
                      self._reply_when_durable(session_id, rid, queue.info()))
        return LATER

    def queue_update(
        self, session_id: int, rid: int, name: str, settings: dict[str, Any], now: int
    ) -> Any:
        """Change a queue's settings (quotas, ingress/egress, DLQ …)."""
        queue = self._existing(name)
        queue.settings = queue.settings.updated(settings)
        info = queue.info()
        if queue.settings.egress:
            self._dispatch(queue, now)
        if not queue.durable:
            return info
        self._persist(Kind.QUEUE_PUT, queue.definition(),
                      self._reply_when_durable(session_id, rid, info))
        return LATER

    def queue_delete(self, session_id: int, rid: int, name: str, now: int) -> Any:
        """Delete a queue (and its messages) or a topic (and its subscriptions)."""
        topic = self.topics.pop(name, None)
        if topic is not None:
            dropped = 0
            for sub in list(topic.subscriptions):
                dropped += self._delete_queue(sub, now)
            self._persist(Kind.QUEUE_DELETE, name,
                          self._reply_when_durable(session_id, rid, {"deleted": dropped}))
            return LATER
        queue = self._existing(name)
        if not queue.durable:
            return {"deleted": self._delete_queue(name, now)}
        result: dict[str, int] = {}
        result["deleted"] = self._delete_queue(
            name, now, on_durable=self._reply_when_durable(session_id, rid, result))
        return LATER

    def queue_purge(self, session_id: int, rid: int, name: str, now: int) -> Any:
        """Drop every ready or scheduled message (in-flight ones are left alone)."""
        queue = self._existing(name)
        victims = queue.ready_messages()
        queue.clear_ready()
        stored = [m for m in victims if m.persistent]
        for message in victims:
            message.state = State.GONE
            queue.count_out(message)
            if not message.persistent:
                self._forget(message)
        result = {"purged": len(victims)}
        if not stored:
            return result

        def on_durable(error: BaseException | None) -> None:
            if error is None:
                for message in stored:
                    self._forget(message)
            self._reply_when_durable(session_id, rid, result)(error)

        self._persist(Kind.DROP, [[m.id for m in stored], "purged"], on_durable)
        return LATER

    def queue_info(self, name: str) -> dict[str, Any]:
        if name in self.topics:
            return self.topics[name].info()
        return self._existing(name).info()

    def queue_list(self) -> list[dict[str, Any]]:
        found = [q.info() for q in self.queues.values()]
        found.extend(t.info() for t in self.topics.values())
        return sorted(found, key=lambda info: str(info["name"]))

    def stats(self) -> dict[str, Any]:
        return {
            "queues": len(self.queues),
            "topics": len(self.topics),
            "messages": len(self.messages),
            "sessions": len(self.sessions),
            "storage_failed": None if self.failed is None else str(self.failed),
            **self.counters,
        }

    def _existing(self, name: Any) -> Queue:
        if not isinstance(name, str):
            raise BadRequest("queue name must be a string")
        queue = self.queues.get(name)
        if queue is None:
            raise NotFound(f"no queue {name!r}")
        return queue
