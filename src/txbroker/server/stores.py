"""Which store a server opens (the journal by default, or the dir store) and where its
single-writer lock — also the shared-store HA lock — lives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from txbroker.server.config import ServerConfig
from txbroker.storage.interface import Dispatch, SnapshotProvider, Store
from txbroker.storage.store_lock import StoreLock

__all__ = ["StoreOpener", "open_store", "store_lock_path"]

#: Opens a server's store from the completion dispatcher, the snapshot provider and the
#: store's lock (if already held): :func:`open_store` on the server's config by default;
#: tests pass one that opens a ``MemoryStore`` (``tests/inmemory.py``).
StoreOpener = Callable[[Dispatch, SnapshotProvider, StoreLock | None], Store]


def open_store(config: ServerConfig, dispatch: Callable[[Callable[[], None]], None],
               snapshot: Callable[[], tuple[int, bytes]], lock: StoreLock | None = None
               ) -> Store:
    """Build the configured store (journal by default); ``lock``: the store's lock,
    already held (the HA part takes it first), else the store takes it."""
    if config.store == "dir":
        from txbroker.storage.dirstore import DirStore

        return DirStore(config.data, flags=config.dir_flags, dispatch=dispatch,
                        snapshot_provider=snapshot, lock=lock,
                        body_cache_bytes=config.body_cache_bytes)
    from txbroker.storage.journal import JournalStore

    return JournalStore(
        config.data,
        sync=config.sync,
        segment_size=config.segment_size,
        body_cache_bytes=config.body_cache_bytes,
        dispatch=dispatch,
        snapshot_provider=snapshot,
        repair=config.repair,
        compaction=config.compaction(),
        recovery_index=config.recovery_index,
        # (a replicated backup's too: server/ha/replica_checkpoints.py)
        checkpoints=config.recovery_checkpoint and config.ha != "shared-store",
        lock=lock,
    )


def store_lock_path(config: ServerConfig) -> Path:
    """The lock file of the configured store: its single-writer lock, and the
    shared-store HA lock."""
    if config.store == "dir":
        from txbroker.storage.dirstore import DirStore

        return DirStore.lock_path(config.data)
    from txbroker.storage.journal import JournalStore

    return JournalStore.lock_path(config.data)
