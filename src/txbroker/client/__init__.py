"""Python clients of the native protocol: one async client, and a sync face on top of it.

* ``txbroker.client.sync.connect(url, **options) -> Connection`` (also ``txbroker.connect``)
* ``await txbroker.aio.connect(url, **options) -> AsyncConnection``
"""

from txbroker.client.aio import (
    AsyncConnection,
    AsyncMessage,
    AsyncSubscription,
    AsyncTransaction,
)
from txbroker.client.options import ConnectOptions
from txbroker.client.sync import Connection, Message, Subscription, Transaction, connect
from txbroker.client.transport import Stream, TCPTransport, Transport
from txbroker.client.url import ClientURL, HostPort, parse_url

__all__ = [
    "AsyncConnection",
    "AsyncMessage",
    "AsyncSubscription",
    "AsyncTransaction",
    "ClientURL",
    "ConnectOptions",
    "Connection",
    "HostPort",
    "Message",
    "Stream",
    "Subscription",
    "TCPTransport",
    "Transaction",
    "Transport",
    "connect",
    "parse_url",
]
