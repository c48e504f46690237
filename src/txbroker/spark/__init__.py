"""txbroker on Apache Spark: exactly-once connectors (and the journal audit job).

::

    import txbroker.spark
    txbroker.spark.register(spark)          # once per SparkSession

    df = (spark.readStream.format("txbroker")
          .option("url", "txb://127.0.0.1:5445").option("queues", "orders")
          .option("name", "orders-to-parquet").load())

Importing this package does not import pyspark; :func:`register` does.
docs/spark.md describes the formats, their options and the exactly-once design.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["register"]

#: Optional modules of this package that bring their own formats: each has a
#: ``register(spark)`` called by :func:`register` when the module exists.
_EXTRA_SOURCES = ("txbroker.spark.journal_source",)


def register(spark: Any) -> None:
    """Register the ``txbroker`` format (and ``txbroker-journal`` when present)
    with ``spark``; needed once in every new SparkSession."""
    from txbroker.spark.source import TxBrokerDataSource

    spark.dataSource.register(TxBrokerDataSource)
    for module_name in _EXTRA_SOURCES:
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        extra_register = getattr(module, "register", None)
        if callable(extra_register):
            extra_register(spark)
