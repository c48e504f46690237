"""Following a journal that another process writes: the warm standby (issue 29).

Theory of operation
-------------------
A shared-store standby cannot open the store (the active holds its lock), but
it can read the segment files. :class:`JournalFollower` reads them read-only,
oldest first, as the active appends, checking every entry's CRC with the
recovery's own scanner (:func:`~txbroker.storage.journal_scan.scan_entries`),
and hands the entries back in log order, in bounded slices (:meth:`poll`), so
that the standby replays them into its core while it waits. For every segment
it read it keeps a :class:`FollowedSegment`: the file's identity (device,
inode), where the entries it read end, their tally, and where its last entry
read starts.

Where it stops: in the segment it is reading, at the first place where no
complete valid entry is -- the end of what the active has written so far (its
pre-allocated zeros, or an entry still being written). It moves on to the next
segment only when that one exists *and* this one was read up to its file's
end: the writer cuts a sealed segment to its data before it creates the next
(``journal_writer.py``), so a sealed segment read to its end holds nothing more.
Damage in a sealed segment leaves the follower where it is; the takeover's
recovery finds it and stops the start, as a cold recovery would. Files are read
with ``pread`` (no mapping: a file cut under a mapping would be a SIGBUS).

Deleted segments (compaction deletes the oldest ones) are forgotten at the next
poll, with the bodies released in them. A segment deleted before it was read, or
replaced or shortened under the follower, makes it *lost*
(:class:`FollowerLost`): the standby starts following again from scratch.

At the takeover, holding the lock (nobody writes any more),
:meth:`JournalFollower.resume_point` checks that every segment it read is still
the same file, at least as long as what it read, with its last entry read still
intact, and no older segment appeared; it returns the :class:`Resume` that
``JournalStore.resume_from`` takes: a segment read to its end is not read again
(its tally is reused), the one the follower stopped in is scanned from where it
stopped, with the same rules as a cold recovery (a torn tail of the last
segment is cut, damage elsewhere stops the start), and later ones are scanned
whole. Any mismatch returns None: the standby recovers cold, as before.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from txbroker.storage.interface import BodyRef, StoredEntry
from txbroker.storage.journal_format import (
    ENTRY_MAGIC,
    REF_LENGTH_BITS,
    SEGMENT_HEADER,
    check_segment_header,
    segment_name,
    unpack_ref,
)
from txbroker.storage.journal_recovery import ResumedSegment, list_segments
from txbroker.storage.journal_scan import Tally, scan_entries

log = logging.getLogger("txbroker.journal")

#: Bytes read per ``pread`` while following: a few MiB keep one poll short on the
#: standby's event loop (the page cache serves them in about a millisecond).
FOLLOW_READ_BYTES: Final = 4 * 1024 * 1024
#: The first read of a poll (the head's pre-allocated zeros follow what is written:
#: most polls find a few entries and then zeros); each read that found entries doubles
#: the next, up to FOLLOW_READ_BYTES.
FOLLOW_FIRST_READ: Final = 64 * 1024
#: Entries handed back by one :meth:`JournalFollower.poll` at most.
FOLLOW_ENTRIES: Final = 4096


class FollowerLost(Exception):
    """The journal changed in a way the follower cannot follow (start again)."""


@dataclass(slots=True)
class FollowedSegment:
    """What the follower read of one segment."""

    segment_id: int
    #: ``(st_dev, st_ino)`` of the file when it was first read
    identity: tuple[int, int]
    #: where the entries read end (the next entry starts here)
    end: int = SEGMENT_HEADER.size
    #: where the last entry read starts (0: none read yet)
    last_entry: int = 0
    tally: Tally = field(default_factory=Tally)
    #: the next segment existed and this one was read to its file's end
    sealed: bool = False


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a takeover's recovery picks up: per segment id, what was read."""

    segments: dict[int, ResumedSegment]
    #: entries the follower read, over its life (for the log and the tests)
    entries_followed: int


class JournalFollower:
    """Reads a journal another process writes (see the module docstring)."""

    def __init__(self, journal_dir: Path) -> None:
        self.journal_dir = journal_dir
        #: the segments read, oldest first (dict order)
        self.segments: dict[int, FollowedSegment] = {}
        #: bodies released by the follower's core (count, bytes), by segment id
        self._released: dict[int, list[int]] = {}
        #: entries and segment bytes read so far
        self.entries = 0
        self.bytes_read = 0

    def release(self, ref: BodyRef) -> None:
        """Note that the follower's core released ``ref`` (its message died)."""
        segment_id, _offset, length = unpack_ref(ref)
        released = self._released.setdefault(segment_id, [0, 0])
        released[0] += 1
        released[1] += length

    # ------------------------------------------------------------------ following
    def poll(self, limit: int = FOLLOW_ENTRIES) -> list[StoredEntry]:
        """The next entries the active wrote (up to about ``limit``; [] when none).

        Raises :class:`FollowerLost` when the journal was changed under it.
        """
        ids = list_segments(self.journal_dir)
        self._forget_deleted(ids)
        out: list[StoredEntry] = []
        while len(out) < limit:
            current = self._current(ids)
            if current is None:
                return out
            later = current.segment_id < ids[-1]
            progressed = self._read(current, out, limit - len(out), later)
            if not progressed and not current.sealed:
                return out
        return out

    def _forget_deleted(self, ids: list[int]) -> None:
        """Drop the segments compaction deleted (oldest first); a gap means we are lost."""
        present = set(ids)
        for segment_id in list(self.segments):
            if segment_id in present:
                break
            if ids and segment_id > ids[0]:
                raise FollowerLost(f"segment {segment_id} vanished before older ones")
            if not self.segments[segment_id].sealed:  # its unread entries are lost to us
                raise FollowerLost(f"segment {segment_id} was deleted before it was read "
                                   "to its end")
            del self.segments[segment_id]
            self._released.pop(segment_id, None)
        if self.segments and any(segment_id not in present for segment_id in self.segments):
            raise FollowerLost("a segment the follower read vanished out of order")

    def _current(self, ids: list[int]) -> FollowedSegment | None:
        """The segment to read next (opened and registered when new), or None."""
        if not ids:
            return None
        if not self.segments:
            return self._start(ids[0])
        last = next(reversed(self.segments.values()))
        if not last.sealed:
            return last
        following = last.segment_id + 1
        if following not in ids:
            if ids[-1] > following:
                raise FollowerLost(f"segment {following} is missing after {last.segment_id}")
            return None
        return self._start(following)

    def _start(self, segment_id: int) -> FollowedSegment | None:
        """Register a segment to read (None: its header is not there yet)."""
        path = self.journal_dir / segment_name(segment_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise FollowerLost(f"{path} vanished before it was read") from exc
        try:
            stat = os.fstat(fd)
            header = os.pread(fd, SEGMENT_HEADER.size, 0)
        finally:
            os.close(fd)
        if check_segment_header(header, segment_id) is not None:
            return None  # being created; or damaged: the takeover's recovery reports it
        followed = FollowedSegment(segment_id, (stat.st_dev, stat.st_ino))
        self.segments[segment_id] = followed
        return followed

    def _read(self, followed: FollowedSegment, out: list[StoredEntry], limit: int,
              later: bool) -> bool:
        """Read entries of ``followed`` from its end; True if it read any or sealed it."""
        path = self.journal_dir / segment_name(followed.segment_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise FollowerLost(f"{path} vanished while it was read") from exc
        try:
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino) != followed.identity:
                raise FollowerLost(f"{path} was replaced")
            if stat.st_size < followed.end:
                raise FollowerLost(f"{path} shrank below what was read ({followed.end})")
            progressed = False
            want = FOLLOW_FIRST_READ
            while len(out) < limit and followed.end < stat.st_size:
                start = followed.end
                data = os.pread(fd, min(want, stat.st_size - start), start)
                self.bytes_read += len(data)
                if self._scan(followed, data, start, out, limit):
                    progressed = True
                    want = min(2 * want, FOLLOW_READ_BYTES)
                    continue
                # nothing: the end of what is written (the writer's zeros), damage, or
                # an entry longer than the read (then read it whole)
                magic, length = data[:4], int.from_bytes(data[4:8], "little")
                if magic != ENTRY_MAGIC or length <= len(data) or \
                        start + length > stat.st_size:
                    break
                want = length
            if later and followed.end == stat.st_size and not followed.sealed:
                followed.sealed = progressed = True
            return progressed
        finally:
            os.close(fd)

    def _scan(self, followed: FollowedSegment, data: bytes, start: int,
              out: list[StoredEntry], limit: int) -> int:
        """Scan ``data`` (the file from ``start``) for entries; how many were found."""
        chunk: list[StoredEntry] = []
        stop, _damage = scan_entries(data, 0, len(data), followed.segment_id,
                                     followed.tally, chunk, limit - len(out))
        if not chunk and stop == 0:
            return 0
        shift = start << REF_LENGTH_BITS  # refs were computed from offsets in ``data``
        for entry in chunk:
            if entry.refs:
                entry = StoredEntry(entry.kind, entry.meta,
                                    tuple(ref + shift for ref in entry.refs))
            out.append(entry)
        if chunk:
            followed.last_entry = start + self._last_start(data, stop)
        followed.end = start + stop
        self.entries += len(chunk)
        return len(chunk) or stop

    @staticmethod
    def _last_start(data: bytes, stop: int) -> int:
        """Where the last entry before ``stop`` in ``data`` starts (walks the lengths)."""
        offset = last = 0
        while offset < stop:
            last = offset
            offset += int.from_bytes(data[offset + 4:offset + 8], "little")
        return last

    # ------------------------------------------------------------------ takeover
    def resume_point(self) -> Resume | None:
        """Holding the lock: check what was read is intact; where recovery resumes
        (None: follow nothing, recover cold; the reason is logged)."""
        try:
            ids = list_segments(self.journal_dir)
            self._forget_deleted(ids)
            if not self.segments or ids[0] != next(iter(self.segments)):
                raise FollowerLost("the oldest segment was not followed")
            for followed in self.segments.values():
                self._check(followed)
        except (FollowerLost, OSError) as exc:
            log.warning("warm standby: %s; recovering the whole journal", exc)
            return None
        segments = {}
        for segment_id, followed in self.segments.items():
            tally = followed.tally
            released, released_bytes = self._released.get(segment_id, (0, 0))
            segments[segment_id] = ResumedSegment(followed.end, tally.bodies, tally.body_bytes,
                                                  tally.overhead, released, released_bytes)
        return Resume(segments, self.entries)

    def _check(self, followed: FollowedSegment) -> None:
        """The file is the one read, no shorter, and its last entry read is intact."""
        path = self.journal_dir / segment_name(followed.segment_id)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino) != followed.identity:
                raise FollowerLost(f"{path} was replaced")
            if stat.st_size < followed.end:
                raise FollowerLost(f"{path} shrank below what was read ({followed.end})")
            if followed.last_entry:
                data = os.pread(fd, followed.end - followed.last_entry, followed.last_entry)
                entries: list[StoredEntry] = []
                stop, damage = scan_entries(data, 0, len(data), followed.segment_id, Tally(),
                                            entries, 1)
                if damage is not None or stop != len(data):
                    raise FollowerLost(f"{path}: the last entry read changed")
        finally:
            os.close(fd)

