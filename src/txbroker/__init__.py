"""txbroker: a durable, transactional message broker.

Clients::

    import txbroker
    with txbroker.connect("txb://127.0.0.1:5445") as conn:
        conn.send("orders", b"hello")
        msg = conn.receive("orders", timeout=5)
        msg.ack()

    conn = await txbroker.aio.connect("txb://127.0.0.1:5445")   # the same API, async
"""

from __future__ import annotations

from txbroker import _build

_build.choose()  # compiled or pure hot path: before any module of the compiled set loads

from txbroker import aio
from txbroker._version import __version__
from txbroker.client.sync import Connection, connect
from txbroker.errors import (
    BrokerError,
    ConnectionLost,
    ErrorCode,
    IllegalState,
    TransactionInDoubt,
    TransactionRolledBack,
    TxBrokerError,
    XAError,
)
from txbroker.xid import Xid

__all__ = [
    "BrokerError",
    "Connection",
    "ConnectionLost",
    "ErrorCode",
    "IllegalState",
    "TransactionInDoubt",
    "TransactionRolledBack",
    "TxBrokerError",
    "XAError",
    "Xid",
    "__version__",
    "aio",
    "connect",
]
