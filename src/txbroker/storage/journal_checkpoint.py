"""The journal's recovery checkpoint file: the broker's state at a point of the log,
handed back by the next recovery instead of the log up to that point (issue 29; what
the state holds: ``core/checkpoint.py``).

Theory of operation
-------------------
A checkpoint is taken when everything appended is synced and every completion has run
(the server holds its clients' input meanwhile: ``server/recovery.py``), so the state
is exactly what a replay of the log up to there builds. The store records that point
(:class:`CheckpointMark`: the head segment, the offset after its last entry, every
segment's space accounting — live bodies and bytes, the releases of the broker's run,
which a replay would repeat) and :func:`write_checkpoint` writes ``journal/checkpoint``:
a magic, a CRC-32 of the rest and a msgpack map of the mark and the entry (kind, meta),
to a temporary name, synced, renamed and the directory synced: a crash leaves the old
file or the new one. Two moments take one: a clean shutdown (``JournalStore.close``,
nothing follows it) and, while the broker runs, every ``checkpoint_interval`` (the log
goes on after it).

:func:`take_checkpoint_file`, at the next recovery, reads the file and **deletes it at
once** (and syncs the directory), so a checkpoint is used by one start only. It is
used when every check holds — the CRC; the segments it lists are the journal's, but
for the oldest, which may have been deleted since (dead); a sealed one is exactly as
long as it records and the head at least as long — else recovery replays the whole log
and logs why. :func:`checkpoint_entries` hands back its entry, then every entry after
the mark: the recovery resumes each segment where the checkpoint's log ended
(``journal_recovery.py``, as a warm standby's takeover does), checking the CRC of all it
reads. Nothing is lost either way: the log is the truth, the checkpoint a shortcut.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgpack

from txbroker.storage.interface import StoredEntry
from txbroker.storage.journal_format import SEGMENT_HEADER, check_segment_header, segment_name
from txbroker.storage.journal_recovery import (
    RecoveredSegment,
    Recovery,
    RecoveryCounts,
    ResumedSegment,
)
from txbroker.storage.journal_space import SegmentInfo
from txbroker.storage.synced_files import sync_directory, write_synced

log = logging.getLogger("txbroker.journal")

#: The file's name in the journal directory (never a segment's name).
CHECKPOINT_FILE: Final = "checkpoint"
_MAGIC: Final = b"TXBCKPT1"
_INFO_FIELDS: Final = 7


@dataclass(frozen=True, slots=True)
class CheckpointMark:
    """Where the log ended when a checkpoint's state was taken, and every segment's
    accounting then (live bodies: the releases of the run that took it)."""

    head: int  #: the head segment
    offset: int  #: where the head's next entry went
    segments: dict[int, SegmentInfo]  #: every segment's accounting, oldest first

    def resumed(self) -> dict[int, ResumedSegment]:
        """The segments as a recovery resumes them: read up to where the log ended
        (what follows is replayed), their dead bodies released already."""
        return {segment_id: ResumedSegment(info.size, info.bodies, info.live_bytes,
                                           info.overhead, released=info.bodies - info.live_bodies)
                for segment_id, info in self.segments.items()}


@dataclass(frozen=True, slots=True)
class FoundCheckpoint:
    """A checkpoint file that passed every check."""

    mark: CheckpointMark
    kind: int
    meta: bytes
    size: int  #: bytes of the file


def checkpoint_entries(found: FoundCheckpoint, recovery: Recovery, segment_ids: list[int],
                       counts: RecoveryCounts
                       ) -> Generator[StoredEntry, None, list[RecoveredSegment]]:
    """Recovery from a checkpoint: its one entry instead of the log it covers, then
    every entry appended after it (``recovery`` resumes each segment where the
    checkpoint's log ended); counted in ``counts``."""
    yield StoredEntry(found.kind, found.meta, ())
    recovered = yield from recovery.entries(segment_ids, counts)
    counts.entries += 1
    counts.bytes += found.size
    counts.from_checkpoint = True
    return recovered


def write_checkpoint(journal_dir: Path, mark: CheckpointMark, kind: int, meta: bytes) -> bool:
    """Write the checkpoint file (temporary name, sync, rename, directory sync), replacing
    any older one; logged either way. The caller made sure the log up to ``mark`` is
    written and synced, and that the state is the one at ``mark``."""
    body = msgpack.packb({
        "head": mark.head, "offset": mark.offset, "kind": kind, "meta": meta,
        "segments": [[segment_id, info.size, info.live_bodies, info.live_bytes, info.bodies,
                      info.overhead, info.lead]
                     for segment_id, info in sorted(mark.segments.items())],
    }, use_bin_type=True)
    data = _MAGIC + zlib.crc32(body).to_bytes(4, "big") + body
    temporary = journal_dir / (CHECKPOINT_FILE + ".tmp")
    try:
        write_synced(temporary, data)
        os.replace(temporary, journal_dir / CHECKPOINT_FILE)
        sync_directory(journal_dir)
    except OSError as exc:
        log.warning("journal: no checkpoint written: %s", exc)
        return False
    log.info("journal: wrote a checkpoint (%d bytes, the log up to segment %d offset %d)",
             len(data), mark.head, mark.offset)
    return True


def take_checkpoint_file(journal_dir: Path, segment_ids: list[int], *, why_not: str = ""
                         ) -> FoundCheckpoint | None:
    """Read and delete the checkpoint file, if there is one; it if the store may use it
    (``why_not`` empty) and every check holds (see the module docstring), else None
    (and the reason logged)."""
    path = journal_dir / CHECKPOINT_FILE
    (journal_dir / (CHECKPOINT_FILE + ".tmp")).unlink(missing_ok=True)  # (a torn write)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    path.unlink()
    sync_directory(journal_dir)
    if why_not:
        log.info("journal: the checkpoint of the last clean shutdown is not used (%s): "
                 "replaying the log", why_not)
        return None
    try:
        return _check(journal_dir, data, segment_ids)
    except _Unusable as unusable:
        log.warning("journal: the checkpoint of the last clean shutdown is not used (%s): "
                    "replaying the log", unusable)
        return None


class _Unusable(Exception):
    """A checkpoint that does not describe the log as it is."""


def _check(journal_dir: Path, data: bytes, segment_ids: list[int]) -> FoundCheckpoint:
    if len(data) < len(_MAGIC) + 4 or not data.startswith(_MAGIC):
        raise _Unusable("not a checkpoint file")
    body = data[len(_MAGIC) + 4:]
    if zlib.crc32(body) != int.from_bytes(data[len(_MAGIC):len(_MAGIC) + 4], "big"):
        raise _Unusable("its CRC does not match")
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise _Unusable(f"undecodable: {exc}") from exc
    head, offset, kind, meta, infos = _fields(value)
    segments: dict[int, SegmentInfo] = {}
    for info in infos:
        if type(info) is not list or len(info) != _INFO_FIELDS \
                or not all(type(number) is int and number >= 0 for number in info):
            raise _Unusable("a segment's accounting is malformed")
        segment_id, size, live_bodies, live_bytes, bodies, overhead, lead = info
        segments[segment_id] = SegmentInfo(size, live_bodies, live_bytes, bodies, overhead, lead)
    listed = sorted(segments)
    if not listed or head != listed[-1] or segments[head].size != offset:
        raise _Unusable("its head is not the last segment it lists")
    present = [segment_id for segment_id in segment_ids if segment_id <= head]
    if present != listed[len(listed) - len(present):]:  # (only the oldest may have gone)
        raise _Unusable(f"it lists segments {listed[:8]}…, the journal holds "
                        f"{segment_ids[:8]}…")
    for segment_id in present:
        _check_segment(journal_dir, segment_id, segments[segment_id].size, segment_id == head)
    return FoundCheckpoint(CheckpointMark(head, offset, segments), kind, meta, len(data))


def _fields(value: Any) -> tuple[int, int, int, bytes, list[Any]]:
    if type(value) is not dict:
        raise _Unusable("not a map")
    head, offset, kind, meta, infos = (value.get(key) for key in
                                       ("head", "offset", "kind", "meta", "segments"))
    if type(head) is not int or type(offset) is not int or type(kind) is not int \
            or type(meta) is not bytes or type(infos) is not list or offset < SEGMENT_HEADER.size:
        raise _Unusable("a field is missing or of the wrong type")
    return head, offset, kind, meta, infos


def _check_segment(journal_dir: Path, segment_id: int, size: int, head: bool) -> None:
    """A segment the checkpoint covers is as it was: a sealed one exactly as long, the
    head at least as long (what follows is replayed), with a sound header."""
    try:
        fd = os.open(journal_dir / segment_name(segment_id), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise _Unusable(f"segment {segment_id} cannot be opened: {exc}") from exc
    try:
        actual = os.fstat(fd).st_size
        header = os.pread(fd, SEGMENT_HEADER.size, 0)
    finally:
        os.close(fd)
    if actual < size or (actual != size and not head):
        raise _Unusable(f"segment {segment_id} holds {actual} bytes, it records {size}")
    problem = check_segment_header(header, segment_id)
    if problem is not None:
        raise _Unusable(f"segment {segment_id}'s header: {problem}")


__all__ = ["CHECKPOINT_FILE", "CheckpointMark", "FoundCheckpoint", "checkpoint_entries",
           "take_checkpoint_file", "write_checkpoint"]
