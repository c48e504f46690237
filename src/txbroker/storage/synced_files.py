"""Writing a whole file durably, and syncing a directory: the journal's side files (a
sealed segment's recovery index, a clean shutdown's checkpoint) are written to a
temporary name with these, then renamed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_synced(path: Path, data: bytes, sync_file: Callable[[int], None] = os.fsync,
                 mode: int = 0o644) -> None:
    """Create (or truncate) ``path``, write all of ``data`` and sync it (``sync_file``:
    the writer's own, which tests replace to inject faults)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        sync_file(fd)
    finally:
        os.close(fd)


def sync_directory(directory: Path) -> None:
    """fsync a directory (a file created, renamed or deleted in it is then durable)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["sync_directory", "write_synced"]
