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
writer, which unlinks it after the sync of everything queued before). Only
from the oldest end: a segment's ACK and DROP entries cancel message records
in older segments, and a replay without them would bring those messages
back.

So one live message in the oldest segment pins every later segment, however
dead: a broker with 100k messages parked in one queue and a million sent and
consumed through another kept the whole history (1.1 GB for 100 MB live) and
replayed all of it at every restart. :meth:`SegmentSpace.offer_relocation`
therefore weighs *prefixes* of the journal, as Artemis' compactor weighs the
whole journal (journal-compact-percentage, journal-compact-min-files): the
oldest ``k`` sealed segments are worth relocating when copying their live
messages (:meth:`SegmentInfo.copy_bytes`: the live bodies and, per body, the
segment's average record overhead) writes less than
:attr:`CompactionSettings.live_fraction` of what deleting them *and the dead
segments right after them* frees (each relocated segment counts its size
less its snapshot: the copies need segments, and snapshots, of their own).
``k = 1`` without a dead run after it is the plain "mostly dead oldest
segment"; a fully live oldest segment followed by a long dead run pays too.
While the journal is quiet (nothing appended between two ``maintain``
calls) the bar is :attr:`CompactionSettings.idle_live_fraction` instead: an
idle broker packs the copies a busy one left mixed with dead data.
If a prefix pays, the oldest segment is offered (its entries read back); once
its copies are durable and it is deleted, the next call weighs the rest. The
journal must have at least :attr:`CompactionSettings.min_segments` segments,
consumers must not have eaten from the oldest since the call before (its live
count is watched at every call, so a segment that consumers empty is never
copied at the first call at which it pays), and it must not have been
offered in the last :data:`RELOCATION_RETRY_CALLS` calls. Counting body bytes
alone, a segment of small live messages always looked mostly dead and the
same messages were copied forward again and again; counting what a prefix
frees, a fully live segment that pins dead ones is copied once per
``1 / live_fraction - 1`` of its size in dead data behind it, which bounds
the journal to about ``1 / live_fraction`` times its live data plus the head.

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

#: Default of :attr:`CompactionSettings.live_fraction`: ``maintain`` offers the
#: oldest sealed segment for relocation when copying the live messages of the
#: oldest segments writes less than this fraction of what deleting them and the
#: dead segments after them frees (Artemis compacts at 30 % live; 0.5 bounds disk
#: use to about twice the live data, plus the head segment).
RELOCATE_BELOW_LIVE_FRACTION = 0.5
#: If an offered segment is still there after this many ``maintain`` calls
#: (the broker could not move everything yet), offer it again: about a minute
#: at the server's default 1 s maintain interval.
RELOCATION_RETRY_CALLS = 60
#: Default of :attr:`CompactionSettings.idle_live_fraction`: while nothing but
#: compaction writes, relocating pays at a quarter dead. Each relocation still
#: shrinks the journal (it frees more than 1/0.8 of what it writes, and the copies
#: fill segments of their own), so the idle passes end; a fully live journal is
#: never copied (copying it writes what it frees).
RELOCATE_IDLE_LIVE_FRACTION = 0.8
#: Default of :attr:`CompactionSettings.min_segments`: the journal must have a
#: sealed segment besides the head; beyond that the fraction decides. (Artemis
#: compacts from journal-compact-min-files = 10 of its 10 MiB files; a minimum of
#: 4 of our 64 MiB segments tolerated up to 3 segments of waste whatever the live
#: data: 157 MB for 102 MB live in bench/restart_churn.py.)
RELOCATE_MIN_SEGMENTS = 2


@dataclass(frozen=True, slots=True)
class CompactionSettings:
    """When the journal relocates live messages (``compact_live_fraction``,
    ``compact_min_segments`` and ``compact_idle_live_fraction`` in the server's
    ``[server]`` table; docs/storage.md)."""

    #: relocate the oldest segments when copying their live messages writes less
    #: than this fraction of what deleting them (and the dead run after them) frees;
    #: 0 never relocates (nor does the idle fraction then). The journal stays within
    #: about ``1 / live_fraction`` times its live data plus the head segment; each
    #: relocation rewrites the live data of the segments it empties.
    live_fraction: float = RELOCATE_BELOW_LIVE_FRACTION
    #: relocate only when the journal has at least this many segments
    min_segments: int = RELOCATE_MIN_SEGMENTS
    #: the fraction used instead while the journal is quiet (nothing appended
    #: since the last ``maintain`` call): an idle broker tidies up what a busy
    #: one left, at no cost to clients; 0 = the same as ``live_fraction``
    idle_live_fraction: float = RELOCATE_IDLE_LIVE_FRACTION

    def __post_init__(self) -> None:
        for name, value in (("compact_live_fraction", self.live_fraction),
                            ("compact_idle_live_fraction", self.idle_live_fraction)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} {value} outside 0..1 (1 or more would copy live "
                                 "data forward for nothing)")
        if self.min_segments < 2:
            raise ValueError(f"compact_min_segments {self.min_segments} must be >= 2 "
                             "(the head is never relocated)")


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
        """The accounting of a segment recovery replayed: every body counts live but
        those a warm standby's core released already (``segment.dead``)."""
        return cls(
            segment.size, segment.bodies - segment.dead, segment.body_bytes - segment.dead_bytes,
            segment.bodies, segment.overhead, segment.lead,
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
        settings: CompactionSettings | None = None,
    ) -> None:
        self.journal_dir = journal_dir
        self.settings = settings or CompactionSettings()
        self.segments = segments
        #: the oldest segment still there
        self.oldest = 1
        self._delete = delete
        #: the segment offered for relocation last, until it is deleted
        self._relocating: int | None = None
        self._relocation_offered_at = 0
        self._maintain_calls = 0
        #: the store's append count at the last ``maintain`` call (-1: none yet)
        self._appends_seen = -1
        #: nothing was appended between the last two ``maintain`` calls
        self.quiet = False
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

    def count_maintain_call(self, appends: int) -> None:
        """Count one ``maintain`` call of an open store (the relocation retry clock);
        ``appends``, the store's append count, tells whether the journal was quiet."""
        self._maintain_calls += 1
        self.quiet = appends == self._appends_seen
        self._appends_seen = appends

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
        info = self.segments.get(oldest)
        live = info.live_bodies if info is not None else 0
        # watched at every call, so that the first call at which a prefix pays already
        # knows whether consumers ate from the oldest since the call before
        watched, self._oldest_watch = self._oldest_watch, (oldest, live)
        if info is None or oldest >= head or oldest >= written:
            return None  # only the head is left, or the oldest is not fully written yet
        if len(self.segments) < self.settings.min_segments:
            return None  # a few segments of waste are cheaper than copying
        if self.paying_prefix(head, written) == 0:
            return None  # copying would write as much as it frees (or more than it pays)
        if watched[0] == oldest and watched[1] > live:
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

    def paying_prefix(self, head: int, written: int) -> int:
        """How many of the oldest segments a relocation lets go now (0: none pays).

        Relocating the oldest ``k`` sealed, fully written segments writes their
        live messages (``copy_bytes``) and lets them go with the dead segments
        right after them; it pays when it writes less than ``live_fraction`` of
        what it frees. Returns the count of the shortest paying prefix, the
        relocated segments and the dead run after them together.
        """
        settings = self.settings
        fraction = settings.live_fraction
        if fraction == 0.0:
            return 0  # compaction is off
        if self.quiet and settings.idle_live_fraction > fraction:
            fraction = settings.idle_live_fraction
        segments = self.segments
        cost = freed = 0.0
        segment, sealed = self.oldest, min(head, written)
        while segment < sealed:
            info = segments[segment]
            cost += info.copy_bytes()
            freed += info.size - info.lead  # the copies need snapshots of their own
            segment += 1
            while segment < head and segments[segment].live_bodies == 0:
                freed += segments[segment].size  # dead: goes once the prefix is gone
                segment += 1
            if cost < fraction * freed:
                return segment - self.oldest
        return 0

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
