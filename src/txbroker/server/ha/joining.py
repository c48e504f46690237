"""How a backup joins the primary (replicated HA): the suffix of a kept copy, or a dump.

Theory of operation
-------------------
A joining backup's link (``core/ha/backup_link.py``: JOINING) gets one of two
starts, both driven by the :class:`~txbroker.server.ha.replication.ReplicationHub`:

* :func:`send_suffix`: it holds this primary's epoch up to an LSN the catch-up buffer
  still covers: the ``incremental`` welcome and every buffered entry after that LSN
  (the link is catching-up at once, no await before the last frame is written, so the
  stream goes on behind them);
* :func:`send_dump`: the hub stops reading clients until every entry in flight is
  complete (normally one group commit), describes the core's state (cheap: no body is
  read) and lets clients go on; the bodies are then read from the local store and
  streamed while new entries queue behind the dump; ``dumped`` ends it and the queued
  entries follow. While any dump streams the store's space reclamation waits
  (``replicating_store.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from txbroker.core.ha.backup_link import LinkInput, LinkState
from txbroker.core.replica import DumpEntry, check_quiet, state_entries
from txbroker.protocol import replication as link
from txbroker.server.ha.clock import monotonic

if TYPE_CHECKING:
    from txbroker.server.ha.attached import AttachedBackup
    from txbroker.server.ha.replication import ReplicationHub

log = logging.getLogger("txbroker.ha")

__all__ = ["QUIET_TIMEOUT", "send_dump", "send_suffix"]

#: How long a join may wait for the broker to be quiet enough for a dump (s).
QUIET_TIMEOUT: Final = 10.0


async def send_suffix(hub: ReplicationHub, backup: AttachedBackup, at: int) -> None:
    """Incremental catch-up: the backup holds this epoch's state up to ``at``; send
    it every entry after ``at`` from the buffer, then the stream goes on."""
    # no await until every held frame is written: begin() streams to it from now on
    hub.feed(backup, LinkInput.RESUME)  # SEND_SUFFIX: below
    backup.dump_at, backup.acked = at, 0
    backup.joined_by = "suffix"
    writer = backup.writer
    welcome = link.encode("welcome", {"node": hub.node, "epoch": hub.epoch, "at": at,
                                      "incremental": True})
    backup.flush_out()  # what the table wrote to it this turn goes first
    writer.write(welcome)
    entries = sent = 0
    for lsn, frame in hub.suffix:
        if lsn > at:
            writer.write(frame)
            entries += 1
            sent += len(frame)
    backup.sent_bytes += len(welcome) + sent
    shipped = hub.shipped
    shipped["suffixes"] += 1
    shipped["suffix_entries"] += entries
    shipped["suffix_bytes"] += sent
    log.info("replication: %s resumes from LSN %d: %d entries (%d bytes) from the "
             "catch-up buffer, no dump", backup.node, at, entries, sent)
    await writer.drain()


async def _quiet(hub: ReplicationHub) -> None:
    """Wait until every entry in flight is complete, with clients not read."""
    port = hub.port
    port.hold_input(True)
    try:
        deadline = monotonic() + QUIET_TIMEOUT
        while hub.pending or check_quiet(port.broker) is not None:
            if monotonic() > deadline:
                raise TimeoutError("the broker did not become quiet for a dump")
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            hub.waiting_quiet.append(future)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, 0.05)
    except BaseException:
        port.hold_input(False)
        raise


async def send_dump(hub: ReplicationHub, backup: AttachedBackup) -> None:
    """A fresh copy: the state described at a quiet moment, its bodies streamed, then
    ``dumped`` and the entries queued behind it (the module docstring)."""
    await _quiet(hub)
    try:  # no await between the quiet check and the description: nothing moves
        at = hub.lsn
        entries = state_entries(hub.port.broker)
        dumping = hub.feed(backup, LinkInput.DUMP_TAKEN) is LinkState.JOINING
        if dumping:  # else it was dropped while the broker became quiet (rule 3)
            backup.dump_at = at
            hub.dumps += 1
    finally:
        hub.port.hold_input(False)
    if not dumping:
        return
    try:
        writer = backup.writer
        backup.joined_by = "dump"
        hub.shipped["dumps"] += 1
        backup.flush_out()  # what the table wrote to it this turn goes first
        writer.write(link.encode("welcome", {"node": hub.node, "epoch": hub.epoch,
                                             "at": at}))
        for frame in _dump_frames(hub, entries):
            writer.write(frame)
            backup.sent_bytes += len(frame)
            hub.shipped["dump_bytes"] += len(frame)
            await writer.drain()
        hub.shipped["dump_entries"] += len(entries)
        writer.write(link.encode("dumped", {"at": at}))
        hub.feed(backup, LinkInput.DUMP_SENT)  # the backlog follows (SEND_BACKLOG)
        await writer.drain()
        log.info("replication: dump of LSN %d (%d entries) sent to %s", at, len(entries),
                 backup.node)
    finally:
        hub.dumps -= 1
        if not hub.dumps and hub.deferred:
            refs, hub.deferred = hub.deferred, []
            for ref in refs:
                hub.local_store().release(ref)


def _dump_frames(hub: ReplicationHub, entries: list[DumpEntry]) -> Iterator[bytes]:
    store = hub.local_store()
    for entry in entries:
        refs = [m.ref for m in entry.messages if m.ref is not None]
        bodies = store.read_bodies(refs).split() if refs else []
        yield link.encode("entries", [[0, entry.kind, entry.meta, bodies]])
