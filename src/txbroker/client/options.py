"""Options of :func:`txbroker.connect` / :func:`txbroker.aio.connect`."""

from __future__ import annotations

import dataclasses
import os
import ssl
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from txbroker.client.transport import TCPTransport, Transport, tls_client_context
from txbroker.client.url import ClientURL

__all__ = [
    "DEFAULT_FAILOVER_TIMEOUT",
    "DEFAULT_RECONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "ConnectOptions",
    "FailoverCallback",
]

#: Seconds to connect to one host, and to wait for a reply to a request.
DEFAULT_TIMEOUT: Final = 30.0
#: Seconds, in total, to walk the failover list after a lost connection before giving
#: up. A shared-store standby takes over after its activation interval (10 s by
#: default, docs/ha.md, as TIBCO EMS) plus the recovery of the store; 60 s leaves
#: room for recovering a large store.
DEFAULT_FAILOVER_TIMEOUT: Final = 60.0
#: The deprecated name of :data:`DEFAULT_FAILOVER_TIMEOUT`.
DEFAULT_RECONNECT_TIMEOUT: Final = DEFAULT_FAILOVER_TIMEOUT
#: The deprecated alias of the ``failover_timeout`` option.
DEPRECATED_ALIASES: Final = {"reconnect_timeout": "failover_timeout"}

#: ``on_failover(old_host, new_host)``, both as ``"host:port"``.
FailoverCallback = Callable[[str, str], object]


@dataclass(slots=True)
class ConnectOptions:
    """Keyword options of ``connect``.

    * ``timeout`` — seconds to connect to a host and to wait for any reply
      (``None``: wait forever); a ``receive`` waits its own timeout on top.
    * ``reconnect`` — move to the next host of the failover list when the
      connection breaks (default True).
    * ``failover_timeout`` — seconds, in total, to keep walking the failover
      list (with back-off) after a lost connection (default 60: a standby's
      activation interval plus the store's recovery). ``reconnect_timeout`` is
      its deprecated alias (giving both is a TypeError).
    * ``on_failover`` — called as ``on_failover(old_host, new_host)`` (both
      ``"host:port"``) after a successful move (in the sync client, on the
      client's own loop thread: it must not call the connection).
    * ``client_id`` — sent in ``hello``.
    * ``transport`` — how to open streams (tests replace it).

    TLS (``txbs://`` URLs only; docs/tls.md) — the broker's certificate is always
    verified, and must name the host of the address connected to:

    * ``tls_ca`` — a PEM file of the CA(s) that signed the broker's certificate
      (default: the system's trusted CAs).
    * ``tls_cert``, ``tls_key`` — a client certificate and its key (PEM), for a
      broker that requires one (its ``tls_ca``: mutual TLS).
    * ``ssl_context`` — an ``ssl.SSLContext`` made by the application, instead of
      the three above.
    * ``tls_server_hostname`` — the name the broker's certificate must carry,
      instead of each address's host (e.g. when connecting by IP address to a
      broker whose certificate names only its DNS name).
    """

    timeout: float | None = DEFAULT_TIMEOUT
    reconnect: bool = True
    failover_timeout: float = DEFAULT_FAILOVER_TIMEOUT
    on_failover: FailoverCallback | None = None
    client_id: str | None = None
    transport: Transport = field(default_factory=TCPTransport)
    tls_ca: str | os.PathLike[str] | None = None
    tls_cert: str | os.PathLike[str] | None = None
    tls_key: str | os.PathLike[str] | None = None
    ssl_context: ssl.SSLContext | None = None
    tls_server_hostname: str | None = None

    @property
    def reconnect_timeout(self) -> float:
        """Deprecated: the ``failover_timeout``."""
        return self.failover_timeout

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> ConnectOptions:
        """Build options from ``connect``'s keyword arguments; TypeError on unknown names
        (or on an option given together with its deprecated alias)."""
        options = dict(options)
        for alias, name in DEPRECATED_ALIASES.items():
            if alias not in options:
                continue
            if name in options:
                raise TypeError(f"give {name!r} or its deprecated alias {alias!r}, not both")
            warnings.warn(f"the connect option {alias!r} is deprecated: use {name!r}",
                          DeprecationWarning, stacklevel=3)
            options[name] = options.pop(alias)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown connect option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        result = cls(**options)
        if result.timeout is not None and result.timeout <= 0:
            raise ValueError("timeout must be positive or None")
        if not result.failover_timeout >= 0:  # (also refuses NaN)
            raise ValueError("failover_timeout must be >= 0 seconds")
        if result.ssl_context is not None and not isinstance(result.ssl_context,
                                                             ssl.SSLContext):
            raise TypeError("ssl_context must be an ssl.SSLContext")
        if result.ssl_context is not None and (result.tls_ca or result.tls_cert):
            raise ValueError("give ssl_context or tls_ca/tls_cert/tls_key, not both")
        if result.tls_key is not None and result.tls_cert is None:
            raise ValueError("tls_key needs tls_cert (the client certificate)")
        return result

    def _tls_options(self) -> list[str]:
        names = ("tls_ca", "tls_cert", "tls_key", "ssl_context", "tls_server_hostname")
        return [name for name in names if getattr(self, name) is not None]

    def for_url(self, url: ClientURL) -> ConnectOptions:
        """The options to connect to ``url`` with: for a ``txbs://`` URL, the default
        transport becomes the TLS one (its context made once, here; a transport a
        test put in is kept). ValueError for TLS options with a ``txb://`` URL, or
        a CA or certificate file that cannot be loaded."""
        if not url.tls:
            given = self._tls_options()
            if given:
                raise ValueError(f"{', '.join(given)}: TLS options need a txbs:// URL, "
                                 f"not {url}")
            return self
        transport = self.transport
        if type(transport) is not TCPTransport or transport.ssl_context is not None:
            return self
        context = self.ssl_context or tls_client_context(self.tls_ca, self.tls_cert,
                                                         self.tls_key)
        return dataclasses.replace(self, transport=TCPTransport(context,
                                                                self.tls_server_hostname))
