"""The engine's reading part: one reader task per session, what each frame does,
and the back-pressure gate of auto-ack subscriptions.

Theory of operation
-------------------
:meth:`Reader.read_loop` runs as the task of one session (``_engine.py`` starts it
in ``open_session``): it reads, decodes every complete frame of each read and
dispatches it. An ``OK`` or ``ERR`` resolves the future of the pending request
with that id; the reply to a ``receive`` nobody waits for any more (it timed out
on our side) gives its message back (:func:`return_message`). An error with
request id 0 fails the handshake of a session that is not yet current (a refusal
before ``hello``), otherwise it is raised by the next call. ``deliver`` pushes go
to the subscription with that ``sub`` id, ``cancelled`` ends it, ``error`` is raised
by the next call, and other events go to the extension of that name (the router).
When the stream ends or fails, the reader closes the session and tells the
engine, which fails over (``_failover.py``) or fails the waiters.

Reading pauses while any auto-ack subscription has too many messages buffered
(:meth:`Reader.pause_reading`) and resumes when every one that paused it has
resumed it. What the part needs of the engine is :class:`ReaderHost`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from txbroker.client._session import ConnectionExtension, Session, SubscriptionSink
from txbroker.client.operations import settle_args
from txbroker.client.transport import READ_CHUNK
from txbroker.errors import BrokerError, ConnectionLost, ProtocolError, error_for_code
from txbroker.protocol.native import Err, Ok, Push, Request

__all__ = ["Reader", "ReaderHost", "return_message"]

log = logging.getLogger("txbroker.client")


class ReaderHost(Protocol):
    """What the reading part needs of the engine."""

    #: the current session (None while failing over)
    session: Session | None
    subs: dict[int, SubscriptionSink]
    #: parts with pushes of their own, by push event name
    extensions: dict[str, ConnectionExtension]
    #: a broker error the next call raises (an error push, a pipelined request's error)
    deferred: BrokerError | None

    def reader_cancelled(self) -> None:
        """The event loop shut a reader down: the connection is closed, no failover."""
        ...

    def session_lost(self, session: Session, error: BaseException | None) -> None:
        """``session``'s stream ended (``error``: why): fail over or fail its waiters."""
        ...


def return_message(session: Session, result: Any) -> None:
    """Give back a message nobody will process (a receive that timed out on our side)."""
    if isinstance(result, dict) and type(result.get("tag")) is int and not session.closed:
        session.write(session.codec.send(Request(0, "nack", settle_args([result["tag"]]))))


class Reader:
    """Reads the sessions of one connection (see the module docstring)."""

    def __init__(self, host: ReaderHost) -> None:
        self._host = host
        self._read_gate = asyncio.Event()
        self._read_gate.set()
        self._pausers = 0

    def pause_reading(self, paused: bool) -> None:
        """Stop (or resume) reading from the broker: back-pressure for auto-ack subscriptions.

        Reading resumes when every subscription that paused it has resumed it.
        """
        self._pausers += 1 if paused else -1
        if self._pausers > 0:
            self._read_gate.clear()
        else:
            self._pausers = 0
            self._read_gate.set()

    def release(self) -> None:
        """Read again whoever paused (the connection failed: nothing is buffered any more)."""
        self._pausers = 0
        self._read_gate.set()

    async def read_loop(self, session: Session) -> None:
        """Read ``session`` until its stream ends; then tell the engine."""
        error: BaseException | None = None
        codec = session.codec
        dispatch = self._dispatch
        gate = self._read_gate
        try:
            while True:
                if not gate.is_set():
                    await gate.wait()
                data = await session.stream.read(READ_CHUNK)
                if not data:
                    error = ConnectionLost(f"broker {session.host} closed the connection")
                    break
                codec.receive_data(data)
                while events := codec.drain():
                    for event in events:
                        dispatch(session, event)
        except (OSError, ProtocolError) as exc:
            error = exc
        except Exception as exc:  # a bug must not leave waiters hanging
            log.exception("txbroker: client reader failed")
            error = exc
        except asyncio.CancelledError:
            self._host.reader_cancelled()  # only loop shutdown cancels a reader
            raise
        finally:
            session.close()
            self._host.session_lost(session, error)

    def _dispatch(self, session: Session, event: Ok | Err | Push | Request) -> None:
        kind = type(event)
        if kind is Ok:
            ok: Ok = event  # type: ignore[assignment]
            pending = session.pending.pop(ok.rid, None)
            if pending is not None:
                if not pending.future.done():
                    pending.future.set_result(None if pending.discard_result else ok.result)
            elif ok.rid in session.abandoned:
                session.abandoned.discard(ok.rid)
                return_message(session, ok.result)
        elif kind is Err:
            err: Err = event  # type: ignore[assignment]
            error = error_for_code(err.code, err.message)
            if err.rid == 0:  # an error not tied to a request
                if session is not self._host.session:  # a refusal during the handshake
                    for waiting in session.pending.values():
                        if not waiting.future.done():
                            waiting.future.set_exception(error)
                    session.pending.clear()
                elif self._host.deferred is None:  # raised by the next call
                    self._host.deferred = error
                return
            pending = session.pending.pop(err.rid, None)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(error)
            session.abandoned.discard(err.rid)
        else:
            push: Push = event  # type: ignore[assignment]
            self._on_push(session, push)

    def _on_push(self, session: Session, push: Push) -> None:
        data = push.data
        host = self._host
        try:
            sub = host.subs.get(data.get("sub"))  # type: ignore[arg-type]
            if push.event == "deliver":
                # Deliveries that raced our unsubscribe are requeued by the broker itself.
                if sub is not None:
                    sub.on_deliver(data, session.epoch)
            elif push.event == "cancelled":
                if sub is not None:
                    del host.subs[sub.sub_id]
                    sub.on_end(None, str(data.get("reason", "")))
            elif push.event == "error":
                if host.deferred is None:
                    host.deferred = error_for_code(int(data["code"]), str(data["message"]))
            elif (extension := host.extensions.get(push.event)) is not None:
                extension.on_push(data, session.epoch)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed {push.event!r} push: {exc!r}") from exc
