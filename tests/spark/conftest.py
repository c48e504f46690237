"""One shared local Spark session per test run (a cold session costs 10-23 s).

``local[2,2]``: two cores, and a failed task is retried once (the exactly-once
write tests rely on task retries). Python workers run this venv's interpreter,
so they import the installed ``txbroker``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import BrokerProcess


def spark_env() -> None:
    """The environment a local Spark needs on this machine (also for child drivers)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The shared SparkSession with the ``txbroker`` formats registered."""
    pyspark_sql = pytest.importorskip("pyspark.sql")
    spark_env()
    session = (
        pyspark_sql.SparkSession.builder.master("local[2,2]")
        .appName("txbroker-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        import txbroker.spark

        txbroker.spark.register(session)
    except ImportError:
        pass  # the connectors are not there yet (audit tests do not need them)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A journal-store broker process for one test."""
    proc = BrokerProcess(tmp_path / "data").start()
    try:
        yield proc
    finally:
        proc.kill()
