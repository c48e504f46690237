"""The shared-store pair's HA link, as both of its ends read it (``protocol/ha.py``
decodes it; ``shared_store.py`` drives it).

Theory of operation
-------------------
The standby says ``standby``, the active answers ``welcome`` (or ``refused``, with
``retry`` False when it will never take this peer: a second standby, another data
directory), then heartbeats and their acks. :func:`next_message` reads until one whole
message is decoded; :class:`PeerRefused` is the standby's view of a refusal.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from txbroker.errors import TxBrokerError
from txbroker.protocol import ha as link

__all__ = ["AttachedStandby", "PeerRefused", "next_message"]


class PeerRefused(TxBrokerError):
    """The peer's HA port refused us; ``retry`` False: for good (a second standby)."""

    def __init__(self, reason: str, retry: bool) -> None:
        super().__init__(reason)
        self.retry = retry


@dataclass(slots=True)
class AttachedStandby:
    """The standby attached to an active."""

    address: str
    writer: asyncio.StreamWriter
    last_ack: float  # the event loop's clock (monotonic)


async def next_message(reader: asyncio.StreamReader, decoder: link.HaDecoder
                       ) -> dict[str, Any]:
    """The next whole message on the link (ConnectionResetError when the peer closed it)."""
    pending: list[dict[str, Any]] = []
    while not pending:
        data = await reader.read(4096)
        if not data:
            raise ConnectionResetError("the peer closed the HA link")
        pending = decoder.feed(data)
    return pending[0]
