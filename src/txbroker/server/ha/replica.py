"""A backup's side of replicated HA: follow the primary into its own store.

Theory of operation
-------------------
A backup joins the primary's HA port (``join``), gets a ``welcome`` naming the
LSN its dump stands for, and then:

1. marks its data directory **incomplete** (the file :data:`INCOMPLETE`, synced)
   and empties it — everything but the store's lock — so that a half-copied
   state can never be promoted;
2. opens a fresh store and a core that *replays* (``BrokerServer.open_store``,
   recovery never finished): each entry it receives — the dump's, then the
   stream's — is appended to its store (its own group commit) and replayed into
   the core, whose releases free the space of what the primary consumed;
3. once every dump entry is durable, removes the marker and acknowledges the
   dump's LSN; from then on it acknowledges the highest LSN durable here, one
   ``ack`` per batch of completions.

An entry it cannot write is a failed vote (``vote``): it says so and leaves.
When the link breaks, the primary is gone or dropped us: the node joins again
or, if promoted, finishes recovery from the state it replayed
(``server/ha/replicated.py``). A whole copy is **kept** across the break (its store
stays open, the same :class:`Follower` joins again): its ``join`` names the
primary's epoch and the highest LSN it applied, and a primary of that epoch that
still holds every later entry sends just those (an ``incremental`` welcome, no
wipe, no dump — issue 29's incremental catch-up); any other answer is a dump, and
the kept copy is closed and replaced as above. Entries must arrive in LSN order
without a gap: anything else is a protocol error (the link is dropped, the copy
too).

**Resuming from the disk.** A node restarted on a whole copy (no marker, a backup's
standing) replays its own store and, when the log says which LSN it holds, joins to
resume it like a kept copy. The log says so by counting: a ``REPLICA_AT`` record (the
epoch, an LSN) after the dump, or whenever the count would not reach the next entry;
every later entry but a snapshot is the next LSN; a segment's snapshot carries the
count (dead segments may go). Replay counts alike (``core/replay.py``): a kill's lost
tail is just sent again. Only the journal keeps its log in order (not the dir store);
a promoted node ends the count (``end_position``). A backup drops dead segments as a
primary does; the primary's relocations reach it as entries.

The copy's states (joining, copying, following) change only by the rules of
``core/ha/follower.py``; the named fault points tests arm are ``faults.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Final

from txbroker.core.effects import Release
from txbroker.core.ha.follower import CopyAction, CopyInput, CopyState, copy_next
from txbroker.core.ha.promotion import ReadyRecord, Standing, record_refusal
from txbroker.core.records import ReplicaAt, StoredEntry
from txbroker.errors import CorruptStore, ProtocolError, StorageFailed, StoreError, TxBrokerError
from txbroker.protocol import replication as link
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.ha.clock import monotonic
from txbroker.server.ha.faults import FAULTS, ReplicaFaults, is_local_commit
from txbroker.server.ha.link import LinkSecurity
from txbroker.server.ha.promises import raise_promise, read_promise
from txbroker.server.ha.replica_checkpoints import CopyCheckpoints
from txbroker.server.ha.replica_files import (
    incomplete,
    read_record,
    read_standing,
    unmark,
    wipe,
    write_standing,
)
from txbroker.storage.store_lock import StoreLock

#: The line a backup writes in its store's lock file.
LOCK_LINE: Final = "replicated broker, HA {node}"

log = logging.getLogger("txbroker.ha")

__all__ = ["LOCK_LINE", "Follower", "PrimaryRefused", "ServerFactory", "end_position",
           "new_server"]

#: The primary's heartbeat period on every link (s; ``server/ha/replication.py``).
HEARTBEAT_INTERVAL: Final = 0.25
#: Makes the broker a node runs on its data directory, under the store's lock (held).
ServerFactory = Callable[[ServerConfig, StoreLock | None], BrokerServer]


def new_server(config: ServerConfig, lock: StoreLock | None) -> BrokerServer:
    """The production :data:`ServerFactory`: the store the configuration names (the
    simulator's gives a store on its simulated disk and its virtual clock)."""
    return BrokerServer(config, lock=lock)


class PrimaryRefused(TxBrokerError):
    """The peer is not a primary that takes this backup (it said why; ``standing``:
    what a peer that is a backup said of itself, ``core/ha/promotion.py``)."""

    def __init__(self, message: str, standing: Standing | None = None) -> None:
        super().__init__(message)
        self.standing = standing


class Follower:
    """One backup following one primary over one link (module docstring)."""

    def __init__(self, config: ServerConfig, lock: StoreLock, lock_path: Path,
                 node: str, security: LinkSecurity | None = None,
                 faults: ReplicaFaults = FAULTS, make_server: ServerFactory = new_server
                 ) -> None:
        self.config = config
        self._make_server = make_server
        #: TLS and the handshake on the link (server/ha/link.py)
        self.security = security if security is not None else LinkSecurity.from_config(config)
        self.lock = lock
        self.lock_path = lock_path
        self.node = node
        self.server: BrokerServer | None = None
        self.primary = ""  #: the primary's node name
        self.primary_address = ""
        self.state = CopyState.JOINING  #: core/ha/follower.py
        self.epoch = ""  #: the primary's epoch (its LSNs count within it)
        self.applied_lsn = 0  #: the highest LSN appended and replayed here
        self.connected = False  #: a link to the primary is up (the copy may outlive it)
        self.heard_at = float("-inf")  #: when the primary last sent anything (loop clock)
        #: links a primary welcomed (one more per join it took; replicated.py: when a
        #: follow() that raised it ends, the primary is lost)
        self.links = 0
        self.joined_by = ""  #: "dump", or "suffix" (resumed from the kept copy)
        self.resumes = 0  #: incremental catch-ups of this copy
        #: bumped when a kept copy is replaced: completions of the old store are ignored
        self._generation = 0
        self.at = 0  #: the LSN of the dump
        self.dumped = False
        self.dump_entries = 0
        self.dump_durable = 0
        self.durable_lsn = 0  #: the highest LSN durable here
        self.acked = -1  #: the last LSN acknowledged (-1: none yet, not even the dump's)
        self.received = 0
        #: the primary counts this backup as ready (it waits for its acks)
        self.ready = False
        #: the newest ready-set record this node holds (``core/ha/promotion.py``)
        self.record: ReadyRecord | None = read_record(config.data)
        self._faults = faults  #: the named fault points (``faults.py``)
        #: freeze after the first local commit (fault point ``freeze_after:local_commit``)
        self._freeze = faults.freeze_after_local_commit
        self._frozen = False
        #: a primary silent this long (s) is gone: join whoever is primary now
        self.silence = max(2 * config.backup_timeout, 4 * HEARTBEAT_INTERVAL)
        self._writer: asyncio.StreamWriter | None = None
        self._ack_scheduled = False
        self.failed: str | None = None
        self._maintain_at = 0.0  #: when the store next drops dead segments (loop clock)
        #: the copy's recovery checkpoints (``replica_checkpoints.py``)
        self.checkpoints = CopyCheckpoints(config)

    def status(self) -> dict[str, object]:
        """The follower's part of ``ha status``."""
        return {"primary": self.primary, "primary_address": self.primary_address,
                "state": self.state.value, "ready": self.ready, "dump_lsn": self.at,
                "durable_lsn": self.durable_lsn, "applied_lsn": self.applied_lsn,
                "received": self.received, "connected": self.connected,
                "joined_by": self.joined_by, "resumes": self.resumes, "epoch": self.epoch,
                "checkpoints": dict(self.checkpoints.counts)}

    def resume_disk_copy(self) -> bool:
        """At the node's start: keep the whole copy on this node's disk when its log says
        which LSN it holds (module docstring, "Resuming from the disk"); False: there is
        none to keep (the next welcome brings a dump)."""
        data = self.config.data
        if not self.config.ha_catchup_bytes or self.config.store == "dir" \
                or incomplete(data) or read_standing(data) is None:
            return False
        server = self._make_server(self.config, self.lock)
        try:
            server.open_store()
        except (CorruptStore, StoreError, OSError) as exc:  # the dump will replace it
            log.warning("replication: the copy on disk cannot be kept: %s", exc)
            if not self.lock.held:
                self._take_lock()
            return False
        at = server.broker.replica_at
        if at is None or not getattr(server.store, "keeps_log", False):
            self.server = server
            self.close_store()
            self._take_lock()
            return False
        self._release(server)
        self.server = server
        self._step(CopyInput.COPY_ON_DISK)
        self.epoch, self.at, self.applied_lsn, self.durable_lsn = at.epoch, at.lsn, at.lsn, at.lsn
        self.joined_by, self.ready = "disk", read_standing(data) is True
        log.info("replication: kept the copy on disk (epoch %s, LSN %d) to resume", at.epoch,
                 at.lsn)
        return True

    def resumable(self) -> bool:
        """A whole copy whose link ended: it may ask the next primary for the suffix."""
        return (self.state is CopyState.FOLLOWING and self.server is not None
                and self.failed is None)

    def _step(self, event: CopyInput) -> tuple[CopyAction, ...]:
        """Move the copy by the table (``core/ha/follower.py``)."""
        self.state, actions = copy_next(self.state, event)
        return actions

    async def follow(self, host: str, port: int) -> None:
        """Join the primary at ``host:port`` and follow it until the link breaks
        (returns) or it refuses us (PrimaryRefused)."""
        reader, writer = await self.security.connect(host, port, 2.0)
        self._writer = writer
        self.acked = -1  # a new link: acknowledge what is durable again
        self.primary_address = f"{host}:{port}"
        codec = link.ReplicationCodec()
        join: dict[str, object] = {"node": self.node, "version": 1}
        if self.resumable():
            join["resume"] = {"epoch": self.epoch, "lsn": self.applied_lsn}
        try:
            writer.write(link.encode("join", join))
            while True:
                # a primary sends at least a heartbeat every HEARTBEAT_INTERVAL, from the
                # moment it took our join (a black hole, or a frozen peer, says nothing)
                silence = self.silence
                try:
                    data = await asyncio.wait_for(reader.read(1 << 20), silence)
                except TimeoutError:
                    log.warning("replication: nothing from the primary %s for %.1f s: "
                                "looking for the primary again", self.primary_address,
                                silence)
                    return
                if not data:
                    return
                self.heard_at = monotonic()
                try:
                    for message in codec.receive_data(data):
                        self._on_message(message)
                except ProtocolError as exc:  # the copy is not trusted further: a dump next
                    self.failed = str(exc)
                    raise
                await writer.drain()
                if self.failed is not None:
                    return
                self._maintain()
                if self.server is not None and self.resumable():
                    await self.checkpoints.maybe(self.server, self.ready)
        finally:
            writer.close()
            self._writer = None
            self.connected = False

    def _on_message(self, message: link.LinkMessage) -> None:
        body = message.body
        if message.type == "refuse":
            raise PrimaryRefused(str(body.get("reason", "refused")),
                                 Standing.from_wire(body.get("standing")))
        if message.type == "welcome":
            self.connected = True
            self.links += 1
            if body.get("incremental"):
                self._resume(str(body["node"]), str(body.get("epoch", "")), int(body["at"]))
            else:
                self._start(str(body["node"]), int(body["at"]))
                self.epoch = str(body.get("epoch", ""))
        elif message.type == "entries":
            if self.server is None:
                raise ProtocolError("entries before welcome")
            for lsn, kind, meta, bodies in body:
                self._apply(int(lsn), int(kind), bytes(meta), [bytes(b) for b in bodies])
        elif message.type == "dumped":
            self.dumped = True
            try:
                self._position(self.applied_lsn)
            except (StorageFailed, ValueError, OSError) as exc:
                self._vote_fail(self.applied_lsn, str(exc))
                return
            self._maybe_whole()
        elif message.type == "state":
            ready = bool(body.get("ready"))
            if ready != self.ready:
                write_standing(self.config.data, ready, self.primary, self.record)
            self.ready = ready
        elif message.type == "record":
            self._on_record(body)
        elif message.type != "heartbeat":
            raise ProtocolError(f"a primary may not send {message.type!r}")

    def _on_record(self, body: object) -> None:
        """The primary's ready set, recorded here (synced) before it is acknowledged. A
        primary of an older term than one recorded here is refused (a newer primary
        was promoted since), and so is a second primary of the same term (two
        promotions at once: the first to reach this node keeps the term), and any
        record this node's promise rules out (``core/ha/promotion.py``)."""
        record = ReadyRecord.from_wire(body.get("record") if isinstance(body, dict) else None)
        if record is None:
            raise ProtocolError("a malformed ready-set record")
        mine, promised = self.record, read_promise(self.config.data)
        writer = self._writer
        why = record_refusal(mine, promised, record)
        if why is not None:
            term, primary = (mine.term, mine.primary) if mine is not None else (0, "")
            if promised is not None and promised.term >= term:
                term, primary = promised.term, promised.candidate
            if writer is not None and not writer.is_closing():
                writer.write(link.encode("recorded", {"ok": False, "term": term,
                                                      "primary": primary}))
            raise PrimaryRefused(why)
        if mine is None or record.key() > mine.key():
            raise_promise(self.config.data, record)
            self.record = record
            write_standing(self.config.data, self.ready, self.primary or record.primary,
                           record)
        if writer is not None and not writer.is_closing():
            writer.write(link.encode("recorded", {"ok": True, "term": record.term,
                                                  "version": record.version}))

    def _start(self, primary: str, at: int) -> None:
        """The primary welcomed us: replace our copy with its dump."""
        self._step(CopyInput.WELCOME_DUMP)  # REPLACE_COPY: below
        if self.server is not None:  # a kept copy this primary cannot resume
            self.close_store()
            self._take_lock()
            self._generation += 1
            self.dumped, self.dump_entries, self.dump_durable = False, 0, 0
            self.durable_lsn = 0
            self.checkpoints.reset()
        self.primary, self.at = primary, at
        self.applied_lsn, self.joined_by = at, "dump"
        log.info("replication: following %s from its dump at LSN %d", primary, at)
        wipe(self.config.data, self.lock_path)
        write_standing(self.config.data, False, primary, self.record)
        server = self._make_server(self.config, self.lock)
        server.open_store()
        self.server = server

    def _resume(self, primary: str, epoch: str, at: int) -> None:
        """The primary resumes our kept copy: the entries after ``at`` follow."""
        if not self.resumable() or epoch != self.epoch or at != self.applied_lsn:
            raise ProtocolError(f"the primary resumes epoch {epoch!r} from LSN {at}; this copy "
                                f"holds {self.epoch!r} up to {self.applied_lsn}")
        actions = self._step(CopyInput.WELCOME_SUFFIX)  # KEEP_COPY, ACK
        self.primary, self.joined_by = primary, "suffix"
        self.resumes += 1
        if self.ready:  # the primary counts us as catching up until we are within the lag
            write_standing(self.config.data, False, primary, self.record)
            self.ready = False
        log.info("replication: resuming the copy of %s from LSN %d (incremental catch-up, no "
                 "dump)", primary, at)
        if CopyAction.ACK in actions:
            self._schedule_ack()

    def _apply(self, lsn: int, kind: int, meta: bytes, bodies: list[bytes]) -> None:
        server = self.server
        assert server is not None and server.store is not None
        self.received += 1
        if self._frozen and lsn:
            return  # the fault point: nothing after the local commit is written or acked
        if lsn:  # a streamed entry: the next one, always (a gap would lose an entry)
            if lsn != self.applied_lsn + 1:
                raise ProtocolError(f"entry {lsn} after entry {self.applied_lsn}: a gap in "
                                    "the replication stream")
            self.applied_lsn = lsn
        if lsn == 0:
            self.dump_entries += 1
        elif self._faults.votes_fail(kind, meta):
            self._vote_fail(lsn, "fault injected (replica fault point vote_fail)")
            return
        generation = self._generation

        def durable(error: BaseException | None) -> None:
            if generation == self._generation:  # else: the copy it belonged to is gone
                self._durable(lsn, error)

        try:
            if lsn:
                self._position(lsn - 1)
            refs = server.store.append(kind, meta, bodies, durable)
        except (StorageFailed, ValueError, OSError) as exc:
            self._vote_fail(lsn, str(exc))
            return
        server.broker.replay(StoredEntry(kind, meta, tuple(refs)))
        if self._freeze and lsn and is_local_commit(kind, meta):
            self._freeze, self._frozen = False, True
        self._release(server)

    @staticmethod
    def _release(server: BrokerServer) -> None:
        """Free the space of what replay found gone."""
        store = server.store
        assert store is not None
        for effect in server.broker.take_effects():
            if isinstance(effect, Release):
                store.release(effect.ref)

    def _position(self, lsn: int) -> None:
        """Before the entry after ``lsn``: make the log say so, if replay would not count
        it so already (``REPLICA_AT``; module docstring, "Resuming from the disk")."""
        server = self.server
        assert server is not None and server.store is not None
        at = server.broker.replica_at
        if (at is not None and at.lsn == lsn and at.epoch == self.epoch) \
                or not getattr(server.store, "keeps_log", False):
            return
        record = ReplicaAt(self.epoch, lsn)
        generation = self._generation

        def durable(error: BaseException | None) -> None:
            if error is not None and generation == self._generation:
                self._vote_fail(lsn, str(error))

        server.store.append(record.kind, record.encode(), (), durable)
        server.broker.replay(StoredEntry(record.kind, record.encode(), ()))

    def _maintain(self) -> None:
        """Now and then, drop the store's dead segments (never relocate: the primary's
        relocations arrive as entries)."""
        now = monotonic()
        server = self.server
        if now < self._maintain_at or server is None or server.store is None \
                or self.state is not CopyState.FOLLOWING:
            return
        self._maintain_at = now + self.config.maintain_interval
        server.store.maintain(relocate=False)

    def _durable(self, lsn: int, error: BaseException | None) -> None:
        if error is not None:
            self._vote_fail(lsn, str(error))
            return
        if lsn == 0:
            self.dump_durable += 1
            self._maybe_whole()
            return
        self.durable_lsn = max(self.durable_lsn, lsn)
        if CopyAction.ACK in self._step(CopyInput.ENTRY_DURABLE):
            self._schedule_ack()

    def _maybe_whole(self) -> None:
        if not self.dumped or self.dump_durable != self.dump_entries:
            return
        actions = self._step(CopyInput.COPY_WHOLE)
        if CopyAction.MARK_WHOLE in actions:
            unmark(self.config.data)
            self.durable_lsn = max(self.durable_lsn, self.at)
            log.info("replication: copy of %s is whole (LSN %d)", self.primary, self.at)
        if CopyAction.ACK in actions:
            self._schedule_ack()

    def _schedule_ack(self) -> None:
        if self._ack_scheduled:
            return
        self._ack_scheduled = True
        asyncio.get_running_loop().call_soon(self._send_ack)

    def _send_ack(self) -> None:
        self._ack_scheduled = False
        writer = self._writer  # none before the welcome: LSNs of another copy (seed 58779)
        if writer is None or not self.connected or writer.is_closing() \
                or self.durable_lsn <= self.acked:
            return
        self.acked = self.durable_lsn
        writer.write(link.encode("ack", {"lsn": self.acked}))

    def _vote_fail(self, lsn: int, reason: str) -> None:
        log.error("replication: cannot write entry %d: %s (voting fail, leaving)", lsn, reason)
        self.failed = reason
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(link.encode("vote", {"lsn": lsn, "ok": False, "reason": reason}))

    def leave(self) -> None:
        """Stop following the primary now (this node promised a newer term to another):
        the link closes, nothing more is acknowledged on it."""
        if self._writer is not None and not self._writer.is_closing():
            log.info("replication: leaving the primary %s (a newer term was promised)",
                     self.primary)
            self._writer.close()

    def _take_lock(self) -> None:
        """The store gave the directory's lock up when it closed: take it again."""
        lock = StoreLock.try_acquire(self.lock_path, LOCK_LINE.format(node=self.node))
        if lock is None:
            raise StorageFailed(f"the data directory {self.config.data} was taken by "
                                "another process while this backup changed copies")
        self.lock = lock

    def close_store(self, checkpoint: bool = False) -> None:
        """Give up the copy's store (before joining again); ``checkpoint``: the node
        stops, and a whole copy's store closes with a checkpoint when it keeps them."""
        server, whole = self.server, self.resumable()
        self.server = None
        if server is not None and server.store is not None:
            if checkpoint and whole:
                self.checkpoints.close(server)
            else:
                server.store.close()
            server.store = None


def end_position(server: BrokerServer) -> None:
    """A node promoted: the entries of its log are its own from here, not a primary's
    (``REPLICA_AT`` with no epoch; before recovery finishes — it may write leftover
    commits — and before the store is wrapped: never shipped)."""
    store = server.store
    if store is None or server.broker.replica_at is None:
        return
    record = ReplicaAt("", 0)
    try:
        store.append(record.kind, record.encode(), (), lambda error: None)
    except (StorageFailed, ValueError, OSError) as exc:  # failed: it writes nothing more
        log.error("replication: cannot end the log's count of LSNs: %s", exc)
    server.broker.replay(StoredEntry(record.kind, record.encode(), ()))
