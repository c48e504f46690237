"""The primary's side of replicated HA (seed 001): every store entry goes to every
backup, and an entry is complete only when it is durable here and on every ready
backup.

Theory of operation
-------------------
:class:`ReplicatingStore` stands in for the primary's store. Each ``append``
gets the next **LSN** (log sequence number) from the :class:`ReplicationHub`,
goes to the local store (group commit as always) and, as one ``entries`` frame
batch, to every attached backup (``protocol/replication.py``). The entry's
``on_durable`` — what answers the client — runs only once the local store has it
AND every *ready* backup acknowledged it; the wait for the backups overlaps the
local fsync. Completions still run in append order (the store contract the core
relies on). A transaction is one entry (``TX``, ``XA_PREPARE``, ``XA_COMMIT`` …):
a backup never holds a proper subset of a transaction.

**Joining.** A backup that connects gets a *dump* (``core/replica.py``) of the
state at one LSN, then every entry after it — unless it can **resume**: a backup
that lost its link but kept its copy (same process) says in its ``join`` which
primary epoch and LSN it holds; when that is this primary's epoch and the
**catch-up buffer** still holds every entry after that LSN, the backup gets only
those entries (an ``incremental`` welcome) and no dump. The buffer keeps the
newest entries' frames up to ``ha_catchup_bytes`` (``ha status``: ``catchup``). The
dump is taken when the state in memory is exactly the durable log: the hub stops
reading clients until every entry in flight is complete (normally one group commit),
describes the state (no body is read) and lets clients go on; bodies are then read
and streamed while new entries queue behind the dump (``joining.py``). While any dump
streams, the store's space reclamation waits (releases are deferred, compaction pauses,
``replicating_store.py``) so that every body the dump names stays readable. The hub
sees the server only as its :class:`HubPort`: the core, ``complete`` (an ack or a drop
completes entries as a group commit does; nothing once the store closed), ``hold_input``.

**Ready set.** A backup is *ready* once it has the dump and is within
:data:`READY_LAG` entries of the newest: from then on entries wait for it. A
ready backup that leaves an entry unacknowledged for ``backup_timeout`` seconds
is dropped from the ready set (logged, and in ``ha status``) and catches up
without being waited for; it is ready again once it is within the lag. Every
change of a backup link's state is a rule of the table in ``core/ha/backup_link.py``:
the hub feeds it inputs and carries out the actions it names. A backup that cannot
write an entry votes fail: it is dropped and its link closed; if the entry was an
``XA_PREPARE`` the branch's prepare fails (XA_RBROLLBACK, the seed's "fail cancels").
A local transaction's commit is an ``XA_PREPARE`` too on a primary (``core/local_tx.py``,
"Voted commit"), so it is voted the same way: a failed vote rolls it back and its
client gets TransactionRolledBack.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from txbroker.core.ha.backup_link import (
    LINK_RULES,
    READY_LAG,
    WAITED_FOR,
    LinkAction,
    LinkInput,
    LinkState,
    ack_input,
    link_next,
)
from txbroker.core.records import Kind
from txbroker.errors import ProtocolError, ReplicaVoteFailed
from txbroker.protocol import replication as link
from txbroker.server.config import DEFAULT_HA_CATCHUP_BYTES
from txbroker.server.ha.attached import AttachedBackup
from txbroker.server.ha.clock import monotonic
from txbroker.server.ha.joining import send_dump, send_suffix
from txbroker.server.ha.ready_records import ReadyRecords, record_grown, record_shrunk
from txbroker.server.ha.replica import HEARTBEAT_INTERVAL
from txbroker.server.ha.replicating_store import ReplicatingStore
from txbroker.storage.interface import BodyRef, DurableCallback, Store

if TYPE_CHECKING:
    from txbroker.core import Broker

log = logging.getLogger("txbroker.ha")

__all__ = ["READY_LAG", "HubPort", "ReplicationHub"]
#: Entries per ``entries`` frame when the stream has a backlog.
BATCH: Final = 256
#: Entries whose running byte count is kept (a backup's lag in bytes, ``ha status``).
HISTORY: Final = 100_000
#: Bytes a backup's link may have queued before it is dropped (it joins again).
MAX_QUEUED: Final = 256 * 1024 * 1024



class HubPort(Protocol):
    """What the hub needs from the running server (``BrokerServer`` implements it)."""

    @property
    def broker(self) -> Broker:
        """The core: quiet for a dump, and described by it."""

    def complete(self, completions: Callable[[], None]) -> None:
        """Run ``completions`` as the store's are run: the core's clock set first, the
        effects carried out after (the one completion path, ``app.py``)."""

    def hold_input(self, held: bool) -> None:
        """Stop (or go on) reading every client connection."""

    def after_turn(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the loop's current turn is done (``loop.call_soon``)."""


@dataclass(slots=True, eq=False)
class _Pending:
    lsn: int
    kind: int
    on_durable: DurableCallback
    appended: float
    local: bool = False
    error: BaseException | None = None
    vote_failed: str | None = None


class ReplicationHub:
    """LSNs, the entries in flight, the attached backups (module docstring)."""

    def __init__(self, port: HubPort, node: str, backup_timeout: float,
                 catchup_bytes: int = DEFAULT_HA_CATCHUP_BYTES, *,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.port = port
        #: the primary's own store, under the replicating one (:meth:`wrap`)
        self.local: Store | None = None
        self.node = node
        self.backup_timeout = backup_timeout
        #: this primary's epoch: its node and the wall clock (ns) when it became primary
        self.epoch = f"{node}-{clock_ns()}"
        self.lsn = 0
        self.answered = 0  #: the newest LSN completed (answered)
        self.bytes = 0  #: bytes of every entry numbered so far (meta and bodies)
        #: (lsn, bytes up to and with it) of the latest entries: a backup's lag in bytes
        self.history: deque[tuple[int, int]] = deque(maxlen=HISTORY)
        self.pending: deque[_Pending] = deque()
        self.backups: dict[str, AttachedBackup] = {}
        self.dumps = 0
        #: the catch-up buffer: (lsn, frame) of the newest entries, ≤ ``catchup_bytes`` (0: none)
        self.catchup_bytes = catchup_bytes
        self.suffix: deque[tuple[int, bytes]] = deque()
        self.suffix_held = 0  #: bytes of the frames in the buffer
        #: what joins cost: dumps and suffixes sent, their entries and bytes
        self.shipped = dict.fromkeys(("dumps", "dump_entries", "dump_bytes", "suffixes",
                                      "suffix_entries", "suffix_bytes"), 0)
        self.deferred: list[BodyRef] = []
        self.closed = False  #: the store closed: acks and drops after that complete nothing
        self.waiting_quiet: list[asyncio.Future[None]] = []
        self._watch: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: records a new ready set before the primary stops waiting for a backup that
        #: left it (etcd's ``/txbroker/<cluster>/ready``; None: nowhere to record)
        self.on_ready_change: Callable[[list[str]], Awaitable[None]] | None = None
        #: the ready set recorded on a majority (no etcd, three nodes or more:
        #: ``ready_records.py``); its ``held`` holds completions
        self.records = ReadyRecords(self)

    # ------------------------------------------------------------------ the store side
    def begin(self, kind: int, meta: bytes, bodies: list[bytes],
              on_durable: DurableCallback) -> int:
        """A new entry: number it, ship it, remember who must have it."""
        self.lsn += 1
        lsn = self.lsn
        self.bytes += len(meta) + sum(map(len, bodies))
        self.history.append((lsn, self.bytes))
        self.pending.append(_Pending(lsn, kind, on_durable, monotonic()))
        if self.backups or self.catchup_bytes:
            frame = link.encode("entries", [[lsn, kind, meta, bodies]])
            for backup in list(self.backups.values()):
                self.feed(backup, LinkInput.ENTRY, frame)
            self._keep(lsn, frame)
        return lsn

    def wrap(self, store: Store) -> Store:
        """``store`` with every append replicated through this hub (``wrap_store``)."""
        self.local = store
        return ReplicatingStore(store, self)

    def _keep(self, lsn: int, frame: bytes) -> None:
        """Hold an entry's frame in the catch-up buffer, dropping the oldest beyond it."""
        if not self.catchup_bytes:
            return
        suffix = self.suffix
        suffix.append((lsn, frame))
        self.suffix_held += len(frame)
        while self.suffix_held > self.catchup_bytes:
            self.suffix_held -= len(suffix.popleft()[1])

    def can_resume(self, resume: Any) -> int | None:
        """The LSN a backup's ``join`` may resume from (it holds this epoch's copy up to
        it and the buffer has every entry after it), None when it needs a dump."""
        if not isinstance(resume, dict) or resume.get("epoch") != self.epoch:
            return None
        lsn = resume.get("lsn")
        if not isinstance(lsn, int) or not 0 <= lsn <= self.lsn:
            return None
        if lsn == self.lsn:
            return lsn
        if self.suffix and self.suffix[0][0] <= lsn + 1:
            return lsn
        return None

    def local_durable(self, lsn: int, error: BaseException | None) -> None:
        """The local store has entry ``lsn`` (or failed)."""
        for entry in self.pending:
            if entry.lsn == lsn:
                entry.local = True
                entry.error = error
                break
        self._complete()

    def _ready(self) -> list[AttachedBackup]:
        """The backups entries wait for: ready ones, and ready ones on their way out
        (until the smaller ready set is recorded, ``on_ready_change``)."""
        return [b for b in self.backups.values() if b.state in WAITED_FOR]

    def ready_names(self) -> list[str]:
        """The ready set as it stands (without the backups on their way out)."""
        return sorted(b.node for b in self.backups.values()
                      if b.state is LinkState.READY and b.told_ready)

    # ------------------------------------------------------------------ the link table
    def feed(self, backup: AttachedBackup, event: LinkInput, frame: bytes = b"",
             reason: str | None = None) -> LinkState:
        """Move ``backup`` by the table (``core/ha/backup_link.py``) and carry out the
        actions; returns the state it was in."""
        before = backup.state
        try:  # the table itself (link_next, without a call on the hot path)
            backup.state, actions = LINK_RULES[(before, event)]
        except KeyError:
            link_next(before, event)  # raises IllegalTransition
            raise
        if reason is not None and actions:
            backup.reason = reason
        for action in actions:
            if action is LinkAction.SEND_ENTRY:  # every entry, every backup: no call
                self._write(backup, frame)
            elif action is LinkAction.COMPLETE and not self.closed:  # every ack (closed: _act)
                self.port.complete(self._complete)
            else:
                self._act(backup, action, frame)
        return before

    def _act(self, backup: AttachedBackup, action: LinkAction, frame: bytes) -> None:
        """One action of a link's transition (SEND_DUMP and SEND_SUFFIX are the async
        callers' own: ``joining.send_dump``, ``joining.send_suffix``)."""
        if action is LinkAction.SEND_ENTRY:  # the frequent ones first
            self._write(backup, frame)
        elif action is LinkAction.COMPLETE:
            self._completed_by_network()
        elif action is LinkAction.QUEUE_ENTRY:
            backup.backlog.append(frame)
        elif action is LinkAction.SEND_HEARTBEAT:
            backup.send_now(frame)
        elif action is LinkAction.SEND_BACKLOG:
            backlog, backup.backlog = backup.backlog, []
            backup.acked = 0
            for queued in backlog:
                self._write(backup, queued)
        elif action is LinkAction.SEND_READY:  # entries wait for it from now on
            backup.ready_mark = self.answered
            self._tell_ready(backup)
        elif action is LinkAction.SEND_NOT_READY:
            backup.told_ready = False
            self._write(backup, link.encode("state", {"ready": False}))
        elif action is LinkAction.RECORD_GROWN_SET:
            pass  # once it is told it is ready (_tell_ready)
        elif action is LinkAction.RECORD_SHRUNK_SET:
            record_shrunk(self, backup)
        elif action is LinkAction.CLOSE_LINK:
            log.warning("replication: backup %s dropped: %s", backup.node, backup.reason)
            backup.writer.close()
        elif action is LinkAction.FORGET and self.backups.get(backup.node) is backup:
            del self.backups[backup.node]

    def _tell_ready(self, backup: AttachedBackup) -> None:
        """A backup entries wait for holds every entry answered once it acknowledged
        the newest answered when they began to (within READY_LAG it may still miss a
        few): only then is it told it is ready and counted in the recorded set."""
        if backup.told_ready or backup.acked < backup.ready_mark:
            return
        backup.told_ready, backup.reason = True, ""
        self._write(backup, link.encode("state", {"ready": True}))
        log.info("replication: backup %s is ready (acked %d of %d)", backup.node,
                 backup.acked, self.lsn)
        record_grown(self)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on the loop (not when the loop is gone: the hub is torn down)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            work.close()
            return
        task = loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _complete(self) -> None:
        if self.records.held:  # the term's first record is not on a majority yet
            return
        ready = self._ready()
        pending = self.pending
        while pending:
            entry = pending[0]
            if not entry.local or any(b.acked < entry.lsn for b in ready):
                break
            pending.popleft()
            self.answered = entry.lsn
            error = entry.error
            if error is None and entry.vote_failed is not None:
                error = ReplicaVoteFailed(entry.vote_failed)
            entry.on_durable(error)
        if not pending and self.waiting_quiet:
            waiting, self.waiting_quiet = self.waiting_quiet, []
            for future in waiting:
                if not future.done():
                    future.set_result(None)

    def _completed_by_network(self) -> None:
        """Completions caused by a backup (an ack, a drop), as the store's; none once closed."""
        if not self.closed:
            self.port.complete(self._complete)

    # ------------------------------------------------------------------ backups
    def _write(self, backup: AttachedBackup, frame: bytes) -> None:
        """Write a frame the table sends (a turn's entries go together,
        ``attached.py``); a link with too much queued is dropped."""
        writer = backup.writer
        if writer.is_closing():
            return
        if writer.transport.get_write_buffer_size() > MAX_QUEUED:
            self.drop(backup, "its link has more than 256 MiB queued")
            return
        if backup.send_entry(frame):
            self.port.after_turn(backup.end_turn)

    def drop(self, backup: AttachedBackup, reason: str) -> None:
        """Take a backup out (it joins again with a fresh dump)."""
        self.feed(backup, LinkInput.DROP, reason=reason)

    def bytes_at(self, lsn: int) -> int:
        """The bytes of every entry up to ``lsn`` (0 before the known history)."""
        history = self.history
        if not history or lsn >= history[-1][0]:
            return self.bytes if history and lsn >= history[-1][0] else 0
        position = bisect.bisect_right(history, (lsn, float("inf"))) - 1
        return history[position][1] if position >= 0 else 0

    def status(self) -> dict[str, Any]:
        """The replication part of ``ha status``."""
        backups = []
        for backup in self.backups.values():
            info = backup.info(self.lsn)
            info["lag_bytes"] = max(0, self.bytes - self.bytes_at(backup.acked))
            backups.append(info)
        suffix = self.suffix
        catchup = {"buffer_bytes": self.catchup_bytes, "held_bytes": self.suffix_held,
                   "held_entries": len(suffix),
                   "oldest_lsn": suffix[0][0] if suffix else None, **self.shipped}
        result = {"lsn": self.lsn, "bytes": self.bytes, "in_flight": len(self.pending),
                  "epoch": self.epoch, "backups": backups, "catchup": catchup}
        records = self.records.status()
        if records is not None:
            result["ready_record"] = records
        return result

    async def serve_backup(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           hello: dict[str, Any], codec: link.ReplicationCodec) -> None:
        """One backup's link, from its ``join`` until it closes."""
        node = str(hello.get("node") or writer.get_extra_info("peername"))
        peer = writer.get_extra_info("peername")
        address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        old = self.backups.get(node)
        if old is not None:
            self.drop(old, "it joined again")
        backup = AttachedBackup(node, address, writer)
        self.backups[node] = backup
        self._start_watch()
        try:
            await self.records.exchange(backup, reader, codec)
            if self.backups.get(node) is not backup:
                return  # it refused the record (a newer term): dropped
            resume_at = self.can_resume(hello.get("resume"))
            if resume_at is not None:
                await send_suffix(self, backup, resume_at)
            else:
                await send_dump(self, backup)
            while not reader.at_eof():
                data = await reader.read(65536)
                if not data:
                    break
                for message in codec.receive_data(data):
                    if self.closed:  # read before close(): the broker's store is gone
                        return
                    self._on_message(backup, message)
        except (ConnectionError, ProtocolError, TimeoutError, OSError) as exc:
            self.drop(backup, f"link lost: {exc}")
        finally:
            self.drop(backup, "link closed")

    def _on_message(self, backup: AttachedBackup, message: link.LinkMessage) -> None:
        if message.type == "ack":
            if (lsn := int(message.body["lsn"])) > self.lsn:  # never sent: not our copy's
                raise ProtocolError(f"an ack of LSN {lsn}, past the newest ({self.lsn})")
            if lsn > backup.acked:
                backup.acked = lsn
                backup.last_ack = monotonic()
            self.feed(backup, ack_input(self.lsn, backup.acked))
            if backup.state is LinkState.READY and not backup.told_ready:
                self._tell_ready(backup)
        elif message.type == "vote":
            lsn, reason = int(message.body["lsn"]), str(message.body.get("reason", ""))
            for entry in self.pending:
                if entry.lsn == lsn and entry.kind == Kind.XA_PREPARE:
                    entry.vote_failed = f"backup {backup.node} voted fail: {reason}"
            self.drop(backup, f"it voted fail on entry {lsn}: {reason}")
        elif message.type == "recorded":
            self.records.on_recorded(backup, message.body)
        else:
            raise ProtocolError(f"a backup may not send {message.type!r}")

    def local_store(self) -> Store:
        """The local store under the replicating one."""
        assert self.local is not None, "the hub replicates no store yet (wrap)"
        return self.local

    # ------------------------------------------------------------------ timeouts
    def _start_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_backups())

    async def _watch_backups(self) -> None:
        last_beat = 0.0
        while self.backups:
            await asyncio.sleep(min(0.2, self.backup_timeout / 4))
            now = monotonic()
            if now - last_beat >= HEARTBEAT_INTERVAL:  # a silent primary is a gone one
                last_beat = now
                beat = link.encode("heartbeat", {"lsn": self.lsn})
                for backup in list(self.backups.values()):
                    self.feed(backup, LinkInput.HEARTBEAT, beat)
            if not self.pending:
                continue
            oldest = self.pending[0]
            if monotonic() - oldest.appended <= self.backup_timeout:
                continue
            for backup in self._ready():
                if backup.acked < oldest.lsn:
                    reason = (f"no ack of entry {oldest.lsn} within backup_timeout "
                              f"({self.backup_timeout:g} s)")
                    if self.feed(backup, LinkInput.LATE, reason=reason) is LinkState.READY:
                        log.warning("replication: backup %s leaves the ready set: %s",
                                    backup.node, reason)

    def close(self) -> None:
        """Stop: every backup link closes."""
        self.closed = True
        for backup in list(self.backups.values()):
            backup.writer.close()
        self.backups.clear()
        if self._watch is not None:
            self._watch.cancel()
        for task in self._tasks:
            task.cancel()
        self.records.close()
