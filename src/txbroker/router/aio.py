"""The router, async: ``ctl = AsyncTransactionController(conn); await ctl.register_facility(…)``.

Same names as :mod:`txbroker.router` (the sync face); here
``TransactionController``, ``ServerTransactionController`` and
``ServerMessageHandler`` are the async classes.
"""

from txbroker.router.client import AsyncTransactionController, ClientState
from txbroker.router.constants import *  # noqa: F403 - the same constants as txbroker.router
from txbroker.router.constants import __all__ as _constants
from txbroker.router.handler import (
    CLIENT_PLAN,
    PLAN,
    AsyncClientMessageHandler,
    AsyncServerMessageHandler,
)
from txbroker.router.server import AsyncServerTransactionController, ServerState

TransactionController = AsyncTransactionController
ServerTransactionController = AsyncServerTransactionController
ServerMessageHandler = AsyncServerMessageHandler
ClientMessageHandler = AsyncClientMessageHandler

__all__ = [
    *_constants,
    "CLIENT_PLAN",
    "PLAN",
    "AsyncClientMessageHandler",
    "AsyncServerMessageHandler",
    "AsyncServerTransactionController",
    "AsyncTransactionController",
    "ClientMessageHandler",
    "ClientState",
    "ServerMessageHandler",
    "ServerState",
    "ServerTransactionController",
    "TransactionController",
]
