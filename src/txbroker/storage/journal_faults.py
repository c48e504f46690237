"""Named crash points of the journal's compaction, for process tests.

Theory of operation
-------------------
House rule: crash points are steps that tests can break on purpose (like the
TM's ``hook(step)`` in ``tm/manager.py``). A kill -9 test of compaction must
stop a real ``txbroker serve`` exactly between two of its steps, so the
journal reads one crash point from the environment variable
:data:`FAULT_ENV` when it opens, ``POINT`` or ``POINT@N`` (the N-th time the
point is passed, default the first), and at that moment sends itself
``SIGKILL``: no ``finally`` runs, no buffer is flushed, as with ``kill -9``.
Unset (always, outside tests) every point is a no-op.

The points, in the order a relocation passes them:

========================  ===============================================================
``relocation_offered``    ``maintain`` is about to hand a segment to the broker for
                          relocation (nothing copied yet)
``synced:KIND``           a batch holding an entry of record kind ``KIND`` is written
                          and synced, its completions not yet dispatched (kind 17,
                          ``RELOCATE_MANY``: the copies are durable, the old refs not
                          yet released)
``before_unlink``         the writer is about to unlink a dead segment (everything
                          queued before the delete is synced)
``after_unlink``          a dead segment is unlinked, the directory not yet synced
========================  ===============================================================
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Final

#: The environment variable naming the crash point (``POINT`` or ``POINT@N``).
FAULT_ENV: Final = "TXBROKER_JOURNAL_FAULT"
#: The points a test may name (``synced:`` takes a record kind after the colon).
POINTS: Final = ("relocation_offered", "synced", "before_unlink", "after_unlink")


class CrashPoints:
    """The crash point armed for this process (if any), and a counter of its passes."""

    def __init__(self, spec: str = "") -> None:
        name, _, count = spec.partition("@")
        base, _, argument = name.partition(":")
        if spec and base not in POINTS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: unknown crash point (known: {POINTS})")
        #: the armed point ("" = none), e.g. ``before_unlink`` or ``synced:17``
        self.point = name
        #: the record kind of a ``synced:KIND`` point (-1: another point)
        self.kind = int(argument) if base == "synced" and argument else -1
        self._left = int(count) if count else 1
        self._lock = threading.Lock()  # passed on the broker's and the writer's threads

    @classmethod
    def from_env(cls) -> CrashPoints:
        """The point named by :data:`FAULT_ENV` (none when unset)."""
        return cls(os.environ.get(FAULT_ENV, ""))

    @property
    def armed(self) -> bool:
        """Is any point armed (cheap check on hot paths)?"""
        return bool(self.point)

    def passed(self, point: str) -> None:
        """Pass ``point``: if it is the armed one for the N-th time, SIGKILL this process."""
        if point != self.point:
            return
        with self._lock:
            self._left -= 1
            fire = self._left == 0
        if fire:
            os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["FAULT_ENV", "POINTS", "CrashPoints"]
