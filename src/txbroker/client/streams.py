"""Offset reading, batched sends and the Spark sink's calls for both clients.

``AsyncStreamMixin`` is mixed into :class:`~txbroker.client.aio.AsyncConnection`;
``StreamMixin`` gives the sync :class:`~txbroker.client.sync.Connection` the same
calls. The broker side is ``core/streams.py``; ``docs/spark.md`` shows the use.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from txbroker.client._engine import Engine
from txbroker.client.operations import BatchRequest, BrokerLimits, batch_face
from txbroker.protocol.columns import (
    I64,
    U32,
    check_page,
    encode_page,
    split_bodies,
    unpack_ints,
)
from txbroker.xid import Xid

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """A queue's offsets: ``first`` is the lowest seq present, ``next`` one past the
    highest readable one (``first == next``: nothing to read)."""

    queue: str
    first: int
    next: int
    reader: str | None = None


@dataclass(slots=True)
class StreamChunk:
    """One ``stream_read`` page, as packed columns (``protocol/columns.py``): one
    entry per message, in seq order. The list properties unpack a column; the
    Spark source builds Arrow arrays straight from the packed ones."""

    queue: str
    next: int  #: the seq to continue from (the range's end when it is done)
    count: int  #: messages in the page
    seq_column: bytes  #: i64 little-endian per message
    timestamp_column: bytes  #: i64 little-endian per message: ms since the epoch (sent)
    delivery_count_column: bytes  #: u32 little-endian per message
    body_lengths: bytes  #: u32 little-endian per message
    body_data: bytes  #: the bodies back to back
    message_id_list: list[str | None] | None = None  #: None: no message has an id
    header_list: list[dict[str, str] | None] | None = None  #: None: no message has any

    @classmethod
    def from_page(cls, page: Any) -> StreamChunk:
        """A received page map, checked (ProtocolError if malformed)."""
        page = check_page(page)
        return cls(page["queue"], page["next"], page["count"], page["seqs"],
                   page["timestamps"], page["delivery_counts"], page["body_lengths"],
                   page["bodies"], page["message_ids"], page["headers"])

    @classmethod
    def of(cls, queue: str, next_seq: int, *, seqs: Sequence[int], bodies: Sequence[bytes],
           timestamps: Sequence[int] | None = None,
           delivery_counts: Sequence[int] | None = None,
           message_ids: Sequence[str | None] | None = None,
           headers: Sequence[dict[str, str] | None] | None = None) -> StreamChunk:
        """A page built from lists (tests, tools); missing columns are zeros/None."""
        zeros = [0] * len(seqs)
        return cls.from_page(encode_page(
            queue, next_seq, seqs=seqs, timestamps=timestamps or zeros,
            delivery_counts=delivery_counts or zeros,
            message_ids=list(message_ids or [None] * len(seqs)),
            headers=list(headers or [None] * len(seqs)),
            body_data=b"".join(bodies), body_lengths=[len(b) for b in bodies]))

    def __len__(self) -> int:
        return self.count

    @property
    def seqs(self) -> list[int]:
        """The messages' sequence numbers."""
        return unpack_ints(I64, self.seq_column).tolist()

    @property
    def timestamps(self) -> list[int]:
        """When each message was sent (ms since the epoch)."""
        return unpack_ints(I64, self.timestamp_column).tolist()

    @property
    def delivery_counts(self) -> list[int]:
        """How often each message was delivered to a consumer before."""
        return unpack_ints(U32, self.delivery_count_column).tolist()

    @property
    def message_ids(self) -> list[str | None]:
        """Each message's id (None: it has none)."""
        return self.message_id_list or [None] * self.count

    @property
    def headers(self) -> list[dict[str, str] | None]:
        """Each message's headers (None: it has none)."""
        return self.header_list or [None] * self.count

    @property
    def bodies(self) -> list[bytes]:
        """The bodies as separate objects."""
        return split_bodies(self.body_data, unpack_ints(U32, self.body_lengths))


def _info(result: dict[str, Any]) -> StreamInfo:
    return StreamInfo(result["queue"], int(result["first"]), int(result["next"]),
                      result.get("reader"))


class AsyncStreamMixin:
    """Stream readers, ``send_batch`` and sink commits (async)."""

    _engine: Engine

    async def _stream_call(self, op: str, args: dict[str, Any]) -> Any:
        result, _ = await self._engine.call(op, args, timeout=self._engine.options.timeout)
        return result

    def _limits(self) -> BrokerLimits:
        return self._engine.limits

    @batch_face
    async def send_batch(self, request: BatchRequest) -> int:
        """Send many messages to one destination in one request; returns how many were
        stored (duplicates by message id are not). Returns once durable; inside an XA
        branch the messages are staged in it. The arguments are those of
        :func:`~txbroker.client.operations.batch_request`, checked before anything is
        sent (a body above ``max_message_size``: MessageTooLarge, nothing sent)."""
        return await self._send_batch(request)

    async def _send_batch(self, request: BatchRequest) -> int:
        result = await self._stream_call("send_batch", request.wire_args())
        return int(result["count"])

    async def stream_open(self, queue: str, name: str) -> StreamInfo:
        """Attach as ``queue``'s exclusive stream reader ``name`` (NotFound: no such queue)."""
        return _info(await self._stream_call("stream_open", {"queue": queue, "name": name}))

    async def stream_info(self, queue: str) -> StreamInfo:
        """``queue``'s offsets, without attaching."""
        return _info(await self._stream_call("stream_info", {"queue": queue}))

    async def stream_read(self, queue: str, start: int, end: int, *, name: str | None = None,
                          max_messages: int = 10_000,
                          max_bytes: int = 4 * 1024 * 1024) -> StreamChunk:
        """Messages with ``start <= seq < end`` without consuming them (one page: go on
        from ``chunk.next`` until it reaches ``end``)."""
        args: dict[str, Any] = {"queue": queue, "start": start, "end": end,
                                "max": max_messages, "max_bytes": max_bytes}
        if name is not None:
            args["name"] = name
        return StreamChunk.from_page(await self._stream_call("stream_read", args))

    async def stream_commit(self, queue: str, name: str, end: int) -> int:
        """Consume every message of ``queue`` below seq ``end`` (idempotent); returns how
        many went now."""
        result = await self._stream_call("stream_commit",
                                         {"queue": queue, "name": name, "end": end})
        return int(result["released"])

    async def stream_close(self, queue: str, name: str) -> None:
        """Detach the stream reader (closing the connection does it too)."""
        await self._stream_call("stream_close", {"queue": queue, "name": name})

    async def sink_status(self, sink: str) -> int:
        """The sink's last committed batch id (-1: none yet)."""
        return int((await self._stream_call("sink_status", {"sink": sink}))["last"])

    async def sink_commit(self, sink: str, batch: int, xids: Sequence[Xid | str]) -> dict[str, Any]:
        """Commit batch ``batch`` of ``sink``: its prepared branches ``xids``, atomically
        with the sink's last committed batch id. ``{"committed": False}`` means the
        batch was already committed (a replay: its new branches were rolled back)."""
        result: dict[str, Any] = await self._stream_call(
            "sink_commit", {"sink": sink, "batch": batch, "xids": [str(x) for x in xids]})
        return result

    async def sink_abort(self, sink: str, batch: int) -> dict[str, Any]:
        """Roll back batch ``batch`` of ``sink`` unless it is committed."""
        result: dict[str, Any] = await self._stream_call("sink_abort",
                                                         {"sink": sink, "batch": batch})
        return result


class StreamMixin:
    """The same calls on the sync connection (run on its loop thread)."""

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    @property
    def _streams(self) -> AsyncStreamMixin:
        raise NotImplementedError

    def _limits(self) -> BrokerLimits:
        return self._streams._limits()

    @batch_face
    def send_batch(self, request: BatchRequest) -> int:
        """See :meth:`AsyncStreamMixin.send_batch`."""
        return self._call(self._streams._send_batch(request))

    def stream_open(self, queue: str, name: str) -> StreamInfo:
        """See :meth:`AsyncStreamMixin.stream_open`."""
        return self._call(self._streams.stream_open(queue, name))

    def stream_info(self, queue: str) -> StreamInfo:
        """See :meth:`AsyncStreamMixin.stream_info`."""
        return self._call(self._streams.stream_info(queue))

    def stream_read(self, queue: str, start: int, end: int, *, name: str | None = None,
                    max_messages: int = 10_000, max_bytes: int = 4 * 1024 * 1024) -> StreamChunk:
        """See :meth:`AsyncStreamMixin.stream_read`."""
        return self._call(self._streams.stream_read(queue, start, end, name=name,
                                                  max_messages=max_messages, max_bytes=max_bytes))

    def stream_commit(self, queue: str, name: str, end: int) -> int:
        """See :meth:`AsyncStreamMixin.stream_commit`."""
        return self._call(self._streams.stream_commit(queue, name, end))

    def stream_close(self, queue: str, name: str) -> None:
        """See :meth:`AsyncStreamMixin.stream_close`."""
        self._call(self._streams.stream_close(queue, name))

    def sink_status(self, sink: str) -> int:
        """See :meth:`AsyncStreamMixin.sink_status`."""
        return self._call(self._streams.sink_status(sink))

    def sink_commit(self, sink: str, batch: int, xids: Sequence[Xid | str]) -> dict[str, Any]:
        """See :meth:`AsyncStreamMixin.sink_commit`."""
        return self._call(self._streams.sink_commit(sink, batch, xids))

    def sink_abort(self, sink: str, batch: int) -> dict[str, Any]:
        """See :meth:`AsyncStreamMixin.sink_abort`."""
        return self._call(self._streams.sink_abort(sink, batch))


__all__ = ["AsyncStreamMixin", "StreamChunk", "StreamInfo", "StreamMixin"]
