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
from txbroker.client._session import ConnectionExtension
from txbroker.client.async_objects import (
    AckMode,
    AsyncMessage,
    AsyncSubscription,
    AwaitableContext,
)
from txbroker.client.async_transaction import AsyncTransaction
from txbroker.client.operations import (
    BrokerLimits,
    ReceiveRequest,
    SendRequest,
    receive_face,
    send_face,
)
from txbroker.client.options import ConnectOptions
from txbroker.client.streams import AsyncStreamMixin
from txbroker.client.url import ClientURL, parse_url
from txbroker.client.xa import AsyncXAResource, TpcMixin
from txbroker.errors import ProtocolError
from txbroker.protocol.native import Request

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

    def _limits(self) -> BrokerLimits:
        return self._engine.limits

    @send_face
    async def send(self, request: SendRequest) -> None:
        """Send a message to a queue or topic; returns once the broker made it durable.

        The arguments are those of :func:`~txbroker.client.operations.send_request`
        (``ttl`` and ``delay`` in seconds), checked before anything is sent: a body
        above the broker's ``max_message_size`` raises MessageTooLarge at once. A
        send with a ``message_id`` is re-sent after a failover (the broker drops
        the duplicate).
        """
        await self._send(request)

    async def _send(self, request: SendRequest) -> None:
        engine = self._engine
        await engine.call(
            "send", request.wire_args(), timeout=engine.options.timeout,
            resend=request.resendable,
        )

    @send_face
    def send_nowait(self, request: SendRequest) -> asyncio.Future[None]:
        """Like :meth:`send` but returns at once with a future: pipeline many sends.

        The arguments are checked at once (errors are raised, not put in the
        future). Must be called from the connection's event loop.
        """
        return self._send_nowait(request)

    def _send_nowait(self, request: SendRequest) -> asyncio.Future[None]:
        return self._engine.submit_send(request.wire_args(), request.resendable)

    @receive_face
    async def receive(self, request: ReceiveRequest) -> AsyncMessage | None:
        """Take one message (client-ack mode: ``ack`` it); None after ``timeout`` seconds.

        ``timeout=None`` waits forever, ``0`` only polls (see
        :func:`~txbroker.client.operations.receive_request`).
        """
        return await self._receive(request)

    async def _receive(self, request: ReceiveRequest) -> AsyncMessage | None:
        engine = self._engine
        result, epoch = await engine.call(
            "receive", request.wire_args(), timeout=request.reply_timeout(engine.options.timeout)
        )
        if result is None:
            return None
        try:
            return AsyncMessage(engine, result, epoch, auto=False)
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

    async def recover(self) -> int:
        """Give back every message delivered to this connection and not acknowledged
        (JMS ``Session.recover()``): the broker redelivers them (``redelivered`` set,
        ``delivery_count`` one up), to this connection's subscriptions too.

        Acks made before are sent first. Messages given back are dropped from the
        subscriptions' buffers; acking one already handed out raises IllegalState.
        Messages consumed by a transaction are not given back. Returns how many
        messages the broker gave back.
        """
        engine = self._engine
        engine._flush_acks()
        result, epoch = await engine.call("recover", {}, timeout=engine.options.timeout,
                                          resend=False)
        try:
            count, fence = int(result["recovered"]), int(result["next_tag"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed recover reply from the broker: {exc!r}") from exc
        session = engine.session
        if session is not None and session.epoch == epoch:
            session.recovered_below = max(session.recovered_below, fence)
            for sub in engine.subs.values():
                sub.on_recover()
        return count

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
        args = {"topic": topic, "name": name, "durable": durable}
        result: dict[str, Any] = await self._admin("topic_subscribe", args)
        if not durable:  # made again after a failover (the broker does not keep it)
            self._engine.topic_subscriptions[str(result["name"])] = args
        return result

    async def update_queue(self, name: str, **settings: Any) -> dict[str, Any]:
        """Change settings of a queue; returns its info."""
        result: dict[str, Any] = await self._admin("queue_update", {**settings, "name": name})
        return result

    async def delete_queue(self, name: str) -> int:
        """Delete a queue; returns how many messages were dropped."""
        result = await self._admin("queue_delete", {"name": name})
        self._engine.topic_subscriptions.pop(name, None)
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

    # ------------------------------------------------------------ raw requests

    async def request(self, op: str, args: dict[str, Any]) -> Any:
        """Send one native request and wait for its result (bounded by ``timeout``).

        For operations this class has no method for (the router's ``rtr_*``,
        ``txbroker.router``). Not re-sent after a failover: ConnectionLost."""
        return await self._admin(op, args)

    def request_nowait(self, op: str, args: dict[str, Any]) -> asyncio.Future[Any]:
        """Like :meth:`request` but pipelined: returns the future of the result at once
        (the error, if any, is the future's). Must be called from the connection's loop."""
        return self._engine.submit(op, args)

    def notify(self, op: str, args: dict[str, Any]) -> bool:
        """Send a request with request id 0 (no reply; a broker error comes back as an
        ``error`` push, raised by the next call). False when no session is live."""
        session = self._engine.session
        if session is None or session.closed:
            return False
        session.write(session.codec.send(Request(0, op, args)))
        return True

    @property
    def extensions(self) -> dict[str, ConnectionExtension]:
        """Parts with pushes of their own, by push event name (``ConnectionExtension``)."""
        return self._engine.extensions

    @property
    def epoch(self) -> int | None:
        """Number of the live session (one up after each failover); None while failing over."""
        return self._engine.epoch

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
    connection = AsyncConnection(parsed, checked.for_url(parsed))
    await connection._engine.start()
    return connection


def connect(url: str | ClientURL, **options: Any) -> AwaitableContext[AsyncConnection]:
    """Connect to a broker: ``conn = await connect(url)`` or ``async with connect(url) as conn``.

    ``url`` is ``txb://[user:password@]host[:port][,host[:port]...]`` (the host list is
    the failover list), ``txbs://…`` over TLS; options are those of
    :class:`~txbroker.client.options.ConnectOptions` (``timeout``, ``reconnect``,
    ``failover_timeout``, ``on_failover``, ``client_id``; ``tls_ca``, ``tls_cert``,
    ``tls_key``, ``ssl_context``, ``tls_server_hostname``). The URL and the options
    are checked at once (ValueError / TypeError).
    """
    parsed = url if isinstance(url, ClientURL) else parse_url(url)
    checked = ConnectOptions.from_kwargs(options).for_url(parsed)
    return AwaitableContext(lambda: open_connection(parsed, checked))
