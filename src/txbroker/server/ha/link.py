"""The HA links' edge: TLS and the peers' handshake, for both HA ports.

Theory of operation
-------------------
Both HA modes open their HA port and reach their peers through one
:class:`LinkSecurity` made from the configuration (``[ha] secret`` or
``secret_file``, ``[ha] tls``, docs/ha.md):

* **Listening** (:meth:`LinkSecurity.start_server`): with ``tls``, the port runs
  the broker's own TLS layer (``server/security/tls.py``: a plaintext peer is refused at
  its first bytes, a handshake failure is one WARNING line), which requires the
  peer's certificate, signed by the HA CA. Then the handshake of
  ``protocol/ha_auth.py`` runs, as the responder, within
  :data:`HANDSHAKE_TIMEOUT`. Only a peer that completes it reaches the link's
  own code (the heartbeat link, the replication hub); any other — random bytes,
  an HTTP request, no secret or a wrong one, silence — is logged in one line
  naming its address and why, counted (``refused`` in ``ha status``), and
  closed. Nothing else happens: the broker keeps serving.
* **Connecting** (:meth:`LinkSecurity.connect`): TLS verifying the peer's
  certificate and address against the CA, and presenting our own; then the
  handshake as the initiator: the peer proves the secret first. A failure raises
  :class:`LinkAuthFailed` (a :class:`~txbroker.errors.ProtocolError`) saying
  why, so that the caller logs it as it logs a peer that breaks the link.

The nonces are drawn here (``LinkSecurity.nonces``: ``secrets.token_bytes``; the
simulator gives its seeded source): the handshake itself is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from txbroker.errors import ProtocolError
from txbroker.protocol.ha_auth import NONCE_SIZE, Failure, LinkHandshake, Side
from txbroker.server.config import ServerConfig
from txbroker.server.ha.clock import monotonic
from txbroker.server.security.tls import tls_factory

__all__ = ["HANDSHAKE_TIMEOUT", "LinkAuthFailed", "LinkHandler", "LinkSecurity"]

log = logging.getLogger("txbroker.ha")

#: Seconds a peer has to complete the handshake on our HA port (a real peer needs
#: one round trip and a half; TLS's own handshake has TLS_HANDSHAKE_TIMEOUT).
HANDSHAKE_TIMEOUT: Final = 5.0
#: Bytes read per call while the handshake runs (its lines are under 1 KiB).
READ_CHUNK: Final = 4096
#: Connections that may be in the handshake at once; more are closed at once. A group
#: has a few brokers, each with one link to a peer: 64 leaves room for reconnections,
#: while a flood of idle connections cannot take the file descriptors the client
#: listeners need (max_connections is 1,000 of a default limit of 1,024).
MAX_PENDING_HANDSHAKES: Final = 64
#: A refusal logged for a peer host is not logged again for the same reason within
#: this many seconds (a misconfigured peer retries several times a second); the
#: next line says how many were left out. ``ha status`` counts every one.
REFUSAL_LOG_INTERVAL: Final = 60.0

#: The link's own code for a peer that passed: ``(reader, writer)``.
LinkHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class LinkAuthFailed(ProtocolError):
    """The HA handshake with a peer failed: ``failure`` says how (the peer is not
    a txbroker HA port, we refused it, it refused us), the message says why."""

    def __init__(self, message: str, failure: Failure | None) -> None:
        super().__init__(message)
        self.failure = failure


def _address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "?")


@dataclass
class LinkSecurity:
    """How one broker's HA link authenticates and encrypts (module docstring)."""

    link: str  #: "shared-store" or "replicated"
    secret: bytes | None = field(default=None, repr=False)
    listener_tls: ssl.SSLContext | None = None
    connector_tls: ssl.SSLContext | None = None
    accepted: int = 0  #: peers that completed the handshake on our port
    refused: int = 0  #: peers refused on our port (foreign, no or wrong secret, silent)
    last_refusal: str = ""
    pending: int = 0  #: connections in the handshake now
    #: draws the handshake's nonces (the simulator gives its seeded source)
    nonces: Callable[[int], bytes] = field(default=secrets.token_bytes, repr=False)
    #: (host, reason) -> (when last logged, monotonic; refusals left out since)
    _logged: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: ServerConfig) -> LinkSecurity:
        """The security ``config`` asks for (validated by ``ServerConfig.validate``)."""
        contexts = config.ha_ssl_contexts()
        return cls(config.ha, config.ha_secret_bytes(),
                   contexts[0] if contexts is not None else None,
                   contexts[1] if contexts is not None else None)

    @property
    def authenticated(self) -> bool:
        """Peers must prove something: the secret, or a certificate of the HA CA."""
        return self.secret is not None or self.listener_tls is not None

    def describe(self) -> str:
        """``secret + TLS``, ``secret``, ``TLS`` or ``unauthenticated``."""
        parts = (["secret"] if self.secret is not None else []) + \
            (["TLS"] if self.listener_tls is not None else [])
        return " + ".join(parts) or "unauthenticated"

    def status(self) -> dict[str, Any]:
        """The link's part of ``ha status``."""
        return {"auth": "hmac-sha256" if self.secret is not None else "none",
                "tls": self.listener_tls is not None, "accepted": self.accepted,
                "refused": self.refused, "last_refusal": self.last_refusal,
                "in_handshake": self.pending}

    def warn_if_open(self, node: str) -> None:
        """The start-up warning of a link anyone who reaches it can join."""
        if not self.authenticated:
            log.warning("HA link on %s is unauthenticated: anyone who can reach its port can "
                        "pose as a peer; set [ha] secret_file (and [ha] tls) on every broker "
                        "of the group (docs/ha.md, \"Securing the HA links\")", node)
        else:
            log.info("HA link on %s: peers authenticated by %s", node, self.describe())

    # ------------------------------------------------------------------ listening
    async def start_server(self, handler: LinkHandler, host: str, port: int) -> asyncio.Server:
        """Listen on the HA port; ``handler`` gets each peer that passed TLS and the
        handshake."""
        loop = asyncio.get_running_loop()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self.pending >= MAX_PENDING_HANDSHAKES:
                self._refused(_address(writer), f"{self.pending} connections are in the HA "
                              "handshake already (MAX_PENDING_HANDSHAKES): closed at once")
                writer.close()
                return
            self.pending += 1
            try:
                try:
                    passed = await self._accept(reader, writer)
                finally:
                    self.pending -= 1
                if passed:
                    await handler(reader, writer)
            except asyncio.CancelledError:
                # the node stops: the link ends, quietly. Python 3.11's StreamReaderProtocol
                # logs a cancelled handler task as an error ("Exception in callback ...
                # CancelledError"; shared-store-live seed 1, docs/simulation.md)
                writer.close()

        def protocol() -> asyncio.Protocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(), accepted)

        factory = protocol
        if self.listener_tls is not None:
            factory = tls_factory(protocol, self.listener_tls,
                                  f"HA link ({self.link}) over TLS")
        return await loop.create_server(factory, host, port, reuse_address=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> bool:
        """Run the responder's handshake; True if the peer passed (else it is logged,
        counted and closed)."""
        address = _address(writer)
        handshake = LinkHandshake(Side.RESPONDER, self.link, self.secret,
                                  self.nonces(NONCE_SIZE))
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                while not (handshake.done or handshake.failed):
                    data = await reader.read(READ_CHUNK)
                    if not data:
                        log.info("HA: %s closed the connection to the HA port before the "
                                 "end of the handshake", address)
                        writer.close()
                        return False
                    out = handshake.receive_data(data)
                    if out:
                        writer.write(out)
        except TimeoutError:
            self._refused(address, f"no HA handshake within {HANDSHAKE_TIMEOUT:g} s")
            writer.close()
            return False
        except OSError as exc:
            log.info("HA: connection from %s to the HA port failed: %s", address, exc)
            writer.close()
            return False
        if handshake.failed:
            if handshake.failure is Failure.REFUSED_BY_PEER:
                self._refused(address, f"it refused this broker: {handshake.reason}")
            else:
                self._refused(address, handshake.reason)
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(writer.drain(), 1.0)
            writer.close()
            return False
        self.accepted += 1
        return True

    def _refused(self, address: str, reason: str) -> None:
        self.refused += 1
        self.last_refusal = f"{address}: {reason}"
        key = (address.rpartition(":")[0], reason)
        now = monotonic()
        last, left_out = self._logged.get(key, (-REFUSAL_LOG_INTERVAL, 0))
        if now - last < REFUSAL_LOG_INTERVAL:
            self._logged[key] = (last, left_out + 1)
            return
        if len(self._logged) > 1000:  # many hosts or reasons: forget the old ones
            self._logged.clear()
        self._logged[key] = (now, 0)
        more = (f" ({left_out} more like it from that host in the last "
                f"{REFUSAL_LOG_INTERVAL:g} s)" if left_out else "")
        log.error("HA: %s on the HA port: %s%s", address, reason, more)

    # ------------------------------------------------------------------ connecting
    async def connect(self, host: str, port: int, timeout: float
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to a peer's HA port: TLS (verifying the peer), then the handshake as
        the initiator. OSError / TimeoutError when the peer cannot be reached or says
        nothing, :class:`LinkAuthFailed` when it fails TLS or the handshake."""
        tls = self.connector_tls
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
        try:
            if tls is not None:
                await self._start_tls(writer, tls, host, timeout)
            await self._initiate(reader, writer, timeout)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    @staticmethod
    async def _start_tls(writer: asyncio.StreamWriter, tls: ssl.SSLContext, host: str,
                         timeout: float) -> None:
        """TLS on the connected stream, verifying the peer (its certificate and name)."""
        try:
            async with asyncio.timeout(timeout):
                await writer.start_tls(tls, server_hostname=host)
        except TimeoutError:
            raise TimeoutError(f"connected, but no answer to the HA handshake (TLS) within "
                               f"{timeout:g} s (a stopped peer, or not a txbroker HA port)"
                               ) from None
        except ssl.SSLCertVerificationError as exc:
            raise LinkAuthFailed(f"TLS: the peer's certificate is refused: "
                                 f"{exc.verify_message}", None) from None
        except (ssl.SSLError, ConnectionError) as exc:
            reason = exc.reason if isinstance(exc, ssl.SSLError) else None
            raise LinkAuthFailed(f"TLS handshake with the peer failed: {reason or exc} "
                                 "(is its HA link over TLS too, and does it trust our "
                                 "certificate?)", None) from None

    async def _initiate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        timeout: float) -> None:
        handshake = LinkHandshake(Side.INITIATOR, self.link, self.secret,
                                  self.nonces(NONCE_SIZE))
        writer.write(handshake.start())
        try:
            async with asyncio.timeout(timeout):
                while not (handshake.done or handshake.failed):
                    data = await reader.read(READ_CHUNK)
                    if not data:  # a refusal by its TLS layer, or a peer going away
                        raise LinkAuthFailed(
                            "the peer closed the HA link during the handshake"
                            + (" (is its HA link over TLS? a txbroker from before the HA "
                               "handshake?)" if self.connector_tls is None
                               else " (does it trust our certificate?)"), None)
                    out = handshake.receive_data(data)
                    if out:
                        writer.write(out)
        except TimeoutError:
            raise TimeoutError(f"connected, but no answer to the HA handshake within "
                               f"{timeout:g} s (a stopped peer, or not a txbroker HA port)"
                               ) from None
        except ssl.SSLError as exc:  # the peer refused our certificate after the handshake
            raise LinkAuthFailed(f"TLS: the peer ended the link: {exc.reason or exc} (does it "
                                 "trust our certificate?)", None) from None
        if handshake.failed:
            with_reason = handshake.reason
            if handshake.failure is Failure.REFUSED_BY_PEER:
                with_reason = f"the peer refused this broker: {with_reason}"
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(writer.drain(), 1.0)
            raise LinkAuthFailed(with_reason, handshake.failure)
