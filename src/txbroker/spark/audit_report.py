"""The audit job's HTML report: small aggregates from Spark, plots by matplotlib.

Theory of operation
-------------------
Spark computes every aggregate (messages per queue and time bucket, outcome
counts, latency samples); only those small results come to the driver. Each
plot is drawn with matplotlib's Agg backend and embedded in the single
``report.html`` as a base64 PNG, so the report is one file that opens
anywhere. The branches that need an operator (``in_doubt``) are listed
in full, with the command that completes each.
"""

from __future__ import annotations

import base64
import html
import io
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

#: Time buckets of the throughput plot: about this many over the journal's span.
THROUGHPUT_BUCKETS: Final = 60
#: Smallest throughput bucket (ms): finer than this is noise.
MIN_BUCKET_MS: Final = 100
#: Queues shown in the throughput and top-queues plots.
TOP_QUEUES: Final = 10
#: Latency samples brought to the driver for the histogram.
MAX_LATENCY_SAMPLES: Final = 100_000
#: Labels of the two latency series.
LOCAL_LATENCY: Final = "local: first send → commit"
XA_LATENCY: Final = "xa: prepare → commit"
#: Plot size in inches (matplotlib's unit) and resolution.
FIGURE_SIZE: Final = (8.0, 3.6)
FIGURE_DPI: Final = 96


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot.subplots(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)


def _png(fig: Any) -> str:
    from matplotlib import pyplot

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    pyplot.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def _empty(text: str) -> str:
    return f"<p class='empty'>{html.escape(text)}</p>"


@dataclass
class ReportData:
    """The small aggregates the report is drawn from (gathered by :func:`gather`)."""

    #: ``(queue, fate, count, first sent_ms, last sent_ms)``.
    queue_fates: list[tuple[str, str, int, int | None, int | None]]
    #: ``(kind, outcome, count)`` of the transactions table.
    outcomes: list[tuple[str, str, int]]
    #: Histogram series: label → milliseconds.
    latencies: dict[str, list[int]]
    #: ``queue → [(bucket, count)]`` of the top queues, and the bucket width.
    buckets: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    bucket_ms: int = MIN_BUCKET_MS
    #: The ``in_doubt`` rows.
    operator_rows: list[Any] = field(default_factory=list)

    def sent_bounds(self) -> tuple[int, int] | None:
        """First and last send time over every message, if any has one."""
        firsts = [row[3] for row in self.queue_fates if row[3] is not None]
        lasts = [row[4] for row in self.queue_fates if row[4] is not None]
        return (min(firsts), max(lasts)) if firsts and lasts else None

    def top_queues(self) -> list[tuple[str, int]]:
        """The queues with the most messages, most first."""
        totals: dict[str, int] = {}
        for queue, _fate, count, _lo, _hi in self.queue_fates:
            totals[queue] = totals.get(queue, 0) + count
        return sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:TOP_QUEUES]


def gather(tables: dict[str, Any]) -> ReportData:
    """Four small Spark jobs (and the in-doubt rows): everything the report draws."""
    from pyspark.sql import functions as F

    messages, transactions = tables["messages"], tables["transactions"]
    queue_fates = [
        (row.queue, row.fate, row["count"], row.lo, row.hi)
        for row in messages.groupBy("queue", "fate").agg(
            F.count(F.lit(1)).alias("count"), F.min("sent_ms").alias("lo"),
            F.max("sent_ms").alias("hi")).collect()
    ]
    outcomes = [(row.kind, row.outcome, row["count"]) for row in
                transactions.groupBy("kind", "outcome").count().orderBy("kind", "outcome")
                .collect()]
    latencies: dict[str, list[int]] = {LOCAL_LATENCY: [], XA_LATENCY: []}
    samples = (transactions
               .select(F.when(F.col("kind") == "local", F.col("duration_ms"))
                       .when(F.col("kind") == "xa", F.col("commit_latency_ms")).alias("ms"),
                       "kind")
               .where(F.col("ms").isNotNull()).limit(MAX_LATENCY_SAMPLES).collect())
    for row in samples:
        latencies[LOCAL_LATENCY if row.kind == "local" else XA_LATENCY].append(row.ms)
    data = ReportData(queue_fates, outcomes, latencies,
                      operator_rows=tables["in_doubt"].orderBy("position").collect())
    bounds = data.sent_bounds()
    if bounds is not None:
        data.bucket_ms = max(MIN_BUCKET_MS, (bounds[1] - bounds[0]) // THROUGHPUT_BUCKETS + 1)
        top = [queue for queue, _count in data.top_queues()]
        for row in (messages.where(F.col("queue").isin(top) & F.col("sent_ms").isNotNull())
                    .groupBy("queue", (F.col("sent_ms") / data.bucket_ms).cast("long")
                             .alias("bucket"))
                    .count().orderBy("queue", "bucket").collect()):
            data.buckets.setdefault(row.queue, []).append((row.bucket, row["count"]))
    return data


def throughput_plot(data: ReportData) -> str:
    """Messages sent per second over time, one line per (top) queue."""
    bounds = data.sent_bounds()
    if bounds is None or not data.buckets:
        return _empty("no message timestamps")
    bucket_s = data.bucket_ms / 1000
    first_bucket = bounds[0] // data.bucket_ms
    fig, axes = _figure()
    for queue, points in data.buckets.items():
        axes.plot([(bucket - first_bucket) * bucket_s for bucket, _ in points],
                  [count / bucket_s for _, count in points], marker="o", label=queue)
    axes.set_xlim(left=-bucket_s)
    axes.set_ylim(bottom=0)
    axes.set_xlabel(f"seconds since {_ms_text(bounds[0])} UTC")
    axes.set_ylabel("messages / s")
    axes.set_title(f"throughput per queue ({bucket_s:g} s buckets)")
    axes.legend(fontsize="small")
    return _png(fig)


def latency_plot(data: ReportData) -> str:
    """Histogram of transaction durations (local) and prepare→commit latency (XA)."""
    series = {label: values for label, values in data.latencies.items() if values}
    if not series:
        return _empty("no commit times in the journal")
    fig, axes = _figure()
    for label, values in series.items():
        axes.hist(values, bins=min(50, max(5, len(values))), alpha=0.6, label=label)
    axes.set_xlabel("ms")
    axes.set_ylabel("transactions")
    axes.set_title("commit latency")
    axes.legend(fontsize="small")
    return _png(fig)


def _bar_plot(labels: list[str], values: list[int], title: str, ylabel: str) -> str:
    if not labels:
        return _empty(f"nothing for {title}")
    fig, axes = _figure()
    axes.bar(labels, values, color="#4a7bb7")
    axes.set_title(title)
    axes.set_ylabel(ylabel)
    axes.tick_params(axis="x", labelrotation=30)
    return _png(fig)


def outcomes_plot(data: ReportData) -> str:
    """Transaction outcomes by kind and message fates."""
    fates: dict[str, int] = {}
    for _queue, fate, count, _lo, _hi in data.queue_fates:
        fates[fate] = fates.get(fate, 0) + count
    labels = [f"tx {kind}: {outcome}" for kind, outcome, _ in data.outcomes]
    labels += [f"msg: {fate}" for fate in sorted(fates)]
    values = [count for _, _, count in data.outcomes] + [fates[f] for f in sorted(fates)]
    return _bar_plot(labels, values, "outcomes", "count")


def top_queues_plot(data: ReportData) -> str:
    """The queues that received the most messages."""
    top = data.top_queues()
    return _bar_plot([queue for queue, _ in top], [count for _, count in top],
                     "top queues by messages", "messages")


def _ms_text(value: int | None) -> str:
    if not value:
        return "—"
    return datetime.fromtimestamp(value / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def operator_table(rows: list[Any]) -> str:
    """Every branch that needs an operator, with the command that completes it."""
    if not rows:
        return _empty("no branch needs an operator")
    cells = []
    for row in rows:
        if row.state == "prepared":
            action = f"txbroker xa commit {row.xid}  |  txbroker xa rollback {row.xid}"
        else:
            action = f"txbroker xa forget {row.xid}"
        cells.append(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
                row.xid, row.state, _ms_text(row.prepared_ms or row.created_ms),
                row.sends if row.sends is not None else "—",
                row.acks if row.acks is not None else "—", action)) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in
                   ("xid", "state", "prepared at (UTC)", "sends", "consumed", "operator action"))
    return f"<table><tr>{head}</tr>{''.join(cells)}</table>"


_STYLE: Final = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #bbb; padding: 4px 8px; text-align: left; font-size: 90%; }
th { background: #eee; }
.empty { color: #777; font-style: italic; }
img { max-width: 100%; }
"""


def write_report(tables: dict[str, Any], counts: dict[str, int], path: Path, *,
                 data: Path) -> ReportData:
    """Write ``report.html`` from the audit tables and their row counts; returns what
    it drew."""
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{v:,}</td></tr>"
                      for k, v in counts.items())
    gathered = gather(tables)
    sections = [
        ("Branches that need an operator", operator_table(gathered.operator_rows)),
        ("Throughput over time per queue", throughput_plot(gathered)),
        ("Commit latency", latency_plot(gathered)),
        ("Outcomes", outcomes_plot(gathered)),
        ("Top queues", top_queues_plot(gathered)),
    ]
    body = "".join(f"<h2>{html.escape(title)}</h2>{content}" for title, content in sections)
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>txbroker audit of {html.escape(str(data))}</title><style>{_STYLE}</style>"
        f"</head><body><h1>txbroker audit</h1><p>journal of <code>{html.escape(str(data))}"
        f"</code>, generated {html.escape(generated)}</p><table>{summary}</table>{body}"
        "</body></html>"
    )
    path.write_text(page, encoding="utf-8")
    return gathered
