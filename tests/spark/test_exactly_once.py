"""Exactly once through crashes: real Spark driver processes (tests/spark/driver.py)
killed with SIGKILL mid-batch, a broker killed and restarted, task failures,
a driver killed between the sink's commit and Spark's commit log, and a sink
commit that raises. Each test checks the output by count and by set of ids.

Both take the ``store`` fixture (tests/spark/conftest.py) and so run on either store;
they run on the journal only (about 60 and 85 s each): the dir store's sink and stream
reader are covered by the connector tests that run on both stores
(``ON_BOTH_STORES`` in test_connectors.py) and tests/server/test_streams.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyspark  # noqa: F401 - the driver processes run it; missing, collection fails
import pytest

import txbroker
from tests.support import ROOT, BrokerProcess, store_args
from txbroker.errors import TxBrokerError


class Driver:
    """``python -m tests.spark.driver …`` in its own process group."""

    def __init__(self, tmp: Path, args: list[str], faults: Path | None = None) -> None:
        self.args = args
        self.stop_file = tmp / f"stop-{args[0]}"
        self.log = tmp / f"driver-{args[0]}.log"
        self.env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
        if faults is not None:
            self.env["TXBROKER_SPARK_FAULTS"] = str(faults)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Driver:
        self.stop_file.unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.spark.driver", *self.args, str(self.stop_file)],
                cwd=ROOT, env=self.env, stdout=log, stderr=log, start_new_session=True)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"driver still running after {timeout} s: "
                                 f"{self.log.read_text()[-3000:]}") from None

    def stop(self, timeout: float = 120) -> int:
        self.stop_file.touch()
        return self.wait(timeout)

    def batches(self) -> int:
        return self.log.read_text().count("\nbatch ") if self.log.exists() else 0


@pytest.fixture
def drivers(java: None) -> Iterator[list[Driver]]:
    started: list[Driver] = []
    yield started
    for driver in started:
        driver.kill()


class Producer(threading.Thread):
    """Sends ``m-<n>`` (message id = body), 20 every 0.1 s, until stopped; a batch that
    fails (broker killed) is sent again with the same ids, so each is stored once."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.url, self.queue = url, queue
        self.sent: list[str] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = txbroker.connect(self.url, timeout=60)
            while not self.halt.is_set():
                ids = [f"m-{n}" for n in range(len(self.sent), len(self.sent) + 20)]
                while True:
                    try:
                        conn.send_batch(self.queue, [i.encode() for i in ids], message_ids=ids)
                        break
                    except TxBrokerError:
                        time.sleep(0.2)  # the broker is restarting: the client fails over
                self.sent += ids
                time.sleep(0.1)
            conn.close()
        except BaseException as exc:  # reported by the test
            self.error = exc


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(900)
def test_streaming_read_is_exactly_once_through_driver_and_broker_kills(
        tmp_path: Path, spark: Any, drivers: list[Driver], store: str) -> None:
    broker = BrokerProcess(tmp_path / "data", *store_args(store)).start()
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"source.read": {"batch": 3, "action": "kill"}}))
    producer = Producer(broker.url, "orders")
    try:
        with txbroker.connect(broker.url) as conn:
            conn.declare_queue("orders")
        producer.start()
        args = ["read", broker.url, "orders", str(out), str(checkpoint), "orders-copy"]
        first = Driver(tmp_path, args, faults).start()
        drivers.append(first)
        # the fault point kills the whole driver (JVM and workers) while batch 3 is read
        assert first.wait(240) == -signal.SIGKILL
        assert Path(f"{faults}.source.read.fired").exists()
        second = Driver(tmp_path, args).start()  # restarts from its checkpoint
        drivers.append(second)
        wait_until(lambda: second.batches() >= 2, 240, "the restarted driver's batches")
        broker.kill()  # kill -9 the broker under the running query and the producer
        time.sleep(1)
        broker.start()
        wait_until(lambda: second.batches() >= 6, 240, "batches after the broker restart")
        producer.halt.set()
        producer.join(60)
        assert producer.error is None, producer.error
        sent = set(producer.sent)

        def copied() -> int:
            if not (out / "_spark_metadata").is_dir():
                return 0
            return int(spark.read.parquet(str(out)).count())

        wait_until(lambda: copied() >= len(sent), 240, f"{len(sent)} rows in the output")
        assert second.stop() == 0
    finally:
        producer.halt.set()
        broker.kill()
    rows = spark.read.parquet(str(out)).select("message_id", "seq").collect()
    ids = [r["message_id"] for r in rows]
    assert len(ids) == len(sent), f"{len(ids)} rows for {len(sent)} messages"
    assert set(ids) == sent
    assert sorted(r["seq"] for r in rows) == list(range(1, len(sent) + 1))


@pytest.mark.timeout(900)
def test_streaming_write_is_exactly_once_through_failures_and_a_driver_kill(
        tmp_path: Path, drivers: list[Driver], store: str) -> None:
    broker = BrokerProcess(tmp_path / "data", *store_args(store)).start()
    source, checkpoint = tmp_path / "source", tmp_path / "checkpoint"
    source.mkdir()
    rows_per_file, files = 400, 6
    for n in range(files):  # one file per micro-batch
        lines = [json.dumps({"id": n * rows_per_file + i}) for i in range(rows_per_file)]
        (source / f"part-{n:02d}.json").write_text("\n".join(lines) + "\n")
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({
        "sink.write": {"batch": 1, "action": "raise"},  # a task fails; Spark retries it
        "sink.committed": {"batch": 2, "action": "kill"},  # after the sink's commit
        "sink.commit": {"batch": 4, "action": "raise"},  # commit raises once: Spark aborts
    }))
    args = ["write", broker.url, "written", str(source), str(checkpoint), "writer-1"]
    try:
        first = Driver(tmp_path, args, faults).start()
        drivers.append(first)
        assert first.wait(240) == -signal.SIGKILL  # killed after batch 2's sink commit
        second = Driver(tmp_path, args, faults).start()  # replays batch 2: rolled back
        drivers.append(second)
        code = second.wait(240)  # batch 4's commit raises: the query fails
        assert code == 3, second.log.read_text()[-3000:]
        third = Driver(tmp_path, args, faults).start()
        drivers.append(third)
        assert third.wait(240) == 0, third.log.read_text()[-3000:]
        for name in ("sink.write", "sink.committed", "sink.commit"):
            assert Path(f"{faults}.{name}.fired").exists(), name
        with txbroker.connect(broker.url) as conn:
            info = conn.stream_info("written")
            bodies: list[bytes] = []
            start = info.first
            while start < info.next:
                chunk = conn.stream_read("written", start, info.next)
                bodies += chunk.bodies
                start = chunk.next
            assert conn.xa_resource().recover() == []  # no branch left in doubt
            assert conn.sink_status("writer-1") >= files - 1
    finally:
        broker.kill()
    expected = {str(i).encode() for i in range(files * rows_per_file)}
    assert len(bodies) == len(expected), f"{len(bodies)} messages for {len(expected)} rows"
    assert set(bodies) == expected
