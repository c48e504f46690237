"""Options of :func:`txbroker.connect` / :func:`txbroker.aio.connect`."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from txbroker.client.transport import TCPTransport, Transport

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
    """

    timeout: float | None = DEFAULT_TIMEOUT
    reconnect: bool = True
    failover_timeout: float = DEFAULT_FAILOVER_TIMEOUT
    on_failover: FailoverCallback | None = None
    client_id: str | None = None
    transport: Transport = field(default_factory=TCPTransport)

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
        return result
