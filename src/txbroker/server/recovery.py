"""Recovery, kept by the server: the store's entries replayed into the core, the
router restored from its journal, and the recovery checkpoints — at a clean shutdown,
and every ``checkpoint_interval`` while the broker runs — that spare the next start the
log up to them (``core/checkpoint.py``, ``storage/journal_checkpoint.py``)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from txbroker.errors import StorageFailed
from txbroker.storage.interface import CheckpointStore, Store

if TYPE_CHECKING:
    from txbroker.server.app import BrokerServer

__all__ = ["CHECKPOINT_ROUNDS", "Checkpointer", "backup_checkpoint", "checkpoint_store", "closing",
           "replay_store", "restore_router", "running_checkpoint"]

log = logging.getLogger("txbroker.server")

#: Flushes a clean shutdown tries before giving up its checkpoint (each round's
#: completions may write more: delivered marks, the next slice of a purge).
CHECKPOINT_ROUNDS = 8


def replay_store(server: BrokerServer, store: Store) -> None:
    """Replay every entry ``store`` holds into the server's core (a checkpoint's one
    entry when the store read one instead of its log)."""
    broker = server.broker
    broker.body_size_of = store.body_size
    for entry in store.recover():
        broker.replay(entry)
    stats = store.stats()
    if stats.recovered_from_checkpoint:
        log.info("recovery: read a checkpoint, then the %d entries logged after it",
                 stats.recovered_entries - 1)


def restore_router(server: BrokerServer) -> None:
    """After the replay: the transaction router's journal (``core/router/log.py``),
    then the facilities of the configuration file."""
    broker = server.broker
    for problem in broker.restore_router(server.body, server.now()):
        log.error("router journal: %s (left out)", problem)
    restored = broker.router_stats()
    if restored["facilities"] or any(restored["transactions"].values()):
        log.info("router: restored %d facilities and %d transactions",
                 restored["facilities"], sum(restored["transactions"].values()))
    for name, partitions in server.config.router_facilities.items():
        broker.define_facility(name, partitions, server.now())


def checkpoint_store(store: Store | None) -> CheckpointStore | None:
    """``store`` if it keeps recovery checkpoints (the journal of a broker without HA
    with ``recovery_checkpoint``), else None: the one place that asks."""
    return cast(CheckpointStore, store) if getattr(store, "checkpoints", False) else None


async def closing(server: BrokerServer, store: Store) -> Callable[[], None]:
    """A clean shutdown's close of ``store`` (to run in a thread): on a store that keeps
    checkpoints, first hold every client's input, write and complete everything and
    take the broker's state, which the close then writes (``core/checkpoint.py``)."""
    journal = checkpoint_store(store)
    if journal is None:
        return store.close
    server.hold_input(True)
    taken = await _take_quietly(server, journal, server.broker.checkpoint)
    return functools.partial(journal.close, taken[:3]) if taken else journal.close


class Checkpointer:
    """The running broker's recovery checkpoints: every ``interval`` seconds one if the
    log grew since the last (the first one whatever: the start deleted the one it
    read), so that a start after a crash reads it and replays only the log after it;
    :attr:`counts` is ``stats()["checkpoints"]``."""

    def __init__(self, server: BrokerServer, journal: CheckpointStore, interval: float
                 ) -> None:
        self.counts: dict[str, float] = {"written": 0, "skipped": 0, "failed": 0}
        self._task = asyncio.create_task(self._loop(server, journal, interval))

    async def _loop(self, server: BrokerServer, journal: CheckpointStore,
                    interval: float) -> None:
        last: int | None = None
        while True:
            await asyncio.sleep(interval)
            if journal.appends != last:
                written = await running_checkpoint(server, journal, self.counts)
                if written is not None:  # (0 is a count: a start that appended nothing yet)
                    last = written

    async def stop(self) -> None:
        """Stop taking them (a write in flight finishes in its thread)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def running_checkpoint(server: BrokerServer, journal: CheckpointStore,
                             counts: dict[str, float]) -> int | None:
    """Hold the clients' input while everything appended is synced and completed and the
    state taken (a pause of about one sync plus the take: docs/storage.md), then write
    it in a thread while the broker goes on; the append count it covers, or None.
    ``counts`` counts them and times the last one."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    server.hold_input(True)
    try:
        taken = await _take_quietly(server, journal, server.broker.checkpoint)
    finally:
        server.hold_input(False)
    if taken is None:
        counts["skipped"] += 1
        return None
    return await _write(journal, taken, counts, loop.time() - started)


async def backup_checkpoint(server: BrokerServer, journal: CheckpointStore,
                            counts: dict[str, float]
                            ) -> asyncio.Future[int | None] | None:
    """A replicated backup's checkpoint of its replay, which never finishes while it
    follows (``core/checkpoint.py``, "A replay's checkpoint"): awaited between two reads
    of its link, so that nothing is appended meanwhile — its log synced and completed,
    its messages settled and the state taken (the pause of its acknowledgements) —;
    then the file is written in a thread while it follows on: the future of that write
    (the append count it covers, or None), or None if none was taken."""
    started = asyncio.get_running_loop().time()
    taken = await _take_quietly(server, journal, server.broker.replay_checkpoint)
    paused = asyncio.get_running_loop().time() - started
    if taken is None:
        counts["skipped"] += 1
        return None
    return asyncio.ensure_future(_write(journal, taken, counts, paused))


#: A checkpoint taken: its kind, meta, the append count it covers and the store's mark.
_Taken = tuple[int, bytes, int, object]


async def _write(journal: CheckpointStore, taken: _Taken, counts: dict[str, float],
                 paused: float) -> int | None:
    """Write a checkpoint taken (in a thread), counted and timed in ``counts``; the append
    count it covers, or None."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    kind, meta, appends, mark = taken
    written = await loop.run_in_executor(None, journal.write_checkpoint, mark, kind, meta)
    if not written:
        counts["failed"] += 1
        return None
    counts["written"] += 1
    counts["last_pause_seconds"] = round(paused, 4)
    counts["last_write_seconds"] = round(loop.time() - started, 4)
    counts["last_bytes"] = len(meta)
    log.info("recovery checkpoint: paused %.3f s, %d bytes written in %.3f s", paused,
             len(meta), counts["last_write_seconds"])
    return appends


async def _take_quietly(server: BrokerServer, journal: CheckpointStore,
                        take: Callable[[], tuple[int, bytes] | None]) -> _Taken | None:
    """With nothing else appending: flush and run completions until nothing more is
    appended (at most :data:`CHECKPOINT_ROUNDS` times), then ``take`` the state at once,
    with the store's mark."""
    loop = asyncio.get_running_loop()
    for _ in range(CHECKPOINT_ROUNDS):
        appends = journal.appends
        try:
            await loop.run_in_executor(None, journal.flush)
        except (StorageFailed, TimeoutError, OSError):
            return None
        await asyncio.sleep(0)  # (the completions the flush dispatched run first)
        server.run_effects()
        if journal.appends == appends:
            taken = take()
            mark = None if taken is None else journal.checkpoint_mark(appends)
            return None if taken is None or mark is None else (*taken, appends, mark)
    return None
