"""Asking the peers of a replicated group for their standing before a promotion
(``core/ha/promotion.py`` decides; ``server/ha/replicated.py`` asks).

A ``standing`` request travels on the HA port, after the link's handshake
(``server/ha/link.py``: the HA secret, TLS), and the peer answers with one
``standing`` message and closes: its role, the primary it follows over a live link
and the newest ready-set record it holds — and, asked to, whether it promised the
asker a term (``core/ha/promotion.py``, "Promises"). A peer that does not answer within
:data:`ASK_TIMEOUT` counts as not heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Final

from txbroker.core.ha.promotion import Promise, Standing
from txbroker.errors import ProtocolError
from txbroker.protocol import replication as link
from txbroker.server.ha.link import LinkAuthFailed, LinkSecurity

log = logging.getLogger("txbroker.ha")

__all__ = ["ASK_TIMEOUT", "announce_promotion", "ask_standing", "gather_promises",
           "gather_standings"]

#: How long one peer may take to connect and answer (s).
ASK_TIMEOUT: Final = 1.0


async def ask_standing(security: LinkSecurity, host: str, port: int,
                       timeout: float = ASK_TIMEOUT, *, promoting: bool = False,
                       promise: Promise | None = None) -> Standing | None:
    """The standing of the peer at ``host:port`` (None: not heard). ``promoting``: we
    are being promoted — a backup looking for its primary looks again at once;
    ``promise``: asks the peer to promise that term to us (``granted`` says whether it
    did)."""
    body: dict[str, object] = {}
    if promoting:
        body["promoting"] = True
    if promise is not None:
        body["promise"] = promise.to_wire()
    try:
        return await asyncio.wait_for(_ask(security, host, port, timeout, body), timeout)
    except (OSError, TimeoutError, ProtocolError, LinkAuthFailed) as exc:
        log.info("HA: no standing from %s:%d: %r", host, port, exc)
        return None


async def _ask(security: LinkSecurity, host: str, port: int, timeout: float,
               body: dict[str, object]) -> Standing | None:
    reader, writer = await security.connect(host, port, timeout)
    try:
        writer.write(link.encode("standing", body))
        codec = link.ReplicationCodec()
        while True:
            data = await reader.read(65536)
            if not data:
                return None
            for message in codec.receive_data(data):
                if message.type == "standing":
                    return Standing.from_wire(message.body)
                if message.type == "refuse" and isinstance(message.body, dict):
                    return Standing.from_wire(message.body.get("standing"))
                raise ProtocolError(f"expected a standing, got {message.type!r}")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def gather_standings(security: LinkSecurity, peers: Sequence[tuple[str, int]],
                           timeout: float = ASK_TIMEOUT) -> list[Standing]:
    """The standings of every peer that answered, asked at once."""
    answers = await asyncio.gather(*(ask_standing(security, host, port, timeout)
                                     for host, port in peers))
    return [answer for answer in answers if answer is not None]


async def gather_promises(security: LinkSecurity, peers: Sequence[tuple[str, int]],
                          promise: Promise, timeout: float = ASK_TIMEOUT) -> list[Standing]:
    """Ask every peer at once to promise ``promise.term`` to ``promise.candidate``: the
    standings of those that answered (``granted``: it promised)."""
    answers = await asyncio.gather(*(ask_standing(security, host, port, timeout,
                                                  promise=promise) for host, port in peers))
    return [answer for answer in answers if answer is not None]


async def announce_promotion(security: LinkSecurity, peers: Sequence[tuple[str, int]]) -> None:
    """Tell every peer we are being promoted (a ``standing`` request that says so): a
    backup between two searches for its primary joins us now, not up to
    ``SEARCH_PAUSE`` later — a new primary's first record waits for a join."""
    await asyncio.gather(*(ask_standing(security, host, port, promoting=True)
                           for host, port in peers))
