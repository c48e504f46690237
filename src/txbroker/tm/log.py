"""The transaction manager's decision log: presumed abort, group commit, compaction.

Theory of operation
-------------------
Presumed abort: the log holds only *commit* decisions. A global transaction
with no COMMIT record was never decided and is rolled back by recovery, so
nothing is written before or during phase one. Between the last vote and the
first phase-two commit the coordinator writes ``COMMIT gtrid`` and waits
until it is on disk (:meth:`DecisionLog.decide`); that record *is* the
decision. Once every participant has finished, ``END gtrid`` is appended
without waiting for the disk (:meth:`DecisionLog.forget`): if it is lost,
recovery merely finds nothing left to commit.

Group commit: many threads deciding at once share one write and one fsync.
The first waiter becomes the leader, writes every record queued so far,
fsyncs, and wakes the others whose records were in that batch.

Compaction: when the file grows past ``compact_bytes`` and the set of open
decisions is small, the log is rewritten with the open decisions only (a
temporary file, fsync, atomic rename, fsync of the directory).

File format — UTF-8 text, one record per line::

    <crc32 of "<kind> <gtrid>", 8 hex digits> <kind> <gtrid hex>\\n

``kind`` is ``C`` (commit decided) or ``E`` (ended: every participant
finished). A line that does not check out at the end of the file is a torn
write and is ignored; anywhere else it is reported as corruption.

The bytes go through a :class:`LogFile` (:class:`OsLogFile`, a file on disk, unless
one is given): a simulation gives one whose sync is virtual and whose crash keeps
only what was synced (``txbroker.sim``).
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from pathlib import Path
from typing import Protocol

from txbroker.errors import CorruptStore

#: Rewrite the log once it is this large (and at most COMPACT_OPEN_LIMIT decisions are open).
DEFAULT_COMPACT_BYTES = 4 * 1024 * 1024
COMPACT_OPEN_LIMIT = 10_000


def _line(kind: str, gtrid: bytes) -> bytes:
    body = f"{kind} {gtrid.hex()}"
    return f"{zlib.crc32(body.encode()):08x} {body}\n".encode()


def _parse(line: bytes) -> tuple[str, bytes] | None:
    try:
        text = line.decode()
        crc, body = text.rstrip("\n").split(" ", 1)
        if int(crc, 16) != zlib.crc32(body.encode()) or not text.endswith("\n"):
            return None
        kind, gtrid = body.split(" ")
        if kind not in ("C", "E"):
            return None
        return kind, bytes.fromhex(gtrid)
    except ValueError:
        return None


class LogFile(Protocol):
    """Where a :class:`DecisionLog` keeps its bytes: one append-only file."""

    def read(self) -> bytes:
        """The whole file (empty when there is none yet: it is created)."""

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes (a torn tail found by :meth:`read`)."""

    def append(self, data: bytes) -> None:
        """Write ``data`` at the end (not synced)."""

    def sync(self) -> None:
        """Make every byte appended so far durable."""

    def replace(self, data: bytes) -> None:
        """Atomically and durably make ``data`` the whole file (compaction)."""

    def close(self) -> None:
        """Close the file (appending after it raises)."""


class OsLogFile:
    """A :class:`LogFile` on disk: ``fdatasync`` to sync; compaction writes a temporary
    file, syncs it, renames it over the log and syncs the directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: io.FileIO | None = None

    def read(self) -> bytes:
        """The whole file (created, with its directory, when missing)."""
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = b""
        else:
            data = self.path.read_bytes()
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open
        return data

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes."""
        with open(self.path, "r+b") as f:
            f.truncate(size)

    def append(self, data: bytes) -> None:
        """Write ``data`` at the end."""
        assert self._file is not None, "read() first"
        self._file.write(data)

    def sync(self) -> None:
        """``fdatasync`` the file."""
        assert self._file is not None, "read() first"
        os.fdatasync(self._file.fileno())

    def replace(self, data: bytes) -> None:
        """Temporary file, fsync, atomic rename, fsync of the directory; reopen."""
        temp = self.path.with_suffix(".compact")
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self.close()
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()


class DecisionLog:
    """A durable log of commit decisions (see the module docstring). ``file``: where
    the bytes go (default: :class:`OsLogFile` at ``path``)."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True,
                 compact_bytes: int = DEFAULT_COMPACT_BYTES,
                 file: LogFile | None = None) -> None:
        self.path = Path(path)
        self._file: LogFile = OsLogFile(self.path) if file is None else file
        self.fsync = fsync
        self.compact_bytes = compact_bytes
        self.open_decisions: set[bytes] = set()  #: decided COMMIT, not yet ended
        self._lock = threading.Lock()
        self._flushed = threading.Condition(self._lock)
        self._queue: list[bytes] = []
        self._queued_seq = 0  #: sequence number of the last queued record
        self._durable_seq = 0  #: records up to this one are on disk
        self._leader = False
        self.syncs = 0  #: fsyncs done (group commit: fewer than decisions)
        #: bytes in the file (kept here: no fstat per forget to decide on compaction)
        self._size = self._load()

    def _load(self) -> int:
        lines = self._file.read().splitlines(keepends=True)
        good = 0
        for number, line in enumerate(lines):
            record = _parse(line)
            if record is None:
                if number == len(lines) - 1:  # a torn tail: cut it off
                    break
                raise CorruptStore(str(self.path), good, f"bad decision record on line "
                                                         f"{number + 1}")
            good += len(line)
            kind, gtrid = record
            if kind == "C":
                self.open_decisions.add(gtrid)
            else:
                self.open_decisions.discard(gtrid)
        if good != sum(len(line) for line in lines):
            self._file.truncate(good)
        return good

    # ------------------------------------------------------------------ writing
    def decide(self, gtrid: bytes) -> None:
        """Record the commit decision for ``gtrid``; returns once it is durable."""
        with self._lock:  # first: a compaction in between must keep it
            self.open_decisions.add(gtrid)
        self._append(_line("C", gtrid), wait=True)

    def decide_many(self, gtrids: list[bytes]) -> None:
        """Record the commit decisions of ``gtrids`` with ONE write and ONE sync (the
        asyncio manager's batch); returns once every one of them is durable."""
        if not gtrids:
            return
        with self._lock:
            self.open_decisions.update(gtrids)
        self._append(b"".join(_line("C", g) for g in gtrids), wait=True)

    def forget(self, gtrid: bytes) -> None:
        """Every participant of ``gtrid`` finished: the decision is no longer needed."""
        with self._lock:
            self.open_decisions.discard(gtrid)
        self._append(_line("E", gtrid), wait=False)
        self._maybe_compact()

    def _append(self, record: bytes, *, wait: bool) -> None:
        with self._lock:
            self._queue.append(record)
            self._queued_seq += 1
            mine = self._queued_seq
            if not wait:
                return
            while self._durable_seq < mine:
                if self._leader:
                    self._flushed.wait()
                    continue
                self._leader = True
                batch, self._queue = self._queue, []
                upto = self._queued_seq
                self._lock.release()
                data = b"".join(batch)
                try:
                    self._file.append(data)
                    if self.fsync:
                        self._file.sync()
                finally:
                    self._lock.acquire()
                    self._leader = False
                self._size += len(data)
                self.syncs += 1
                self._durable_seq = upto
                self._flushed.notify_all()

    def flush(self) -> None:
        """Write (and sync) every queued record."""
        with self._lock:
            if not self._queue:
                return
        self._append(b"", wait=True)

    def _maybe_compact(self) -> None:
        with self._lock:
            if self._leader or len(self.open_decisions) > COMPACT_OPEN_LIMIT \
                    or self._size < self.compact_bytes:
                return
            self._compact_locked()

    def compact(self) -> None:
        """Rewrite the log with the open decisions only."""
        with self._lock:
            while self._leader:
                self._flushed.wait()
            self._compact_locked()

    def _compact_locked(self) -> None:
        self._queue = []  # ENDs not yet written are implied by the rewrite
        self._durable_seq = self._queued_seq
        data = b"".join(_line("C", g) for g in sorted(self.open_decisions))
        self._size = len(data)
        self._file.replace(data)

    def close(self) -> None:
        """Write what is queued and close the file."""
        self.flush()
        self._file.close()
