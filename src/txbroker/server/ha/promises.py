"""A replicated node's promise, kept in its data directory (``core/ha/promotion.py``,
"Promises"; a group of three or more without etcd).

The file :data:`PROMISE_FILE` holds the newest term this node promised and to whom
(Raft's current term and vote). It is written and synced *before* the promise is
answered, raised whenever the node takes a record of a newer term, and kept when a
backup's copy is replaced (``replica_files.wipe``): a node that forgot its promise after a
crash could take the old primary's records again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final

from txbroker.core.ha.promotion import Promise, ReadyRecord

__all__ = ["PROMISE_FILE", "raise_promise", "read_promise", "withdraw_promise",
           "write_json_synced", "write_promise"]

#: ``{"term": int, "candidate": name}``
PROMISE_FILE: Final = "HA_PROMISE"


def read_promise(data: Path) -> Promise | None:
    """The newest promise this directory holds (None: none)."""
    try:
        return Promise.from_wire(json.loads((data / PROMISE_FILE).read_text()))
    except (OSError, ValueError):
        return None


def write_promise(data: Path, promise: Promise) -> None:
    """Keep ``promise`` (synced, with the directory) before it is answered."""
    write_json_synced(data, PROMISE_FILE, promise.to_wire())


def withdraw_promise(data: Path, previous: Promise | None) -> None:
    """A promotion that promised its term to itself was refused: put back the promise
    held before (``previous``; None: none). Safe — the node never acts as the primary
    of the term it withdraws — and needed: kept, it would make this node refuse the
    live primary's records, and fence that primary, for a term nobody holds."""
    if previous is None:
        (data / PROMISE_FILE).unlink(missing_ok=True)
        fd = os.open(data, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        write_promise(data, previous)


def raise_promise(data: Path, record: ReadyRecord) -> None:
    """A record of a newer term than the promise was taken: its term becomes the floor
    (kept across the copy's replacement, which the record itself is not)."""
    promise = read_promise(data)
    if promise is None or record.term > promise.term:
        write_promise(data, Promise(record.term, record.primary))


def write_json_synced(data: Path, name: str, value: object) -> None:
    """Replace ``data / name`` with ``value`` as JSON: a temporary file synced, renamed,
    and the directory synced."""
    path = data / name
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as handle:
        json.dump(value, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
