"""TLS for every listener: the one place the broker's ``ssl.SSLContext`` is made.

Theory of operation
-------------------
:func:`server_context` builds the context of every TLS listener — the native
protocol's (``tls_port``, clients use ``txbs://``), STOMP's
(``stomp_tls_port``) and, when it lands, the HTTP console's (HTTPS): a
certificate chain and its private key (PEM files), TLS 1.2 at least, and, when
a CA file is given, client certificates required and verified against it
(mutual TLS). :func:`check_files` says in one line what is wrong with the files
(missing, unreadable, not PEM, a key that does not belong to the certificate);
``ServerConfig.validate`` calls it, so ``txbroker serve`` refuses bad files
before it opens anything.

A listener made with ``ssl=`` by asyncio drops a failed handshake silently (an
``ssl.SSLError`` is an OSError, which asyncio logs only in debug mode), and
makes a plaintext client wait for a timeout; and a protocol cannot look at the
first bytes before ``loop.start_tls`` takes over (uvloop reads a new socket
even when its protocol paused it in ``connection_made``). So the listeners
accept plain TCP and :class:`TLSAcceptor` is the TLS layer itself, on
``ssl.MemoryBIO`` (as asyncio's own ``sslproto`` is): it refuses at once a
client whose first bytes are not a TLS handshake, then runs the handshake. A
handshake that fails (a plaintext client on the TLS port, an untrusted or
missing client certificate, a timeout) is one WARNING line with the peer's
address, the socket is closed and nothing else happens; one that succeeds hands
a :class:`TLSTransport` to the listener's real protocol, which never sees the
difference. :func:`tls_factory` wraps a protocol factory that way.

The HTTP listener (issue 16) uses the same functions: its context comes from
``ServerConfig.server_ssl_context()`` (which calls :func:`check_files` /
:func:`server_context`); if it runs on ``loop.create_server`` with a protocol
factory (aiohttp's low-level server, uvicorn's ``H11Protocol``), wrap that
factory with :func:`tls_factory` to get the same refusals and log lines; a
server that only takes a context gets ``server_ssl_context()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final, cast

__all__ = [
    "TLS_HANDSHAKE_TIMEOUT",
    "TLS_MINIMUM_VERSION",
    "TLSAcceptor",
    "TLSTransport",
    "check_files",
    "looks_like_tls",
    "peer_context",
    "server_context",
    "tls_factory",
]

log = logging.getLogger("txbroker.server.security.tls")

#: The oldest protocol version a listener accepts: TLS 1.2 (RFC 8996 retired 1.0
#: and 1.1; RabbitMQ and Artemis ship with 1.2 as their floor too).
TLS_MINIMUM_VERSION: Final = ssl.TLSVersion.TLSv1_2
#: Seconds a client has to finish its handshake before the socket is closed
#: (asyncio's default is 60 s; a real client needs a few milliseconds).
TLS_HANDSHAKE_TIMEOUT: Final = 10.0
#: How every TLS connection begins: a handshake record (content type 22) of major
#: version 3 (RFC 8446 section 5.1; TLS 1.0 to 1.3 all write 3 there).
TLS_RECORD_START: Final = b"\x16\x03"
#: Bytes asked of OpenSSL per decrypted read: one read returns at most one record,
#: and a record holds at most 16 KiB (RFC 8446 section 5.1); a larger buffer would
#: only be allocated and cut back on every read.
TLS_READ_CHUNK: Final = 16 * 1024


def _no_password() -> str:
    """The password callback for ``load_cert_chain``: an encrypted key is refused
    (OpenSSL would otherwise ask on the terminal of a server)."""
    raise ValueError("the private key is encrypted (give an unencrypted PEM key)")


def _read_pem(name: str, path: Path, marker: str, what: str) -> None:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{name} {path}: {exc.strerror or exc}") from None
    if marker.encode() not in text:
        raise ValueError(f"{name} {path}: not a PEM file with {what}")


def check_files(cert: Path, key: Path, ca: Path | None = None) -> ssl.SSLContext:
    """:func:`server_context`, after checking each file on its own: ValueError, one
    line naming the setting and the file, if the certificate chain, the key or the
    CA file cannot serve a TLS listener."""
    _read_pem("tls_cert", cert, "-----BEGIN CERTIFICATE-----", "a certificate")
    _read_pem("tls_key", key, "PRIVATE KEY-----", "a private key")
    if ca is not None:
        _read_pem("tls_ca", ca, "-----BEGIN CERTIFICATE-----", "a CA certificate")
    return server_context(cert, key, ca)


def server_context(cert: Path, key: Path, ca: Path | None = None) -> ssl.SSLContext:
    """The context of a TLS listener: ``cert`` (the chain, leaf first) and ``key``
    (PEM), TLS 1.2 at least; with ``ca``, clients must present a certificate
    signed by it (mutual TLS). ValueError with one line on bad files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_MINIMUM_VERSION
    try:
        context.load_cert_chain(cert, key, password=_no_password)
    except ValueError as exc:
        raise ValueError(f"tls_key {key}: {exc}") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"tls_key {key} does not belong to the certificate in "
                             f"tls_cert {cert}") from None
        raise ValueError(f"tls_cert {cert} / tls_key {key}: cannot load them "
                         f"({exc.reason or exc})") from None
    except OSError as exc:
        raise ValueError(f"tls_cert {cert} / tls_key {key}: {exc.strerror or exc}") from None
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"tls_ca {ca}: cannot load it ({exc})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def peer_context(cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    """The context of a broker connecting to another broker (the HA links,
    docs/ha.md): it presents ``cert`` and ``key`` (the peer's listener, made by
    :func:`server_context` with ``ca``, requires a certificate) and verifies the peer's
    certificate, and its name or address, against ``ca``. ValueError, one line, on
    bad files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer and its name
    context.minimum_version = TLS_MINIMUM_VERSION
    try:
        context.load_cert_chain(cert, key, password=_no_password)
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ValueError(f"the HA links' TLS files ({cert}, {key}, CA {ca}): {exc}") from None
    return context


def looks_like_tls(first_bytes: bytes) -> bool:
    """Whether a connection's first bytes are a TLS handshake (a TLS client on a
    plaintext port: the STOMP listener closes it at once)."""
    return first_bytes.startswith(TLS_RECORD_START)


def _reason(exc: BaseException) -> str:
    """A handshake failure in a few words."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"client certificate refused: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    return str(exc) or type(exc).__name__


class TLSAcceptor(asyncio.Protocol):
    """The TLS layer of one connection of a TLS listener, on memory BIOs (see the
    module docstring): the raw TCP transport below, the listener's real protocol
    above, given a :class:`TLSTransport` once the handshake is done.

    * **First bytes**: a TLS client begins with a handshake record
      (:data:`TLS_RECORD_START`); anything else — a plaintext client — is refused
      at once (OpenSSL would wait for the rest of the "record" that the plaintext
      frame's bytes seem to announce, so the client would hang until a timeout).
    * **Handshake**: bytes in, ``do_handshake``, bytes out; a failure (an alert, an
      untrusted client certificate, no handshake within
      :data:`TLS_HANDSHAKE_TIMEOUT`) is one WARNING line with the peer's address,
      the alert is sent and the socket closed. Then the real protocol is made.
    * **Data**: each read is decrypted whole and given to the real protocol in
      one ``data_received``; its writes are encrypted and written through.
      Flow control (pause/resume reading and writing) passes straight through.
    """

    def __init__(self, factory: Callable[[], asyncio.Protocol], context: ssl.SSLContext,
                 listener: str) -> None:
        self._factory = factory
        self._listener = listener
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.ssl_object = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.raw: asyncio.Transport | None = None
        self.app: asyncio.Protocol | None = None
        self.peer = "?"
        self._started = False
        self._refused = False
        self._timer: asyncio.TimerHandle | None = None

    # ---------------------------------------------------------------- raw side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A TCP connection: the handshake must be done within the timeout."""
        self.raw = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self._timer = asyncio.get_running_loop().call_later(
            TLS_HANDSHAKE_TIMEOUT, self._refuse,
            f"no handshake within {TLS_HANDSHAKE_TIMEOUT:g} s")

    def data_received(self, data: bytes) -> None:
        """Bytes from the client: handshake, then application data."""
        if self.app is None:
            if not self._refused:  # (once refused, nothing more is read)
                self._handshake(data)
            return
        self._incoming.write(data)
        self._read_app()

    def eof_received(self) -> bool | None:
        """The client closed its side (without ``close_notify``)."""
        if self.app is None:
            self._closed_in_handshake()
            return False
        return self.app.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone."""
        if self.app is not None:
            self.app.connection_lost(exc)
        else:
            self._closed_in_handshake()

    def _closed_in_handshake(self) -> None:
        """Gone before the end of the handshake: worth a line once it had begun (a
        client that does not trust our certificate closes here); a connection that
        closes before sending anything (a port check) is not."""
        if self._timer is not None and self._started and not self._refused:
            self._refuse("the client closed the connection during the handshake (does it "
                         "trust this broker's certificate?)")
        self._cancel_timer()

    def pause_writing(self) -> None:
        """The socket's write buffer is full."""
        if self.app is not None:
            self.app.pause_writing()

    def resume_writing(self) -> None:
        """The socket's write buffer drained."""
        if self.app is not None:
            self.app.resume_writing()

    # ---------------------------------------------------------------- TLS
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _refuse(self, reason: str) -> None:
        self._cancel_timer()
        self._refused = True
        log.warning("%s: TLS handshake with %s failed: %s", self._listener, self.peer, reason)
        if self.raw is not None:
            self.flush()  # the alert, if OpenSSL wrote one
            self.raw.close()

    def _handshake(self, data: bytes) -> None:
        if not self._started:
            head = data[:len(TLS_RECORD_START)]
            if not TLS_RECORD_START.startswith(head):
                self._refuse(f"not a TLS handshake (first bytes {head!r}: a plaintext client?)")
                return
            self._started = True
        self._incoming.write(data)
        try:
            self.ssl_object.do_handshake()
        except ssl.SSLWantReadError:
            self.flush()
            return
        except (ssl.SSLError, OSError) as exc:
            self._refuse(_reason(exc))
            return
        self._cancel_timer()
        self.flush()
        assert self.raw is not None
        app = self._factory()
        self.app = app
        app.connection_made(TLSTransport(self))
        if self._incoming.pending:  # application data right behind the handshake
            self._read_app()

    def _read_app(self) -> None:
        """Decrypt what has arrived; give it to the real protocol in one piece."""
        chunks: list[bytes] = []
        eof = False
        while True:
            try:
                chunk = self.ssl_object.read(TLS_READ_CHUNK)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # close_notify
                eof = True
                break
            except ssl.SSLError as exc:
                log.info("%s: TLS error from %s: %s", self._listener, self.peer, _reason(exc))
                self.flush()
                assert self.raw is not None
                self.raw.abort()
                return
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
        self.flush()  # anything TLS writes by itself (a key update, say)
        app = self.app
        assert app is not None and self.raw is not None
        if chunks:
            app.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        if eof and not self.raw.is_closing() and not app.eof_received():
            self.close()  # our close_notify too

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt ``data`` and write it to the socket."""
        view = memoryview(data)
        offset = 0
        while offset < len(view):
            offset += self.ssl_object.write(view[offset:])
        self.flush()

    def flush(self) -> None:
        """Write what TLS produced to the socket."""
        raw = self.raw
        if self._outgoing.pending and raw is not None and not raw.is_closing():
            raw.write(self._outgoing.read())

    def close(self) -> None:
        """Send ``close_notify``, then close the socket once it is written."""
        raw = self.raw
        if raw is None or raw.is_closing():
            return
        # want-read: the peer's close_notify is not awaited
        with contextlib.suppress(ssl.SSLError, OSError):
            self.ssl_object.unwrap()
        self.flush()
        raw.close()


class TLSTransport(asyncio.Transport):
    """What the listener's real protocol writes to: encrypts through its
    :class:`TLSAcceptor`; everything else is the TCP transport's."""

    def __init__(self, tls: TLSAcceptor) -> None:
        super().__init__()
        self._tls = tls
        assert tls.raw is not None
        self._raw: asyncio.Transport = tls.raw

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``ssl_object``, ``peercert``, ``cipher``; the TCP transport's otherwise."""
        ssl_object = self._tls.ssl_object
        if name == "ssl_object":
            return ssl_object
        if name == "peercert":
            return ssl_object.getpeercert()
        if name == "cipher":
            return ssl_object.cipher()
        return self._raw.get_extra_info(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt and write (nothing once the socket is closing)."""
        if not self._raw.is_closing():
            self._tls.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        """Write each piece, as one TLS write."""
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        """``close_notify``, then close the socket after the buffered writes."""
        self._tls.close()

    def abort(self) -> None:
        """Close the socket at once."""
        self._raw.abort()

    def is_closing(self) -> bool:
        """True once the socket is closing."""
        return self._raw.is_closing()

    def pause_reading(self) -> None:
        """Stop reading the socket."""
        self._raw.pause_reading()

    def resume_reading(self) -> None:
        """Read the socket again."""
        self._raw.resume_reading()

    def is_reading(self) -> bool:
        """Whether the socket is read."""
        return self._raw.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """The TCP transport's write-buffer limits."""
        self._raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        """Encrypted bytes waiting to be sent."""
        return self._raw.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        """The TCP transport's write-buffer limits."""
        return self._raw.get_write_buffer_limits()

    def can_write_eof(self) -> bool:
        """No half-close over TLS."""
        return False

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Give the decrypted stream to another protocol."""
        self._tls.app = cast(asyncio.Protocol, protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The protocol the decrypted stream goes to."""
        assert self._tls.app is not None
        return self._tls.app


def tls_factory(factory: Callable[[], asyncio.Protocol], context: ssl.SSLContext,
                listener: str) -> Callable[[], asyncio.Protocol]:
    """A protocol factory for ``create_server`` that runs the TLS handshake and then
    makes ``factory()``'s protocol; ``listener`` names it in log lines."""
    return lambda: TLSAcceptor(factory, context, listener)
