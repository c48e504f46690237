"""The ``txbroker`` Spark sink: exactly-once writes through prepared XA branches.

Theory of operation (docs/spark.md has the whole argument):

1. Each write task sends its rows inside one XA branch whose Xid is derived
   from (sink id, batch id, partition, attempt) by ``txbroker.xid.sink_xid``,
   and **prepares** it: the rows are durable in the broker but invisible.
   Any failure in the task rolls its branch back before the error propagates.
   The task returns the Xid text in its commit message.
2. The driver's ``commit(messages, batch_id)`` hands the Xids to
   ``sink_commit``. The broker does the rest as one decision: it commits those
   branches, rolls back every other prepared branch of that batch (a failed
   or speculative attempt's), and advances the sink's durable last-committed
   batch id. A batch at or below that id is a replay (Spark re-ran a batch
   whose sink commit happened before its commit log was written): its
   branches are rolled back and nothing new is committed.
3. ``abort(messages, batch_id)`` calls ``sink_abort``, which rolls back the
   batch's prepared branches, and does nothing to a committed batch (Spark
   calls ``abort`` after a ``commit`` that raised).

A streaming writer is created anew for every micro-batch and its ``commit``
runs in another process, so nothing lives in ``__init__`` but options: the
sink id comes from option ``sinkId`` and the batch id from the task's local
property ``streaming.sql.batchId``. A batch write (``df.write``) is one batch
(id 0) of a sink id generated for that write job.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from txbroker.client.xa import TMFAIL, TMNOFLAGS, TMSUCCESS, XA_RDONLY
from txbroker.errors import ConnectionLost, MessageTooLarge, NotFound
from txbroker.spark import faults
from txbroker.spark._common import (
    SparkConnectorError,
    WriteOptions,
    close_quietly,
    open_connection,
    queue_error,
)
from txbroker.spark.schema import check_sink_schema, outgoing_chunks
from txbroker.xid import sink_xid

if TYPE_CHECKING:
    from txbroker.client.sync import Connection, XAResource

log = logging.getLogger(__name__)

#: The local property in which Spark gives a streaming write task its batch id.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
#: The batch id of a (non-streaming) batch write: one batch per generated sink id.
BATCH_WRITE_BATCH_ID = 0


@dataclass
class BranchCommitMessage(WriterCommitMessage):
    """What a write task reports: its prepared branch (None: it wrote no rows)."""

    xid: str | None
    rows: int
    partition: int
    attempt: int


def _task_identity() -> tuple[int, int, str | None]:
    """(partition id, attempt number, streaming batch id property) of this task."""
    context = TaskContext.get()
    if context is None:  # not in a Spark task (a direct call in a test)
        return 0, 0, None
    return context.partitionId(), context.attemptNumber(), context.getLocalProperty(
        BATCH_ID_PROPERTY)


def _rollback_quietly(xa: XAResource, xid: Any, ended: bool) -> None:
    """Undo a failed task's branch; its own error is the one that matters."""
    if not ended:
        try:
            xa.end(xid, TMFAIL)
        except Exception as exc:
            log.debug("txbroker sink: end(TMFAIL) of %s: %s", xid, exc)
    try:
        xa.rollback(xid)
    except Exception as exc:
        log.warning("txbroker sink: rolling back %s failed (the broker rolls an "
                    "unprepared branch back on its own): %s", xid, exc)


def write_branch(options: WriteOptions, sink_id: str, batch_id: int,
                 batches: Iterator[Any]) -> BranchCommitMessage:
    """Send one task's rows in an XA branch and prepare it (runs in a worker)."""
    partition, attempt, _ = _task_identity()
    xid = sink_xid(sink_id, batch_id, partition, attempt)
    conn: Connection | None = None
    xa: XAResource | None = None
    ended = False
    rows = 0
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if xa is None:
                conn = open_connection(options.url)
                xa = conn.xa_resource()
                xa.start(xid, TMNOFLAGS)
            assert conn is not None
            for chunk in outgoing_chunks(batch):
                conn.send_batch(options.queue, chunk.bodies, headers=chunk.headers,
                                message_ids=chunk.message_ids)
                rows += len(chunk.bodies)
        if xa is None:
            return BranchCommitMessage(None, 0, partition, attempt)
        faults.point("sink.write", batch_id)  # sent, not prepared: the task fails
        xa.end(xid, TMSUCCESS)
        ended = True
        vote = xa.prepare(xid)
        xid_text = None if vote == XA_RDONLY else str(xid)
        faults.point("sink.prepared", batch_id)  # an orphan prepared branch
        return BranchCommitMessage(xid_text, rows, partition, attempt)
    except BaseException as exc:
        if xa is not None:
            _rollback_quietly(xa, xid, ended)
        if isinstance(exc, MessageTooLarge):
            raise SparkConnectorError(
                f"column 'body': a row is too large for the broker (queue "
                f"{options.queue!r}): {exc}; nothing of this task was written") from exc
        if isinstance(exc, NotFound):
            raise queue_error("queue", options.queue, exc) from exc
        raise
    finally:
        close_quietly(conn)


def commit_batch(options: WriteOptions, sink_id: str, batch_id: int,
                 messages: list[WriterCommitMessage | None]) -> dict[str, Any]:
    """The driver's commit decision for one batch (``sink_commit``)."""
    xids = [m.xid for m in messages if isinstance(m, BranchCommitMessage) and m.xid]
    faults.point("sink.commit", batch_id)  # before the decision: Spark aborts
    conn = open_connection(options.url)
    try:
        try:
            result: dict[str, Any] = conn.sink_commit(sink_id, batch_id, xids)
        except ConnectionLost:
            # The answer was lost, not necessarily the decision. Asking again is safe:
            # a batch already committed answers committed=False and changes nothing.
            close_quietly(conn)
            conn = open_connection(options.url)
            result = conn.sink_commit(sink_id, batch_id, xids)
    finally:
        close_quietly(conn)
    faults.point("sink.committed", batch_id)  # decided, Spark's commit log not written
    if not result.get("committed", False):
        log.info("txbroker sink %r: batch %d is a replay (last committed %s); "
                 "rolled back %s branches", sink_id, batch_id, result.get("last"),
                 result.get("rolled_back"))
    return result


def abort_batch(options: WriteOptions, sink_id: str, batch_id: int) -> None:
    """Roll back a failed batch's prepared branches (``sink_abort``; a no-op for
    a committed batch). Errors are logged, not raised: the task's error is the
    one Spark should report, and a replay of the batch rolls back leftovers."""
    try:
        conn = open_connection(options.url)
    except Exception as exc:
        log.warning("txbroker sink %r: abort of batch %d could not connect: %s",
                    sink_id, batch_id, exc)
        return
    try:
        conn.sink_abort(sink_id, batch_id)
    except Exception as exc:
        log.warning("txbroker sink %r: abort of batch %d failed: %s", sink_id, batch_id, exc)
    finally:
        close_quietly(conn)


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("txbroker")``: exactly once per ``sinkId``."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        check_sink_schema(schema)
        assert options.sink_id is not None
        self.options = options
        self.sink_id: str = options.sink_id

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        """Send this task's rows in a prepared branch of the current batch."""
        _, _, batch_property = _task_identity()
        if batch_property is None:
            raise SparkConnectorError(
                f"no '{BATCH_ID_PROPERTY}' in the task's local properties: not a "
                "streaming micro-batch")
        return write_branch(self.options, self.sink_id, int(batch_property), iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Commit the batch's branches and advance the sink's last committed batch."""
        commit_batch(self.options, self.sink_id, batchId, messages)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Roll back the batch's prepared branches unless it was committed."""
        abort_batch(self.options, self.sink_id, batchId)


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("txbroker").mode("append")``: all rows or none.

    The sink id is generated once per write job, here on the driver; Spark
    ships this very instance (pickled) to the tasks and to ``commit``.
    """

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        check_sink_schema(schema)
        self.options = options
        self.sink_id = f"batch-{uuid.uuid4().hex}"  # 38 bytes: under the 40 allowed

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        """Send this task's rows in a prepared branch."""
        return write_branch(self.options, self.sink_id, BATCH_WRITE_BATCH_ID, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Commit every task's branch at once."""
        commit_batch(self.options, self.sink_id, BATCH_WRITE_BATCH_ID, messages)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Roll back every prepared branch of this write."""
        abort_batch(self.options, self.sink_id, BATCH_WRITE_BATCH_ID)
