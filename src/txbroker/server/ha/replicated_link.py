"""A replicated broker's HA port (``server/ha/replicated.py``): what a peer's first
message asks for — a backup's ``join`` (served by the hub of a primary, or of a node
being promoted; refused by anybody else, with its standing), or a ``standing``
(before a promotion, asking for a promise of a term, or saying one is under way: a
backup then searches at once)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from txbroker.core.ha.promotion import Promise
from txbroker.core.ha.replicated_role import RoleAction, RoleInput
from txbroker.errors import ProtocolError
from txbroker.protocol import replication as link

if TYPE_CHECKING:
    from txbroker.server.ha.replicated import ReplicatedNode

log = logging.getLogger("txbroker.ha")

__all__ = ["on_link"]


def _standing(node: ReplicatedNode) -> dict[str, Any] | None:
    """The node's standing on the link (None: the group keeps no records)."""
    return None if node.quorum is None else node.quorum.standing().to_wire()


async def on_link(node: ReplicatedNode, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    """One connection to ``node``'s HA port, after the link's handshake."""
    codec = link.ReplicationCodec()
    try:
        messages: list[link.LinkMessage] = []
        while not messages:
            data = await asyncio.wait_for(reader.read(65536), 5.0)
            if not data:
                return
            messages = codec.receive_data(data)
        first = messages[0]
        if first.type == "standing":  # a peer asks before (or says it is in) a promotion
            body = first.body if isinstance(first.body, dict) else {}
            if body.get("promoting"):
                node.search_now.set()  # look for the primary again at once
            promise = Promise.from_wire(body.get("promise"))
            if promise is not None and node.quorum is not None:  # asks us to promise it
                answer: dict[str, Any] | None = node.quorum.grant(promise).to_wire()
            else:
                answer = _standing(node)
            writer.write(link.encode("standing", answer))
            await writer.drain()
            return
        if first.type != "join" or not isinstance(first.body, dict):
            raise ProtocolError(f"expected join, got {first.type!r}")
        hub = node.hub
        if RoleAction.SERVE_BACKUP not in node.step(RoleInput.JOIN) or hub is None:
            writer.write(link.encode("refuse", {
                "reason": f"{node.node} is a {node.role.value}, not the primary",
                "standing": _standing(node)}))
            await writer.drain()
            return
        await hub.serve_backup(reader, writer, first.body, codec)
    except (ProtocolError, TimeoutError, ConnectionError, OSError) as exc:
        log.warning("HA link: %s", exc)
    finally:
        writer.close()
