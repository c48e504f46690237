"""The primary's ready set, recorded on a majority of a replicated group without etcd
(three nodes or more; ``core/ha/promotion.py`` has the argument).

Theory of operation
-------------------
A new primary starts its term with a record of an empty ready set (version 0) and
answers nothing until ``quorum`` backups (a majority of the group, less itself) hold it:
each joining backup gets the newest record before its dump or suffix and says
``recorded`` once it synced it (``server/ha/replica.py``). Each later change of the
ready set is a new version, written to every attached backup; a smaller set is acted
on (entries stop waiting for the backup that left, :func:`record_shrunk`)
only once ``quorum`` backups hold it, and the primary's own data directory too. A
backup that holds a newer term refuses the record: the primary was superseded, and
stops (``on_superseded``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from txbroker.core.ha.backup_link import LinkInput
from txbroker.core.ha.promotion import ReadyRecord
from txbroker.errors import ProtocolError
from txbroker.protocol import replication as link

if TYPE_CHECKING:
    from txbroker.server.ha.attached import AttachedBackup
    from txbroker.server.ha.replication import ReplicationHub

log = logging.getLogger("txbroker.ha")

__all__ = ["ReadyRecords", "record_grown", "record_shrunk"]

#: How long a joining backup may take to hold the record (s).
RECORD_TIMEOUT = 5.0


def record_shrunk(hub: ReplicationHub, backup: AttachedBackup) -> None:
    """Record the ready set without ``backup`` (``hub.on_ready_change``: etcd, or a
    majority of the group) before entries stop waiting for it: a copy that missed
    acknowledged entries must not be promoted. Recorded (at once when nothing records),
    the link's table moves it on (``READY_SET_RECORDED``)."""
    record = hub.on_ready_change
    if record is None:
        hub.feed(backup, LinkInput.READY_SET_RECORDED)
        return

    async def shrink() -> None:
        while True:
            try:
                await record(hub.ready_names())
                break
            except Exception as exc:  # etcd down: keep waiting for the backup
                log.error("replication: cannot record the ready set without %s: %s",
                          backup.node, exc)
                await asyncio.sleep(0.5)
        hub.feed(backup, LinkInput.READY_SET_RECORDED)

    hub.spawn(shrink())


def record_grown(hub: ReplicationHub) -> None:
    """Record a larger ready set (not waited for: only a missed chance to promote)."""
    record = hub.on_ready_change
    if record is None:
        return

    async def grow() -> None:
        try:
            await record(hub.ready_names())
        except Exception as exc:
            log.warning("replication: cannot record the ready set: %s", exc)

    hub.spawn(grow())


class ReadyRecords:
    """The hub's ready-set records (module docstring)."""

    def __init__(self, hub: ReplicationHub) -> None:
        self.hub = hub
        self.record: ReadyRecord | None = None  #: the newest record (None: not kept)
        self.quorum = 0  #: backups that must hold a record before it counts
        self.recorded: dict[str, tuple[int, int]] = {}  #: the newest each backup holds
        self._waiters: list[tuple[tuple[int, int], asyncio.Future[None]]] = []
        #: completions wait until the term's first record is on a majority
        self.held = False
        self._first_done = asyncio.Event()
        #: writes a record to the primary's own data directory (synced)
        self.write_own: Callable[[ReadyRecord], None] | None = None
        #: a backup holds a newer term: this primary was superseded (it must stop)
        self.on_superseded: Callable[[str], None] | None = None

    def status(self) -> dict[str, Any] | None:
        """Its part of ``ha status`` (None when records are not kept)."""
        record = self.record
        if record is None:
            return None
        return {**record.to_wire(), "quorum": self.quorum, "held": self.held,
                "recorded": {node: list(key) for node, key in sorted(self.recorded.items())}}

    def start_term(self, term: int, quorum: int) -> None:
        """Keep records for this primary's ``term``; ``quorum`` backups must hold each.
        Nothing completes until the term's first record (an empty ready set) is held."""
        hub = self.hub
        first = ReadyRecord(term, 0, hub.node, ())
        self.record, self.quorum, self.held = first, quorum, True
        hub.on_ready_change = self.record_ready_set

        async def confirm_first() -> None:
            await self.confirmed(first.key())
            if self.write_own is not None:
                self.write_own(first)
            log.info("replication: term %d recorded on a majority: answering", term)
            self.held = False
            self._first_done.set()
            hub.port.complete(hub._complete)

        hub.spawn(confirm_first())

    async def first_confirmed(self, stop: asyncio.Event) -> None:
        """Until the term's first record is on a majority (or ``stop`` is set): a new
        primary opens its client ports only then — nothing it answers, not even a
        duplicate send it finds in the store it inherited, may precede it."""
        if not self.held:
            return
        done = asyncio.ensure_future(self._first_done.wait())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({done, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            stopping.cancel()

    async def record_ready_set(self, names: list[str]) -> None:
        """A new version of the ready set, held by ``quorum`` backups and this node's
        directory before it returns (the primary acts on a smaller set only then)."""
        current = self.record
        assert current is not None, "start_term first"
        record = ReadyRecord(current.term, current.version + 1, current.primary,
                             tuple(sorted(names)))
        self.record = record
        frame = link.encode("record", {"record": record.to_wire()})
        for backup in list(self.hub.backups.values()):
            backup.send_now(frame)
        await self.confirmed(record.key())
        if self.write_own is not None and self.record is record:
            self.write_own(record)

    def _holders(self, key: tuple[int, int]) -> int:
        return sum(1 for held in self.recorded.values() if held >= key)

    async def confirmed(self, key: tuple[int, int]) -> None:
        """Until ``quorum`` backups hold a record at least as new as ``key``."""
        if self._holders(key) >= self.quorum:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((key, future))
        await future

    def on_recorded(self, backup: AttachedBackup, body: Any) -> None:
        """A backup holds a record (or refuses it: it holds a newer term)."""
        if not isinstance(body, dict):
            raise ProtocolError("a malformed 'recorded'")
        if body.get("ok") is not True:
            reason = (f"backup {backup.node} holds term {body.get('term')} of primary "
                      f"{body.get('primary')}: a newer primary was promoted")
            log.critical("replication: %s", reason)
            if self.on_superseded is not None:
                self.on_superseded(reason)
            self.hub.drop(backup, reason)
            return
        term, version = body.get("term"), body.get("version")
        if not isinstance(term, int) or not isinstance(version, int):
            raise ProtocolError("a malformed 'recorded'")
        if (term, version) > self.recorded.get(backup.node, (-1, -1)):
            self.recorded[backup.node] = (term, version)
        waiting, self._waiters = self._waiters, []
        for wanted, future in waiting:
            if future.done():
                continue
            if self._holders(wanted) >= self.quorum:
                future.set_result(None)
            else:
                self._waiters.append((wanted, future))

    async def exchange(self, backup: AttachedBackup, reader: asyncio.StreamReader,
                       codec: link.ReplicationCodec) -> None:
        """A joining backup gets the newest record first and holds it before its dump
        (a new primary's first record reaches a majority through its backups' joins)."""
        record = self.record
        if record is None:
            return
        backup.send_now(link.encode("record", {"record": record.to_wire()}))
        while True:
            data = await asyncio.wait_for(reader.read(65536), RECORD_TIMEOUT)
            if not data:
                raise ConnectionResetError("the backup left before it held the record")
            messages = codec.receive_data(data)
            for message in messages:
                if message.type != "recorded":
                    raise ProtocolError(f"expected 'recorded', got {message.type!r}")
                self.on_recorded(backup, message.body)
            if messages:
                return

    def close(self) -> None:
        """The hub stops: nobody waits any more."""
        for _, future in self._waiters:
            future.cancel()
        self._waiters.clear()
