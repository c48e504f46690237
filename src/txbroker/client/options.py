"""Options of :func:`txbroker.connect` / :func:`txbroker.aio.connect`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from txbroker.client.transport import TCPTransport, Transport

__all__ = [
    "DEFAULT_RECONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "ConnectOptions",
    "FailoverCallback",
]

#: Seconds to connect to one host, and to wait for a reply to a request.
DEFAULT_TIMEOUT: Final = 30.0
#: Seconds, in total, to find a live host of the failover list after a loss
#: (DESIGN.md: activation interval 10 s, so a backup takes over well within this).
DEFAULT_RECONNECT_TIMEOUT: Final = 30.0

#: ``on_failover(old_host, new_host)``, both as ``"host:port"``.
FailoverCallback = Callable[[str, str], object]


@dataclass(slots=True)
class ConnectOptions:
    """Keyword options of ``connect``.

    * ``timeout`` — seconds to connect to a host and to wait for any reply
      (``None``: wait forever); a ``receive`` waits its own timeout on top.
    * ``reconnect`` — move to the next host of the failover list when the
      connection breaks (default True).
    * ``reconnect_timeout`` — seconds, in total, to find a live host.
    * ``on_failover`` — called as ``on_failover(old_host, new_host)`` after a
      successful move (in the sync client, on the client's own loop thread:
      it must not call the connection).
    * ``client_id`` — sent in ``hello``.
    * ``transport`` — how to open streams (tests replace it).
    """

    timeout: float | None = DEFAULT_TIMEOUT
    reconnect: bool = True
    reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT
    on_failover: FailoverCallback | None = None
    client_id: str | None = None
    transport: Transport = field(default_factory=TCPTransport)

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> ConnectOptions:
        """Build options from ``connect``'s keyword arguments; TypeError on unknown names."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown connect option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        result = cls(**options)
        if result.timeout is not None and result.timeout <= 0:
            raise ValueError("timeout must be positive or None")
        if result.reconnect_timeout < 0:
            raise ValueError("reconnect_timeout must be >= 0")
        return result
