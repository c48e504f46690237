"""A read task's pages: one Arrow batch per ``stream_read`` page, in seq order.

``read_range`` is what a Spark worker runs for one input partition; these call
it directly against a real broker (no Spark session): the Arrow batches it
yields, the pages behind them, what a consuming read releases and when, and
that a task stopped early or failing ends cleanly.
"""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

import txbroker
import txbroker.spark.source as source
from tests.support import BrokerProcess
from txbroker.spark._common import ReadOptions, SparkConnectorError
from txbroker.spark.source import SeqRange, read_range

pytestmark = pytest.mark.timeout(120)

SCHEMA = StructType([StructField("seq", LongType()), StructField("body", BinaryType()),
                     StructField("queue", StringType())])


def options(url: str, **extra: str) -> ReadOptions:
    return ReadOptions.parse({"url": url, "queues": "q", "name": "reader", **extra})


def fill(url: str, queue: str, count: int) -> None:
    with txbroker.connect(url) as conn:
        conn.declare_queue(queue)
        conn.send_batch(queue, [b"m-%d" % i for i in range(count)])


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of three messages, so a range of a few messages spans several pages."""
    monkeypatch.setattr(source, "READ_PAGE_MESSAGES", 3)


def test_pages_in_seq_order_one_batch_each(broker: BrokerProcess, small_pages: None) -> None:
    fill(broker.url, "q", 12)  # seqs 1..12
    batches = list(read_range(options(broker.url), SCHEMA, SeqRange("q", 2, 10)))
    assert [b.num_rows for b in batches] == [3, 3, 2]
    rows = [row for b in batches for row in b.to_pylist()]
    assert rows == [{"seq": s, "body": b"m-%d" % (s - 1), "queue": "q"} for s in range(2, 10)]
    with txbroker.connect(broker.url) as conn:  # a plain read releases nothing
        info = conn.stream_info("q")
        assert (info.first, info.next) == (1, 13)


def test_consuming_read_releases_after_the_last_page(broker: BrokerProcess,
                                                     small_pages: None) -> None:
    fill(broker.url, "q", 7)
    part = SeqRange("q", 1, 8, consume=True)
    reader = read_range(options(broker.url, consume="true"), SCHEMA, part)
    first = next(reader)
    assert first.column(0).to_pylist() == [1, 2, 3]
    with txbroker.connect(broker.url) as conn:  # nothing released mid-range
        assert conn.stream_info("q").first == 1
    rest = list(reader)
    assert [row["seq"] for b in rest for row in b.to_pylist()] == [4, 5, 6, 7]
    with txbroker.connect(broker.url) as conn:
        info = conn.stream_info("q")
        assert (info.first, info.next) == (8, 8)


def test_a_task_stopped_early_stops_fetching(broker: BrokerProcess, small_pages: None) -> None:
    fill(broker.url, "q", 30)
    reader = read_range(options(broker.url), SCHEMA, SeqRange("q", 1, 31))
    assert next(reader).column(0).to_pylist() == [1, 2, 3]
    reader.close()  # Spark stops consuming (a limit, a cancelled task)
    with txbroker.connect(broker.url) as conn:  # nothing released, the queue readable
        info = conn.stream_info("q")
        assert (info.first, info.next) == (1, 31)
        assert len(conn.stream_read("q", 1, 31, max_messages=100)) == 30


def test_an_error_while_fetching_reaches_the_task(broker: BrokerProcess) -> None:
    reader: Any = read_range(options(broker.url), SCHEMA, SeqRange("nope", 1, 5))
    with pytest.raises(SparkConnectorError, match="option 'queues': queue 'nope' does not exist"):
        next(reader)
