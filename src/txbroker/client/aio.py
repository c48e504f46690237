"""The async client: ``async with txbroker.aio.connect(url) as conn: ...``.

This is the one client; :mod:`txbroker.client.sync` runs it on a private
event-loop thread. All I/O goes through the transport of
:class:`~txbroker.client.options.ConnectOptions` (TCP unless replaced).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from txbroker.client._engine import Engine
from txbroker.client.async_objects import (
    AckMode,
    AsyncMessage,
    AsyncSubscription,
    AwaitableContext,
    build_send_args,
)
from txbroker.client.async_transaction import AsyncTransaction
from txbroker.client.options import ConnectOptions
from txbroker.client.streams import AsyncStreamMixin
from txbroker.client.url import ClientURL, parse_url
from txbroker.client.xa import AsyncXAResource, TpcMixin
from txbroker.errors import MessageTooLarge, ProtocolError

__all__ = [
    "AsyncConnection",
    "AsyncMessage",
    "AsyncSubscription",
    "AsyncTransaction",
    "AsyncXAResource",
    "connect",
    "open_connection",
]


class AsyncConnection(TpcMixin, AsyncStreamMixin):
    """A connection to a broker (and its failover list). Use :func:`connect` to make one.

    XA: ``xa_resource()`` and the DB-API TPC names (``tpc_begin`` …) come from
    :class:`~txbroker.client.xa.TpcMixin`."""

    def __init__(self, url: ClientURL, options: ConnectOptions) -> None:
        self._engine = Engine(url, options)

    # ------------------------------------------------------------- properties

    @property
    def url(self) -> ClientURL:
        """The parsed URL (failover list and user)."""
        return self._engine.url

    @property
    def options(self) -> ConnectOptions:
        """The options given to connect."""
        return self._engine.options

    @property
    def server_info(self) -> dict[str, Any]:
        """The broker's ``hello`` reply (version, session, limits)."""
        return self._engine.server_info

    @property
    def host(self) -> str | None:
        """``host:port`` of the broker we are connected to (None while failing over)."""
        session = self._engine.session
        return None if session is None else str(session.host)

    # --------------------------------------------------------------- messages

    async def send(
        self,
        dest: str,
        body: bytes,
        *,
        headers: dict[str, str] | None = None,
        message_id: str | None = None,
        persistent: bool = True,
        priority: int = 4,
        ttl: float | None = None,
        delay: float | None = None,
    ) -> None:
        """Send a message to a queue or topic; returns once the broker made it durable.

        ``ttl`` and ``delay`` are in seconds. A send with a ``message_id`` is
        re-sent after a failover (the broker drops the duplicate).
        """
        args = build_send_args(dest, body, headers, message_id, persistent, priority, ttl, delay)
        self._check_size(body)
        await self._engine.call(
            "send", args, timeout=self._engine.options.timeout, resend=message_id is not None
        )

    def send_nowait(
        self,
        dest: str,
        body: bytes,
        *,
        headers: dict[str, str] | None = None,
        message_id: str | None = None,
        persistent: bool = True,
        priority: int = 4,
        ttl: float | None = None,
        delay: float | None = None,
    ) -> asyncio.Future[None]:
        """Like :meth:`send` but returns at once with a future: pipeline many sends.

        Must be called from the connection's event loop.
        """
        args = build_send_args(dest, body, headers, message_id, persistent, priority, ttl, delay)
        self._check_size(body)
        return self._engine.submit("send", args, resend=message_id is not None, discard_result=True)

    def _check_size(self, body: bytes) -> None:
        limit = self._engine.server_info.get("max_message_size")
        if type(limit) is int and len(body) > limit > 0:
            raise MessageTooLarge(f"body of {len(body)} bytes exceeds the broker's {limit}")

    async def receive(self, queue: str, timeout: float | None = None) -> AsyncMessage | None:
        """Take one message (client-ack mode: ``ack`` it); None after ``timeout`` seconds.

        ``timeout=None`` waits forever, ``0`` only polls.
        """
        args: dict[str, Any] = {"queue": queue}
        request_timeout: float | None = None
        if timeout is not None:
            if timeout < 0:
                raise ValueError("timeout must be >= 0")
            args["timeout_ms"] = round(timeout * 1000)
            option = self._engine.options.timeout
            request_timeout = None if option is None else timeout + option
        result, epoch = await self._engine.call("receive", args, timeout=request_timeout)
        if result is None:
            return None
        try:
            return AsyncMessage(self._engine, result, epoch, auto=False)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed message from the broker: {exc!r}") from exc

    def subscribe(
        self, queue: str, prefetch: int = 100, ack: AckMode = "client"
    ) -> AwaitableContext[AsyncSubscription]:
        """Subscribe to a queue: ``sub = await conn.subscribe(q)`` or ``async with ...``.

        ``ack="client"``: each message must be acked; ``"auto"``: acked when sent.
        """
        subscription = AsyncSubscription(self._engine, queue, prefetch, ack)

        async def start() -> AsyncSubscription:
            engine = self._engine
            engine.subs[subscription.sub_id] = subscription
            try:
                await engine.call(
                    "subscribe",
                    subscription.subscribe_args(),
                    timeout=engine.options.timeout,
                    resend=True,
                )
            except BaseException:
                engine.subs.pop(subscription.sub_id, None)
                raise
            subscription.active = True
            return subscription

        return AwaitableContext(start)

    def transaction(self) -> AsyncTransaction:
        """A new local transaction (``async with conn.transaction() as tx``)."""
        return AsyncTransaction(self)

    # ------------------------------------------------------------ queue admin

    async def _admin(self, op: str, args: dict[str, Any]) -> Any:
        result, _ = await self._engine.call(op, args, timeout=self._engine.options.timeout)
        return result

    async def declare_queue(self, name: str, **settings: Any) -> dict[str, Any]:
        """Create a queue (or check its settings); returns the queue info."""
        result: dict[str, Any] = await self._admin(
            "queue_declare", {**settings, "name": name, "kind": "queue"}
        )
        return result

    async def declare_topic(self, name: str, **settings: Any) -> dict[str, Any]:
        """Create a topic; returns its info."""
        result: dict[str, Any] = await self._admin(
            "queue_declare", {**settings, "name": name, "kind": "topic"}
        )
        return result

    async def subscribe_topic(self, topic: str, name: str, durable: bool = True) -> dict[str, Any]:
        """Create the subscription queue ``"{topic}::{name}"``; returns its info."""
        result: dict[str, Any] = await self._admin(
            "topic_subscribe", {"topic": topic, "name": name, "durable": durable}
        )
        return result

    async def update_queue(self, name: str, **settings: Any) -> dict[str, Any]:
        """Change settings of a queue; returns its info."""
        result: dict[str, Any] = await self._admin("queue_update", {**settings, "name": name})
        return result

    async def delete_queue(self, name: str) -> int:
        """Delete a queue; returns how many messages were dropped."""
        result = await self._admin("queue_delete", {"name": name})
        return int(result.get("deleted", 0)) if isinstance(result, dict) else 0

    async def purge_queue(self, name: str) -> int:
        """Drop every ready message of a queue; returns how many."""
        result = await self._admin("queue_purge", {"name": name})
        return int(result.get("purged", 0)) if isinstance(result, dict) else 0

    async def queues(self) -> list[dict[str, Any]]:
        """Info of every queue and topic."""
        result: list[dict[str, Any]] = await self._admin("queue_list", {})
        return result

    async def queue_info(self, name: str) -> dict[str, Any]:
        """Info of one queue: depth, in_flight, consumers, bytes, scheduled, settings."""
        result: dict[str, Any] = await self._admin("queue_info", {"name": name})
        return result

    async def stats(self) -> dict[str, Any]:
        """The broker's counters."""
        result: dict[str, Any] = await self._admin("stats", {})
        return result

    async def ping(self) -> None:
        """Round trip to the broker."""
        await self._admin("ping", {})

    # ---------------------------------------------------------------- closing

    async def close(self) -> None:
        """Flush pending acks and close; waiting calls get ConnectionLost."""
        await self._engine.close()

    async def __aenter__(self) -> AsyncConnection:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def open_connection(
    url: str | ClientURL, options: ConnectOptions | None = None, **kwargs: Any
) -> AsyncConnection:
    """Connect (coroutine form of :func:`connect`); ``options`` or keyword options."""
    parsed = url if isinstance(url, ClientURL) else parse_url(url)
    checked = options if options is not None else ConnectOptions.from_kwargs(kwargs)
    connection = AsyncConnection(parsed, checked)
    await connection._engine.start()
    return connection


def connect(url: str | ClientURL, **options: Any) -> AwaitableContext[AsyncConnection]:
    """Connect to a broker: ``conn = await connect(url)`` or ``async with connect(url) as conn``.

    ``url`` is ``txb://[user:password@]host[:port][,host[:port]...]``; options are those of
    :class:`~txbroker.client.options.ConnectOptions` (``timeout``, ``reconnect``,
    ``reconnect_timeout``, ``on_failover``, ``client_id``). The URL and the options are
    checked at once (ValueError / TypeError).
    """
    parsed = url if isinstance(url, ClientURL) else parse_url(url)
    checked = ConnectOptions.from_kwargs(options)
    return AwaitableContext(lambda: open_connection(parsed, checked))
