"""A replicated backup's recovery checkpoints (issue 29: a restarted backup rejoins in
the time of the log since its last checkpoint, not of its whole copy).

Theory of operation
-------------------
A backup's copy is a replay that never finishes while it follows
(``server/ha/replica.py``), and a restart used to replay the whole of its log before
it could ask its primary for the suffix it missed ("Resuming from the disk"). With
``recovery_checkpoint`` (and ``checkpoint_interval`` > 0), :class:`CopyCheckpoints`
takes a checkpoint of that replay every interval while the copy is ready (its primary
waits for it: caught up) and its log grew, and one as soon as it is ready again after
a catch-up, which is a burst of log (``core/checkpoint.py``, "A replay's checkpoint");
none while it catches up, which it would only slow down. The follower awaits
:meth:`CopyCheckpoints.maybe` between two reads of its link, so nothing is appended
meanwhile; its log is synced, its messages settled and the state taken — the pause of
its acknowledgements, which the primary's committers wait for —; the file is then
written in a thread while it follows on (``server/recovery.py``). The journal keeps it
as it keeps a primary's (``storage/journal_checkpoint.py``): the next start reads it
and replays only the log after its mark, counting the primary's LSNs on from the LSN
it holds. A clean stop writes one too (:meth:`CopyCheckpoints.close`).

The journal refuses a write once the store closed, so a checkpoint in flight never
lands in the directory of the copy that replaced it (a dump wipes the directory).
"""

from __future__ import annotations

import asyncio
import logging

from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.ha.clock import monotonic
from txbroker.server.recovery import backup_checkpoint, checkpoint_store

log = logging.getLogger("txbroker.ha")

__all__ = ["CopyCheckpoints"]


class CopyCheckpoints:
    """The checkpoints of one node's copies (module docstring); :attr:`counts` is the
    ``checkpoints`` part of the follower's ``ha status``."""

    def __init__(self, config: ServerConfig) -> None:
        self.interval = config.checkpoint_interval
        self.counts: dict[str, float] = {"written": 0, "skipped": 0, "failed": 0}
        #: when the next one is due (monotonic; the first: one interval after the start)
        self._due = monotonic() + self.interval
        #: the store's append count the last one covered (None: none yet)
        self._covered: int | None = None
        self._writing: asyncio.Future[int | None] | None = None
        self._ready = False  #: the copy was ready at the last call

    async def maybe(self, server: BrokerServer, ready: bool) -> None:
        """Take one of ``server``'s whole copy if it is due, ``ready`` and its log grew
        (the caller appends nothing until this returns)."""
        now = monotonic()
        if ready and not self._ready:
            self._due = min(self._due, now)  # ready again after a catch-up: one now
        self._ready = ready
        journal = checkpoint_store(server.store)
        if not ready or not self.interval or now < self._due or journal is None \
                or (self._writing is not None and not self._writing.done()):
            return
        self._due = now + self.interval
        if journal.appends == self._covered:
            return
        self._writing = await backup_checkpoint(server, journal, self.counts)
        if self._writing is not None:
            self._writing.add_done_callback(self._written)

    def _written(self, writing: asyncio.Future[int | None]) -> None:
        if not writing.cancelled() and writing.exception() is None:
            covered = writing.result()
            if covered is not None:
                self._covered = covered

    def reset(self) -> None:
        """A new copy replaced the last (its store counts appends from 0 again)."""
        self._covered = None

    def close(self, server: BrokerServer) -> None:
        """Close ``server``'s store (a whole copy at a clean stop), with a checkpoint of
        its replay when it keeps them: everything it appended is replayed already."""
        store = server.store
        journal = checkpoint_store(store)
        taken = server.broker.replay_checkpoint() if journal is not None else None
        if journal is None or taken is None:
            if store is not None:
                store.close()
            return
        log.info("replication: closing the copy with a checkpoint of its replay (%d bytes)",
                 len(taken[1]))
        journal.close((*taken, journal.appends))
