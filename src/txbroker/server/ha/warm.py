"""The warm standby of a shared-store pair (issue 29).

Theory of operation
-------------------
A cold takeover replays the whole journal the active leaves behind before it
answers anyone: its cost follows what the journal retains, and a fully live
oldest segment keeps every later one. A :class:`WarmStandby` does that work
while it waits: it follows the journal as the active writes it
(``storage/journal_follow.py``: read-only, every CRC checked, slices of a few
thousand entries between two turns of the event loop, so the HA link and the
lock poll keep running) and replays what it reads into a core of its own
(``Broker.replay``, exactly what a recovery does). The bodies its core
releases (messages that died) are noted per segment and forgotten with their
segment when compaction deletes it. Between two slices it *settles* what it
replayed (``core/replay_settled.py``): the messages that will be compact chunk
slots whatever the active writes later leave the replay's per-message dict as
ready-made queue columns, so the takeover's finish does not walk every live
message again.

At the takeover, holding the lock, :func:`takeover_server` checks that what it
read is intact (``JournalFollower.resume_point``) and builds the new active
around that core with a store that resumes where the follower stopped
(``JournalStore.resume_from``): the recovery reads and CRC-checks only the
suffix the active wrote since, with the rules of a cold recovery (a torn tail of
the last segment is cut; damage anywhere else stops the start), then finishes
as usual; the store counts the bodies noted released as dead from the start. Anything that
does not match -- a file replaced or shortened, a segment gone before it was
read, a configuration whose limits changed, ``--repair``, an entry the core
could not replay, another store kind -- gives a cold recovery, as before. The lock stays
the only authority: the follower never writes, and the core it built serves
nobody before the lock is held and the suffix replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, Final

from txbroker.core import Broker
from txbroker.core.effects import Effect, Release
from txbroker.errors import CorruptStore
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.stores import open_store
from txbroker.storage.interface import SnapshotProvider, Store
from txbroker.storage.journal import JournalStore
from txbroker.storage.journal_bodies import REF_LENGTH_MASK
from txbroker.storage.journal_follow import FOLLOW_ENTRIES, FollowerLost, JournalFollower, Resume
from txbroker.storage.journal_format import JOURNAL_SUBDIR
from txbroker.storage.store_lock import StoreLock

log = logging.getLogger("txbroker.ha")

#: Pause between two polls of the journal once the follower has caught up (s): the
#: suffix a takeover reads is at most what the active writes in this time, plus
#: what it wrote since the last poll.
FOLLOW_INTERVAL: Final = 0.05
#: Replayed messages that may wait unsettled. A settle walks everything that waits,
#: the messages that cannot settle too, so it runs once the wait grew by this many
#: plus as many as the last settle left (a geometric step: a journal of messages that
#: never settle is walked about twice, not once per step), or when the follower is
#: idle and at most this many wait. 4,096: a few ms of pure-Python CPU per settle,
#: about what one slice of ``FOLLOW_ENTRIES`` entries costs to replay.
SETTLE_ENTRIES: Final = 4096


def _journal_body_size(ref: int) -> int:
    """A journal body ref's length (``JournalStore.body_size``: packed in the ref)."""
    return int(ref & REF_LENGTH_MASK)


def _core(config: ServerConfig) -> Broker:
    """A standby's core: body sizes read from the refs, as its recovery would."""
    broker = Broker(config.limits)
    broker.body_size_of = _journal_body_size
    return broker


class WarmStandby:
    """Follows the shared journal into a core of its own (see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.journal_dir = config.data / JOURNAL_SUBDIR
        self.broker = _core(config)
        self.follower = JournalFollower(self.journal_dir)
        #: effects of the replay other than releases, kept for the takeover
        self._effects: list[Effect] = []
        #: why it stopped following for good (a takeover then recovers cold)
        self.broken: str | None = None
        self._task: asyncio.Task[None] | None = None
        #: replayed messages left unsettled by the last settle
        self._unsettled = 0
        #: settle after each slice whatever waits (tests: every slice settles)
        self.settle_always = False

    def status(self) -> dict[str, Any]:
        """What it followed (``ha status --json``: ``warm``)."""
        follower = self.follower
        last = next(reversed(follower.segments.values()), None)
        return {"entries": follower.entries, "bytes_read": follower.bytes_read,
                "segment": last.segment_id if last is not None else None,
                "offset": last.end if last is not None else None,
                "following": self._task is not None and not self._task.done(),
                "broken": self.broken}

    def start(self) -> asyncio.Task[None]:
        """Start following (on the running event loop); the task that follows."""
        self._task = asyncio.ensure_future(self._run())
        return self._task

    async def stop(self) -> None:
        """Stop following (the state is kept for :func:`takeover_server`)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _restart(self, reason: str) -> None:
        log.info("warm standby: %s; following again from the oldest segment", reason)
        self.broker = _core(self.config)
        self.follower = JournalFollower(self.journal_dir)
        self._effects = []
        self._unsettled = 0

    async def _run(self) -> None:
        while True:
            try:
                entries = self.step()
            except FollowerLost as exc:
                self._restart(str(exc))
                entries = 0
            except (CorruptStore, OSError) as exc:
                self.broken = str(exc)
                log.warning("warm standby: stopped following (%s): a takeover will recover "
                            "the whole journal", exc)
                return
            await asyncio.sleep(0 if entries >= FOLLOW_ENTRIES else FOLLOW_INTERVAL)

    def step(self) -> int:
        """Read and replay the next slice of the journal; how many entries it held."""
        entries = self.follower.poll()
        broker = self.broker
        for entry in entries:
            broker.replay(entry)
        for effect in broker.take_effects():
            if isinstance(effect, Release):
                self.follower.release(effect.ref)
            else:
                self._effects.append(effect)
        waiting = broker.replay_backlog()
        if self.settle_always or waiting >= 2 * self._unsettled + SETTLE_ENTRIES or \
                (not entries and self._unsettled < waiting <= SETTLE_ENTRIES):
            self._unsettled = broker.settle_replay()
        return len(entries)

    def take_over(self, config: ServerConfig) -> tuple[Broker, Resume] | None:
        """Holding the lock: the core and where recovery resumes, or None (cold)."""
        if self.broken is not None:
            return None
        if (config.limits, config.store, config.data, config.repair) != \
                (self.config.limits, "journal", self.config.data, False):
            log.info("warm standby: the configuration changed: recovering the whole journal")
            return None
        resume = self.follower.resume_point()
        if resume is None:
            return None
        for effect in self._effects:
            self.broker.outbox.emit(effect)
        return self.broker, resume


def start_warm(config: ServerConfig, tasks: set[asyncio.Task[Any]]) -> WarmStandby | None:
    """A started warm standby for ``config``, its task added to ``tasks`` (the node
    cancels them when it closes); None when the store is not the journal."""
    if config.store != "journal":
        return None
    warm = WarmStandby(config)
    tasks.add(warm.start())
    return warm


def _resumed_store(config: ServerConfig, resume: Resume,
                   dispatch: Callable[[Callable[[], None]], None],
                   snapshot: SnapshotProvider, lock: StoreLock | None = None) -> Store:
    store = open_store(config, dispatch, snapshot, lock)
    assert isinstance(store, JournalStore)
    store.resume_from(resume.segments)
    return store


async def takeover_server(warm: WarmStandby | None, config: ServerConfig,
                          lock: StoreLock) -> BrokerServer:
    """The new active's server: around the warm standby's core when it can be used
    (its store resumes where the follower stopped), else a cold one."""
    taken = None
    if warm is not None:
        await warm.stop()
        taken = warm.take_over(config)
    if taken is None:
        return BrokerServer(config, lock=lock)
    broker, resume = taken
    log.info("warm standby: %d entries replayed while standby; recovery resumes after them",
             resume.entries_followed)
    return BrokerServer(config, lock=lock, broker=broker,
                        store_opener=functools.partial(_resumed_store, config, resume))
