"""The writer threads' histograms (``/metrics``: batch time and size)."""

from __future__ import annotations

from pathlib import Path

from txbroker.storage.interface import Histogram
from txbroker.storage.journal import JournalStore


def test_buckets_are_cumulative_and_inclusive() -> None:
    histogram = Histogram((1.0, 2.0, 4.0))
    for value in (0.5, 1.0, 1.5, 4.0, 9.0):
        histogram.observe(value)
    assert histogram.cumulative() == [(1.0, 2), (2.0, 3), (4.0, 4), (float("inf"), 5)]
    assert (histogram.count, histogram.total) == (5, 16.0)


def test_a_store_counts_its_batches(tmp_path: Path) -> None:
    store = JournalStore(tmp_path / "j")
    try:
        list(store.recover())
        for n in range(3):
            store.append(4, b"\x90", [b"body%d" % n], lambda error: None)
        store.flush()
        stats = store.stats()
        assert stats.batch_seconds is not None and stats.batch_entries is not None
        assert stats.batch_seconds.count == stats.batch_entries.count >= 1
        assert stats.batch_entries.total >= 3  # every append went through a batch
    finally:
        store.close()
