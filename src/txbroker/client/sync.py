"""The sync client: ``with txbroker.connect(url) as conn: conn.send("q", b"hi")``.

A thin wrapper: each :class:`Connection` runs an
:class:`~txbroker.client.aio.AsyncConnection` on an event loop (uvloop if
installed) on a daemon thread that every sync connection of the process shares
(``_portal.SHARED_LOOP``), and every method hands the matching coroutine to
that loop with ``run_coroutine_threadsafe`` and waits for its outcome.
Exceptions are the async client's. ``on_failover`` runs on that thread, so it
must not call a sync connection (that raises RuntimeError: it would deadlock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, Final, TypeVar

from txbroker.client._engine import Engine
from txbroker.client._portal import SHARED_LOOP, LoopThread
from txbroker.client.aio import AsyncConnection, open_connection
from txbroker.client.async_objects import AckMode, AsyncMessage, AsyncSubscription, MessageBase
from txbroker.client.async_transaction import AsyncTransaction
from txbroker.client.operations import (
    BrokerLimits,
    ReceiveRequest,
    SendRequest,
    receive_face,
    send_face,
)
from txbroker.client.options import ConnectOptions
from txbroker.client.streams import StreamMixin
from txbroker.client.url import ClientURL, parse_url
from txbroker.client.xa import AsyncXAResource
from txbroker.core.xa import TMENDRSCAN, TMSTARTRSCAN, TMSUCCESS
from txbroker.errors import BrokerError, ConnectionLost
from txbroker.xid import Xid

__all__ = ["Connection", "Message", "Subscription", "Transaction", "XAResource", "connect"]

T = TypeVar("T")

#: Messages moved from the loop thread to a sync subscription per hand-over.
SYNC_BATCH: Final = 256


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def _deferring(engine: Engine, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro``; a broker error it raises is raised by the next call instead (as
    the engine does with a pipelined request's error)."""
    try:
        await coro
    except BrokerError as exc:
        if engine.deferred is None:
            engine.deferred = exc


class Message(MessageBase):
    """A received message; ``msg.ack()`` / ``msg.nack()`` settle it."""

    __slots__ = ("_inner", "_portal")

    def __init__(self, inner: AsyncMessage, portal: LoopThread) -> None:
        self._copy_fields(inner)
        self._inner = inner
        self._portal = portal

    def ack(self, *, wait: bool = False) -> None:
        """Acknowledge (pipelined: a broker error is raised by the next call, unless ``wait``)."""
        self._portal.call(self._inner.ack(wait=wait))

    def nack(self, requeue: bool = True, *, wait: bool = False) -> None:
        """Reject: redeliver (``requeue``) or dead-letter at once."""
        self._portal.call(self._inner.nack(requeue, wait=wait))


class Subscription:
    """Messages pushed for one queue: ``for msg in sub``; ``close()`` or ``with`` ends it."""

    def __init__(self, inner: AsyncSubscription, portal: LoopThread) -> None:
        self._inner = inner
        self._portal = portal
        self._local: deque[Message] = deque()

    @property
    def queue(self) -> str:
        """The subscribed queue."""
        return self._inner.queue

    @property
    def prefetch(self) -> int:
        """Unacked deliveries the broker may have out on it."""
        return self._inner.prefetch

    @property
    def ack_mode(self) -> AckMode:
        """``"client"`` or ``"auto"``."""
        return self._inner.ack_mode

    @property
    def cancel_reason(self) -> str | None:
        """Why the broker cancelled it, if it did."""
        return self._inner.cancel_reason

    def get(self, timeout: float | None = None) -> Message | None:
        """The next message; None on timeout or once the subscription ended."""
        local = self._local
        while local and local[0]._inner._given_back():
            local.popleft()  # a failover or recover() gave it back: the broker redelivers it
        if not local:
            batch = self._portal.call(self._inner.get_batch(SYNC_BATCH, timeout))
            local.extend(Message(m, self._portal) for m in batch)
            if not local:
                return None
        return local.popleft()

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        message = self.get()
        if message is None:
            raise StopIteration
        return message

    def close(self) -> None:
        """Unsubscribe; unacked and buffered messages go back to the queue."""
        self._local.clear()
        self._portal.call(self._inner.close())

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Transaction:
    """A local transaction: ``with conn.transaction() as tx`` commits on normal exit and
    rolls back on an exception."""

    def __init__(self, inner: AsyncTransaction, portal: LoopThread) -> None:
        self._inner = inner
        self._portal = portal

    @property
    def tx_id(self) -> int | None:
        """The broker's id of the transaction (None before it began)."""
        return self._inner.tx_id

    def begin(self) -> None:
        """Begin now (otherwise the first operation does)."""
        self._portal.call(self._inner.begin())

    def _limits(self) -> BrokerLimits:
        return self._inner._limits()

    @send_face
    def send(self, request: SendRequest) -> None:
        """Stage a send; it becomes visible at commit (arguments: the connection's ``send``,
        checked before anything is sent)."""
        self._portal.call(self._inner._send(request))

    @receive_face
    def receive(self, request: ReceiveRequest) -> Message | None:
        """Receive a message consumed by the transaction (its ack is staged)."""
        inner = self._portal.call(self._inner._receive(request))
        return None if inner is None else Message(inner, self._portal)

    def ack(self, message: Message) -> None:
        """Stage the ack of a message received outside the transaction."""
        self._portal.call(self._inner.ack(message._inner))

    def nack(self, message: Message, requeue: bool = True) -> None:
        """Stage the rejection of a message received outside the transaction."""
        self._portal.call(self._inner.nack(message._inner, requeue))

    def commit(self) -> None:
        """Commit; returns once durable. Raises TransactionRolledBack if it could not."""
        self._portal.call(self._inner.commit())

    def rollback(self) -> None:
        """Roll back: staged sends are dropped, consumed messages redelivered."""
        self._portal.call(self._inner.rollback())

    def __enter__(self) -> Transaction:
        self._portal.call(self._inner.__aenter__())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._portal.call(self._inner.__aexit__(exc_type, exc, tb))


def _chain(source: asyncio.Future[None], target: concurrent.futures.Future[None]) -> None:
    if target.cancelled():
        return
    if source.cancelled():
        target.cancel()
    elif (error := source.exception()) is not None:
        target.set_exception(error)
    else:
        target.set_result(None)


class Connection(StreamMixin):
    """A sync connection to a broker. Use :func:`connect` to make one."""

    def __init__(self, inner: AsyncConnection, portal: LoopThread) -> None:
        self._inner = inner
        self._portal = portal
        self._closed = False

    @property
    def url(self) -> ClientURL:
        """The parsed URL (failover list and user)."""
        return self._inner.url

    @property
    def server_info(self) -> dict[str, Any]:
        """The broker's ``hello`` reply."""
        return self._inner.server_info

    @property
    def host(self) -> str | None:
        """``host:port`` of the broker we are connected to (None while failing over)."""
        return self._inner.host

    @property
    def async_connection(self) -> AsyncConnection:
        """The async connection this one wraps (lives on the private loop thread)."""
        return self._inner

    @property
    def _streams(self) -> AsyncConnection:
        return self._inner

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise ConnectionLost("the connection is closed")
        return self._portal.call(coro)

    def _limits(self) -> BrokerLimits:
        return self._inner._limits()

    @send_face
    def send(self, request: SendRequest) -> None:
        """Send a message; returns once the broker made it durable.

        The arguments are those of :func:`~txbroker.client.operations.send_request`
        (``ttl``/``delay`` in seconds), checked before anything is sent.
        """
        self._call(self._inner._send(request))

    @send_face
    def send_nowait(self, request: SendRequest) -> concurrent.futures.Future[None]:
        """Like :meth:`send` but returns a future at once: pipeline many sends.

        The arguments are checked at once (errors are raised, not put in the future).
        """
        if self._closed:
            raise ConnectionLost("the connection is closed")
        result: concurrent.futures.Future[None] = concurrent.futures.Future()

        def start() -> None:
            try:
                reply = self._inner._send_nowait(request)
            except BaseException as exc:
                result.set_exception(exc)
            else:
                reply.add_done_callback(lambda source: _chain(source, result))

        self._portal.call_soon(start)
        return result

    @receive_face
    def receive(self, request: ReceiveRequest) -> Message | None:
        """Take one message (``ack`` it); None after ``timeout`` s (None: wait forever)."""
        inner = self._call(self._inner._receive(request))
        return None if inner is None else Message(inner, self._portal)

    def subscribe(self, queue: str, prefetch: int = 100, ack: AckMode = "client") -> Subscription:
        """Subscribe to a queue; iterate over the returned Subscription."""
        inner: AsyncSubscription = self._call(
            _awaited(self._inner.subscribe(queue, prefetch=prefetch, ack=ack))
        )
        return Subscription(inner, self._portal)

    def transaction(self) -> Transaction:
        """A new local transaction (``with conn.transaction() as tx``)."""
        return Transaction(self._inner.transaction(), self._portal)

    def request(self, op: str, args: dict[str, Any]) -> Any:
        """Send one native request and wait for its result (see
        :meth:`AsyncConnection.request <txbroker.client.aio.AsyncConnection.request>`)."""
        return self._call(self._inner.request(op, args))

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this connection's loop thread and wait for its outcome: for
        parts built on :attr:`async_connection` (``txbroker.router``)."""
        return self._call(coro)

    def run_async_pipelined(self, coro: Coroutine[Any, Any, None]) -> None:
        """Hand ``coro`` to this connection's loop thread without waiting for it — for a
        pipelined request (``xa_start`` with ``wait=False``): the calls made after it
        run after it on the loop, in order, and a broker error it raises (an
        :class:`~txbroker.errors.XAError` too) is raised by the next call on this
        connection, like a pipelined request's refusal. It saves the wait for the loop
        thread's turn (a thread wake-up each way, issue 30)."""
        if self._closed:
            coro.close()
            raise ConnectionLost("the connection is closed")
        self._portal.submit(_deferring(self._inner._engine, coro))

    def recover(self) -> int:
        """Give back every unacknowledged message of this connection (JMS
        ``Session.recover()``); the broker redelivers them. Returns how many.
        See :meth:`AsyncConnection.recover <txbroker.client.aio.AsyncConnection.recover>`."""
        return self._call(self._inner.recover())

    def declare_queue(self, name: str, **settings: Any) -> dict[str, Any]:
        """Create a queue (or check its settings); returns the queue info."""
        return self._call(self._inner.declare_queue(name, **settings))

    def declare_topic(self, name: str, **settings: Any) -> dict[str, Any]:
        """Create a topic; returns its info."""
        return self._call(self._inner.declare_topic(name, **settings))

    def subscribe_topic(self, topic: str, name: str, durable: bool = True) -> dict[str, Any]:
        """Create the subscription queue ``"{topic}::{name}"``; returns its info."""
        return self._call(self._inner.subscribe_topic(topic, name, durable))

    def update_queue(self, name: str, **settings: Any) -> dict[str, Any]:
        """Change settings of a queue; returns its info."""
        return self._call(self._inner.update_queue(name, **settings))

    def delete_queue(self, name: str) -> int:
        """Delete a queue; returns how many messages were dropped."""
        return self._call(self._inner.delete_queue(name))

    def purge_queue(self, name: str) -> int:
        """Drop every ready message of a queue; returns how many."""
        return self._call(self._inner.purge_queue(name))

    def queues(self) -> list[dict[str, Any]]:
        """Info of every queue and topic."""
        return self._call(self._inner.queues())

    def queue_info(self, name: str) -> dict[str, Any]:
        """Info of one queue."""
        return self._call(self._inner.queue_info(name))

    def stats(self) -> dict[str, Any]:
        """The broker's counters."""
        return self._call(self._inner.stats())

    def ping(self) -> None:
        """Round trip to the broker."""
        self._call(self._inner.ping())

    # ------------------------------------------------------------------ XA / TPC
    def xa_resource(self) -> XAResource:
        """This connection's XAResource."""
        return XAResource(self._inner.xa_resource(), self)

    @staticmethod
    def xid(format_id: int, gtrid: str | bytes, bqual: str | bytes) -> Xid:
        """An Xid (DB-API 2.0 ``Connection.xid``)."""
        return Xid(format_id, gtrid, bqual)

    def tpc_begin(self, xid: Xid | tuple[int, Any, Any]) -> None:
        """Begin a TPC transaction: this connection's sends and acks join branch ``xid``."""
        self._call(self._inner.tpc_begin(xid))

    def tpc_prepare(self) -> None:
        """End the work and prepare (durable when this returns)."""
        self._call(self._inner.tpc_prepare())

    def tpc_commit(self, xid: Xid | tuple[int, Any, Any] | None = None) -> None:
        """Commit the current transaction (one-phase if not prepared) or, for recovery,
        the prepared branch ``xid``."""
        self._call(self._inner.tpc_commit(xid))

    def tpc_rollback(self, xid: Xid | tuple[int, Any, Any] | None = None) -> None:
        """Roll back the current transaction or, for recovery, the branch ``xid``."""
        self._call(self._inner.tpc_rollback(xid))

    def tpc_recover(self) -> list[Xid]:
        """Xids of prepared (and heuristically completed) branches."""
        return self._call(self._inner.tpc_recover())

    def xa_branches(self) -> list[dict[str, Any]]:
        """Every XA branch of the broker (operator view)."""
        return self._call(self._inner.xa_branches())

    def xa_heuristic(self, xid: Xid, commit: bool) -> None:
        """Complete a PREPARED branch by hand (operator)."""
        self._call(self._inner.xa_heuristic(xid, commit))

    def close(self) -> None:
        """Flush pending acks and close (the last connection open stops the loop thread)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._inner.close())
        finally:
            SHARED_LOOP.release(self._portal)

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class XAResource:
    """The sync face of :class:`~txbroker.client.xa.AsyncXAResource` (same methods)."""

    def __init__(self, inner: AsyncXAResource, connection: Connection) -> None:
        self._inner = inner
        self._connection = connection

    def start(self, xid: Xid, flags: int = 0, *, wait: bool = True) -> None:
        """Associate the connection with branch ``xid`` (TMNOFLAGS, TMJOIN, TMRESUME);
        ``wait=False`` pipelines it (a refusal is raised by the next call)."""
        self._connection._call(self._inner.start(xid, flags, wait=wait))

    def end(self, xid: Xid, flags: int = TMSUCCESS, *, wait: bool = True) -> None:
        """End the association (TMSUCCESS, TMSUSPEND, TMFAIL); ``wait`` as for start."""
        self._connection._call(self._inner.end(xid, flags, wait=wait))

    def prepare(self, xid: Xid) -> int:
        """Phase one: XA_OK or XA_RDONLY."""
        return self._connection._call(self._inner.prepare(xid))

    def commit(self, xid: Xid, one_phase: bool = False) -> None:
        """Commit (two-phase, or ``one_phase`` for an ended, unprepared branch)."""
        self._connection._call(self._inner.commit(xid, one_phase))

    def rollback(self, xid: Xid) -> None:
        """Roll the branch back."""
        self._connection._call(self._inner.rollback(xid))

    def recover(self, flags: int = TMSTARTRSCAN | TMENDRSCAN) -> list[Xid]:
        """Prepared and heuristically completed branches."""
        return self._connection._call(self._inner.recover(flags))

    def forget(self, xid: Xid) -> None:
        """Remove a heuristically completed branch."""
        self._connection._call(self._inner.forget(xid))

    def set_transaction_timeout(self, seconds: int) -> bool:
        """Timeout of branches started from now on; 0 restores the default."""
        return self._connection._call(self._inner.set_transaction_timeout(seconds))

    def get_transaction_timeout(self) -> int:
        """The transaction timeout in seconds."""
        return self._connection._call(self._inner.get_transaction_timeout())

    def is_same_rm(self, other: object) -> bool:
        """True when ``other`` talks to the same broker."""
        return isinstance(other, XAResource) and self._inner.is_same_rm(other._inner)


def connect(url: str | ClientURL, **options: Any) -> Connection:
    """Connect to a broker: ``with connect("txb://host:5445") as conn: ...``.

    Same URL and options as :func:`txbroker.aio.connect`.
    """
    parsed = url if isinstance(url, ClientURL) else parse_url(url)
    checked = ConnectOptions.from_kwargs(options).for_url(parsed)
    portal = SHARED_LOOP.acquire()
    try:
        inner = portal.call(open_connection(parsed, options=checked))
    except BaseException:
        SHARED_LOOP.release(portal)
        raise
    return Connection(inner, portal)
