"""The router, async: ``ctl = AsyncTransactionController(conn); await ctl.register_facility(…)``.

Same names as :mod:`txbroker.router` (the sync face); here
``TransactionController``, ``ServerTransactionController`` and
``ServerMessageHandler`` are the async classes.
"""

from txbroker.router.client import AsyncTransactionController, ClientState
from txbroker.router.constants import *  # noqa: F403 - the same constants as txbroker.router
from txbroker.router.constants import __all__ as _constants
from txbroker.router.handler import PLAN, AsyncServerMessageHandler
from txbroker.router.server import AsyncServerTransactionController, ServerState

TransactionController = AsyncTransactionController
ServerTransactionController = AsyncServerTransactionController
ServerMessageHandler = AsyncServerMessageHandler

__all__ = [
    *_constants,
    "PLAN",
    "AsyncServerMessageHandler",
    "AsyncServerTransactionController",
    "AsyncTransactionController",
    "ClientState",
    "ServerMessageHandler",
    "ServerState",
    "ServerTransactionController",
    "TransactionController",
]
