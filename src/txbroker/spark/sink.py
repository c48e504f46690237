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
from txbroker.core.limits import DEFAULT_MAX_SINK_BRANCH_MESSAGES
from txbroker.errors import ConnectionLost, MessageTooLarge, NotFound
from txbroker.spark import faults
from txbroker.spark._common import (
    SparkConnectorError,
    WriteOptions,
    close_quietly,
    open_connection,
    queue_error,
)
from txbroker.spark.schema import OutgoingChunk, check_sink_schema, outgoing_chunks
from txbroker.xid import Xid, sink_xid

if TYPE_CHECKING:
    from txbroker.client.sync import Connection, XAResource

log = logging.getLogger(__name__)

#: The local property in which Spark gives a streaming write task its batch id.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
#: The batch id of a (non-streaming) batch write: one batch per generated sink id.
BATCH_WRITE_BATCH_ID = 0
#: Rows per sink branch when the broker does not announce its cap: the broker's
#: default ``max_sink_branch_messages`` (core/limits.py).
DEFAULT_SINK_BRANCH_ROWS = DEFAULT_MAX_SINK_BRANCH_MESSAGES


@dataclass
class BranchCommitMessage(WriterCommitMessage):
    """What a write task reports: its prepared branches (none: it wrote no rows)."""

    xids: list[str]
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


class TaskBranches:
    """One write task's XA branches: chunk 0, 1, 2 … of at most ``branch_limit`` rows.

    The broker caps the messages of one sink branch (``max_sink_branch_messages``:
    a prepared branch is one journal entry), so a task that writes more rows
    prepares a branch and starts the next (``sink_xid(..., chunk)``). The driver
    commits all of them in one ``sink_commit``; on failure :meth:`rollback`
    undoes every one (prepared or not).
    """

    def __init__(self, conn: Connection, sink_id: str, batch_id: int, partition: int,
                 attempt: int, branch_limit: int) -> None:
        self.xa: XAResource = conn.xa_resource()
        self.ids = (sink_id, batch_id, partition, attempt)
        self.branch_limit = branch_limit
        self.prepared: list[Xid] = []
        self.active: Xid | None = None
        self.active_rows = 0
        self.active_ended = False

    def room(self) -> int:
        """Rows the current branch still takes (starting one when needed)."""
        if self.active is None:
            self.active = sink_xid(*self.ids, chunk=len(self.prepared))
            self.active_rows = 0
            self.active_ended = False
            self.xa.start(self.active, TMNOFLAGS)
        if self.active_rows >= self.branch_limit:
            self.prepare()
            return self.room()
        return self.branch_limit - self.active_rows

    def sent(self, count: int) -> None:
        """``count`` rows went into the current branch."""
        self.active_rows += count

    def prepare(self) -> None:
        """End and prepare the current branch (a read-only one simply ends)."""
        if self.active is None:
            return
        self.xa.end(self.active, TMSUCCESS)
        self.active_ended = True
        if self.xa.prepare(self.active) != XA_RDONLY:
            self.prepared.append(self.active)
        self.active = None

    def rollback(self) -> None:
        """Undo every branch of the task; errors are logged (the task's own error is
        the one that matters, and the broker rolls back an unprepared branch of a
        closed connection by itself)."""
        undo = [*self.prepared, *([self.active] if self.active is not None else [])]
        if self.active is not None and not self.active_ended:
            try:
                self.xa.end(self.active, TMFAIL)
            except Exception as exc:
                log.debug("txbroker sink: end(TMFAIL) of %s: %s", self.active, exc)
        for xid in undo:
            try:
                self.xa.rollback(xid)
            except Exception as exc:
                log.warning("txbroker sink: rolling back %s failed: %s", xid, exc)
        self.prepared, self.active = [], None


def _branch_limit(conn: Connection, options: WriteOptions) -> int:
    """Rows per branch: the broker's cap (from its hello when it says so), or
    option ``rowsPerBranch`` when smaller."""
    announced = conn.server_info.get("max_sink_branch_messages")
    limit = announced if isinstance(announced, int) and announced > 0 else (
        DEFAULT_SINK_BRANCH_ROWS)
    return min(limit, options.rows_per_branch or limit)


def write_branch(options: WriteOptions, sink_id: str, batch_id: int,
                 batches: Iterator[Any]) -> BranchCommitMessage:
    """Send one task's rows in XA branches and prepare them (runs in a worker)."""
    partition, attempt, _ = _task_identity()
    conn: Connection | None = None
    branches: TaskBranches | None = None
    rows = 0
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if conn is None:
                conn = open_connection(options.url)
                branches = TaskBranches(conn, sink_id, batch_id, partition, attempt,
                                        _branch_limit(conn, options))
            assert branches is not None
            for chunk in outgoing_chunks(batch):
                pending: OutgoingChunk | None = chunk
                while pending is not None:
                    part, pending = pending.split(branches.room())
                    conn.send_batch(options.queue, part.bodies, headers=part.headers,
                                    message_ids=part.message_ids)
                    branches.sent(len(part.bodies))
                    rows += len(part.bodies)
        if branches is None:
            return BranchCommitMessage([], 0, partition, attempt)
        faults.point("sink.write", batch_id)  # sent, not all prepared: the task fails
        branches.prepare()
        faults.point("sink.prepared", batch_id)  # orphan prepared branches
        return BranchCommitMessage([str(x) for x in branches.prepared], rows, partition,
                                   attempt)
    except BaseException as exc:
        if branches is not None:
            branches.rollback()
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
    xids = [xid for m in messages if isinstance(m, BranchCommitMessage) for xid in m.xids]
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
