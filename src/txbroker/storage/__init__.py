"""Message stores: the ``Store`` protocol and its implementations.

* :mod:`~txbroker.storage.interface` — the protocol every store implements;
* :class:`~txbroker.storage.journal.JournalStore` — the default store: a
  segmented append-only log with CRCs and group commit (``docs/storage.md``);
* :class:`~txbroker.storage.memory.MemoryStore` — in memory, for unit tests;
* :mod:`~txbroker.storage.records` — what the broker writes into entries.
"""

from __future__ import annotations

from txbroker.storage.interface import (
    BodyRef,
    Dispatch,
    DurableCallback,
    Relocation,
    SnapshotProvider,
    Store,
    StoredEntry,
    StoreStats,
    SyncMode,
)
from txbroker.storage.journal import JournalStore
from txbroker.storage.memory import MemoryState, MemoryStore

__all__ = [
    "BodyRef",
    "Dispatch",
    "DurableCallback",
    "JournalStore",
    "MemoryState",
    "MemoryStore",
    "Relocation",
    "SnapshotProvider",
    "Store",
    "StoreStats",
    "StoredEntry",
    "SyncMode",
]
