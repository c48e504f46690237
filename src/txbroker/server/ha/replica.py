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
too). The copy's states (joining, copying, following) change only by the rules of
``core/ha/follower.py``; the named fault points tests arm are ``faults.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Final

from txbroker.core.effects import Release
from txbroker.core.ha.follower import CopyAction, CopyInput, CopyState, copy_next
from txbroker.core.ha.promotion import ReadyRecord, Standing, record_refusal
from txbroker.core.records import StoredEntry
from txbroker.errors import ProtocolError, StorageFailed, TxBrokerError
from txbroker.protocol import replication as link
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.ha.clock import monotonic
from txbroker.server.ha.faults import FAULTS, ReplicaFaults, is_local_commit
from txbroker.server.ha.link import LinkSecurity
from txbroker.server.ha.promises import (
    PROMISE_FILE,
    raise_promise,
    read_promise,
    write_json_synced,
)
from txbroker.storage.store_lock import StoreLock

#: The line a backup writes in its store's lock file.
LOCK_LINE: Final = "replicated broker, HA {node}"

log = logging.getLogger("txbroker.ha")

__all__ = ["INCOMPLETE", "LOCK_LINE", "STATE_FILE", "Follower", "PrimaryRefused", "ServerFactory",
           "forget_standing", "incomplete", "new_server", "read_record", "read_standing",
           "wipe", "write_record", "write_standing"]

#: The marker of a data directory whose copy of the primary is not whole.
INCOMPLETE: Final = "REPLICA_INCOMPLETE"
#: The primary's heartbeat period on every link (s; ``server/ha/replication.py``).
HEARTBEAT_INTERVAL: Final = 0.25
#: What the backup last knew of its standing: ``{"ready": bool, "primary": name,
#: "record": {...}}``, synced whenever it changes, so that a whole-group restart still
#: knows whether this copy had every acknowledged entry; ``record`` is the newest
#: ready-set record it holds (``core/ha/promotion.py``; a primary's directory holds
#: only its own record).
STATE_FILE: Final = "REPLICA_STATE"

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


def incomplete(data: Path) -> bool:
    """Does ``data`` hold a copy that was cut off before it was whole?"""
    return (data / INCOMPLETE).exists()


def wipe(data: Path, keep: Path) -> None:
    """Mark ``data`` incomplete (durably), then delete all of it but ``keep`` (the
    store's lock, held), the marker and the node's promise (``promises.py``)."""
    data.mkdir(parents=True, exist_ok=True)
    marker = data / INCOMPLETE
    with open(marker, "wb") as handle:
        handle.write(b"a backup's copy of its primary is being replaced\n")
        handle.flush()
        os.fsync(handle.fileno())
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    keep = keep.resolve()
    for path in sorted(data.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        resolved = path.resolve()
        if resolved in (keep, marker.resolve(), (data / PROMISE_FILE).resolve()) \
                or resolved in keep.parents:
            continue
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        else:
            path.unlink()
    for child in data.iterdir():  # directories left with only the lock's ancestors
        if child.is_dir() and child.resolve() not in keep.parents:
            shutil.rmtree(child)


def read_standing(data: Path) -> bool | None:
    """Whether this directory's copy was ready when last written (None: no record, e.g.
    a primary's directory or a fresh one)."""
    try:
        standing = json.loads((data / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(standing, dict) or "ready" not in standing:
        return None  # none, or a primary's own record (write_record)
    return bool(standing["ready"])


def read_record(data: Path) -> ReadyRecord | None:
    """The newest ready-set record this directory holds (None: none)."""
    try:
        standing = json.loads((data / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return ReadyRecord.from_wire(standing.get("record")) if isinstance(standing, dict) \
        else None


def write_standing(data: Path, ready: bool, primary: str,
                   record: ReadyRecord | None = None) -> None:
    """Record (synced) whether the primary counts this copy as ready, and the newest
    ready-set record this node holds."""
    state: dict[str, object] = {"ready": ready, "primary": primary}
    if record is not None:
        state["record"] = record.to_wire()
    _write_state(data, state)


def write_record(data: Path, record: ReadyRecord) -> None:
    """A primary's own directory: its newest ready-set record (synced), no standing."""
    _write_state(data, {"record": record.to_wire()})


def _write_state(data: Path, state: dict[str, object]) -> None:
    write_json_synced(data, STATE_FILE, state)


def forget_standing(data: Path) -> None:
    """This directory is a primary's now: its copy is the authority."""
    (data / STATE_FILE).unlink(missing_ok=True)
    _sync_dir(data)


def _sync_dir(data: Path) -> None:
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unmark(data: Path) -> None:
    (data / INCOMPLETE).unlink(missing_ok=True)
    _sync_dir(data)


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

    def status(self) -> dict[str, object]:
        """The follower's part of ``ha status``."""
        return {"primary": self.primary, "primary_address": self.primary_address,
                "state": self.state.value, "ready": self.ready, "dump_lsn": self.at,
                "durable_lsn": self.durable_lsn, "applied_lsn": self.applied_lsn,
                "received": self.received, "connected": self.connected,
                "joined_by": self.joined_by, "resumes": self.resumes, "epoch": self.epoch}

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
            lock = StoreLock.try_acquire(self.lock_path, LOCK_LINE.format(node=self.node))
            if lock is None:
                raise StorageFailed(f"the data directory {self.config.data} was taken by "
                                    "another process while this backup changed copies")
            self.lock = lock
            self._generation += 1
            self.dumped, self.dump_entries, self.dump_durable = False, 0, 0
            self.durable_lsn = 0
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
            refs = server.store.append(kind, meta, bodies, durable)
        except (StorageFailed, ValueError, OSError) as exc:
            self._vote_fail(lsn, str(exc))
            return
        server.broker.replay(StoredEntry(kind, meta, tuple(refs)))
        if self._freeze and lsn and is_local_commit(kind, meta):
            self._freeze, self._frozen = False, True
        for effect in server.broker.take_effects():
            if isinstance(effect, Release):
                server.store.release(effect.ref)

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
            _unmark(self.config.data)
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
        writer = self._writer
        if writer is None or writer.is_closing() or self.durable_lsn <= self.acked:
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

    def close_store(self) -> None:
        """Give up the copy's store (before joining again)."""
        server = self.server
        self.server = None
        if server is not None and server.store is not None:
            server.store.close()
            server.store = None
