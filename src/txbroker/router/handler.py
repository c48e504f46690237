"""The event-driven server model (the seed's ``RTRServerMessageHandler``, Table 4-7).

Theory of operation
-------------------
Subclass :class:`ServerMessageHandler` (or :class:`AsyncServerMessageHandler`),
override the callbacks you need, and call ``handler.run(controller)``: it
receives from the server controller and calls, for each message, the
callbacks :data:`PLAN` lists for its type, in order; after an outcome's
callback it acknowledges the outcome (the seed's steps 7-9: OnAccepted, SQL
commit, AcknowledgeTransactionOutcome). The callbacks vote through the
controller they are given (``controller.accept_transaction()`` in
``on_application_message`` for implicit prepare, in ``on_prepare`` for explicit
prepare). The plan is decided here once, for both faces.

``run`` returns when ``stop()`` returns true (checked between messages and at
least every ``poll_interval`` seconds) or when the controller is closed
(ConnectionLost is not raised then).

The client side has the same model (:class:`ClientMessageHandler`,
:class:`AsyncClientMessageHandler`): ``on_accepted`` / ``on_rejected`` for the
outcomes of its transactions and ``on_event`` for user and router events
(:data:`CLIENT_PLAN`), for applications that send from one place and react to
outcomes and events in another.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from txbroker.errors import ConnectionLost
from txbroker.router.constants import MessageType, RouterMessage

if TYPE_CHECKING:
    from txbroker.router.client import AsyncTransactionController
    from txbroker.router.server import AsyncServerTransactionController
    from txbroker.router.sync import ServerTransactionController, TransactionController

__all__ = ["CLIENT_PLAN", "PLAN", "AsyncClientMessageHandler", "AsyncServerMessageHandler",
           "ClientMessageHandler", "ServerMessageHandler"]

M = MessageType
#: The callbacks each received type calls, in order; ``"acknowledge"`` is the
#: controller's acknowledge_outcome() after the callback (seed Table 4-7).
PLAN: Final[dict[MessageType, tuple[str, ...]]] = {
    M.MSG1: ("on_initialize", "on_application_message"),
    M.MSG: ("on_application_message",),
    # a replay after this server may have voted: check the TID table, then the message
    M.UNCERTAIN: ("on_uncertain", "on_application_message"),
    M.PREPARE: ("on_prepare",),
    M.ACCEPTED: ("on_accepted", "acknowledge"),
    M.REJECTED: ("on_rejected", "acknowledge"),
    M.USER_EVENT: ("on_event",),
    M.ROUTER_EVENT: ("on_event",),
}
#: The callback of each type a client receives.
CLIENT_PLAN: Final[dict[MessageType, str]] = {
    M.ACCEPTED: "on_accepted",
    M.REJECTED: "on_rejected",
    M.USER_EVENT: "on_event",
    M.ROUTER_EVENT: "on_event",
}
#: Seconds between two checks of ``stop`` while no message comes.
DEFAULT_POLL_INTERVAL: Final = 0.1


def _run(controller: Any, dispatch: Callable[[RouterMessage, Any], None],
         stop: Callable[[], bool] | None, poll_interval: float) -> None:
    """The receive loop of every sync handler: until ``stop()`` or the controller is
    closed (ConnectionLost is not raised then)."""
    while stop is None or not stop():
        try:
            message = controller.receive(None if stop is None else poll_interval)
        except ConnectionLost:
            if controller.closed:
                return
            raise
        if message is not None:
            dispatch(message, controller)


async def _run_async(controller: Any,
                     dispatch: Callable[[RouterMessage, Any], Awaitable[None]],
                     stop: Callable[[], bool] | None, poll_interval: float) -> None:
    """The receive loop of every async handler (as :func:`_run`)."""
    while stop is None or not stop():
        try:
            message = await controller.receive(None if stop is None else poll_interval)
        except ConnectionLost:
            if controller.closed:
                return
            raise
        if message is not None:
            await dispatch(message, controller)


class ServerMessageHandler:
    """Callbacks of a server (sync): override what you need; each gets the message and
    the controller. The defaults do nothing."""

    def on_initialize(self, message: RouterMessage,
                      controller: ServerTransactionController) -> None:
        """A new transaction starts (before its first message)."""

    def on_application_message(self, message: RouterMessage,
                               controller: ServerTransactionController) -> None:
        """A message of the transaction (the first one too)."""

    def on_prepare(self, message: RouterMessage,
                   controller: ServerTransactionController) -> None:
        """Explicit prepare: vote now (accept_transaction / reject_transaction)."""

    def on_accepted(self, message: RouterMessage,
                    controller: ServerTransactionController) -> None:
        """The transaction is accepted: commit (acknowledged after this returns)."""

    def on_rejected(self, message: RouterMessage,
                    controller: ServerTransactionController) -> None:
        """The transaction is rejected (``message.reason``): roll back."""

    def on_uncertain(self, message: RouterMessage,
                     controller: ServerTransactionController) -> None:
        """A replay after this partition may have voted: check the TID table."""

    def on_event(self, message: RouterMessage,
                 controller: ServerTransactionController) -> None:
        """A user or router event."""

    def dispatch(self, message: RouterMessage, controller: ServerTransactionController) -> None:
        """Call the callbacks of ``message`` (:data:`PLAN`)."""
        for step in PLAN[message.type]:
            if step == "acknowledge":
                if controller.tid == message.tid:
                    controller.acknowledge_outcome()
            else:
                getattr(self, step)(message, controller)

    def run(self, controller: ServerTransactionController, *,
            stop: Callable[[], bool] | None = None,
            poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        """Receive and dispatch until ``stop()`` or the controller is closed."""
        _run(controller, self.dispatch, stop, poll_interval)


class AsyncServerMessageHandler:
    """Callbacks of a server (async): like :class:`ServerMessageHandler`, coroutines."""

    async def on_initialize(self, message: RouterMessage,
                            controller: AsyncServerTransactionController) -> None:
        """A new transaction starts (before its first message)."""

    async def on_application_message(self, message: RouterMessage,
                                     controller: AsyncServerTransactionController) -> None:
        """A message of the transaction (the first one too)."""

    async def on_prepare(self, message: RouterMessage,
                         controller: AsyncServerTransactionController) -> None:
        """Explicit prepare: vote now."""

    async def on_accepted(self, message: RouterMessage,
                          controller: AsyncServerTransactionController) -> None:
        """The transaction is accepted: commit (acknowledged after this returns)."""

    async def on_rejected(self, message: RouterMessage,
                          controller: AsyncServerTransactionController) -> None:
        """The transaction is rejected (``message.reason``): roll back."""

    async def on_uncertain(self, message: RouterMessage,
                           controller: AsyncServerTransactionController) -> None:
        """A replay after this partition may have voted: check the TID table."""

    async def on_event(self, message: RouterMessage,
                       controller: AsyncServerTransactionController) -> None:
        """A user or router event."""

    async def dispatch(self, message: RouterMessage,
                       controller: AsyncServerTransactionController) -> None:
        """Call the callbacks of ``message`` (:data:`PLAN`)."""
        for step in PLAN[message.type]:
            if step == "acknowledge":
                if controller.tid == message.tid:
                    await controller.acknowledge_outcome()
            else:
                await getattr(self, step)(message, controller)

    async def run(self, controller: AsyncServerTransactionController, *,
                  stop: Callable[[], bool] | None = None,
                  poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        """Receive and dispatch until ``stop()`` or the controller is closed."""
        await _run_async(controller, self.dispatch, stop, poll_interval)


class ClientMessageHandler:
    """Callbacks of a client (sync): the outcomes of its transactions and the events it
    subscribed to. Override what you need; the defaults do nothing."""

    def on_accepted(self, message: RouterMessage, controller: TransactionController) -> None:
        """The transaction ``message.tid`` is accepted: applied on every partition."""

    def on_rejected(self, message: RouterMessage, controller: TransactionController) -> None:
        """The transaction ``message.tid`` is rejected (``message.reason``)."""

    def on_event(self, message: RouterMessage, controller: TransactionController) -> None:
        """A user or router event."""

    def dispatch(self, message: RouterMessage, controller: TransactionController) -> None:
        """Call the callback of ``message`` (:data:`CLIENT_PLAN`)."""
        getattr(self, CLIENT_PLAN[message.type])(message, controller)

    def run(self, controller: TransactionController, *, stop: Callable[[], bool] | None = None,
            poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        """Receive and dispatch until ``stop()`` or the controller is closed."""
        _run(controller, self.dispatch, stop, poll_interval)


class AsyncClientMessageHandler:
    """Callbacks of a client (async): like :class:`ClientMessageHandler`, coroutines."""

    async def on_accepted(self, message: RouterMessage,
                          controller: AsyncTransactionController) -> None:
        """The transaction ``message.tid`` is accepted: applied on every partition."""

    async def on_rejected(self, message: RouterMessage,
                          controller: AsyncTransactionController) -> None:
        """The transaction ``message.tid`` is rejected (``message.reason``)."""

    async def on_event(self, message: RouterMessage,
                       controller: AsyncTransactionController) -> None:
        """A user or router event."""

    async def dispatch(self, message: RouterMessage,
                       controller: AsyncTransactionController) -> None:
        """Call the callback of ``message`` (:data:`CLIENT_PLAN`)."""
        await getattr(self, CLIENT_PLAN[message.type])(message, controller)

    async def run(self, controller: AsyncTransactionController, *,
                  stop: Callable[[], bool] | None = None,
                  poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        """Receive and dispatch until ``stop()`` or the controller is closed."""
        await _run_async(controller, self.dispatch, stop, poll_interval)
