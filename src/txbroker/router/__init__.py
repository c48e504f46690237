"""The transaction router's client library (docs/router.md): two-phase commit between
clients and the partitioned servers that vote, in the style of Reliable Transaction
Router's C++ API.

* :class:`TransactionController` — a client: ``start_transaction``, ``send(body,
  key=…)``, ``accept`` / ``reject`` / ``set_accept``, ``receive`` the outcome;
* :class:`ServerTransactionController` — a server of a partition: ``receive``
  MSG1/MSG/PREPARE/…, ``accept_transaction`` / ``reject_transaction``,
  ``acknowledge_outcome``; ``inactivity_timeout_ms``;
* :class:`ServerMessageHandler` — the event-driven server model;
  :class:`ClientMessageHandler` — the client's (outcomes and events);
* the constants: :class:`MessageType`, :class:`Role`, event numbers, reasons,
  :class:`RouterMessage`.

This is the sync face; :mod:`txbroker.router.aio` has the same names, async.
"""

from txbroker.router.client import ClientState
from txbroker.router.constants import *  # noqa: F403 - re-exported
from txbroker.router.constants import __all__ as _constants
from txbroker.router.handler import (
    CLIENT_PLAN,
    PLAN,
    ClientMessageHandler,
    ServerMessageHandler,
)
from txbroker.router.server import ServerState
from txbroker.router.sync import ServerTransactionController, TransactionController

__all__ = [
    *_constants,
    "CLIENT_PLAN",
    "PLAN",
    "ClientMessageHandler",
    "ClientState",
    "ServerMessageHandler",
    "ServerState",
    "ServerTransactionController",
    "TransactionController",
]
