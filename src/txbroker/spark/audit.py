"""``txbroker audit``: a PySpark job that turns a broker's journal into audit tables.

Theory of operation
-------------------
The job reads the journal once through the ``txbroker-journal`` source (one
row per record, cached) and derives five tables, written as Parquet under
``OUT/<table>/``; ``OUT/report.html`` summarises them (``audit_report.py``).
Every decision follows the broker's own replay rules (``core/replay.py``):

* **messages** — one row per message ever added: from ADD, TX and (when its
  ADD's segment is gone) RELOCATE / RELOCATE_MANY records, and the sends of prepared XA
  branches. Its *fate* is the first terminal event after it: ``consumed`` (an
  ack in TX/ACK, or consumed by a committed XA branch), ``dropped`` (DROP with
  its reason, a discard at XA commit, or a deleted queue), else
  ``in_doubt`` (sent or consumed by a branch still prepared), ``rolled_back``
  (sent by a rolled-back branch), ``moved`` (MOVE: dead-lettered or expired to
  ``moved_to``, still there) or ``live``.
* **xa_branches** — per Xid, its state history as a list of ``(state,
  position, time_ms)`` from XA_PREPARE / XA_COMMIT / XA_ROLLBACK /
  XA_HEURISTIC / XA_FORGET / SINK_COMMIT records (and SNAPSHOT mentions when
  the branch's XA_PREPARE lies in a deleted segment); ``state`` is the last.
* **in_doubt** — branches still ``prepared`` or ``heuristic_*`` at the end of
  the log: what ``txbroker xa list`` shows after a restart.
* **transactions** — one row per TX record (``kind`` ``local`` when it carries
  a commit time: a local transaction or an XA one-phase commit; ``group``
  otherwise: plain sends/acks committed together, or a transaction written by
  an older broker) and one per XA branch (``kind`` ``xa``), with sends, acks,
  outcome and the times the records carry.
* **dead_letters** — messages moved for ``max_deliveries`` / ``rejected`` /
  ``expired``, and dropped messages, with the reason.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from txbroker.core.records import Kind
from txbroker.errors import CorruptStore
from txbroker.spark.audit_report import write_report
from txbroker.spark.journal_source import FORMAT_NAME, register_journal_source
from txbroker.storage.journal_reader import SINK_COMMIT, journal_segments

#: The tables the job writes, in order (each under ``OUT/<name>/``).
TABLES: Final = ("xa_branches", "in_doubt", "messages", "dead_letters", "transactions")
#: Progress steps: reading, one per table, the report.
STEPS: Final = ("read journal", *TABLES, "report")
#: Move reasons that make a message a dead letter (``core/queue_index.py``).
DEAD_LETTER_REASONS: Final = ("max_deliveries", "rejected", "expired", "maxlen")
#: Branch states that still need a decision or an operator (``core/xa.py`` BranchState).
OPEN_STATES: Final = ("prepared", "heuristic_committed", "heuristic_rolled_back")
#: Branch states that end a branch's transaction.
DECIDED_STATES: Final = ("committed", "rolled_back", "heuristic_committed",
                         "heuristic_rolled_back")
#: Spark master of the CLI's own session: every core of this machine.
DEFAULT_MASTER: Final = "local[*]"
#: Shuffle partitions of the CLI's session (audit tables are small next to Spark's 200).
SHUFFLE_PARTITIONS: Final = 8

Progress = Callable[[str], None]


@dataclass
class AuditResult:
    """What the job wrote: table row counts, the report, the open branches."""

    out: Path
    counts: dict[str, int] = field(default_factory=dict)
    report: Path | None = None
    in_doubt: list[str] = field(default_factory=list)


def local_session(master: str = DEFAULT_MASTER) -> Any:
    """A local SparkSession set up for this machine (see ``SPARK.md``)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers must import this txbroker
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master(master)
        .appName("txbroker-audit")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(SHUFFLE_PARTITIONS))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


def run_audit(data: Path, out: Path, *, spark: Any = None, master: str = DEFAULT_MASTER,
              progress: Progress | None = None) -> AuditResult:
    """Audit the journal of ``data`` into ``out``; uses ``spark`` or a local session.

    Raises :class:`~txbroker.storage.journal_reader.NoJournal` (naming the
    path) before Spark starts when ``data`` holds no journal, and
    :class:`~txbroker.errors.CorruptStore` (file and offset) when a task met
    a damaged record.
    """
    journal_segments(data)  # fail fast, before a 10-20 s Spark start
    step = progress or (lambda _name: None)
    own_session = spark is None
    if own_session:
        step("starting Spark")
        spark = local_session(master)
    try:
        return _audit(spark, data, out, step)
    except Exception as exc:
        corrupt = corrupt_store_of(exc)
        if corrupt is not None:
            raise corrupt from exc
        raise
    finally:
        if own_session:
            spark.stop()


#: How a CorruptStore raised in a Python worker reads in the Spark error text.
_CORRUPT_TEXT: Final = re.compile(r"corrupt store: (.+?) at offset (\d+): ([^\n]*)")


def corrupt_store_of(exc: BaseException) -> CorruptStore | None:
    """The :class:`CorruptStore` a Spark task failed with, rebuilt from the error text."""
    if isinstance(exc, CorruptStore):
        return exc
    found = _CORRUPT_TEXT.search(str(exc))
    if found is None:
        return None
    return CorruptStore(found.group(1), int(found.group(2)), found.group(3).strip())


def _audit(spark: Any, data: Path, out: Path, step: Progress) -> AuditResult:
    """The job itself, on a session (see :func:`run_audit`)."""
    register_journal_source(spark)
    out.mkdir(parents=True, exist_ok=True)
    step("read journal")
    records = spark.read.format(FORMAT_NAME).option("path", str(data)).load().cache()
    result = AuditResult(out)
    result.counts["records"] = records.count()
    tables = write_tables(spark, records, out, step)
    result.counts.update({name: parquet_rows(out / name) for name in tables})
    step("report")
    result.report = out / "report.html"
    drawn = write_report(tables, result.counts, result.report, data=data)
    result.in_doubt = [row.xid for row in drawn.operator_rows]
    records.unpersist()
    return result


def parquet_rows(directory: Path) -> int:
    """Rows of the Parquet files of a written table (from their footers: no Spark job)."""
    parquet: Any = importlib.import_module("pyarrow.parquet")  # pyarrow has no type hints
    return sum(parquet.ParquetFile(path).metadata.num_rows
               for path in directory.glob("*.parquet"))


def write_tables(spark: Any, records: Any, out: Path, step: Progress) -> dict[str, Any]:
    """Write the five tables of a ``txbroker-journal`` DataFrame under ``out``.

    Returns each as read back from its Parquet files. Tables derived from
    others are built from the written files: short plans, nothing computed twice.
    """
    def save(name: str, frame: Any) -> Any:
        step(name)
        frame.write.mode("overwrite").parquet(str(out / name))
        return spark.read.parquet(str(out / name))

    branches = save("xa_branches", _branches(records))
    in_doubt = save("in_doubt", _in_doubt(branches))
    messages = save("messages", _messages(records, branches))
    dead_letters = save("dead_letters", _dead_letters(messages))
    transactions = save("transactions", _transactions(records, branches))
    return {"messages": messages, "transactions": transactions, "xa_branches": branches,
            "in_doubt": in_doubt, "dead_letters": dead_letters}


# ---------------------------------------------------------------------- XA branches
def _branch_events(records: Any) -> Any:
    """``(xid, position, state, time_ms)`` of every record that changes a branch."""
    from pyspark.sql import functions as F

    kind = F.col("kind")
    base = records.where(kind.isin(int(Kind.XA_PREPARE), int(Kind.XA_COMMIT),
                                   int(Kind.XA_ROLLBACK), int(Kind.XA_HEURISTIC),
                                   int(Kind.XA_FORGET)))
    state = (
        F.when(kind == int(Kind.XA_PREPARE), "prepared")
        .when(kind == int(Kind.XA_COMMIT), "committed")
        .when(kind == int(Kind.XA_ROLLBACK), "rolled_back")
        .when(kind == int(Kind.XA_FORGET), "forgotten")
        .when(F.col("outcome") == "commit", "heuristic_committed")
        .otherwise("heuristic_rolled_back")
    )
    direct = base.select("xid", "position", state.alias("state"), "time_ms")
    sink = records.where(kind == SINK_COMMIT)
    sink_commits = sink.select(F.explode("sink_branches.xid").alias("xid"), "position",
                               F.lit("committed").alias("state"), "time_ms")
    sink_rollbacks = sink.select(F.explode("rolled_back").alias("xid"), "position",
                                 F.lit("rolled_back").alias("state"), "time_ms")
    # a branch whose XA_PREPARE is in a deleted segment is known from snapshots only
    prepared = base.where(kind == int(Kind.XA_PREPARE)).select("xid")
    snapshot = (
        records.where(kind == int(Kind.SNAPSHOT))
        .select("position", F.explode("branches").alias("b"))
        .select(F.col("b.xid").alias("xid"), "position", F.col("b.state").alias("state"))
        .join(prepared, "xid", "left_anti")
        .groupBy("xid", "state").agg(F.min("position").alias("position"))
        .select("xid", "position", "state", F.lit(None).cast("bigint").alias("time_ms"))
    )
    return direct.unionByName(sink_commits).unionByName(sink_rollbacks).unionByName(snapshot)


def _branches(records: Any) -> Any:
    """The ``xa_branches`` table."""
    from pyspark.sql import functions as F

    events = _branch_events(records)
    history = events.groupBy("xid").agg(
        F.array_sort(F.collect_list(F.struct("position", "state", "time_ms"))).alias("h"))
    decided = F.filter("h", lambda e: e.state.isin(*DECIDED_STATES))
    prepares = (
        records.where(F.col("kind") == int(Kind.XA_PREPARE))
        .groupBy("xid")
        .agg(F.min_by(F.struct(
            F.size("messages").alias("sends"), F.size("consumed").alias("acks"),
            "created_ms", F.col("time_ms").alias("prepared_ms")), "position").alias("p"))
    )
    return (
        history.join(prepares, "xid", "left")
        .select(
            "xid",
            F.try_element_at("h", F.lit(-1)).state.alias("state"),
            F.transform("h", lambda e: F.struct(e.state.alias("state"),
                                                e.position.alias("position"),
                                                e.time_ms.alias("time_ms"))).alias("history"),
            F.col("p.sends").alias("sends"), F.col("p.acks").alias("acks"),
            F.col("p.created_ms").alias("created_ms"),
            F.col("p.prepared_ms").alias("prepared_ms"),
            F.try_element_at(decided, F.lit(1)).time_ms.alias("completed_ms"),
            F.try_element_at(decided, F.lit(1)).position.alias("completed_position"),
            F.try_element_at("h", F.lit(1)).position.alias("position"),
        )
        .withColumn("outcome", _outcome(F.col("history")))
    )


def _outcome(history: Any) -> Any:
    """committed / rolled_back / prepared / heuristic from a history (forget ignored)."""
    from pyspark.sql import functions as F

    last = F.try_element_at(F.filter(history, lambda e: e.state != "forgotten"), F.lit(-1)).state
    return (F.when(last.startswith("heuristic"), "heuristic")
            .when(last.isin("committed", "rolled_back", "prepared"), last)
            .otherwise("unknown"))


def _in_doubt(branches: Any) -> Any:
    """Branches still prepared or heuristically completed at the end of the log."""
    from pyspark.sql import functions as F

    return branches.where(F.col("state").isin(*OPEN_STATES)).select(
        "xid", "state", "created_ms", "prepared_ms", "completed_ms", "sends", "acks",
        "position")


# ---------------------------------------------------------------------- transactions
def _transactions(records: Any, branches: Any) -> Any:
    """TX records and XA branches with sends, acks, outcome and times."""
    from pyspark.sql import functions as F

    tx = records.where(F.col("kind") == int(Kind.TX))
    started = F.array_min("messages.timestamp_ms")
    local = tx.select(
        F.format_string("tx@%d:%d", "segment_id", "offset").alias("id"),
        F.when(F.col("time_ms").isNotNull(), "local").otherwise("group").alias("kind"),
        F.lit(None).cast("string").alias("xid"),
        F.size("messages").alias("sends"), F.size("ids").alias("acks"),
        F.lit("committed").alias("outcome"),
        F.lit(None).cast("string").alias("heuristic"),
        started.alias("started_ms"),
        F.lit(None).cast("bigint").alias("prepared_ms"),
        F.col("time_ms").alias("completed_ms"),
        (F.col("time_ms") - started).alias("duration_ms"),
        F.lit(None).cast("bigint").alias("commit_latency_ms"),
        "position",
    )
    decisions = F.filter("history", lambda e: e.state != "forgotten")
    last_state = F.try_element_at(decisions, F.lit(-1)).state
    xa = branches.select(
        F.col("xid").alias("id"), F.lit("xa").alias("kind"), "xid",
        F.coalesce("sends", F.lit(0)).alias("sends"), F.coalesce("acks", F.lit(0)).alias("acks"),
        "outcome",
        F.when(last_state == "heuristic_committed", "commit")
        .when(last_state == "heuristic_rolled_back", "rollback").alias("heuristic"),
        F.col("created_ms").alias("started_ms"), "prepared_ms", "completed_ms",
        (F.col("completed_ms") - F.col("created_ms")).alias("duration_ms"),
        (F.col("completed_ms") - F.col("prepared_ms")).alias("commit_latency_ms"),
        "position",
    )
    return local.unionByName(xa)


# ---------------------------------------------------------------------- messages
def _added(records: Any, branches: Any) -> Any:
    """The first add of every message id (plain, TX, relocated, or an XA branch's send)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    kind = F.col("kind")
    plain = (
        records.where(kind.isin(int(Kind.ADD), int(Kind.TX), int(Kind.RELOCATE),
                                int(Kind.RELOCATE_MANY)))
        .select("position", "kind_name", F.explode("messages").alias("m"),
                F.lit(None).cast("string").alias("xid"))
    )
    xa_sends = (
        records.where(kind == int(Kind.XA_PREPARE))
        .select("position", "kind_name", F.explode("messages").alias("m"), "xid")
    )
    seqs = _assigned_seqs(records)
    first = Window.partitionBy("id").orderBy("position")
    return (
        plain.unionByName(xa_sends)
        .select(F.col("m.id").alias("id"), F.col("m.queue").alias("queue"),
                F.col("m.seq").alias("own_seq"), F.col("m.message_id").alias("message_id"),
                F.col("m.size").alias("size"), F.col("m.priority").alias("priority"),
                F.col("m.timestamp_ms").alias("sent_ms"), "position",
                F.col("kind_name").alias("origin"), "xid")
        .withColumn("rank", F.row_number().over(first)).where("rank = 1").drop("rank")
        .join(seqs, "id", "left")
        .withColumn("seq", F.coalesce("own_seq", "assigned_seq")).drop("own_seq", "assigned_seq")
        .join(branches.select("xid", F.col("state").alias("branch_state")), "xid", "left")
    )


def _assigned_seqs(records: Any) -> Any:
    """``(id, assigned_seq)`` given at commit to the sends of XA branches."""
    from pyspark.sql import functions as F

    kind = F.col("kind")
    direct = records.where(kind.isin(int(Kind.XA_COMMIT), int(Kind.XA_HEURISTIC))).select(
        F.explode("seqs").alias("s"))
    sink = (records.where(kind == SINK_COMMIT)
            .select(F.explode("sink_branches").alias("b"))
            .select(F.explode("b.seqs").alias("s")))
    return (direct.unionByName(sink)
            .select(F.col("s.id").alias("id"), F.col("s.seq").alias("assigned_seq"))
            .groupBy("id").agg(F.min("assigned_seq").alias("assigned_seq")))


def _terminal_events(records: Any, branches: Any, added: Any) -> Any:
    """``(id, position, event, reason, time_ms)``: consumed or dropped, every candidate."""
    from pyspark.sql import functions as F

    kind = F.col("kind")

    def ids_of(kinds: tuple[int, ...], event: str, reason: Any, column: str = "ids") -> Any:
        return records.where(kind.isin(*kinds)).select(
            F.explode(column).alias("id"), "position", F.lit(event).alias("event"),
            reason.alias("reason"), "time_ms")

    acked = ids_of((int(Kind.TX), int(Kind.ACK)), "consumed", F.lit(None).cast("string"))
    dropped = ids_of((int(Kind.DROP),), "dropped", F.col("reason"))
    discarded = ids_of((int(Kind.XA_COMMIT), int(Kind.XA_HEURISTIC)), "dropped",
                       F.lit("discarded"), "discards")
    sink_discarded = (
        records.where(kind == SINK_COMMIT)
        .select("position", "time_ms", F.explode("sink_branches").alias("b"))
        .select(F.explode("b.discards").alias("id"), "position", F.lit("dropped").alias("event"),
                F.lit("discarded").alias("reason"), "time_ms"))
    # messages consumed by a branch are gone when the branch commits
    commits = (branches.select("xid", F.explode("history").alias("e"))
               .where(F.col("e.state").isin("committed", "heuristic_committed"))
               .groupBy("xid").agg(F.min("e.position").alias("position"),
                                   F.min("e.time_ms").alias("time_ms")))
    consumed_by_branch = (
        records.where(kind == int(Kind.XA_PREPARE))
        .select("xid", F.explode("consumed.id").alias("id"))
        .join(commits, "xid")
        .select("id", "position", F.lit("consumed").alias("event"),
                F.lit(None).cast("string").alias("reason"), "time_ms")
    )
    return (acked.unionByName(dropped).unionByName(discarded).unionByName(sink_discarded)
            .unionByName(consumed_by_branch)
            .unionByName(_deleted_by_queue(records, added)))


def _moves(records: Any) -> Any:
    """``(id, position, moved_to, move_reason)`` of every MOVE."""
    from pyspark.sql import functions as F

    return records.where(F.col("kind") == int(Kind.MOVE)).select(
        F.explode("ids").alias("id"), "position", F.col("queue").alias("moved_to"),
        F.col("reason").alias("move_reason"))


def _deleted_by_queue(records: Any, added: Any) -> Any:
    """Messages dropped because their queue (at that moment) was deleted."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    stays = (added.select("id", "position", "queue")
             .unionByName(_moves(records).select("id", "position",
                                                 F.col("moved_to").alias("queue"))))
    stay_end = F.lead("position").over(Window.partitionBy("id").orderBy("position"))
    stays = stays.withColumn("until", stay_end)
    deletes = records.where(F.col("kind") == int(Kind.QUEUE_DELETE)).select(
        F.col("queue").alias("deleted"), F.col("position").alias("deleted_at"), "time_ms")
    hit = stays.join(deletes, (stays.queue == deletes.deleted)
                     & (deletes.deleted_at > stays.position)
                     & (stays.until.isNull() | (deletes.deleted_at < stays.until)))
    return hit.select("id", F.col("deleted_at").alias("position"),
                      F.lit("dropped").alias("event"), F.lit("queue_deleted").alias("reason"),
                      "time_ms")


def _messages(records: Any, branches: Any) -> Any:
    """The ``messages`` table: every message ever added and its fate."""
    from pyspark.sql import functions as F

    added = _added(records, branches)
    terminal = (_terminal_events(records, branches, added)
                .join(added.select("id", F.col("position").alias("added_at")), "id")
                .where(F.col("position") > F.col("added_at"))
                .groupBy("id")
                .agg(F.min_by(F.struct("event", "reason", "position", "time_ms"),
                              "position").alias("t")))
    moves = _moves(records).groupBy("id").agg(
        F.max_by(F.struct("moved_to", "move_reason"), "position").alias("mv"))
    held = (records.where(F.col("kind") == int(Kind.XA_PREPARE))
            .select("xid", F.explode("consumed.id").alias("id"))
            .join(branches.where(F.col("state") == "prepared").select("xid"), "xid")
            .select("id", F.lit(True).alias("held")).dropDuplicates(["id"]))
    state = F.col("branch_state")
    fate = (
        F.when(F.col("t.event").isNotNull(), F.col("t.event"))
        .when(state == "prepared", "in_doubt")
        .when(state.isin("rolled_back", "heuristic_rolled_back"), "rolled_back")
        .when(F.col("held"), "in_doubt")
        .when(F.col("mv").isNotNull(), "moved")
        .otherwise("live")
    )
    return (
        added.join(terminal, "id", "left").join(moves, "id", "left").join(held, "id", "left")
        .select(
            "id", "queue", "seq", "message_id", "size", "priority", "sent_ms",
            (F.col("sent_ms") / 1000).cast("timestamp").alias("sent_at"),
            "origin", "xid", "position", fate.alias("fate"),
            F.when(F.col("t.event") == "dropped", F.col("t.reason")).alias("drop_reason"),
            F.col("mv.moved_to").alias("moved_to"), F.col("mv.move_reason").alias("move_reason"),
            F.col("t.position").alias("fate_position"), F.col("t.time_ms").alias("fate_ms"),
        )
    )


def _dead_letters(messages: Any) -> Any:
    """Messages dead-lettered (moved for a delivery/expiry reason) or dropped."""
    from pyspark.sql import functions as F

    dead = F.col("move_reason").isin(*DEAD_LETTER_REASONS) | (F.col("fate") == "dropped")
    return messages.where(dead).select(
        "id", "queue", "message_id", "sent_ms", "fate",
        F.coalesce("drop_reason", "move_reason").alias("reason"), "moved_to",
        "drop_reason", "move_reason", "fate_position")
