"""The small I/O interface the async client runs on, so tests can replace it.

A :class:`Transport` opens a :class:`Stream` to ``host:port``; a stream reads
bytes (``b""`` at end of stream), writes bytes without blocking, waits for
the write buffer to drain, and closes. :class:`TCPTransport` is the real
one, on asyncio streams, over TLS when it is given an ``ssl.SSLContext``
(``txbs://`` URLs: ``ConnectOptions.for_url`` makes that transport, with the
context of :func:`tls_client_context` or the application's own).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from typing import Final, Protocol

__all__ = ["READ_CHUNK", "TLS_MINIMUM_VERSION", "Stream", "TCPTransport", "Transport",
           "tls_client_context"]

#: Bytes asked for per read: large enough to carry many small frames at once.
READ_CHUNK: Final = 256 * 1024
#: Write-buffer high-water mark above which ``drain`` waits (asyncio's default is 64 KiB).
WRITE_HIGH_WATER: Final = 1024 * 1024
#: The oldest TLS version the client accepts (the broker's floor too, server/security/tls.py).
TLS_MINIMUM_VERSION: Final = ssl.TLSVersion.TLSv1_2


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
    """TCP (asyncio streams; TCP_NODELAY is asyncio's default); TLS over it when
    ``ssl_context`` is given. The server's certificate is checked against the host
    of each address (the context's ``check_hostname``), or against
    ``server_hostname`` when that is given."""

    __slots__ = ("server_hostname", "ssl_context")

    def __init__(self, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None) -> None:
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname

    async def open(self, host: str, port: int) -> Stream:
        """Connect to ``host:port`` over TCP (and do the TLS handshake)."""
        if self.ssl_context is None:
            reader, writer = await asyncio.open_connection(host, port, limit=READ_CHUNK)
        else:
            reader, writer = await asyncio.open_connection(
                host, port, limit=READ_CHUNK, ssl=self.ssl_context,
                server_hostname=self.server_hostname or host)
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        return _TCPStream(reader, writer)


def tls_client_context(ca: str | os.PathLike[str] | None = None,
                       cert: str | os.PathLike[str] | None = None,
                       key: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """The client's TLS context: the broker's certificate must be signed by the CA in
    ``ca`` (a PEM file; None: the system's CAs) and name the host connected to; TLS
    1.2 at least; ``cert``/``key``: a client certificate, for a broker that asks for
    one (mutual TLS). ValueError naming the file on one that cannot be loaded."""
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"tls_ca {ca}: cannot load it ({exc})") from None
    context.minimum_version = TLS_MINIMUM_VERSION
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_cert {cert} / tls_key {key}: cannot load them ({exc})"
                             ) from None
    return context
