"""The queues' message rates in the REST API (``server/edges/http/rates.py``), with a
clock the test moves: exact values."""

from __future__ import annotations

from typing import Any

from txbroker.server.edges.http.rates import RateMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def queue(name: str, enqueued: int, dequeued: int) -> dict[str, Any]:
    return {"name": name, "kind": "queue", "enqueued": enqueued, "dequeued": dequeued}


def test_rates_are_the_counters_change_per_second_over_the_window() -> None:
    clock = Clock()
    meter = RateMeter(clock)
    first = [queue("a", 0, 0), {"name": "t", "kind": "topic"}]
    meter.annotate(first, complete=True)
    assert first[0]["enqueue_rate"] is None and "enqueue_rate" not in first[1]
    clock.now += 0.5  # too soon for a rate
    soon = queue("a", 10, 0)
    meter.annotate([soon])
    assert soon["enqueue_rate"] is None
    clock.now += 1.5
    later = queue("a", 300, 100)
    meter.annotate([later])
    assert (later["enqueue_rate"], later["dequeue_rate"]) == (150.0, 50.0)  # over 2 s
    for _ in range(12):  # samples older than 10 s are dropped: the rate follows
        clock.now += 1.0
        steady = queue("a", later["enqueued"], later["dequeued"])
        meter.annotate([steady])
    assert (steady["enqueue_rate"], steady["dequeue_rate"]) == (0.0, 0.0)


def test_a_complete_list_forgets_deleted_queues() -> None:
    clock = Clock()
    meter = RateMeter(clock)
    meter.annotate([queue("a", 0, 0), queue("gone", 0, 0)], complete=True)
    clock.now += 2
    meter.annotate([queue("a", 4, 2)], complete=True)
    again = queue("gone", 50, 0)  # recreated: its history starts afresh
    meter.annotate([again])
    assert again["enqueue_rate"] is None
