"""The small I/O interface the async client runs on, so tests can replace it.

A :class:`Transport` opens a :class:`Stream` to ``host:port``; a stream reads
bytes (``b""`` at end of stream), writes bytes without blocking, waits for
the write buffer to drain, and closes. :class:`TCPTransport` is the real
one, on asyncio streams.
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

__all__ = ["READ_CHUNK", "Stream", "TCPTransport", "Transport"]

#: Bytes asked for per read: large enough to carry many small frames at once.
READ_CHUNK: Final = 256 * 1024
#: Write-buffer high-water mark above which ``drain`` waits (asyncio's default is 64 KiB).
WRITE_HIGH_WATER: Final = 1024 * 1024


class Stream(Protocol):
    """A byte stream to one broker."""

    async def read(self, max_bytes: int) -> bytes:
        """Return up to ``max_bytes`` bytes, ``b""`` at end of stream; OSError on failure."""
        ...

    def write(self, data: bytes) -> None:
        """Queue bytes for writing; never blocks."""
        ...

    async def drain(self) -> None:
        """Wait while the write buffer is above its high-water mark."""
        ...

    def close(self) -> None:
        """Close the stream (pending reads then see end of stream or an error)."""
        ...


class Transport(Protocol):
    """Opens streams; the async client's only way to reach the network."""

    async def open(self, host: str, port: int) -> Stream:
        """Connect to ``host:port``; raise OSError if nobody answers."""
        ...


class _TCPStream:
    """A Stream over asyncio's StreamReader/StreamWriter."""

    __slots__ = ("_reader", "_writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int) -> bytes:
        return await self._reader.read(max_bytes)

    def write(self, data: bytes) -> None:
        if self._writer.is_closing():  # the peer went away: the reader reports the loss
            return  # (uvloop raises RuntimeError on a write to a closed transport)
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


class TCPTransport:
    """Plain TCP (asyncio streams; TCP_NODELAY is asyncio's default)."""

    async def open(self, host: str, port: int) -> Stream:
        """Connect to ``host:port`` over TCP."""
        reader, writer = await asyncio.open_connection(host, port, limit=READ_CHUNK)
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        return _TCPStream(reader, writer)
