"""One shared local Spark session per test run (a cold session costs 10-23 s).

``local[2,2]``: two cores, and a failed task is retried once (the exactly-once
write tests rely on task retries). Python workers run this venv's interpreter,
so they import the installed ``txbroker``.

``make test`` installs what these tests need (the ``spark`` extra, and Java
with ``make java``): a missing piece fails the run, it is never skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

import txbroker.spark


def spark_env() -> None:
    """The environment a local Spark needs on this machine (also for child drivers)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


#: Spark 4 runs on Java 17 or later.
JAVA_MIN = 17


def java_major() -> int | None:
    """The major version of the Java runtime Spark would start (None: there is none)."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        return None
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    found = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if found is None:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major  # "1.8" is Java 8


@pytest.fixture(scope="session")
def java() -> None:
    """Fail (never skip) when there is no Java runtime Spark can use."""
    major = java_major()
    if major is None or major < JAVA_MIN:
        found = "none" if major is None else f"Java {major}"
        pytest.fail(f"Spark needs a Java {JAVA_MIN}+ runtime ({found} found): `make java` "
                    "installs one (`make test` runs it)", pytrace=False)


@pytest.fixture(scope="session")
def spark(java: None) -> Iterator[Any]:
    """The shared SparkSession with the ``txbroker`` formats registered."""
    spark_env()
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("txbroker-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    txbroker.spark.register(session)
    try:
        yield session
    finally:
        session.stop()
