"""The async client: ``async with txbroker.aio.connect("txb://127.0.0.1:5445") as conn``.

``await txbroker.aio.connect(url)`` also works. Same names as the sync client
(``txbroker.connect``); here ``Connection``, ``Message``, ``Subscription`` and
``Transaction`` are the async classes.
"""

from txbroker.client.aio import (
    AsyncConnection,
    AsyncMessage,
    AsyncSubscription,
    AsyncTransaction,
    connect,
    open_connection,
)

Connection = AsyncConnection
Message = AsyncMessage
Subscription = AsyncSubscription
Transaction = AsyncTransaction

__all__ = [
    "AsyncConnection",
    "AsyncMessage",
    "AsyncSubscription",
    "AsyncTransaction",
    "Connection",
    "Message",
    "Subscription",
    "Transaction",
    "connect",
    "open_connection",
]
