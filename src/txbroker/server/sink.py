"""What the server needs from a client connection of any protocol.

The effect runner (``server/app.py``) finds the connection of a session in
``BrokerServer.connections`` and hands it replies, deliveries and pushes.
The native protocol (``server/connection.py``) and STOMP each implement this.
"""

from __future__ import annotations

from typing import Any, Protocol

from txbroker.errors import BrokerError


class SessionSink(Protocol):
    """One client connection, as the effect runner sees it."""

    session_id: int
    authenticated: bool

    def answer_later(self, rid: int, result: Any) -> None:
        """The reply to request ``rid`` that the core answered later (LATER)."""

    def fail_later(self, rid: int, error: BrokerError) -> None:
        """The error reply to request ``rid`` that the core answered later."""

    def deliver(self, sub: int, data: dict[str, Any]) -> None:
        """A message for subscription ``sub`` (``data``: the message map of docs/protocol.md)."""

    def push(self, event: str, data: dict[str, Any]) -> None:
        """A broker event such as ``cancelled`` (``{"sub", "reason"}``)."""

    def flush(self) -> None:
        """Write what was gathered since the last flush."""

    def close(self) -> None:
        """Close the connection (shutdown)."""
