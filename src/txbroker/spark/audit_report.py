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


def throughput_plot(messages: Any) -> str:
    """Messages sent per second over time, one line per (top) queue."""
    from pyspark.sql import functions as F

    timed = messages.where(F.col("sent_ms").isNotNull())
    bounds = timed.agg(F.min("sent_ms").alias("lo"), F.max("sent_ms").alias("hi")).first()
    if bounds is None or bounds.lo is None:
        return _empty("no message timestamps")
    bucket_ms = max(MIN_BUCKET_MS, (bounds.hi - bounds.lo) // THROUGHPUT_BUCKETS + 1)
    top = [row.queue for row in timed.groupBy("queue").count()
           .orderBy(F.desc("count")).limit(TOP_QUEUES).collect()]
    counts = (timed.where(F.col("queue").isin(top))
              .groupBy("queue", (F.col("sent_ms") / bucket_ms).cast("long").alias("bucket"))
              .count().orderBy("queue", "bucket").collect())
    first_bucket = bounds.lo // bucket_ms
    series: dict[str, tuple[list[float], list[float]]] = {}
    for row in counts:
        seconds, rates = series.setdefault(row.queue, ([], []))
        seconds.append((row.bucket - first_bucket) * bucket_ms / 1000)
        rates.append(row["count"] / (bucket_ms / 1000))
    fig, axes = _figure()
    for queue, (seconds, rates) in series.items():
        axes.plot(seconds, rates, marker="o", label=queue)
    axes.set_xlim(left=-bucket_ms / 1000)
    axes.set_ylim(bottom=0)
    axes.set_xlabel(f"seconds since {_ms_text(bounds.lo)} UTC")
    axes.set_ylabel("messages / s")
    axes.set_title(f"throughput per queue ({bucket_ms / 1000:g} s buckets)")
    axes.legend(fontsize="small")
    return _png(fig)


def latency_plot(transactions: Any) -> str:
    """Histogram of transaction durations (local) and prepare→commit latency (XA)."""
    from pyspark.sql import functions as F

    series = {
        "local: first send → commit": transactions.where(F.col("kind") == "local")
        .select(F.col("duration_ms").alias("ms")),
        "xa: prepare → commit": transactions.where(F.col("kind") == "xa")
        .select(F.col("commit_latency_ms").alias("ms")),
    }
    fig, axes = _figure()
    drawn = 0
    for label, frame in series.items():
        values = [row.ms for row in frame.where(F.col("ms").isNotNull())
                  .limit(MAX_LATENCY_SAMPLES).collect()]
        if values:
            axes.hist(values, bins=min(50, max(5, len(values))), alpha=0.6, label=label)
            drawn += 1
    if not drawn:
        return _empty("no commit times in the journal")
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


def outcomes_plot(transactions: Any, messages: Any) -> str:
    """Transaction outcomes by kind and message fates."""
    tx = transactions.groupBy("kind", "outcome").count().orderBy("kind", "outcome").collect()
    fates = messages.groupBy("fate").count().orderBy("fate").collect()
    labels = [f"tx {r.kind}: {r.outcome}" for r in tx] + [f"msg: {r.fate}" for r in fates]
    values = [r["count"] for r in tx] + [r["count"] for r in fates]
    return _bar_plot(labels, values, "outcomes", "count")


def top_queues_plot(messages: Any) -> str:
    """The queues that received the most messages."""
    from pyspark.sql import functions as F

    rows = (messages.groupBy("queue").count().orderBy(F.desc("count"), "queue")
            .limit(TOP_QUEUES).collect())
    return _bar_plot([r.queue for r in rows], [r["count"] for r in rows],
                     "top queues by messages", "messages")


def _ms_text(value: int | None) -> str:
    if not value:
        return "—"
    return datetime.fromtimestamp(value / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def operator_table(in_doubt: Any) -> str:
    """Every branch that needs an operator, with the command that completes it."""
    rows = in_doubt.orderBy("position").collect()
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
                 data: Path) -> Path:
    """Write ``report.html`` from the audit tables and their row counts; returns its path."""
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{v:,}</td></tr>"
                      for k, v in counts.items())
    sections = [
        ("Branches that need an operator", operator_table(tables["in_doubt"])),
        ("Throughput over time per queue", throughput_plot(tables["messages"])),
        ("Commit latency", latency_plot(tables["transactions"])),
        ("Outcomes", outcomes_plot(tables["transactions"], tables["messages"])),
        ("Top queues", top_queues_plot(tables["messages"])),
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
    return path
