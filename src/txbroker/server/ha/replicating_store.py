"""The primary's store in replicated HA: its own store, every append also replicated.

Theory of operation
-------------------
:class:`ReplicatingStore` implements the :class:`~txbroker.storage.interface.Store`
interface, method by method (no forwarding of unknown attributes): ``append`` takes
the entry's LSN from the :class:`~txbroker.server.ha.replication.ReplicationHub`,
which ships it to the backups, and appends it to the local store, whose completion
goes back to the hub; the entry's ``on_durable`` runs once the local store and every
ready backup have it (``server/ha/replication.py``). Reads, sizes and statistics are
the local store's. While a dump streams, releases are deferred and compaction pauses,
so that every body the dump names stays readable. ``BrokerServer.wrap_store`` puts it
in place (``ReplicationHub.wrap``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from txbroker.storage.interface import (
    BodyRef,
    DurableCallback,
    PackedBodies,
    Relocation,
    Store,
    StoredEntry,
    StoreStats,
)

if TYPE_CHECKING:
    from txbroker.server.ha.replication import ReplicationHub

__all__ = ["ReplicatingStore"]


class ReplicatingStore:
    """The primary's store: the local one, with every append also replicated (see
    the module docstring). Reads, releases and compaction go to the local store."""

    def __init__(self, store: Store, hub: ReplicationHub) -> None:
        self.store = store
        self.hub = hub
        try:  #: the hub's loop: its links and tasks are closed there
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    @property
    def repair_report(self) -> list[str]:
        """What the local store repaired when it opened (``serve --repair``)."""
        report: list[str] = getattr(self.store, "repair_report", [])
        return report

    def recover(self) -> Iterator[StoredEntry]:
        """The local store's entries (a primary recovers from its own disk)."""
        return self.store.recover()

    def append(self, kind: int, meta: bytes, bodies: Sequence[bytes],
               on_durable: DurableCallback) -> list[BodyRef]:
        """Append locally and to every backup; complete when both have it."""
        hub = self.hub
        lsn = hub.begin(kind, meta, list(bodies), on_durable)
        return self.store.append(kind, meta, bodies,
                                 lambda error: hub.local_durable(lsn, error))

    def read_body(self, ref: BodyRef) -> bytes:
        """A body (local)."""
        return self.store.read_body(ref)

    def read_bodies(self, refs: Sequence[BodyRef]) -> PackedBodies:
        """Bodies (local)."""
        return self.store.read_bodies(refs)

    def body_size(self, ref: BodyRef) -> int:
        """A body's size (local)."""
        return self.store.body_size(ref)

    def release(self, ref: BodyRef) -> None:
        """A dead body: released now, or after the dumps that may still read it."""
        if self.hub.dumps:
            self.hub.deferred.append(ref)
        else:
            self.store.release(ref)

    def maintain(self, relocate: bool = True) -> Relocation | None:
        """Compaction (paused while a dump streams)."""
        return None if self.hub.dumps else self.store.maintain(relocate)

    def stats(self) -> StoreStats:
        """The local store's counters."""
        return self.store.stats()

    def close(self) -> None:
        """Close the backups' links, then the local store. ``BrokerServer.stop`` calls
        this in an executor thread: the hub (transports, tasks) is closed on its loop,
        waited for; acks read meanwhile complete nothing (``hub.closed``)."""
        hub, loop = self.hub, self._loop
        hub.closed = True
        if loop is None or _on_loop(loop) or loop.is_closed():
            hub.close()
        else:
            done = threading.Event()

            def close_hub() -> None:
                try:
                    hub.close()
                finally:
                    done.set()

            loop.call_soon_threadsafe(close_hub)
            done.wait(5.0)
        self.store.close()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Is this thread running ``loop``?"""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
