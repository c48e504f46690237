"""Spark connector figures (issue 6), in one run on one machine.

1. **Ingest**: N small JSON messages from a txbroker queue to Parquet with a
   streaming query and ``trigger(availableNow=True)`` (``format=json`` with a
   schema), against Spark reading the same rows from local JSON-lines files
   into Parquet. Aim: txbroker >= 50 % of the file source's rate. Measured
   twice: with all eight source columns, and with ``columns=seq,body``.
2. **Streaming write**: N rows from a streaming source (Parquet files read as a
   stream) into a queue through the exactly-once sink. Aim: >= 100,000 rows/s.

Each is run ``--reps`` times; the median is reported, with every figure, as
JSON in ``bench/results/spark-<time>.json``::

    flock /tmp/txb-bench.lock .venv/bin/python bench/spark_bench.py --count 1000000 --reps 3

What is the broker's and what is Spark's: before an ingest is timed, one
``stream_info`` builds the broker's per-queue seq index (done once per queue
and broker run, on its first stream use; timed apart as ``broker_index_s``);
``broker_read_s`` is one plain client paging through the same queue (the
broker's pages plus the client, without Spark); ``broker_cpu_s`` is the
broker process's CPU seconds during each ingest. The machine's load average
(``os.getloadavg()``) is recorded at the start and after every rep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import BrokerProcess  # noqa: E402

import txbroker  # noqa: E402

SCHEMA = "id long, name string, amount double, at long"


def row(i: int) -> bytes:
    return json.dumps({"id": i, "name": f"customer-{i % 997}", "amount": i * 0.25,
                       "at": 1_700_000_000_000 + i}, separators=(",", ":")).encode()


def session(cores: int):  # type: ignore[no-untyped-def]
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import txbroker.spark

    spark = (SparkSession.builder.master(f"local[{cores}]").appName("txbroker-bench")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", str(cores))
             .config("spark.driver.memory", "4g")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    txbroker.spark.register(spark)
    return spark


def fill(url: str, queue: str, count: int) -> float:
    """Send the rows; returns the seconds of the queue's first stream use (the broker
    builds its seq index of the queue then), which no ingest should be timed with."""
    with txbroker.connect(url) as conn:
        for start in range(0, count, 20_000):
            conn.send_batch(queue, [row(i) for i in range(start, min(count, start + 20_000))])
        started = time.perf_counter()
        conn.stream_info(queue)
        return time.perf_counter() - started


def broker_read(url: str, queue: str, count: int) -> float:
    """Seconds for one plain client to page through the queue as a read task does."""
    from txbroker.spark._common import READ_PAGE_BYTES, READ_PAGE_MESSAGES

    started = time.perf_counter()
    with txbroker.connect(url) as conn:
        info = conn.stream_info(queue)
        position, got = info.first, 0
        while position < info.next:
            chunk = conn.stream_read(queue, position, info.next, max_messages=READ_PAGE_MESSAGES,
                                     max_bytes=READ_PAGE_BYTES)
            got += chunk.count
            position = chunk.next
    assert got == count, f"read {got} of {count}"
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ingest_broker(spark, url: str, queue: str, work: Path, count: int,  # type: ignore[no-untyped-def]
                  partition_size: int, columns: str | None = None) -> float:
    out, checkpoint = work / f"out-broker-{columns}", work / f"cp-broker-{columns}"
    started = time.perf_counter()
    reader = (spark.readStream.format("txbroker").option("url", url).option("queues", queue)
              .option("name", f"bench-{time.time_ns()}").option("format", "json")
              .option("jsonSchema", SCHEMA).option("partitionSize", str(partition_size)))
    if columns is not None:
        reader = reader.option("columns", columns)
    query = (reader.load().select("seq", "body.*")
             .writeStream.format("parquet").option("path", str(out))
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    elapsed = time.perf_counter() - started
    got = spark.read.parquet(str(out)).count()
    assert got == count, f"broker ingest wrote {got} rows, not {count}"
    return elapsed


def ingest_files(spark, source: Path, work: Path, count: int) -> float:  # type: ignore[no-untyped-def]
    out, checkpoint = work / "out-files", work / "cp-files"
    started = time.perf_counter()
    query = (spark.readStream.format("json").schema(SCHEMA).load(str(source))
             .writeStream.format("parquet").option("path", str(out))
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    elapsed = time.perf_counter() - started
    got = spark.read.parquet(str(out)).count()
    assert got == count, f"file ingest wrote {got} rows, not {count}"
    return elapsed


def stream_write(spark, url: str, source: Path, work: Path, count: int,  # type: ignore[no-untyped-def]
                 queue: str) -> float:
    checkpoint = work / f"cp-write-{queue}"
    started = time.perf_counter()
    query = (spark.readStream.schema("body string").parquet(str(source))
             .writeStream.format("txbroker").option("url", url).option("queue", queue)
             .option("sinkId", queue).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    elapsed = time.perf_counter() - started
    with txbroker.connect(url) as conn:
        info = conn.stream_info(queue)
        assert info.next - info.first == count, f"{queue} holds {info.next - info.first}"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--partition-size", type=int, default=500_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="txb-spark-bench-"))
    broker = BrokerProcess(work / "data").start()
    figures: dict[str, list[float]] = {"ingest_broker_s": [], "ingest_broker_pruned_s": [],
                                       "ingest_files_s": [], "stream_write_s": [],
                                       "broker_index_s": [], "broker_read_s": [],
                                       "broker_cpu_s": [], "broker_cpu_pruned_s": []}
    load = {"start": os.getloadavg()[0], "reps": [], "end": 0.0}
    try:
        spark = session(args.cores)
        lines = work / "jsonl"
        lines.mkdir()
        per_file = args.count // 4
        for part in range(4):
            with open(lines / f"part-{part}.json", "wb") as out:
                for i in range(part * per_file, (part + 1) * per_file):
                    out.write(row(i) + b"\n")
        bodies = work / "bodies"
        spark.read.text(str(lines)).withColumnRenamed("value", "body") \
            .repartition(args.cores).write.parquet(str(bodies))
        # warm up: the JVM's code paths and Spark's Python workers, one per core (the
        # first batch of a session costs 10-15 s more; a worker's first task about
        # 1 s); not counted
        fill(broker.url, "warm-up", 10_000)
        warm = work / "warm"
        ingest_files(spark, lines, warm, args.count)
        ingest_broker(spark, broker.url, "warm-up", warm, 10_000, 10_000 // (2 * args.cores))
        stream_write(spark, broker.url, bodies, warm, args.count, "warm-up-written")
        with txbroker.connect(broker.url) as conn:
            conn.delete_queue("warm-up")
            conn.delete_queue("warm-up-written")
        shutil.rmtree(warm, ignore_errors=True)
        for rep in range(args.reps):
            queue = f"ingest-{rep}"
            figures["broker_index_s"].append(fill(broker.url, queue, args.count))
            figures["broker_read_s"].append(broker_read(broker.url, queue, args.count))
            run = work / f"run-{rep}"
            figures["ingest_files_s"].append(ingest_files(spark, lines, run, args.count))
            # Spark ends a Python worker idle for a minute, and filling the queue takes
            # about that: a few rows through the source start them again (not counted;
            # a cold worker's first task costs about a second more)
            fill(broker.url, "warm-up", 100)
            ingest_broker(spark, broker.url, "warm-up", run / "warm", 100, 50)
            with txbroker.connect(broker.url) as conn:
                conn.delete_queue("warm-up")
            before = cpu_seconds(broker.proc.pid)
            figures["ingest_broker_s"].append(
                ingest_broker(spark, broker.url, queue, run, args.count, args.partition_size))
            figures["broker_cpu_s"].append(cpu_seconds(broker.proc.pid) - before)
            # the same query with option columns=seq,body (no JVM work for unused columns);
            # a new stream reader name reads the queue again from its start
            before = cpu_seconds(broker.proc.pid)
            figures["ingest_broker_pruned_s"].append(
                ingest_broker(spark, broker.url, queue, run, args.count, args.partition_size,
                              columns="seq,body"))
            figures["broker_cpu_pruned_s"].append(cpu_seconds(broker.proc.pid) - before)
            figures["stream_write_s"].append(
                stream_write(spark, broker.url, bodies, run, args.count, f"written-{rep}"))
            load["reps"].append(os.getloadavg()[0])
            print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in figures.items())
                  + f", load {load['reps'][-1]:.2f}", flush=True)
            with txbroker.connect(broker.url) as conn:
                conn.delete_queue(queue)
                conn.delete_queue(f"written-{rep}")
            shutil.rmtree(run, ignore_errors=True)
        spark.stop()
    finally:
        broker.kill()
    load["end"] = os.getloadavg()[0]
    median = {k: statistics.median(v) for k, v in figures.items()}
    result = {
        "count": args.count, "reps": args.reps, "cores": args.cores,
        "partition_size": args.partition_size, "load_average": load, "figures": figures,
        "medians_s": median,
        "ingest_broker_rows_s": args.count / median["ingest_broker_s"],
        "ingest_files_rows_s": args.count / median["ingest_files_s"],
        "ingest_ratio": median["ingest_files_s"] / median["ingest_broker_s"],
        "ingest_pruned_rows_s": args.count / median["ingest_broker_pruned_s"],
        "ingest_pruned_ratio": median["ingest_files_s"] / median["ingest_broker_pruned_s"],
        "stream_write_rows_s": args.count / median["stream_write_s"],
        "broker_read_rows_s": args.count / median["broker_read_s"],
    }
    print(json.dumps(result, indent=2))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / f"spark-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(result, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
