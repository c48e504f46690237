"""The files a replicated node keeps in its data directory beside its store: the marker
of a copy that is not whole (``REPLICA_INCOMPLETE``) and the standing it last knew
(``REPLICA_STATE``), each written and synced at once (``replica.py`` says when)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Final

from txbroker.core.ha.promotion import ReadyRecord
from txbroker.server.ha.promises import PROMISE_FILE, write_json_synced

__all__ = ["INCOMPLETE", "STATE_FILE", "forget_standing", "incomplete", "read_record",
           "read_standing", "unmark", "wipe", "write_record", "write_standing"]

#: The marker of a data directory whose copy of the primary is not whole.
INCOMPLETE: Final = "REPLICA_INCOMPLETE"
#: What the backup last knew of its standing: ``{"ready": bool, "primary": name,
#: "record": {...}}``, synced whenever it changes, so that a whole-group restart still
#: knows whether this copy had every acknowledged entry; ``record`` is the newest
#: ready-set record it holds (``core/ha/promotion.py``; a primary's directory holds
#: only its own record).
STATE_FILE: Final = "REPLICA_STATE"


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


def unmark(data: Path) -> None:
    """The copy in ``data`` is whole: remove the marker (synced)."""
    (data / INCOMPLETE).unlink(missing_ok=True)
    _sync_dir(data)
