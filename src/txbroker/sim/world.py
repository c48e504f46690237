"""The simulated world: a virtual clock, one random source, an event heap, a trace.

Theory of operation
-------------------
Everything a simulation does is an event on one heap, ordered by (virtual time in
ms, sequence number): the sequence number breaks ties in the order events were
scheduled, so a run depends on nothing but its seed. The one ``random.Random`` of
the world is the only source of chance; scenarios, the network and the disks draw
from it in event order. Each event that matters appends a line to the trace, and
``trace_hash`` (SHA-256 of the lines) names a run: the same seed on the same
commit gives the same hash (FoundationDB's simulation and TigerBeetle's VOPR work
the same way; this is our own, much smaller, code).
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

#: The virtual clock's start (ms): far from 0, so that no deadline computed from it
#: is mistaken for "no deadline" (the core uses 0 for that).
EPOCH_MS: Final = 1_000_000


@dataclass(order=True)
class _Event:
    at: int
    seq: int
    action: Callable[[], None] = field(compare=False)


class World:
    """A virtual clock (ms), one RNG seeded with ``seed``, an event heap and a trace."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = EPOCH_MS
        self.trace: list[str] = []
        self._heap: list[_Event] = []
        self._seq = 0

    def schedule(self, delay_ms: int, action: Callable[[], None]) -> None:
        """Run ``action`` ``delay_ms`` from now (0: after the events already due now)."""
        self._seq += 1
        heapq.heappush(self._heap, _Event(self.now + max(0, delay_ms), self._seq, action))

    def at(self, when_ms: int, action: Callable[[], None]) -> None:
        """Run ``action`` at virtual time ``when_ms`` (now, if that is past)."""
        self.schedule(when_ms - self.now, action)

    def log(self, line: str) -> None:
        """Append one line to the trace, stamped with the virtual time."""
        self.trace.append(f"{self.now} {line}")

    def step(self) -> bool:
        """Run the next event; False when the heap is empty."""
        if not self._heap:
            return False
        event = heapq.heappop(self._heap)
        self.now = max(self.now, event.at)
        event.action()
        return True

    def run_until(self, until_ms: int) -> None:
        """Run events due up to ``until_ms``; the clock then stands at ``until_ms``."""
        while self._heap and self._heap[0].at <= until_ms:
            self.step()
        self.now = max(self.now, until_ms)

    def pending(self) -> int:
        """How many events are scheduled."""
        return len(self._heap)

    def chance(self, probability: float) -> bool:
        """True with ``probability``."""
        return self.rng.random() < probability

    def delay(self, low_ms: int, high_ms: int) -> int:
        """A delay drawn uniformly from ``low_ms..high_ms``."""
        return self.rng.randint(low_ms, high_ms)

    @property
    def trace_hash(self) -> str:
        """SHA-256 of the trace (hex): the run's fingerprint."""
        digest = hashlib.sha256()
        for line in self.trace:
            digest.update(line.encode())
            digest.update(b"\n")
        return digest.hexdigest()
