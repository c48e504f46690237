"""The ``txbroker`` Spark data source: batch and streaming reads.

Theory of operation (see docs/spark.md for the whole story):

* Every committed message of a queue has a gap-free, increasing sequence
  number. An offset is ``{queue: next_seq}`` (keys in the order of option
  ``queues``); a micro-batch is, per queue, the range ``[start, end)``.
* The driver-side :class:`StreamReader` attaches as the queues' named stream
  reader (``stream_open``) the first time it needs the broker, and again on
  every ``latestOffset`` (re-opening with the same name is how a reader takes
  its queues back after a broker restart or a lost connection).
* ``partitions(start, end)`` cuts the ranges into :class:`SeqRange` pieces of
  at most ``partitionSize`` sequence numbers. ``read()`` runs in a worker on
  an unpickled copy of the reader: it opens its own connection and pages
  through ``stream_read``, which reads without consuming, so a replayed batch
  reads the same messages (those consumed by someone else are simply absent).
* ``commit(end)`` releases everything below ``end`` (``stream_commit``,
  idempotent). Spark calls it one batch late and never for the last batch;
  that is harmless because Spark's checkpoint, not the broker, decides where
  a restarted query resumes, and the broker keeps unreleased messages.
* A batch read is a snapshot: ``stream_info`` pins ``[first, next)`` of each
  queue on the driver. With ``consume=true`` each queue is read by one task,
  which attaches, reads its range and releases it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from txbroker.errors import BrokerError, ConnectionLost, NotFound
from txbroker.spark import faults
from txbroker.spark._common import (
    FORMAT_NAME,
    READ_PAGE_BYTES,
    READ_PAGE_MESSAGES,
    SOURCE_COLUMNS,
    ReadOptions,
    SparkConnectorError,
    WriteOptions,
    close_quietly,
    column_list,
    open_connection,
    queue_error,
    source_ddl,
)

if TYPE_CHECKING:
    from txbroker.client.sync import Connection

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SeqRange(InputPartition):
    """One input partition: sequence numbers ``[start, end)`` of ``queue``.

    ``consume``: attach, and release the range after reading it (a consuming
    batch read). ``streaming``: read as the stream reader of option ``name``
    (the broker lets only the queue's owner read it while it is attached).
    """

    queue: str
    start: int
    end: int
    consume: bool = False
    streaming: bool = False


def split_ranges(queue: str, start: int, end: int, size: int, *,
                 streaming: bool = False) -> list[SeqRange]:
    """``[start, end)`` cut into pieces of at most ``size`` sequence numbers."""
    return [SeqRange(queue, lo, min(lo + size, end), streaming=streaming)
            for lo in range(start, end, size)]


def share_rows(backlog: dict[str, int], budget: int) -> dict[str, int]:
    """Split a row budget over queues in proportion to their backlog.

    Every queue with a backlog gets its share rounded down; what rounding
    leaves over goes to the queues in order. The shares sum to
    ``min(budget, sum(backlog))``.
    """
    total = sum(backlog.values())
    if total <= budget:
        return dict(backlog)
    shares = {queue: waiting * budget // total for queue, waiting in backlog.items()}
    left = budget - sum(shares.values())
    for queue, waiting in backlog.items():
        if left <= 0:
            break
        extra = min(left, waiting - shares[queue])
        shares[queue] += extra
        left -= extra
    return shares


def read_range(options: ReadOptions, schema: StructType, part: SeqRange) -> Iterator[Any]:
    """Arrow record batches of the messages of one range (runs in a worker)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    from txbroker.spark.schema import BatchBuilder  # pyarrow: only the workers need it

    builder = BatchBuilder(to_arrow_schema(schema, timezone="UTC"), options.body_format)
    conn = open_connection(options.url)
    try:
        name = options.name if part.consume or part.streaming else None
        if part.consume:
            _attach(conn, part.queue, options.name)
        position = part.start
        while position < part.end:
            try:
                chunk = conn.stream_read(part.queue, position, part.end, name=name,
                                         max_messages=READ_PAGE_MESSAGES,
                                         max_bytes=READ_PAGE_BYTES)
            except NotFound as exc:
                raise queue_error("queues", part.queue, exc) from exc
            except ConnectionLost:
                if part.consume:  # the attachment went with the connection
                    raise
                # Reads are repeatable: continue from ``position`` on a new connection.
                close_quietly(conn)
                conn = open_connection(options.url)
                continue
            if chunk.seqs:
                yield builder.build(part.queue, chunk)
                faults.point("source.read", _batch_id())  # mid-batch, rows handed over
            if chunk.next <= position:
                raise SparkConnectorError(
                    f"queue {part.queue!r}: stream_read made no progress at seq {position}")
            position = chunk.next
        if part.consume:
            conn.stream_commit(part.queue, options.name, part.end)
            conn.stream_close(part.queue, options.name)
    finally:
        close_quietly(conn)


def _batch_id() -> int | None:
    """The micro-batch a read task belongs to (None outside a streaming query)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    value = None if context is None else context.getLocalProperty("streaming.sql.batchId")
    return None if value is None else int(value)


def _attach(conn: Connection, queue: str, name: str) -> Any:
    """``stream_open``, with an unknown queue reported against option ``queues``."""
    try:
        return conn.stream_open(queue, name)
    except NotFound as exc:
        raise queue_error("queues", queue, exc) from exc


class BatchReader(DataSourceReader):
    """``spark.read.format("txbroker")``: a snapshot of the queues."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        """Pin ``[first, next)`` of every queue now (on the driver)."""
        conn = open_connection(self.options.url)
        try:
            ranges: list[SeqRange] = []
            for queue in self.options.queues:
                try:
                    info = conn.stream_info(queue)
                except NotFound as exc:
                    raise queue_error("queues", queue, exc) from exc
                if info.next <= info.first:
                    continue
                if self.options.consume:  # one task per queue: it releases what it read
                    ranges.append(SeqRange(queue, info.first, info.next, consume=True))
                else:
                    ranges.extend(split_ranges(queue, info.first, info.next,
                                               self.options.partition_size))
            return ranges
        finally:
            close_quietly(conn)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """The messages of one range, as Arrow record batches."""
        if not isinstance(partition, SeqRange):  # Spark's stand-in when there are none
            return iter(())
        return read_range(self.options, self.schema, partition)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("txbroker")``: exactly-once micro-batches by offset."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self._conn: Connection | None = None
        self._pinned_end: dict[str, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_conn"] = None  # a connection never travels to a worker
        return state

    # -- the driver's connection ---------------------------------------------------

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = open_connection(self.options.url)
        return self._conn

    def _drop_connection(self) -> None:
        close_quietly(self._conn)
        self._conn = None

    def _with_broker(self, action: Callable[[Connection], T]) -> T:
        """Run ``action`` on the driver's connection; after a lost connection,
        connect again and retry once (``action`` re-attaches)."""
        try:
            return action(self._connection())
        except ConnectionLost:
            log.warning("txbroker stream reader %r: connection lost; reconnecting",
                        self.options.name)
            self._drop_connection()
            return action(self._connection())

    def _open_all(self) -> dict[str, tuple[int, int]]:
        """Attach to every queue (again); ``{queue: (first, next)}``."""

        def open_all(conn: Connection) -> dict[str, tuple[int, int]]:
            result = {}
            for queue in self.options.queues:
                info = _attach(conn, queue, self.options.name)
                result[queue] = (info.first, info.next)
            return result

        return self._with_broker(open_all)

    # -- DataSourceStreamReader ----------------------------------------------------

    def initialOffset(self) -> dict[str, int]:
        """Each queue's lowest present sequence number."""
        return {queue: first for queue, (first, _next) in self._open_all().items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        """``ReadMaxRows(maxRowsPerTrigger)`` when the option is set."""
        if self.options.max_rows_per_trigger is not None:
            return ReadMaxRows(self.options.max_rows_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Pin the end offsets: an ``availableNow`` query reads up to here and stops."""
        self._pinned_end = {queue: nxt for queue, (_first, nxt) in self._open_all().items()}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        """Each queue's ``next`` (or the pinned end), cut down to ``ReadMaxRows``."""
        infos = self._open_all()
        starts: dict[str, int] = {}
        backlog: dict[str, int] = {}
        for queue, (first, nxt) in infos.items():
            # A queue new to this query (the option changed) starts at its first
            # message; this batch reads nothing of it, so a replay stays identical.
            begin = int(start[queue]) if queue in start else first
            latest = nxt if self._pinned_end is None else self._pinned_end.get(queue, nxt)
            if queue not in start:
                latest = begin
            starts[queue] = begin
            backlog[queue] = max(0, latest - begin)
        if isinstance(limit, ReadMaxRows):
            backlog = share_rows(backlog, int(limit.max_rows))
        return {queue: starts[queue] + backlog[queue] for queue in self.options.queues}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        """The ranges between two offsets, cut to ``partitionSize``."""
        ranges: list[SeqRange] = []
        for queue, stop in end.items():
            begin = int(start.get(queue, stop))
            ranges.extend(split_ranges(queue, begin, int(stop), self.options.partition_size,
                                       streaming=True))
        return ranges

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """The messages of one range, as Arrow record batches (in a worker)."""
        if not isinstance(partition, SeqRange):
            return iter(())
        return read_range(self.options, self.schema, partition)

    def commit(self, end: dict[str, int]) -> None:
        """Release every message below ``end`` (idempotent; a failure is retried by
        the next commit, which releases at least as much)."""

        faults.point("source.commit")

        def release(conn: Connection) -> None:
            for queue, stop in end.items():
                if queue not in self.options.queues:
                    continue
                try:
                    conn.stream_commit(queue, self.options.name, int(stop))
                except BrokerError:  # not attached any more (broker restart): take it back
                    _attach(conn, queue, self.options.name)
                    conn.stream_commit(queue, self.options.name, int(stop))

        try:
            self._with_broker(release)
        except Exception as exc:
            log.warning("txbroker stream reader %r: releasing up to %s failed: %s",
                        self.options.name, end, exc)

    def stop(self) -> None:
        """Detach from the queues and close the driver's connection."""
        conn = self._conn
        if conn is None:
            return
        for queue in self.options.queues:
            try:
                conn.stream_close(queue, self.options.name)
            except Exception:  # best effort; closing the connection detaches anyway
                continue
        self._drop_connection()


class TxBrokerDataSource(DataSource):
    """The ``txbroker`` format: read queues, write a queue; batch and streaming.

    Options: ``url`` (always), ``queues``/``name``/``format``/``jsonSchema``/
    ``partitionSize``/``maxRowsPerTrigger``/``consume``/``columns`` for reads, ``queue``/
    ``sinkId`` for writes (docs/spark.md).
    """

    @classmethod
    def name(cls) -> str:
        """The format name, ``txbroker``."""
        return FORMAT_NAME

    def schema(self) -> str:
        """The message schema: option ``columns`` (all by default); the body's type
        follows option ``format``. A bad option is reported by the reader, naming it."""
        options = self.options
        body_format = (options.get("format") or "binary").strip().lower()
        if body_format not in ("binary", "text", "json"):
            body_format = "binary"
        json_schema = options.get("jsonschema")
        if body_format == "json" and not (json_schema or "").strip():
            body_format = "binary"
        try:
            columns = column_list(options)
        except SparkConnectorError:
            columns = tuple(SOURCE_COLUMNS)
        return source_ddl(body_format, json_schema, columns)

    def reader(self, schema: StructType) -> DataSourceReader:
        """A batch reader (a snapshot of option ``queues``)."""
        return BatchReader(ReadOptions.parse(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """An exactly-once stream reader of option ``queues``."""
        options = ReadOptions.parse(self.options)
        if options.consume:
            raise SparkConnectorError(
                "option 'consume' is for batch reads: a stream releases what Spark commits")
        return StreamReader(options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """A batch writer (``mode("append")``) to option ``queue``."""
        from txbroker.spark.sink import BatchWriter

        if overwrite:
            raise SparkConnectorError(
                "mode('overwrite') is not supported: rows are appended to the queue; "
                "use mode('append')")
        return BatchWriter(WriteOptions.parse(self.options, streaming=False), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """An exactly-once stream writer to option ``queue`` keyed by ``sinkId``."""
        from txbroker.spark.sink import StreamWriter

        if overwrite:
            raise SparkConnectorError(
                "outputMode('complete') is not supported: rows are appended to the queue")
        return StreamWriter(WriteOptions.parse(self.options, streaming=True), schema)
