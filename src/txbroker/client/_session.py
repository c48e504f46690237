"""One stream to one broker (a session), its pending requests, and what a subscription offers.

See ``_engine.py`` for how sessions are used.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from txbroker.client.transport import Stream
from txbroker.client.url import HostPort
from txbroker.protocol.native import NativeConnection, Role

__all__ = ["ConnectionExtension", "Pending", "Session", "SubscriptionSink"]


class SubscriptionSink(Protocol):
    """What the engine needs of a subscription."""

    sub_id: int
    active: bool

    def subscribe_args(self) -> dict[str, Any]:
        """Arguments of the ``subscribe`` request that (re)creates it."""
        ...

    def on_deliver(self, data: dict[str, Any], epoch: int) -> None:
        """A ``deliver`` push for it arrived."""
        ...

    def on_end(self, error: BaseException | None, reason: str = "") -> None:
        """It ended: cancelled by the broker, closed, or the connection failed."""
        ...

    def on_failover(self, new_epoch: int) -> None:
        """The connection moved to a new session."""
        ...

    def on_recover(self) -> None:
        """``recover()`` gave back every unacked delivery of the session."""
        ...

    def on_acked_by_id(self, queue: str, seq: int) -> None:
        """A message delivered before a failover was acknowledged by its queue and id
        (``ack_by_id``): a copy delivered again meanwhile is acknowledged too."""
        ...


#: ``call(op, args)`` on one given session (used while restoring it after a failover).
SessionCall = Callable[[str, dict[str, Any]], Awaitable[Any]]


class ConnectionExtension(Protocol):
    """A part that rides a connection with pushes of its own event name (the
    transaction router, ``txbroker.router``): registered in ``Engine.extensions``
    under that name."""

    def on_push(self, data: dict[str, Any], epoch: int) -> None:
        """A push of its event name arrived on the session of ``epoch``."""
        ...

    def on_session_lost(self) -> None:
        """The current session broke (a failover follows if ``reconnect``)."""
        ...

    async def restore(self, call: SessionCall, epoch: int) -> None:
        """Restore its state on the new session (``call`` sends on it) before the
        session is made current: after the subscriptions, before the carried requests."""
        ...

    def on_failed(self, error: BaseException) -> None:
        """No broker is left (or the connection was closed): fail every waiter."""
        ...


class Pending:
    """A request waiting for its reply."""

    __slots__ = ("args", "branch", "discard_result", "future", "op", "resend", "rid", "session")

    def __init__(
        self,
        session: Session | None,
        rid: int,
        op: str,
        args: dict[str, Any],
        resend: bool,
        discard_result: bool = False,
    ) -> None:
        #: the session it was sent on (None: asked while failing over, not sent yet)
        self.session = session
        self.rid = rid
        self.op = op
        self.args = args
        self.resend = resend  # send again on the next session after a failover
        self.discard_result = discard_result  # resolve the future with None
        #: the XA branch (Xid text) this request is work of (re-sent only into it)
        self.branch: str | None = None
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()


class Session:
    """One stream to one broker."""

    def __init__(self, index: int, host: HostPort, stream: Stream, epoch: int) -> None:
        self.index = index
        self.host = host
        self.stream = stream
        self.epoch = epoch
        self.codec = NativeConnection(Role.CLIENT)
        self.pending: dict[int, Pending] = {}
        self.abandoned: set[int] = set()  # rids of receives nobody waits for any more
        #: deliveries with a lower tag were given back by ``recover`` (the broker's fence)
        self.recovered_below = 0
        self.info: dict[str, Any] = {}
        self.reader: asyncio.Task[None] | None = None
        self.closed = False
        self._out: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Queue a frame; frames queued in one loop iteration go out in one write."""
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if not self.closed and out:
            self.stream.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        """Close the stream; the reader then ends and fails what is pending."""
        if not self.closed:
            self._flush()
            self.closed = True
            self.stream.close()
