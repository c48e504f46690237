"""The ``txbroker`` Spark connectors against a real broker, in the shared local session.

Streaming reads copy queues to Parquet with ``trigger(availableNow=True)``;
streaming writes read Parquet files and write a queue; the checks read the
broker back with the plain client. Unit tests of the pure parts (ranges,
row budgets, Arrow building, schema checks) need no Spark.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import txbroker
from tests.support import STORES, BrokerProcess
from txbroker.spark._common import ReadOptions, SparkConnectorError, WriteOptions
from txbroker.spark.schema import BatchBuilder, outgoing_chunks
from txbroker.spark.source import share_rows, split_ranges

pytestmark = pytest.mark.timeout(300)


# -- helpers ---------------------------------------------------------------------------


#: The cases that also run on the dir store (FDATASYNC,DSYNC; issue 17): a stream
#: reader, the sink's exactly-once write, and a batch write read back. The others use
#: the same broker calls and stay on the journal to keep the Spark run short.
ON_BOTH_STORES = pytest.mark.parametrize("store", STORES)


def fill(url: str, queue: str, count: int, *, start: int = 0, json_bodies: bool = False) -> None:
    """Declare ``queue`` and send ``count`` messages m-<i> (key k<i mod 3>)."""
    with txbroker.connect(url) as conn:
        conn.declare_queue(queue)
        bodies = [
            (json.dumps({"id": i, "name": f"n{i}"}) if json_bodies else f"m-{i}").encode()
            for i in range(start, start + count)
        ]
        headers = [{"key": f"k{i % 3}", "h": str(i)} for i in range(start, start + count)]
        ids = [f"id-{i}" for i in range(start, start + count)]
        conn.send_batch(queue, bodies, headers=headers, message_ids=ids)


def drain(url: str, queue: str) -> list[Any]:
    """Consume every message of ``queue`` (acked)."""
    out = []
    with txbroker.connect(url) as conn:
        while (msg := conn.receive(queue, timeout=1.0)) is not None:
            out.append(msg)
            msg.ack(wait=True)
    return out


def run_available_now(df: Any, checkpoint: Path, out: Path, **options: str) -> None:
    """Copy a streaming DataFrame to Parquet until it has read what was there."""
    writer = (df.writeStream.format("parquet").option("path", str(out))
              .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True))
    query = writer.start()
    query.awaitTermination(120)
    assert not query.isActive
    if query.exception() is not None:
        raise AssertionError(str(query.exception()))


def offsets(checkpoint: Path) -> list[dict[str, int]]:
    """The source offsets Spark logged, batch by batch."""
    files = sorted((checkpoint / "offsets").iterdir(), key=lambda p: int(p.name)
                   if p.name.isdigit() else -1)
    return [json.loads(p.read_text().splitlines()[-1]) for p in files if p.name.isdigit()]


def stream(spark: Any, url: str, queues: str, **options: str) -> Any:
    reader = spark.readStream.format("txbroker").option("url", url).option("queues", queues)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def auth_broker(tmp_path: Path, extra: str = "") -> Iterator[BrokerProcess]:
    from txbroker.server.security.auth import hash_password

    config = tmp_path / "broker.toml"
    config.write_text(f'{extra}[users]\nalice = "{hash_password("s3cret")}"\n')
    with BrokerProcess(tmp_path / "data", "--config", str(config)) as proc:
        yield proc


# -- pure parts ------------------------------------------------------------------------


def test_ranges_and_row_budget() -> None:
    assert [(r.start, r.end) for r in split_ranges("q", 1, 11, 4)] == [(1, 5), (5, 9), (9, 11)]
    assert split_ranges("q", 5, 5, 4) == []
    assert share_rows({"a": 10, "b": 0}, 4) == {"a": 4, "b": 0}
    assert share_rows({"a": 3, "b": 2}, 10) == {"a": 3, "b": 2}
    shares = share_rows({"a": 5, "b": 5, "c": 1}, 4)
    assert sum(shares.values()) == 4 and all(shares[q] <= w for q, w in
                                             {"a": 5, "b": 5, "c": 1}.items())


def test_options_name_what_is_wrong() -> None:
    with pytest.raises(SparkConnectorError, match="'url'"):
        ReadOptions.parse({"queues": "a"})
    with pytest.raises(SparkConnectorError, match="'queues'"):
        ReadOptions.parse({"url": "txb://h:1"})
    with pytest.raises(SparkConnectorError, match="'jsonSchema'"):
        ReadOptions.parse({"url": "txb://h:1", "queues": "a", "format": "json"})
    with pytest.raises(SparkConnectorError, match="'maxRowsPerTrigger'"):
        ReadOptions.parse({"url": "txb://h:1", "queues": "a", "maxrowspertrigger": "x"})
    with pytest.raises(SparkConnectorError, match="'sinkId'"):
        WriteOptions.parse({"url": "txb://h:1", "queue": "a"}, streaming=True)
    with pytest.raises(SparkConnectorError, match="'queue'"):
        WriteOptions.parse({"url": "txb://h:1"}, streaming=False)
    parsed = ReadOptions.parse({"url": "txb://h:1", "queues": "a, b,a"})
    assert parsed.queues == ("a", "b") and parsed.partition_size == 100_000


def test_arrow_batches_from_a_page() -> None:
    from txbroker.client.streams import StreamChunk

    schema = pa.schema([
        ("queue", pa.string()), ("seq", pa.int64()), ("message_id", pa.string()),
        ("key", pa.string()), ("body", pa.struct([("id", pa.int64()), ("name", pa.string())])),
        ("headers", pa.map_(pa.string(), pa.string())),
        ("timestamp", pa.timestamp("us", tz="UTC")), ("redelivered", pa.bool_()),
    ])
    chunk = StreamChunk.of(
        "q", 4, seqs=[1, 2, 3], message_ids=["a", None, "c"],
        headers=[{"key": "k"}, None, {"x": "y"}], timestamps=[1000, 2000, 3000],
        delivery_counts=[0, 2, 0],
        bodies=[b'{"id": 1, "name": "one"}', b"not json", b'{"id": 3}'])
    batch = BatchBuilder(schema, "json").build("q", chunk)
    assert batch.schema.equals(schema)
    rows = batch.to_pylist()
    assert [r["seq"] for r in rows] == [1, 2, 3]
    assert [r["message_id"] for r in rows] == ["a", None, "c"]
    assert [r["body"] for r in rows] == [{"id": 1, "name": "one"}, None,
                                         {"id": 3, "name": None}]
    assert [r["key"] for r in rows] == ["k", None, None]
    assert [r["redelivered"] for r in rows] == [False, True, False]
    assert [r["timestamp"].timestamp() for r in rows] == [1.0, 2.0, 3.0]
    assert rows[2]["headers"] == [("x", "y")] and rows[1]["headers"] == []
    # a page of plain bodies: no ids, no headers; binary, text and JSON lines
    plain = StreamChunk.of("q", 9, seqs=[7, 8], bodies=[b'{"id": 7}', b'{"id": 8, "x": [1]}'])
    rows = BatchBuilder(schema, "json").build("q", plain).to_pylist()
    assert [(r["seq"], r["body"], r["message_id"], r["headers"]) for r in rows] == [
        (7, {"id": 7, "name": None}, None, []), (8, {"id": 8, "name": None}, None, [])]
    multi = StreamChunk.of("q", 3, seqs=[1, 2], bodies=[b'{"id":\n 1}', b""])
    assert [r["body"] for r in BatchBuilder(schema, "json").build("q", multi).to_pylist()] == [
        {"id": 1, "name": None}, None]
    text_schema = schema.set(schema.get_field_index("body"), pa.field("body", pa.string()))
    rows = BatchBuilder(text_schema, "text").build(
        "q", StreamChunk.of("q", 3, seqs=[1, 2], bodies=["zürich".encode(), b"\xff"])).to_pylist()
    assert [r["body"] for r in rows] == ["zürich", "\ufffd"]


def test_outgoing_chunks_stay_under_the_frame() -> None:
    body = b"x" * (1024 * 1024)
    batch = pa.record_batch({"body": pa.array([body] * 9, pa.binary()),
                             "key": pa.array(["k"] * 9, pa.string())})
    chunks = list(outgoing_chunks(batch))
    assert sum(len(c.bodies) for c in chunks) == 9 and len(chunks) == 3
    assert chunks[0].headers == [{"key": "k"}] * 3 and chunks[0].message_ids is None
    head, tail = chunks[0].split(2)
    assert len(head.bodies) == 2 and tail is not None and tail.headers == [{"key": "k"}]
    assert chunks[0].split(3) == (chunks[0], None)


# -- streaming read --------------------------------------------------------------------


@ON_BOTH_STORES
def test_stream_read_exactly_once_to_parquet(spark: Any, broker: BrokerProcess,
                                             tmp_path: Path) -> None:
    url = broker.url
    fill(url, "orders", 50)
    checkpoint, out = tmp_path / "cp", tmp_path / "out"
    run_available_now(stream(spark, url, "orders", name="copy"), checkpoint, out)

    rows = spark.read.parquet(str(out)).orderBy("seq").collect()
    assert [r.body for r in rows] == [b"m-%d" % i for i in range(50)]
    assert [r.seq for r in rows] == list(range(1, 51))
    assert [r.key for r in rows] == [f"k{i % 3}" for i in range(50)]
    assert [r.message_id for r in rows] == [f"id-{i}" for i in range(50)]
    assert rows[7].headers == {"key": "k1", "h": "7"} and rows[0].queue == "orders"
    assert not any(r.redelivered for r in rows) and rows[0].timestamp is not None
    assert offsets(checkpoint) == [{"orders": 51}]

    fill(url, "orders", 20, start=50)
    run_available_now(stream(spark, url, "orders", name="copy"), checkpoint, out)
    rows = spark.read.parquet(str(out)).collect()
    assert sorted(r.seq for r in rows) == list(range(1, 71))          # each message once
    assert sorted(r.body for r in rows) == sorted(b"m-%d" % i for i in range(70))
    assert offsets(checkpoint) == [{"orders": 51}, {"orders": 71}]
    with txbroker.connect(url) as conn:  # batch 0 was released; batch 1 is not yet
        info = conn.stream_info("orders")
        assert (info.first, info.next) == (51, 71)


def test_max_rows_per_trigger_and_two_queues(spark: Any, broker: BrokerProcess,
                                            tmp_path: Path) -> None:
    url = broker.url
    fill(url, "a", 10)
    fill(url, "b", 5)
    checkpoint, out = tmp_path / "cp", tmp_path / "out"
    df = stream(spark, url, "a,b", name="capped", maxRowsPerTrigger="6", partitionSize="2")
    run_available_now(df, checkpoint, out)
    logged = offsets(checkpoint)
    sizes = [sum(end[q] - start.get(q, 1) for q in end)
             for start, end in zip([{"a": 1, "b": 1}, *logged], logged, strict=False)]
    assert sizes == [6, 6, 3]
    assert logged[-1] == {"a": 11, "b": 6}
    rows = spark.read.parquet(str(out)).collect()
    assert sorted((r.queue, r.seq) for r in rows) == sorted(
        [("a", s) for s in range(1, 11)] + [("b", s) for s in range(1, 6)])


def test_json_format_with_schema(spark: Any, broker: BrokerProcess) -> None:
    url = broker.url
    fill(url, "events", 5, json_bodies=True)
    with txbroker.connect(url) as conn:
        conn.send("events", b"{broken")
    df = (spark.read.format("txbroker").option("url", url).option("queues", "events")
          .option("format", "json").option("jsonSchema", "id long, name string").load())
    assert df.schema["body"].dataType.simpleString() == "struct<id:bigint,name:string>"
    rows = df.orderBy("seq").select("seq", "body.id", "body.name").collect()
    assert [(r.id, r.name) for r in rows] == [(i, f"n{i}") for i in range(5)] + [(None, None)]
    text = (spark.read.format("txbroker").option("url", url).option("queues", "events")
            .option("format", "text").load().orderBy("seq").collect())
    assert text[-1].body == "{broken"


def test_columns_option_chooses_and_orders_the_columns(spark: Any, broker: BrokerProcess,
                                                       tmp_path: Path) -> None:
    url = broker.url
    fill(url, "picked", 4, json_bodies=True)
    df = (spark.read.format("txbroker").option("url", url).option("queues", "picked")
          .option("columns", "seq, body,key").option("format", "json")
          .option("jsonSchema", "id long").load())
    assert df.schema.simpleString() == "struct<seq:bigint,body:struct<id:bigint>,key:string>"
    assert [tuple(r) for r in df.orderBy("seq").collect()] == [
        (i + 1, (i,), f"k{i % 3}") for i in range(4)]
    out, checkpoint = tmp_path / "out", tmp_path / "cp"
    run_available_now(stream(spark, url, "picked", name="picked-copy", columns="headers,seq"),
                      checkpoint, out)
    rows = spark.read.parquet(str(out)).orderBy("seq").collect()
    assert [r.seq for r in rows] == [1, 2, 3, 4]
    assert rows[0].headers == {"key": "k0", "h": "0"}
    with pytest.raises(Exception, match="option 'columns': 'payload' is not a column"):
        (spark.read.format("txbroker").option("url", url).option("queues", "picked")
         .option("columns", "seq,payload").load().collect())
    with pytest.raises(SparkConnectorError, match="names a column twice"):
        ReadOptions.parse({"url": url, "queues": "picked", "columns": "seq,seq"})


# -- writes ----------------------------------------------------------------------------


@ON_BOTH_STORES
def test_stream_write_exactly_once(spark: Any, broker: BrokerProcess, tmp_path: Path) -> None:
    url = broker.url
    source = tmp_path / "in"
    rows = [(f"row-{i}".encode(), f"k{i % 4}", {"n": str(i)}, f"w-{i}") for i in range(300)]
    (spark.createDataFrame(rows, "body binary, key string, headers map<string,string>, "
                                 "message_id string")
     .repartition(3).write.parquet(str(source)))
    checkpoint = tmp_path / "cp"

    def run() -> None:
        df = spark.readStream.schema(spark.read.parquet(str(source)).schema).parquet(str(source))
        query = (df.writeStream.format("txbroker").option("url", url).option("queue", "copy")
                 .option("sinkId", "copy-sink").option("checkpointLocation", str(checkpoint))
                 .option("rowsPerBranch", "40")  # ~100 rows a task: several branches each
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
        assert query.exception() is None, str(query.exception())

    run()
    run()  # a restart from the checkpoint writes nothing again
    received = drain(url, "copy")
    assert sorted(m.body for m in received) == sorted(r[0] for r in rows)
    by_body = {m.body: m for m in received}
    assert by_body[b"row-7"].headers["key"] == "k3" and by_body[b"row-7"].headers["n"] == "7"
    assert by_body[b"row-7"].message_id == "w-7"
    with txbroker.connect(url) as conn:
        assert conn.sink_status("copy-sink") == 0
        assert conn.tpc_recover() == []


@ON_BOTH_STORES
def test_batch_write_read_round_trip(spark: Any, broker: BrokerProcess) -> None:
    url = broker.url
    with txbroker.connect(url) as conn:
        conn.declare_queue("rt")
    df = spark.createDataFrame([(f"text-{i}", f"k{i}") for i in range(120)],
                               "body string, key string")
    df.repartition(4).write.format("txbroker").option("url", url).option("queue", "rt") \
        .mode("append").save()

    def read(**options: str) -> list[Any]:
        reader = spark.read.format("txbroker").option("url", url).option("queues", "rt")
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load().collect()

    rows = read(format="text", partitionSize="50")
    assert sorted((r.body, r.key) for r in rows) == sorted((f"text-{i}", f"k{i}")
                                                           for i in range(120))
    assert sorted(r.seq for r in rows) == list(range(1, 121))
    assert len(read()) == 120                            # a snapshot does not consume
    assert len(read(consume="true")) == 120
    assert read() == []                                  # consumed: released in the broker
    with txbroker.connect(url) as conn:
        info = conn.stream_info("rt")
        assert info.first == info.next == 121
        assert conn.tpc_recover() == []


# -- bad input -------------------------------------------------------------------------


def test_unknown_queue_names_the_option(spark: Any, broker: BrokerProcess,
                                        tmp_path: Path) -> None:
    reader = spark.read.format("txbroker").option("url", broker.url).option("queues", "nope")
    with pytest.raises(Exception, match=r"option 'queues': queue 'nope' does not exist"):
        reader.load().collect()
    with pytest.raises(Exception, match=r"option 'queues': queue 'nope' does not exist"):
        run_available_now(stream(spark, broker.url, "nope"), tmp_path / "cp", tmp_path / "o")


def test_missing_options_and_columns(spark: Any, broker: BrokerProcess) -> None:
    with pytest.raises(Exception, match=r"option 'url' is required"):
        spark.read.format("txbroker").option("queues", "a").load().collect()
    with pytest.raises(Exception, match=r"option 'queues' is required"):
        spark.read.format("txbroker").option("url", broker.url).load().collect()
    df = spark.createDataFrame([(b"x", "p")], "body binary, payload string")
    with pytest.raises(Exception, match=r"column 'payload' cannot be written"):
        df.write.format("txbroker").option("url", broker.url).option("queue", "q") \
            .mode("append").save()
    with pytest.raises(Exception, match=r"column 'body' is required"):
        df.select("payload").write.format("txbroker").option("url", broker.url) \
            .option("queue", "q").mode("append").save()
    with pytest.raises(Exception, match=r"option 'queue' is required"):
        df.select("body").write.format("txbroker").option("url", broker.url) \
            .mode("append").save()
    with txbroker.connect(broker.url) as conn:  # nothing was sent anywhere
        assert [q["name"] for q in conn.queues() if q["name"] == "q"] == []


def test_wrong_password_names_the_url(spark: Any, tmp_path: Path) -> None:
    for proc in auth_broker(tmp_path):
        url = f"txb://alice:wrong@127.0.0.1:{proc.port}"
        with pytest.raises(Exception, match=r"option 'url': the broker refused the credentials"):
            spark.read.format("txbroker").option("url", url).option("queues", "a").load() \
                .collect()


def test_too_large_row_writes_nothing(spark: Any, tmp_path: Path) -> None:
    for proc in auth_broker(tmp_path, "[limits]\nmax_message_size = 1024\n\n"):
        url = f"txb://alice:s3cret@127.0.0.1:{proc.port}"
        with txbroker.connect(url) as conn:
            conn.declare_queue("big")
        rows = [(b"small-%d" % i,) for i in range(40)] + [(b"x" * 2000,)]
        df = spark.createDataFrame(rows, "body binary").repartition(4)
        with pytest.raises(Exception, match=r"column 'body': a row is too large"):
            df.write.format("txbroker").option("url", url).option("queue", "big") \
                .mode("append").save()
        with txbroker.connect(url) as conn:
            info = conn.stream_info("big")
            assert info.first == info.next           # nothing committed, not even small rows
            assert conn.tpc_recover() == []          # and no branch left prepared
