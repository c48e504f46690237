"""Messages and subscriptions of the async client.

A message remembers the session epoch it was delivered on (see
``_engine.py``). After a failover the broker has put it back in its queue;
acking it then is seed 004's case: the ack names the message by its queue and
id (``ack_by_id``) and succeeds unless the message was sent to another
receiver meanwhile (IllegalState). If the broker had delivered it again to
this connection (a restored subscription), that copy is dropped from the
subscription's buffer. Nacking it after a failover, or settling a message
that ``recover()`` gave back (its tag is below the session's
``recovered_below``), raises IllegalState. Subscriptions drop client-ack
messages of an old session from their buffers: the broker delivers them again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, Final, Generic, Literal, TypeVar

from txbroker.client._engine import Engine, Session
from txbroker.client.operations import settle_args
from txbroker.errors import IllegalState, TxBrokerError, XAError

__all__ = [
    "AckMode",
    "AsyncMessage",
    "AsyncSubscription",
    "AwaitableContext",
    "MessageBase",
]

AckMode = Literal["client", "auto"]

#: Buffered auto-ack messages of one subscription above which the client stops
#: reading from the broker until the application catches up (at least the prefetch).
AUTO_ACK_BUFFER: Final = 1000

T = TypeVar("T")


class AwaitableContext(Generic[T]):
    """``await x`` gives the object; ``async with x as obj`` also closes it at the end."""

    __slots__ = ("_factory", "_value")

    def __init__(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> None:
        self._factory = factory
        self._value: T | None = None

    def __await__(self) -> Generator[Any, None, T]:
        return self._factory().__await__()

    async def __aenter__(self) -> T:
        self._value = await self._factory()
        return self._value

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._value is not None:
            await self._value.close()  # type: ignore[attr-defined]


class MessageBase:
    """The fields of a received message (shared by the sync and async faces)."""

    __slots__ = (
        "body",
        "delivery_count",
        "headers",
        "message_id",
        "priority",
        "queue",
        "redelivered",
        "seq",
        "tag",
        "timestamp",
    )

    body: bytes
    headers: dict[str, str]
    message_id: str | None
    redelivered: bool
    delivery_count: int
    priority: int
    queue: str
    seq: int
    timestamp: float  #: seconds since the epoch (the broker's ``timestamp_ms`` / 1000)
    tag: int  #: delivery tag, unique per connection

    def _copy_fields(self, other: MessageBase) -> None:
        for name in MessageBase.__slots__:
            setattr(self, name, getattr(other, name))

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} queue={self.queue!r} seq={self.seq} "
            f"id={self.message_id!r} redelivered={self.redelivered} {len(self.body)} bytes>"
        )


class AsyncMessage(MessageBase):
    """A message received by the async client; ``await msg.ack()`` settles it."""

    __slots__ = ("_auto", "_engine", "_epoch", "_settled", "_tx")

    def __init__(self, engine: Engine, data: dict[str, Any], epoch: int, auto: bool) -> None:
        self.tag = int(data["tag"])
        self.queue = str(data["queue"])
        body = data["body"]
        self.body = body if type(body) is bytes else bytes(body)
        self.headers = data.get("headers") or {}
        self.message_id = data.get("message_id")
        self.redelivered = bool(data.get("redelivered", False))
        self.delivery_count = int(data.get("delivery_count", 1))
        self.priority = int(data.get("priority", 4))
        self.timestamp = int(data.get("timestamp_ms", 0)) / 1000.0
        self.seq = int(data.get("seq", 0))
        self._engine = engine
        self._epoch = epoch
        self._auto = auto
        self._settled = auto
        self._tx: object | None = None  # the AsyncTransaction that consumed it

    def _given_back(self) -> bool:
        """True when the broker has taken this client-ack delivery back: its session is
        gone (a failover) or ``recover()`` returned it."""
        if self._auto:
            return False
        session = self._engine.session
        return session is None or session.epoch != self._epoch \
            or self.tag < session.recovered_below

    async def _settle(self) -> Session:
        if self._settled:
            raise IllegalState(f"message {self.tag} was already acknowledged or rejected")
        session = await self._engine.wait_ready()
        if session.epoch != self._epoch:
            self._settled = True
            raise IllegalState(
                "the message was delivered before a failover; the broker redelivers it"
            )
        if self.tag < session.recovered_below:
            self._settled = True
            raise IllegalState("the message was given back by recover(); the broker "
                               "redelivers it")
        self._settled = True
        return session

    async def _ack_after_failover(self) -> None:
        """Seed 004: the ack of a message delivered before a failover names it by its
        queue and id; IllegalState if it went to another receiver meanwhile."""
        engine = self._engine
        self._settled = True
        try:
            await engine.call("ack_by_id", {"queue": self.queue, "id": self.seq},
                              timeout=engine.options.timeout, resend=False)
        except IllegalState:  # another receiver has it (or it is gone): settled for good
            raise
        except BaseException:  # refused before it was sent (a lost XA branch), or the
            self._settled = False  # outcome is unknown (another failover): may be retried
            raise
        for sub in list(engine.subs.values()):  # a copy delivered again is acked now
            sub.on_acked_by_id(self.queue, self.seq)

    async def _settle_with(self, op: str, args: dict[str, Any], wait: bool) -> None:
        if op == "ack" and not self._settled and not self._auto:
            session = await self._engine.wait_ready()
            if session.epoch != self._epoch:
                await self._ack_after_failover()
                return
        session = await self._settle()
        try:
            if wait:
                await self._engine.call(op, args, timeout=self._engine.options.timeout,
                                        resend=False)
            elif op == "ack":
                self._engine.pipeline_ack(session, self.tag)
            else:
                self._engine.pipeline(session, op, args)
        except XAError:  # refused before it was sent (a lost XA branch): it may be retried
            self._settled = False
            raise

    async def ack(self, *, wait: bool = False) -> None:
        """Acknowledge. Pipelined: a broker error is raised by the next call, unless ``wait``
        (then this returns once the ack is durable). No-op for auto-ack messages and for
        messages consumed by a transaction (their ack is part of the transaction)."""
        if self._auto or self._tx is not None:
            return
        await self._settle_with("ack", settle_args([self.tag]), wait)

    async def nack(self, requeue: bool = True, *, wait: bool = False) -> None:
        """Reject: redeliver it (``requeue``) or dead-letter it at once."""
        if self._auto:
            raise IllegalState("an auto-ack message cannot be rejected")
        if self._tx is not None:
            raise IllegalState("the message was consumed by a transaction: roll it back instead")
        await self._settle_with("nack", settle_args([self.tag], requeue=requeue), wait)


_END: Final = None


class AsyncSubscription:
    """Messages pushed by the broker for one queue: ``async for msg in sub``."""

    def __init__(self, engine: Engine, queue: str, prefetch: int, ack: AckMode) -> None:
        if ack not in ("client", "auto"):
            raise ValueError(f"ack must be 'client' or 'auto', not {ack!r}")
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        self.queue = queue
        self.prefetch = prefetch
        self.ack_mode: AckMode = ack
        self.sub_id = engine.new_sub_id()
        self.active = False
        #: Why the broker cancelled it (the queue was deleted), if it did.
        self.cancel_reason: str | None = None
        self._engine = engine
        self._buffer: deque[AsyncMessage] = deque()
        self._wakeup = asyncio.Event()
        self._ended = False
        self._error: BaseException | None = None
        self._paused = False
        self._pause_at = max(prefetch, AUTO_ACK_BUFFER)

    # -- engine side -------------------------------------------------------

    def subscribe_args(self) -> dict[str, Any]:
        """Arguments of the ``subscribe`` request."""
        return {
            "queue": self.queue,
            "sub": self.sub_id,
            "prefetch": self.prefetch,
            "ack": self.ack_mode,
        }

    def on_deliver(self, data: dict[str, Any], epoch: int) -> None:
        """Buffer a delivered message."""
        auto = self.ack_mode == "auto"
        self._buffer.append(AsyncMessage(self._engine, data, epoch, auto))
        self._wakeup.set()
        if auto and not self._paused and len(self._buffer) >= self._pause_at:
            self._paused = True
            self._engine.reader.pause_reading(True)

    def on_end(self, error: BaseException | None, reason: str = "") -> None:
        """End the subscription (closed, cancelled by the broker, or connection failed)."""
        self._ended = True
        self.active = False
        self._error = error
        if reason:
            self.cancel_reason = reason
        self._wakeup.set()
        self._resume()

    def on_failover(self, new_epoch: int) -> None:
        """Drop client-ack messages of the old session: the broker redelivers them."""
        if self.ack_mode == "client":
            self._buffer = deque(m for m in self._buffer if m._epoch == new_epoch)

    def on_acked_by_id(self, queue: str, seq: int) -> None:
        """A message delivered before a failover was acknowledged by its id: drop the
        copy the broker delivered again to this subscription, if it is buffered."""
        if self.ack_mode == "client" and queue == self.queue:
            self._buffer = deque(m for m in self._buffer if m.seq != seq)

    def on_recover(self) -> None:
        """Drop client-ack messages ``recover()`` gave back: the broker redelivers them."""
        if self.ack_mode == "client":
            self._buffer = deque(m for m in self._buffer if not m._given_back())

    def _resume(self) -> None:
        if self._paused and (self._ended or len(self._buffer) < self._pause_at):
            self._paused = False
            self._engine.reader.pause_reading(False)

    # -- application side --------------------------------------------------

    def _drop_given_back(self) -> bool:
        """Drop buffered messages the broker took back meanwhile (a failover under way:
        their session is gone); True if the buffer is empty now. They come first: the
        buffer is in delivery order."""
        buffer = self._buffer
        if self.ack_mode == "client":
            while buffer and buffer[0]._given_back():
                buffer.popleft()
        return not buffer

    async def _wait(self, timeout: float | None) -> bool:
        """Wait until a message is buffered; False on timeout or end."""
        try:
            async with asyncio.timeout(timeout):
                while not self._buffer or self._drop_given_back():
                    if self._ended:
                        if self._error is not None:
                            raise self._error
                        return False
                    self._wakeup.clear()
                    await self._wakeup.wait()
        except TimeoutError:
            return False
        return True

    async def get(self, timeout: float | None = None) -> AsyncMessage | None:
        """The next message; None on timeout or once the subscription ended."""
        if not await self._wait(timeout):
            return None
        message = self._buffer.popleft()
        if self._paused:
            self._resume()
        return message

    async def get_batch(self, max_count: int, timeout: float | None = None) -> list[AsyncMessage]:
        """Wait for one message, then return up to ``max_count`` buffered ones."""
        if not await self._wait(timeout):
            return []
        buffer = self._buffer
        batch = [buffer.popleft() for _ in range(min(max_count, len(buffer)))]
        if self._paused:
            self._resume()
        return batch

    def __aiter__(self) -> AsyncSubscription:
        return self

    async def __anext__(self) -> AsyncMessage:
        message = await self.get()
        if message is None:
            raise StopAsyncIteration
        return message

    async def close(self) -> None:
        """Unsubscribe; unacked and buffered messages go back to the queue."""
        if self._ended:
            return
        engine = self._engine
        was_active = engine.subs.pop(self.sub_id, None) is not None and self.active
        self.on_end(None)
        self._buffer.clear()
        if was_active and engine.session is not None:
            # If the connection is gone, the broker requeues them anyway.
            with contextlib.suppress(TxBrokerError):
                await engine.call(
                    "unsubscribe", {"sub": self.sub_id}, timeout=engine.options.timeout
                )

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
