"""Pipelined sends coalesced into ``send_batch`` requests (the engine's producer batching).

``send_nowait`` calls made in one event-loop iteration, to one destination, with
nothing but a body, headers, a message id and the persistence flag, are joined
into one ``send_batch`` request when the iteration ends (``call_soon``), as Kafka's
producer fills a batch per partition. The broker stores a batch with one journal
entry and one reply, so each message costs both sides a fraction of a request.
Nothing else changes for the caller: every message keeps its own future, resolved
when the batch is durable (or failed with the batch's error), and messages stay
in call order.

Order with the connection's other requests is kept by the engine: any other
request flushes the pending batch first (``Engine._submit_on``). A batch whose
messages all carry a ``message_id`` is re-sent after a failover like a single
send with an id (the broker drops duplicates by id).

A batch holds at most :data:`MAX_MESSAGES` messages or :data:`MAX_BYTES` of
bodies; a lone message, or one above :data:`MAX_BODY`, goes out as a plain ``send``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

#: Most messages one coalesced ``send_batch`` holds.
MAX_MESSAGES: Final = 256
#: Most body bytes one coalesced ``send_batch`` holds (far below any frame limit).
MAX_BYTES: Final = 512 * 1024
#: Bodies larger than this go out as a plain ``send`` (a batch never nears a frame limit).
MAX_BODY: Final = 64 * 1024
#: The only ``send`` arguments a coalesced message may carry.
BATCHABLE_KEYS: Final = frozenset({"dest", "body", "headers", "message_id", "persistent"})


def batchable(args: dict[str, Any]) -> bool:
    """True when a ``send`` with these wire arguments can join a batch."""
    return args.keys() <= BATCHABLE_KEYS and len(args["body"]) <= MAX_BODY


class SendBatch:
    """The sends of one loop iteration to one destination, not yet written."""

    __slots__ = ("args", "body_bytes", "dest", "futures", "key", "resend")

    def __init__(self, key: tuple[object, str, bool]) -> None:
        self.key = key
        self.dest = key[1]
        self.args: list[dict[str, Any]] = []
        self.futures: list[asyncio.Future[None]] = []
        self.body_bytes = 0
        self.resend = True

    def add(self, args: dict[str, Any], resend: bool,
            loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """Add one message; return its future."""
        future: asyncio.Future[None] = loop.create_future()
        self.args.append(args)
        self.futures.append(future)
        self.body_bytes += len(args["body"])
        self.resend = self.resend and resend
        return future

    @property
    def full(self) -> bool:
        """True when the batch holds as many messages or bytes as one may."""
        return len(self.args) >= MAX_MESSAGES or self.body_bytes >= MAX_BYTES

    def wire_args(self) -> dict[str, Any]:
        """The ``send_batch`` request's arguments."""
        args: dict[str, Any] = {"dest": self.dest, "bodies": [a["body"] for a in self.args]}
        if any("headers" in a for a in self.args):
            args["headers"] = [a.get("headers") for a in self.args]
        if any("message_id" in a for a in self.args):
            args["message_ids"] = [a.get("message_id") for a in self.args]
        if not self.key[2]:
            args["persistent"] = False
        return args

    def settle_with(self, request: asyncio.Future[Any]) -> None:
        """Resolve every message's future from the batch request's future."""
        request.add_done_callback(self._settle)

    def _settle(self, request: asyncio.Future[Any]) -> None:
        error: BaseException | None
        error = asyncio.CancelledError() if request.cancelled() else request.exception()
        for future in self.futures:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def chain_each(self, submit: Callable[[dict[str, Any]], asyncio.Future[Any]]) -> None:
        """Send each message on its own (the session changed before the flush)."""
        for args, future in zip(self.args, self.futures, strict=True):
            _chain(submit(args), future)


def _chain(source: asyncio.Future[Any], target: asyncio.Future[None]) -> None:
    def done(src: asyncio.Future[Any]) -> None:
        if target.done():
            return
        if src.cancelled():
            target.cancel()
        elif src.exception() is not None:
            target.set_exception(src.exception())  # type: ignore[arg-type]
        else:
            target.set_result(None)

    source.add_done_callback(done)
