"""Client URLs: ``txb://[user:password@]host[:port][,host[:port]…]``, and
``txbs://…`` for the same over TLS (every host of the list; docs/tls.md).

The host list is a *failover list*: the client connects to the first host
that answers and, when that connection breaks, moves on to the next ones.
User and password may be percent-encoded (``%40`` for ``@``); IPv6
addresses are written in brackets (``txb://[::1]:5445``). A trailing ``/``
is allowed; any other path, a query or a fragment is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NamedTuple
from urllib.parse import unquote

from txbroker.protocol.native import DEFAULT_PORT

__all__ = ["DEFAULT_PORT", "DEFAULT_TLS_PORT", "SCHEME", "TLS_SCHEME", "ClientURL", "HostPort",
           "parse_url"]

#: The native protocol's scheme...
SCHEME: Final = "txb"
#: ... and the same protocol over TLS.
TLS_SCHEME: Final = "txbs"
#: The port of a ``txbs://`` host given without one. The broker's TLS listener is
#: off by default (``tls_port = 0``); docs/tls.md suggests this port for it.
DEFAULT_TLS_PORT: Final = 5443


class HostPort(NamedTuple):
    """One broker address of a failover list."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ClientURL:
    """A parsed client URL: the failover list and the credentials."""

    hosts: tuple[HostPort, ...]
    user: str | None = None
    password: str | None = None
    #: ``txbs://``: every host is reached over TLS
    tls: bool = False

    def __str__(self) -> str:
        """The URL with the password masked (safe to log)."""
        auth = ""
        if self.user is not None:
            auth = self.user + (":***" if self.password is not None else "") + "@"
        scheme = TLS_SCHEME if self.tls else SCHEME
        return f"{scheme}://{auth}{','.join(str(h) for h in self.hosts)}"


def _bad(url: str, reason: str) -> ValueError:
    return ValueError(
        f"bad txbroker URL {url!r}: {reason} "
        f"(expected {SCHEME}://[user:password@]host[:port][,host[:port]...], or {TLS_SCHEME}://"
        "... for TLS)"
    )


def _parse_host(url: str, item: str, default_port: int) -> HostPort:
    if not item:
        raise _bad(url, "empty host in the host list")
    if item.startswith("["):
        close = item.find("]")
        if close < 0:
            raise _bad(url, f"unclosed '[' in {item!r}")
        host, rest = item[1:close], item[close + 1 :]
        if not host:
            raise _bad(url, "empty IPv6 address")
        if rest and not rest.startswith(":"):
            raise _bad(url, f"unexpected {rest!r} after {item[: close + 1]!r}")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_raw = item.partition(":")
        port_text = port_text_raw if sep else None
        if not host:
            raise _bad(url, f"missing host in {item!r}")
        if ":" in port_text_raw:
            raise _bad(url, f"IPv6 addresses must be in brackets: {item!r}")
    if any(c.isspace() or c in "/?#@" for c in host):
        raise _bad(url, f"invalid host {host!r}")
    if port_text is None:
        return HostPort(host, default_port)
    if not port_text.isdigit() or not port_text.isascii():
        raise _bad(url, f"port must be a number, not {port_text!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _bad(url, f"port {port} out of range 1-65535")
    return HostPort(host, port)


def parse_url(url: str) -> ClientURL:
    """Parse a client URL; raise ValueError with a clear message if it is malformed."""
    if not isinstance(url, str):
        raise TypeError(f"a txbroker URL must be a str, not {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise _bad(url, "missing scheme")
    if scheme.lower() not in (SCHEME, TLS_SCHEME):
        raise _bad(url, f"unsupported scheme {scheme!r}")
    tls = scheme.lower() == TLS_SCHEME
    at = rest.rfind("@")
    tail_start = max(at + 1, 0)
    cut = len(rest)
    for delimiter in "/?#":
        found = rest.find(delimiter, tail_start)
        if found >= 0:
            cut = min(cut, found)
    authority, remainder = rest[:cut], rest[cut:]
    if remainder not in ("", "/"):
        raise _bad(url, f"paths, queries and fragments are not supported: {remainder!r}")
    user: str | None = None
    password: str | None = None
    if at >= 0:
        userinfo, authority = authority[:at], authority[at + 1 :]
        raw_user, colon, raw_password = userinfo.partition(":")
        if not raw_user:
            raise _bad(url, "empty user name before '@'")
        user = unquote(raw_user)
        password = unquote(raw_password) if colon else None
    if not authority:
        raise _bad(url, "no host")
    default_port = DEFAULT_TLS_PORT if tls else DEFAULT_PORT
    hosts = tuple(_parse_host(url, item.strip(), default_port) for item in authority.split(","))
    return ClientURL(hosts=hosts, user=user, password=password, tls=tls)
