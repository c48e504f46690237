"""Journal opening and recovery: lock, replay segments, cut a torn tail, stop at
(or repair) damage.

Theory of operation
-------------------
Segments are replayed oldest first. Each is opened, its header checked, and
mapped read-only; :func:`~txbroker.storage.journal_scan.scan_entries`
walks it entry by entry, checking every CRC, and hands back ``(kind, meta,
refs)`` in chunks of :data:`REPLAY_CHUNK` entries (a generator hop per entry
costs more than the rest of the replay), counting bodies (every body counts
as live; the broker releases the dead ones afterwards).

When the scan stops at damage, recovery looks for any valid entry *after* it:

* nothing valid follows and this is the **last** segment — a torn tail left by
  a crash during a write that was never acknowledged: the file is truncated at
  the damage, fsynced, and the cut is logged (quietly when everything from the
  damage on is zeros: the writer's pre-allocated free space, journal_writer.py);
* otherwise (valid data follows, or an older segment) — :class:`CorruptStore`
  naming the file and offset, unless ``repair`` is on. Repair covers the
  damaged region with a *pad* (so the next start skips it quietly), keeps
  everything else, and records what was dropped in the report.

A header that is short or all zeros in the last segment is a torn segment
creation: the header is written again. Missing segment ids (a gap) are
corruption; repair fills the gap with empty segments.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path

from txbroker.errors import CorruptStore, StoreError
from txbroker.storage.interface import StoredEntry
from txbroker.storage.journal_format import (
    ENTRY_HEADER,
    ENTRY_MAGIC,
    MIN_PAD,
    SEGMENT_HEADER,
    check_segment_header,
    encode_pad,
    encode_segment_header,
    index_name,
    parse_segment_name,
    segment_name,
)
from txbroker.storage.journal_scan import (
    Tally,
    collect_entries,
    find_next_entry,
    read_index,
    scan_entries,
)
from txbroker.storage.store_lock import StoreLock

log = logging.getLogger("txbroker.journal")

#: Entries handed over per chunk during replay: big enough to amortise the
#: generator hops, small enough to keep a few MiB of metadata in memory.
REPLAY_CHUNK = 4096
#: The lock file in the journal directory (locked while a store is open: ``store_lock.py``).
LOCK_FILE = "lock"


@dataclass(slots=True)
class RecoveredSegment:
    """What recovery learned about one segment."""

    segment_id: int
    size: int  #: bytes of valid data (where appends continue, for the last one)
    bodies: int
    body_bytes: int
    #: bytes of its body-carrying entries that are not bodies (see ``Tally``)
    overhead: int = 0
    #: bytes of its first entry if that carries no bodies: the snapshot the
    #: journal writes first in every segment it rolls to (0: none)
    lead: int = 0
    #: bytes of its recovery index read instead of the segment (0: the segment was
    #: scanned)
    indexed_bytes: int = 0
    #: bytes a warm standby had read already (``journal_follow.py``): recovery read
    #: only what follows
    resumed: int = 0
    #: bodies (and bytes) of it that are dead already: the warm standby's core released
    #: them while it followed (a cold recovery counts every body live)
    dead: int = 0
    dead_bytes: int = 0

    @property
    def read_bytes(self) -> int:
        """Bytes recovery read for it: its index, or its data (after ``resumed``)."""
        return self.indexed_bytes or self.size - self.resumed


@dataclass(frozen=True, slots=True)
class ResumedSegment:
    """A segment a warm standby read up to ``end`` already (``journal_follow.py``),
    with the tally of what it read."""

    end: int
    bodies: int
    body_bytes: int
    overhead: int
    #: bodies its core released there (messages that died), and their bytes
    released: int = 0
    released_bytes: int = 0


def lock_directory(directory: Path, journal_dir: Path, lock: StoreLock | None = None
                   ) -> tuple[StoreLock, list[Path]]:
    """Create the journal directory if needed and lock its lock file
    (``store_lock.py``), unless the caller holds that lock already (``lock``: the
    HA part takes it before it opens the store).

    Returns the lock (releasing it unlocks) and the directories it had to create
    (their parents need an fsync). Raises :class:`~txbroker.errors.StoreLocked`, naming the
    directory and the holder's pid, if another store holds it.
    """
    created = []
    for path in (directory, journal_dir):
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True)
            created.append(path)
    lock_path = journal_dir / LOCK_FILE
    if lock is None:
        lock = StoreLock.acquire(lock_path, directory=directory)
    elif lock.path != lock_path or not lock.held:
        raise StoreError(f"the lock given is not a held lock of {lock_path}")
    return lock, created


def list_segments(journal_dir: Path) -> list[int]:
    """Ids of the segment files in ``journal_dir``, ascending."""
    ids = [parse_segment_name(name) for name in os.listdir(journal_dir)]
    return sorted(segment_id for segment_id in ids if segment_id is not None)


def read_segment_entries(journal_dir: Path, segment_id: int, size: int) -> tuple[StoredEntry, ...]:
    """The entries of a sealed segment's first ``size`` bytes (for relocation)."""
    path = journal_dir / segment_name(segment_id)
    with open(path, "rb") as file:
        size = min(size, os.fstat(file.fileno()).st_size)  # never map past the end (SIGBUS)
        with mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) as data:
            entries, damage = collect_entries(data, SEGMENT_HEADER.size, size, segment_id)
    if damage is not None:
        raise CorruptStore(str(path), damage.offset, damage.reason)
    return tuple(entries)


def segment_lead(fd: int, end: int) -> int:
    """The length of a segment's first entry if it carries no bodies (a snapshot)."""
    first = os.pread(fd, ENTRY_HEADER.size, SEGMENT_HEADER.size)
    if len(first) < ENTRY_HEADER.size:
        return 0
    magic, length, _kind, bodies, _meta = ENTRY_HEADER.unpack(first)
    if magic != ENTRY_MAGIC or bodies or SEGMENT_HEADER.size + length > end:
        return 0
    return int(length)


@dataclass(slots=True)
class RecoveryCounts:
    """What the last recovery read (``StoreStats.recovered_*``)."""

    bytes: int = 0  #: segment data, recovery indexes or the checkpoint read
    segments: int = 0  #: segments of which anything was read
    entries: int = 0  #: entries handed back
    from_checkpoint: bool = False  #: a clean shutdown's checkpoint instead of the log


class Recovery:
    """Replays a journal directory; fills ``report`` with what it dropped."""

    def __init__(self, journal_dir: Path, *, repair: bool, use_index: bool = False,
                 resume: Mapping[int, ResumedSegment] | None = None) -> None:
        self.journal_dir = journal_dir
        #: segments a warm standby read already, and how far (``journal_follow.py``):
        #: recovery scans each from there
        self.resume = resume or {}
        self.repair = repair
        #: read a sealed segment's recovery index instead of the segment when it is
        #: sound (journal_format.py); never under repair
        self.use_index = use_index and not repair
        #: One line per dropped region, cut tail or rewritten header.
        self.report: list[str] = []

    def replay(
        self, segment_ids: list[int]
    ) -> Generator[list[StoredEntry], None, list[RecoveredSegment]]:
        """Yield every entry of ``segment_ids`` (in chunks); return what each segment holds."""
        recovered: list[RecoveredSegment] = []
        self._tidy_indexes(segment_ids)
        for index, segment_id in enumerate(segment_ids):
            if recovered and segment_id != recovered[-1].segment_id + 1:
                recovered += self._fill_gap(recovered[-1].segment_id, segment_id)
            last = index == len(segment_ids) - 1
            resumed = self.resume.get(segment_id)
            if resumed is not None:
                recovered.append((yield from self._replay_segment(segment_id, last, resumed)))
                continue
            if self.use_index and not last:
                indexed = yield from self._replay_indexed(segment_id)
                if indexed is not None:
                    recovered.append(indexed)
                    continue
            recovered.append((yield from self._replay_segment(segment_id, last)))
        return recovered

    def entries(self, segment_ids: list[int], counts: RecoveryCounts
                ) -> Generator[StoredEntry, None, list[RecoveredSegment]]:
        """:meth:`replay` entry by entry, counted in ``counts``."""
        replay = self.replay(segment_ids)
        while True:
            try:
                chunk = next(replay)
            except StopIteration as done:
                recovered: list[RecoveredSegment] = done.value
                break
            counts.entries += len(chunk)
            yield from chunk
        counts.bytes = sum(segment.read_bytes for segment in recovered)
        counts.segments = sum(1 for segment in recovered if segment.read_bytes)
        return recovered

    def _tidy_indexes(self, segment_ids: list[int]) -> None:
        """Delete the recovery indexes that cannot be used: all of them under repair
        (it may pad a sealed segment in place), the last segment's (it grows),
        those of missing segments, and temporary ones a crash left."""
        keep = set(segment_ids[:-1]) if not self.repair else set()
        for name in os.listdir(self.journal_dir):
            stem, _, suffix = name.partition(".")
            if suffix not in ("idx", "idx.tmp"):
                continue
            if suffix == "idx" and stem.isdigit() and int(stem) in keep:
                continue
            try:
                os.unlink(self.journal_dir / name)
            except OSError as exc:
                log.warning("could not delete %s: %s", self.journal_dir / name, exc)

    def _replay_indexed(
        self, segment_id: int
    ) -> Generator[list[StoredEntry], None, RecoveredSegment | None]:
        """Replay a sealed segment from its recovery index, if it has a sound one
        (None: scan the segment instead)."""
        index_path = self.journal_dir / index_name(segment_id)
        try:
            data = index_path.read_bytes()
            fd = os.open(self._path(segment_id), os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                header = os.pread(fd, SEGMENT_HEADER.size, 0)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        if check_segment_header(header, segment_id) is not None:
            return None  # the scan reports it
        entries: list[StoredEntry] = []
        tally = Tally()
        lead, problem = read_index(data, segment_id, size, tally, entries)
        if problem is not None:
            log.warning("%s: %s; scanning the segment instead", index_path, problem)
            index_path.unlink(missing_ok=True)
            return None
        for start in range(0, len(entries), REPLAY_CHUNK):
            yield entries[start:start + REPLAY_CHUNK]
        return RecoveredSegment(segment_id, size, tally.bodies, tally.body_bytes,
                                tally.overhead, lead, indexed_bytes=len(data))

    def _path(self, segment_id: int) -> Path:
        return self.journal_dir / segment_name(segment_id)

    def _note(self, message: str) -> None:
        log.warning("%s", message)
        self.report.append(message)

    def _fill_gap(self, before: int, after: int) -> list[RecoveredSegment]:
        missing = self._path(before + 1)
        reason = f"segments {before + 1}..{after - 1} are missing (the log has a gap)"
        if not self.repair:
            raise CorruptStore(str(missing), 0, reason)
        filled = []
        for segment_id in range(before + 1, after):
            fd = os.open(self._path(segment_id), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                os.pwrite(fd, encode_segment_header(segment_id), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            filled.append(RecoveredSegment(segment_id, SEGMENT_HEADER.size, 0, 0))
        self._note(f"{self.journal_dir}: {reason}; created them empty (their data is lost)")
        return filled

    def _replay_segment(
        self, segment_id: int, last: bool, resumed: ResumedSegment | None = None
    ) -> Generator[list[StoredEntry], None, RecoveredSegment]:
        """Scan one segment (from where a warm standby stopped, if it read it)."""
        path = self._path(segment_id)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if not self._header_ok(fd, path, segment_id, size, last):
                return RecoveredSegment(segment_id, SEGMENT_HEADER.size, 0, 0)
            size = max(size, SEGMENT_HEADER.size)
            tally, start = Tally(), SEGMENT_HEADER.size
            if resumed is not None:
                if not SEGMENT_HEADER.size <= resumed.end <= size:  # resume_point checked it
                    raise StoreError(f"{path}: a warm standby read up to {resumed.end}, "
                                     f"past its end ({size})")
                tally = Tally(resumed.bodies, resumed.body_bytes, resumed.overhead)
                start = resumed.end
            end, pads = size, list[tuple[int, int]]()
            if size > start:
                end, pads = yield from self._scan(fd, path, segment_id, size, last, tally,
                                                  start)
            if end < size:
                os.ftruncate(fd, end)
            for pad_start, pad_stop in pads:
                os.pwrite(fd, encode_pad(pad_stop - pad_start), pad_start)
            if end < size or pads:
                os.fsync(fd)
            return RecoveredSegment(segment_id, end, tally.bodies, tally.body_bytes,
                                    tally.overhead, segment_lead(fd, end),
                                    resumed=start if resumed is not None else 0,
                                    dead=resumed.released if resumed is not None else 0,
                                    dead_bytes=resumed.released_bytes if resumed else 0)
        finally:
            os.close(fd)

    def _header_ok(self, fd: int, path: Path, segment_id: int, size: int, last: bool) -> bool:
        """Check the header; rewrite it if torn (last segment) or under repair.

        Returns False when the segment was reset to an empty one.
        """
        head = os.pread(fd, SEGMENT_HEADER.size, 0)
        problem = check_segment_header(head, segment_id)
        if problem is None:
            return True
        torn = len(head) < SEGMENT_HEADER.size or not any(head)
        if last and torn:
            os.ftruncate(fd, 0)
            os.pwrite(fd, encode_segment_header(segment_id), 0)
            os.fsync(fd)
            self._note(
                f"{path}: torn segment header ({problem}); reset to an empty segment, "
                f"{size} bytes dropped"
            )
            return False
        if not self.repair:
            raise CorruptStore(str(path), 0, problem)
        os.pwrite(fd, encode_segment_header(segment_id), 0)
        os.fsync(fd)
        self._note(f"{path}: {problem}; header rewritten")
        return True

    def _scan(
        self, fd: int, path: Path, segment_id: int, size: int, last: bool, tally: Tally,
        start: int = SEGMENT_HEADER.size,
    ) -> Generator[list[StoredEntry], None, tuple[int, list[tuple[int, int]]]]:
        """Replay the entries of one mapped segment from ``start``; return (valid end,
        regions to pad)."""
        pads: list[tuple[int, int]] = []
        # populate the mapping up front for a whole scan, not for a warm standby's
        # suffix (the pages before ``start`` are never read)
        populate = getattr(mmap, "MAP_POPULATE", 0) if start == SEGMENT_HEADER.size else 0
        flags = mmap.MAP_SHARED | populate
        with mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ) as mapped:
            if hasattr(mapped, "madvise"):
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            offset = start
            while True:
                chunk: list[StoredEntry] = []
                offset, damage = scan_entries(
                    mapped, offset, size, segment_id, tally, chunk, REPLAY_CHUNK
                )
                if chunk:
                    yield chunk
                if damage is None:
                    if offset < size:
                        continue
                    return size, pads
                if last and mapped[damage.offset:size] == bytes(size - damage.offset):
                    # the writer's pre-allocated zeros (journal_writer.py): free space
                    # (one comparison: searching them for an entry took 0.1 s at 8 MiB)
                    log.debug("%s: %d pre-allocated bytes after offset %d", path,
                              size - damage.offset, damage.offset)
                    return damage.offset, pads
                following = find_next_entry(mapped, damage.offset + 1, size)
                if following is None and last:
                    self._note(f"{path}: cut torn tail at offset {damage.offset} "
                               f"({size - damage.offset} bytes dropped): {damage.reason}")
                    return damage.offset, pads
                if not self.repair:
                    where = (
                        f"valid entries follow at offset {following}"
                        if following is not None
                        else "not at the tail of the last segment"
                    )
                    raise CorruptStore(str(path), damage.offset, f"{damage.reason}; {where}")
                stop = size if following is None else following
                self._drop(path, damage.offset, stop, damage.reason, pads)
                if following is None:
                    return size, pads
                offset = following

    def _drop(
        self, path: Path, start: int, stop: int, reason: str, pads: list[tuple[int, int]]
    ) -> None:
        """Record a damaged region that repair skips (padded when big enough)."""
        if stop - start >= MIN_PAD:
            pads.append((start, stop))
            how = "covered with a pad"
        else:
            how = f"too short to pad (< {MIN_PAD} bytes): run --repair again next start"
        self._note(f"{path}: dropped bytes {start}..{stop} ({stop - start} bytes): {reason}; {how}")
