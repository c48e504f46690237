"""Per-queue message rates for the REST API: messages in and out per second.

The core counts each queue's ``enqueued`` and ``dequeued`` messages (every
queue info carries them); a rate is the change of such a counter over time,
which only the edge can measure (the core has no clock of its own). So the
HTTP edge keeps, per queue, a few recent samples of the two counters — taken
when a request reads the queue, at most one a second, none older than
:data:`WINDOW` seconds — and adds ``enqueue_rate`` and ``dequeue_rate`` to
the queue's info: the change since the oldest sample, per second; ``None``
until two samples lie at least a second apart (the first request after a
quiet spell). No request, no sampling: nothing runs in the background.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final

#: Seconds of history a rate covers at most.
WINDOW: Final = 10.0
#: The least time between two samples of a queue, seconds.
EVERY: Final = 1.0


class RateMeter:
    """Samples of each queue's counters; adds the rates to queue infos."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: dict[str, deque[tuple[float, int, int]]] = {}

    def annotate(self, infos: Iterable[dict[str, Any]], *, complete: bool = False) -> None:
        """Add ``enqueue_rate`` / ``dequeue_rate`` (msg/s, or None) to each queue info
        that has counters; ``complete``: ``infos`` is every queue (the samples of the
        others are dropped: deleted queues)."""
        now = self._clock()
        seen: set[str] = set()
        for info in infos:
            if "enqueued" not in info:
                continue
            name = info["name"]
            seen.add(name)
            samples = self._samples.get(name)
            if samples is None:
                samples = self._samples[name] = deque()
            while samples and now - samples[0][0] > WINDOW:
                samples.popleft()
            if not samples or now - samples[-1][0] >= EVERY:
                samples.append((now, info["enqueued"], info["dequeued"]))
            first_at, enqueued, dequeued = samples[0]
            elapsed = now - first_at
            if elapsed >= EVERY:
                info["enqueue_rate"] = round((info["enqueued"] - enqueued) / elapsed, 2)
                info["dequeue_rate"] = round((info["dequeued"] - dequeued) / elapsed, 2)
            else:
                info["enqueue_rate"] = info["dequeue_rate"] = None
        if complete:
            for name in [n for n in self._samples if n not in seen]:
                del self._samples[name]


__all__ = ["EVERY", "WINDOW", "RateMeter"]
