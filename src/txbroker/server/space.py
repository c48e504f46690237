"""The store's space, kept by the server: dead segments dropped and the live messages of
a mostly dead one copied forward (compaction, ``storage/journal_space.py``), a slice
at a time, with the loop free for clients in between."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from txbroker.storage.interface import Relocation

if TYPE_CHECKING:
    from txbroker.server.app import BrokerServer

__all__ = ["RELOCATE_PAUSE", "RELOCATE_SLICE_BYTES", "RELOCATE_SLICE_MESSAGES",
           "maintain_loop", "relocate"]

log = logging.getLogger("txbroker.server")

#: Compaction copies live messages in slices of at most this many messages and
#: body bytes (one entry each; 2,000 small messages take about 5 ms of loop time)...
RELOCATE_SLICE_MESSAGES = 2_000
RELOCATE_SLICE_BYTES = 4 * 1024 * 1024
#: ... and pauses this long between slices (seconds), so that clients' requests
#: go first.
RELOCATE_PAUSE = 0.005

async def maintain_loop(server: BrokerServer) -> None:
    """Every ``maintain_interval`` seconds: let the store drop dead segments, and copy
    forward the live messages of the one it asks to relocate."""
    while True:
        await asyncio.sleep(server.config.maintain_interval)
        relocation = server.maintain()
        if relocation is not None:
            await relocate(server, relocation)

async def relocate(server: BrokerServer, relocation: Relocation) -> None:
    """Copy the live messages of a mostly-dead segment forward, a slice at a time:
    the segment's entries are scanned a slice's worth at a time, and each slice
    costs one ``pread`` for the bodies and one entry (``RELOCATE_MANY``), the
    loop free for clients in between (a segment can hold a million live
    messages; scanning and copying them in one go stalled every client for
    seconds)."""
    entries = relocation.entries
    moved, start = 0, 0
    while start < len(entries) and server.broker.failed is None:
        end, count = start, 0
        while end < len(entries) and count < RELOCATE_SLICE_MESSAGES:
            count += len(entries[end].refs) + 1
            end += 1
        live = server.broker.live_refs(entries[start:end])
        start = end
        moved += await _copy_forward(server, live)
        await asyncio.sleep(0)
    log.info("compaction: relocated %d live messages out of segment %d", moved,
             relocation.segment)

async def _copy_forward(server: BrokerServer, live: list[tuple[int, int]]) -> int:
    """Relocate ``(message id, ref)`` pairs in slices; how many were copied."""
    store = server.store
    assert store is not None
    copied, start = 0, 0
    while start < len(live) and server.broker.failed is None:
        end, size = start, 0
        while end < len(live) and end - start < RELOCATE_SLICE_MESSAGES and (
                end == start or size < RELOCATE_SLICE_BYTES):
            size += store.body_size(live[end][1])
            end += 1
        pairs = server.broker.still_live(live[start:end])
        start = end
        if pairs:
            bodies = store.read_bodies([ref for _, ref in pairs]).split()
            server.broker.relocate_many(pairs, bodies)
            server.run_effects()
            copied += len(pairs)
        await asyncio.sleep(RELOCATE_PAUSE)
    return copied
