"""Space accounting of the journal's segments, and when relocation pays.

Theory of operation
-------------------
Each segment has a :class:`SegmentInfo`: its size, its live bodies and live
body bytes, and — to estimate what relocating it would write — all the
bodies it ever held, the bytes of its body-carrying entries that are not
bodies (entry headers and message records) and its snapshot's size.
Recovery counts every body live; ``release`` marks one dead.

:class:`SegmentSpace` holds the table from the oldest segment to the head.
The store's ``maintain`` has it delete dead segments from the oldest end
only, stopping at the first with a live body and never deleting the head
(the store closes the segment's reader and queues the ``Delete`` to the
writer, which unlinks it after the sync of everything queued before). Then
:meth:`SegmentSpace.offer_relocation` decides whether the oldest sealed
segment is worth relocating, and reads its entries back if so. It is when
copying its live messages (:meth:`SegmentInfo.copy_bytes`: the live bodies
and, per body, the segment's average record overhead) writes less than
:data:`RELOCATE_BELOW_LIVE_FRACTION` of what deleting it frees (its size less
its snapshot: the copies need segments, and snapshots, of their own), the
journal has at least :data:`RELOCATE_MIN_SEGMENTS` segments, consumers are
not eating it already, and it was not offered in the last
:data:`RELOCATION_RETRY_CALLS` calls. Counting body bytes alone, a segment of
small live messages always looked mostly dead and the same messages were
copied forward again and again.

Threading: the broker's thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from txbroker.errors import CorruptStore
from txbroker.storage.interface import BodyRef, Relocation, StoreStats
from txbroker.storage.journal_format import unpack_ref
from txbroker.storage.journal_recovery import RecoveredSegment, read_segment_entries

#: The journal store's logger (its warnings and errors have always gone here).
log = logging.getLogger("txbroker.journal")

#: ``maintain`` offers the oldest sealed segment for relocation when copying its
#: live messages (``SegmentInfo.copy_bytes``) writes less than this fraction of
#: its size less its snapshot (Artemis compacts at 30 % live; 0.5 bounds disk
#: use to about twice the live data).
RELOCATE_BELOW_LIVE_FRACTION = 0.5
#: If an offered segment is still there after this many ``maintain`` calls
#: (the broker could not move everything yet), offer it again: about a minute
#: at the server's default 1 s maintain interval.
RELOCATION_RETRY_CALLS = 60
#: Relocate only once the journal has this many segments (Artemis compacts from
#: journal-compact-min-files = 10; with 64 MiB segments 4 is a similar amount).
RELOCATE_MIN_SEGMENTS = 4


@dataclass(slots=True)
class SegmentInfo:
    """Space accounting of one segment (on the broker's thread)."""

    size: int  #: bytes assigned (written or queued)
    live_bodies: int
    live_bytes: int
    bodies: int = 0  #: bodies ever stored in it
    #: bytes of its body-carrying entries that are not bodies: entry headers and
    #: message records, which a relocation copies too
    overhead: int = 0
    lead: int = 0  #: bytes of its snapshot (every segment has one)

    def copy_bytes(self) -> float:
        """About what relocating its live messages writes: their bodies and, per
        body, the segment's average record overhead."""
        if not self.bodies:
            return self.live_bytes
        return self.live_bytes + self.live_bodies * self.overhead / self.bodies

    @classmethod
    def recovered(cls, segment: RecoveredSegment) -> SegmentInfo:
        """The accounting of a segment recovery replayed: every body counts live."""
        return cls(
            segment.size, segment.bodies, segment.body_bytes, segment.bodies,
            segment.overhead, segment.lead,
        )


class SegmentSpace:
    """The segments from the oldest to the head: live bodies, deletion, relocation.

    ``segments`` is the store's own table (the store adds segments as it rolls);
    ``delete`` is called with each dead segment this removes from it, oldest
    first, and must close the segment's files and have the writer unlink it.
    """

    def __init__(
        self,
        journal_dir: Path,
        segments: dict[int, SegmentInfo],
        delete: Callable[[int], None],
    ) -> None:
        self.journal_dir = journal_dir
        self.segments = segments
        #: the oldest segment still there
        self.oldest = 1
        self._delete = delete
        #: the segment offered for relocation last, until it is deleted
        self._relocating: int | None = None
        self._relocation_offered_at = 0
        self._maintain_calls = 0
        #: (oldest segment, its live bodies) when last considered for relocation
        self._oldest_watch: tuple[int, int] = (-1, 0)

    def release(self, ref: BodyRef) -> bool:
        """Mark a body dead; False if its segment is gone or has no live body left."""
        segment, _offset, length = unpack_ref(ref)
        info = self.segments.get(segment)
        if info is None:
            return False
        if info.live_bodies <= 0:
            log.warning("release of ref %#x: segment %d has no live bodies left", ref, segment)
            return False
        info.live_bodies -= 1
        info.live_bytes -= length
        return True

    def count_maintain_call(self) -> None:
        """Count one ``maintain`` call of an open store (the relocation retry clock)."""
        self._maintain_calls += 1

    def delete_dead(self, head: int) -> None:
        """Delete the segments without a live body from the oldest end, up to the head."""
        while self.oldest < head and self.segments[self.oldest].live_bodies == 0:
            segment = self.oldest
            del self.segments[segment]
            if self._relocating == segment:
                self._relocating = None
            self._delete(segment)
            self.oldest += 1

    def offer_relocation(self, head: int, written: int) -> Relocation | None:
        """The oldest segment and its entries, if relocating it pays now.

        ``written`` is the segment the writer is writing: the oldest is offered
        only when it is neither the head nor still being written. An offered
        segment is offered again only after :data:`RELOCATION_RETRY_CALLS` calls.
        """
        oldest = self.oldest
        if oldest >= head or oldest >= written:
            return None  # only the head is left, or the oldest is not fully written yet
        info = self.segments[oldest]
        if info.copy_bytes() >= RELOCATE_BELOW_LIVE_FRACTION * (info.size - info.lead):
            return None  # copying would write as much as it frees (the copies need
            # segments, and snapshots, of their own)
        if len(self.segments) < RELOCATE_MIN_SEGMENTS:
            return None  # a few segments of waste are cheaper than copying
        watched, self._oldest_watch = self._oldest_watch, (oldest, info.live_bodies)
        if watched[0] == oldest and watched[1] > info.live_bodies:
            return None  # consumers are eating it: it will likely die on its own
        recently = self._maintain_calls - self._relocation_offered_at < RELOCATION_RETRY_CALLS
        if self._relocating == oldest and recently:
            return None
        self._relocating = oldest
        self._relocation_offered_at = self._maintain_calls
        try:
            entries = read_segment_entries(self.journal_dir, oldest, info.size)
        except (CorruptStore, OSError) as exc:
            log.error("cannot read segment %d for relocation: %s", oldest, exc)
            return None
        return Relocation(oldest, entries)

    def stats(self, appends: int, syncs: int, bytes_written: int) -> StoreStats:
        """The store's counters: the given ones and the segments' totals."""
        segments = self.segments.values()
        return StoreStats(
            appends=appends,
            syncs=syncs,
            bytes_written=bytes_written,
            segments=len(segments),
            disk_bytes=sum(info.size for info in segments),
            live_bodies=sum(info.live_bodies for info in segments),
            live_body_bytes=sum(info.live_bytes for info in segments),
        )
