"""The bookkeeping of the kill -9 tests (native protocol and STOMP alike).

Clients record what they tried, what the broker confirmed and what they got;
:func:`verdict` compares that with what is left in the queues at the end.
"""

from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Ledger:
    """Message ids by fate, shared by the client threads of one test."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    attempted: set[str] = field(default_factory=set)  # sends tried (maybe stored)
    acknowledged: set[str] = field(default_factory=set)  # sends the broker confirmed
    received: dict[str, int] = field(default_factory=dict)  # id -> times delivered
    ack_confirmed: set[str] = field(default_factory=set)  # consumer acks confirmed
    came_back: set[str] = field(default_factory=set)  # delivered after a confirmed ack
    moved: set[str] = field(default_factory=set)  # committed moves txin -> txout

    def add(self, name: str, *ids: str) -> None:
        with self.lock:
            getattr(self, name).update(ids)

    def delivered(self, mid: str) -> None:
        with self.lock:
            self.received[mid] = self.received.get(mid, 0) + 1
            if mid in self.ack_confirmed:
                self.came_back.add(mid)


def verdict(ledger: Ledger, plain: list[str], txin: list[str], txout: list[str],
            **extra: Any) -> dict[str, Any]:
    """Counts of every kind of failure, given what was drained from the three queues."""
    everything = set(ledger.received) | set(plain) | set(txin) | set(txout)
    return {
        **extra,
        "acknowledged_sends": len(ledger.acknowledged),
        "consumer_acks_confirmed": len(ledger.ack_confirmed),
        "committed_moves": len(ledger.moved),
        "drained": len(plain) + len(txin) + len(txout),
        "lost": len({m for m in ledger.acknowledged if m not in everything}),
        "duplicated": sum(len(x) - len(set(x)) for x in (plain, txin, txout)),
        "unexpected": len(everything - ledger.attempted),
        "acked_came_back": len(ledger.came_back | (ledger.ack_confirmed & set(plain))),
        "partial_transactions": len(set(txin) & set(txout)),  # a move partly visible
        "committed_moves_missing": len(ledger.moved - set(txout)),
    }


def check(report: dict[str, Any]) -> None:
    """Nothing acknowledged lost, nothing duplicated or invented, nothing partial."""
    assert report["acknowledged_sends"] > 0
    assert report["consumer_acks_confirmed"] > 0
    for key in ("lost", "duplicated", "unexpected", "acked_came_back", "partial_transactions",
                "committed_moves_missing"):
        assert report[key] == 0, f"{key}: {report}"


def join_or_explain(thread: threading.Thread, timeout: float) -> None:
    """Join a client thread; if it hangs, fail with the stack it hangs in."""
    thread.join(timeout=timeout)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
        raise AssertionError(f"a client thread hung after the kill:\n{stack}")
