"""The ``txbroker-journal`` batch data source: a broker's journal as a table.

Theory of operation
-------------------
``spark.read.format("txbroker-journal").option("path", DATA).load()`` gives
one row per journal record (see ``core/records/__init__.py``), in no particular
order: sort by ``position`` (``segment_id << 40 | offset``) for log order.

The driver lists the segment files once (:func:`journal_segments`) and makes
one input partition per ``segmentsPerPartition`` consecutive segments
(default 1). Each task reads its segments with
:func:`~txbroker.storage.journal_reader.read_segment`: read-only, no lock,
CRC-checked, so a live broker's directory is fine (its newest segment is read
up to the last complete record); damage elsewhere fails the task with a
:class:`~txbroker.errors.CorruptStore` naming the file and offset. Rows leave
the worker as Arrow record batches of up to ``batchSize`` rows (default
:data:`DEFAULT_BATCH_ROWS`).

No pyspark import at module level but the base classes: the Python workers
unpickle the reader and import this module.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from txbroker.storage.journal_format import segment_name
from txbroker.storage.journal_reader import (
    COLUMNS,
    decode_record,
    journal_dir_of,
    journal_segments,
    read_segment,
)

#: pyarrow ships no type information: used as ``Any``.
pa: Any = importlib.import_module("pyarrow")

#: The format name to use with ``spark.read.format``.
FORMAT_NAME: Final = "txbroker-journal"
#: Rows per Arrow record batch: big enough to amortise the JVM hop, small
#: enough to keep a worker's memory flat (a segment is 64 MiB by default).
DEFAULT_BATCH_ROWS: Final = 4096

_LONG, _INT, _TEXT = pa.int64(), pa.int32(), pa.string()
_MESSAGE: Final = pa.struct([
    ("id", _LONG), ("queue", _TEXT), ("message_id", _TEXT),
    ("headers", pa.map_(_TEXT, _TEXT)), ("priority", _INT), ("timestamp_ms", _LONG),
    ("expires_ms", _LONG), ("deliver_at_ms", _LONG), ("delivery_count", _INT),
    ("seq", _LONG), ("size", _LONG),
])
_SEQ: Final = pa.struct([("id", _LONG), ("seq", _LONG)])
#: The Arrow schema of the rows (the Spark schema is derived from it).
ARROW_SCHEMA: Final = pa.schema([
    ("position", _LONG), ("segment_id", _LONG), ("offset", _LONG), ("length", _LONG),
    ("kind", _INT), ("kind_name", _TEXT), ("time_ms", _LONG), ("created_ms", _LONG),
    ("messages", pa.list_(_MESSAGE)), ("ids", pa.list_(_LONG)),
    ("consumed", pa.list_(pa.struct([("id", _LONG), ("delivery_count", _INT)]))),
    ("discards", pa.list_(_LONG)), ("seqs", pa.list_(_SEQ)), ("reason", _TEXT),
    ("queue", _TEXT), ("queue_kind", _TEXT), ("topic", _TEXT), ("xid", _TEXT),
    ("outcome", _TEXT), ("delivery_count", _INT), ("deliver_at_ms", _LONG),
    ("next_id", _LONG),
    ("branches", pa.list_(pa.struct([("xid", _TEXT), ("state", _TEXT),
                                     ("created_ms", _LONG)]))),
    ("sink_id", _TEXT), ("batch_id", _LONG),
    ("sink_branches", pa.list_(pa.struct([("xid", _TEXT), ("seqs", pa.list_(_SEQ)),
                                          ("discards", pa.list_(_LONG))]))),
    ("rolled_back", pa.list_(_TEXT)), ("meta_json", _TEXT),
])
assert tuple(ARROW_SCHEMA.names) == COLUMNS, "the reader's columns and the schema disagree"

#: The same schema as Spark DDL.
SCHEMA_DDL: Final = """
position BIGINT, segment_id BIGINT, offset BIGINT, length BIGINT, kind INT,
kind_name STRING, time_ms BIGINT, created_ms BIGINT,
messages ARRAY<STRUCT<id: BIGINT, queue: STRING, message_id: STRING,
  headers: MAP<STRING, STRING>, priority: INT, timestamp_ms: BIGINT, expires_ms: BIGINT,
  deliver_at_ms: BIGINT, delivery_count: INT, seq: BIGINT, size: BIGINT>>,
ids ARRAY<BIGINT>, consumed ARRAY<STRUCT<id: BIGINT, delivery_count: INT>>,
discards ARRAY<BIGINT>, seqs ARRAY<STRUCT<id: BIGINT, seq: BIGINT>>, reason STRING,
queue STRING, queue_kind STRING, topic STRING, xid STRING, outcome STRING,
delivery_count INT, deliver_at_ms BIGINT, next_id BIGINT,
branches ARRAY<STRUCT<xid: STRING, state: STRING, created_ms: BIGINT>>,
sink_id STRING, batch_id BIGINT,
sink_branches ARRAY<STRUCT<xid: STRING, seqs: ARRAY<STRUCT<id: BIGINT, seq: BIGINT>>,
  discards: ARRAY<BIGINT>>>,
rolled_back ARRAY<STRING>, meta_json STRING
"""


@dataclass(frozen=True)
class SegmentPartition(InputPartition):
    """Consecutive segments read by one task; ``last`` is the newest segment id."""

    journal_dir: str
    segment_ids: tuple[int, ...]
    last: int


def _int_option(options: dict[str, str], key: str, default: int) -> int:
    raw = options.get(key.lower())
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"option '{key}' must be a positive integer, not {raw!r}") from None
    if value < 1:
        raise ValueError(f"option '{key}' must be a positive integer, not {raw!r}")
    return value


def record_batches(partition: SegmentPartition, batch_rows: int) -> Iterator[Any]:
    """The rows of ``partition``'s segments as Arrow record batches."""
    journal_dir = Path(partition.journal_dir)
    rows: list[dict[str, Any]] = []
    for segment_id in partition.segment_ids:
        path = str(journal_dir / segment_name(segment_id))
        for entry in read_segment(journal_dir, segment_id, last=segment_id >= partition.last):
            rows.append(decode_record(entry, path))
            if len(rows) >= batch_rows:
                yield pa.RecordBatch.from_pylist(rows, schema=ARROW_SCHEMA)
                rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=ARROW_SCHEMA)


class JournalReader(DataSourceReader):
    """Plans one partition per group of segments; each task decodes its segments."""

    def __init__(self, data_dir: Path, segments_per_partition: int, batch_rows: int) -> None:
        self.data_dir = data_dir
        self.segments_per_partition = segments_per_partition
        self.batch_rows = batch_rows

    def partitions(self) -> list[SegmentPartition]:
        """Segment groups, oldest first (listed once, on the driver)."""
        ids = journal_segments(self.data_dir)
        journal_dir = str(journal_dir_of(self.data_dir))
        step = self.segments_per_partition
        return [SegmentPartition(journal_dir, tuple(ids[i:i + step]), ids[-1])
                for i in range(0, len(ids), step)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """Arrow batches (``pyarrow.RecordBatch``) of the partition's records."""
        assert isinstance(partition, SegmentPartition), partition
        return record_batches(partition, self.batch_rows)


class JournalDataSource(DataSource):
    """``txbroker-journal``: options ``path`` (the broker data dir, required),
    ``segmentsPerPartition`` (1) and ``batchSize`` (rows per Arrow batch)."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return FORMAT_NAME

    def schema(self) -> str:
        """One row per journal record (see the module doc)."""
        return SCHEMA_DDL

    def reader(self, schema: Any) -> JournalReader:
        """Check the options and the directory on the driver, before any task starts."""
        options = dict(self.options)
        raw_path = (options.get("path") or "").strip()
        if not raw_path:
            raise ValueError("option 'path' is required: the broker's data directory")
        data_dir = Path(raw_path)
        journal_segments(data_dir)  # NoJournal / gap: fail before planning
        return JournalReader(
            data_dir,
            _int_option(options, "segmentsPerPartition", 1),
            _int_option(options, "batchSize", DEFAULT_BATCH_ROWS),
        )


def register_journal_source(spark: Any) -> None:
    """Register ``txbroker-journal`` with ``spark`` (needed in every new session)."""
    spark.dataSource.register(JournalDataSource)


#: The hook ``txbroker.spark.register`` calls for this module.
register = register_journal_source
