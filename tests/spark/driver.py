"""A Spark driver process for the exactly-once crash tests (tests/spark/test_exactly_once.py).

    python -m tests.spark.driver read  URL QUEUE OUT CHECKPOINT NAME STOPFILE
    python -m tests.spark.driver write URL QUEUE SOURCE CHECKPOINT SINK_ID STOPFILE

``read`` copies QUEUE to Parquet files in OUT (a stream with a 0.5 s trigger and
at most 300 rows per batch); ``write`` streams the JSON-lines files of SOURCE
(one file per batch) into QUEUE through the exactly-once sink. Both run until
STOPFILE exists (``write``: or until every file is done), then stop cleanly.
The process is started in its own process group, so that a ``kill`` fault
point (``TXBROKER_SPARK_FAULTS``) or the test kills the driver, its JVM and its
Python workers together. It prints ``batch <id>`` for every finished batch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    mode, url, queue, path, checkpoint, name, stop_file = argv
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import txbroker.spark

    spark = (SparkSession.builder.master("local[2,2]").appName(f"txbroker-{mode}-driver")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    txbroker.spark.register(spark)
    if mode == "read":
        query = (spark.readStream.format("txbroker").option("url", url).option("queues", queue)
                 .option("name", name).option("maxRowsPerTrigger", "3000")
                 .option("partitionSize", "1000").load()
                 .select("seq", "message_id", "body")
                 .writeStream.format("parquet").option("path", path)
                 .option("checkpointLocation", checkpoint)
                 .trigger(processingTime="500 milliseconds").start())
    else:
        query = (spark.readStream.schema("id long").option("maxFilesPerTrigger", "1").json(path)
                 .selectExpr("CAST(id AS STRING) AS body", "CAST(id AS STRING) AS key")
                 .repartition(2)
                 .writeStream.format("txbroker").option("url", url).option("queue", queue)
                 .option("sinkId", name).option("checkpointLocation", checkpoint)
                 .trigger(processingTime="200 milliseconds").start())
    files = len(list(Path(path).glob("*.json"))) if mode == "write" else 0
    seen = -1
    while query.isActive and not Path(stop_file).exists():
        progress = query.lastProgress
        if progress and progress["batchId"] != seen:
            seen = progress["batchId"]
            print(f"batch {seen}", flush=True)
        time.sleep(0.2)
        if mode == "write" and files and _written_all(checkpoint, files):
            break
    query.stop()
    exception = query.exception()
    spark.stop()
    if exception is not None:
        print(f"query failed: {exception}", file=sys.stderr, flush=True)
        return 3
    return 0


def _written_all(checkpoint: str, files: int) -> bool:
    """Every source file is in a batch that Spark's commit log holds."""
    commits = Path(checkpoint) / "commits"
    offsets = Path(checkpoint) / "sources" / "0"
    if not commits.is_dir() or not offsets.is_dir():
        return False
    committed = {p.name for p in commits.iterdir() if p.name.isdigit()}
    sources = [p for p in offsets.iterdir() if p.name.isdigit()]
    done = 0
    for log in sources:
        if log.name in committed:
            done += sum(1 for line in log.read_text().splitlines() if line.startswith("{"))
    return done >= files


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
