"""The journal's recovery checkpoint file: the broker's state at the end of the log,
written at a clean shutdown and handed back by the next recovery instead of that log
(issue 29; what the state holds: ``core/checkpoint.py``).

Theory of operation
-------------------
:meth:`JournalStore.close <txbroker.storage.journal.JournalStore.close>` given a
checkpoint writes ``journal/checkpoint`` once the writer has written and synced
everything: a magic, a CRC-32 of the rest and a msgpack map of where the log ends
(the head segment and the offset after its last entry), every segment's space
accounting (live bodies and bytes: the releases of the broker's run, which a replay
would repeat) and the entry (kind, meta). It is written to a temporary name, synced,
renamed and the directory synced: a crash leaves the old state or the new one.

:func:`take_checkpoint_file`, at the next recovery, reads the file and **deletes it
at once** (and syncs the directory) — before the log can be appended to, so a
checkpoint never describes a log that has grown since. It is used only when every
check holds — the CRC, the segment files are exactly the ones it lists, the head is
no longer than where it says the log ends and nothing valid follows there (an older
version that ignored the file and appended would show there) — else recovery
replays the log and logs why. Nothing is lost either way: the log is the truth, the
checkpoint only a shortcut.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgpack

from txbroker.storage.journal_format import (
    ENTRY_HEADER,
    ENTRY_MAGIC,
    PAD_MAGIC,
    SEGMENT_HEADER,
    check_segment_header,
    segment_name,
)
from txbroker.storage.journal_recovery import RecoveredSegment, list_segments
from txbroker.storage.journal_space import SegmentInfo
from txbroker.storage.synced_files import sync_directory, write_synced

log = logging.getLogger("txbroker.journal")

#: The file's name in the journal directory (never a segment's name).
CHECKPOINT_FILE: Final = "checkpoint"
_MAGIC: Final = b"TXBCKPT1"
_INFO_FIELDS: Final = 7


@dataclass(frozen=True, slots=True)
class FoundCheckpoint:
    """A checkpoint file that passed every check."""

    head: int  #: the head segment
    offset: int  #: where the head's next entry goes
    segments: dict[int, SegmentInfo]  #: every segment's accounting, oldest first
    kind: int
    meta: bytes
    size: int  #: bytes of the file

    def recovered(self) -> list[RecoveredSegment]:
        """The segments as a recovery that read them would leave them (every one read
        already: ``resumed``; the bodies the last run released: ``dead``)."""
        return [RecoveredSegment(segment_id, info.size, info.bodies, info.live_bytes,
                                 overhead=info.overhead, lead=info.lead, resumed=info.size,
                                 dead=info.bodies - info.live_bodies)
                for segment_id, info in self.segments.items()]


def write_checkpoint(journal_dir: Path, head: int, offset: int,
                     segments: dict[int, SegmentInfo], kind: int, meta: bytes, *,
                     current: bool) -> None:
    """Write the checkpoint file (temporary name, sync, rename, directory sync) when it is
    ``current`` (nothing appended since it was taken, the store works) and the segment
    files are exactly ``segments``; logged either way. The caller made sure the writer
    has written and synced everything."""
    if not current or list_segments(journal_dir) != sorted(segments):
        log.warning("journal: no checkpoint written (the log moved on, or failed)")
        return
    body = msgpack.packb({
        "head": head, "offset": offset, "kind": kind, "meta": meta,
        "segments": [[segment_id, info.size, info.live_bodies, info.live_bytes, info.bodies,
                      info.overhead, info.lead] for segment_id, info in sorted(segments.items())],
    }, use_bin_type=True)
    data = _MAGIC + zlib.crc32(body).to_bytes(4, "big") + body
    temporary = journal_dir / (CHECKPOINT_FILE + ".tmp")
    try:
        write_synced(temporary, data)
        os.replace(temporary, journal_dir / CHECKPOINT_FILE)
        sync_directory(journal_dir)
    except OSError as exc:
        log.warning("journal: no checkpoint written: %s", exc)
        return
    log.info("journal: wrote the checkpoint of a clean shutdown (%d bytes)", len(data))


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
    if sorted(segments) != segment_ids:
        raise _Unusable(f"it lists segments {sorted(segments)[:8]}…, the journal holds "
                        f"{segment_ids[:8]}…")
    if not segment_ids or head != segment_ids[-1] or segments[head].size != offset:
        raise _Unusable("its head is not the journal's")
    _check_head(journal_dir, head, offset)
    return FoundCheckpoint(head, offset, segments, kind, meta, len(data))


def _fields(value: Any) -> tuple[int, int, int, bytes, list[Any]]:
    if type(value) is not dict:
        raise _Unusable("not a map")
    head, offset, kind, meta, infos = (value.get(key) for key in
                                       ("head", "offset", "kind", "meta", "segments"))
    if type(head) is not int or type(offset) is not int or type(kind) is not int \
            or type(meta) is not bytes or type(infos) is not list or offset < SEGMENT_HEADER.size:
        raise _Unusable("a field is missing or of the wrong type")
    return head, offset, kind, meta, infos


def _check_head(journal_dir: Path, head: int, offset: int) -> None:
    """The head segment ends where the checkpoint says: no entry starts there."""
    try:
        fd = os.open(journal_dir / segment_name(head), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise _Unusable(f"its head segment cannot be opened: {exc}") from exc
    try:
        header = os.pread(fd, SEGMENT_HEADER.size, 0)
        after = os.pread(fd, ENTRY_HEADER.size, offset)
    finally:
        os.close(fd)
    problem = check_segment_header(header, head)
    if problem is not None:
        raise _Unusable(f"its head segment's header: {problem}")
    if after.startswith(ENTRY_MAGIC) or after.startswith(PAD_MAGIC):
        raise _Unusable(f"an entry follows the end it records (segment {head}, "
                        f"offset {offset})")


__all__ = ["CHECKPOINT_FILE", "FoundCheckpoint", "take_checkpoint_file", "write_checkpoint"]
