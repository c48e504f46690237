"""Local transactions of the async client.

A transaction remembers the session epoch it began in (see ``_engine.py``):
after a failover the broker has rolled it back, so its next operation or its
commit raises TransactionRolledBack.

States (``tx_begin`` is sent lazily, by the first operation)::

    NEW --first op / begin--> ACTIVE --commit--> COMMITTED
    NEW --commit/rollback--> COMMITTED/ROLLED_BACK (nothing was sent)
    ACTIVE --rollback, failed commit, failover--> ROLLED_BACK
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from types import TracebackType
from typing import TYPE_CHECKING, Any

from txbroker.client._engine import Engine
from txbroker.client.async_objects import AsyncMessage
from txbroker.client.operations import (
    BrokerLimits,
    ReceiveRequest,
    SendRequest,
    receive_face,
    send_face,
    settle_args,
)
from txbroker.errors import IllegalState, TransactionError, TransactionRolledBack, TxBrokerError

if TYPE_CHECKING:
    from txbroker.client.aio import AsyncConnection

__all__ = ["AsyncTransaction", "TxState"]


class TxState(enum.Enum):
    """Life of a client-side transaction."""

    NEW = "new"  # no tx_begin sent yet (it is sent by the first operation)
    ACTIVE = "active"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled back"


class AsyncTransaction:
    """A local transaction: ``async with conn.transaction() as tx`` commits on normal exit,
    rolls back on an exception."""

    def __init__(self, connection: AsyncConnection) -> None:
        self._connection = connection
        self._engine: Engine = connection._engine
        self.state = TxState.NEW
        self.tx_id: int | None = None
        self._epoch: int | None = None
        self._staged: list[asyncio.Future[Any]] = []

    def _doomed(self) -> bool:
        return self._epoch is not None and self._engine.epoch != self._epoch

    async def _ensure(self) -> int:
        if self.state is TxState.NEW:
            result, epoch = await self._engine.call(
                "tx_begin", {}, timeout=self._engine.options.timeout
            )
            self.tx_id = int(result["tx"])
            self._epoch = epoch
            self.state = TxState.ACTIVE
        if self.state is not TxState.ACTIVE:
            raise TransactionError(f"the transaction is already {self.state.value}")
        if self._doomed():
            self.state = TxState.ROLLED_BACK
            raise TransactionRolledBack("the connection failed over: the transaction rolled back")
        assert self.tx_id is not None
        return self.tx_id

    async def _call(self, op: str, args: dict[str, Any]) -> Any:
        result, epoch = await self._engine.call(
            op, args, timeout=self._engine.options.timeout, resend=False
        )
        if epoch != self._epoch:
            raise TransactionRolledBack("the connection failed over: the transaction rolled back")
        return result

    async def begin(self) -> None:
        """Send ``tx_begin`` now (otherwise the first operation does)."""
        await self._ensure()

    def _limits(self) -> BrokerLimits:
        return self._engine.limits

    @send_face
    async def send(self, request: SendRequest) -> None:
        """Stage a send; it becomes visible at commit.

        The arguments are those of the connection's ``send``
        (:func:`~txbroker.client.operations.send_request`), checked before
        anything is sent — before ``tx_begin`` too.
        """
        await self._send(request)

    async def _send(self, request: SendRequest) -> None:
        args = request.wire_args()
        args["tx"] = await self._ensure()
        await self._call("send", args)

    @receive_face
    async def receive(self, request: ReceiveRequest) -> AsyncMessage | None:
        """Receive a message consumed by the transaction (its ack is staged at once)."""
        return await self._receive(request)

    async def _receive(self, request: ReceiveRequest) -> AsyncMessage | None:
        tx = await self._ensure()
        message = await self._connection._receive(request)
        if message is None:
            return None
        session = self._engine.session
        if session is None or message._epoch != self._epoch or session.epoch != self._epoch:
            self.state = TxState.ROLLED_BACK
            raise TransactionRolledBack("the connection failed over: the transaction rolled back")
        message._settled = True
        message._tx = self
        staged_ack = settle_args([message.tag], tx=tx)
        self._staged.append(self._engine.pipeline(session, "ack", staged_ack))
        return message

    async def _settle(self, message: AsyncMessage, op: str, requeue: bool = True) -> None:
        tx = await self._ensure()
        if message._tx is self:
            if op == "ack":
                return  # already staged by receive()
            raise IllegalState("the message was consumed by this transaction: roll it back")
        if message._settled:
            raise IllegalState(f"message {message.tag} was already acknowledged or rejected")
        if message._epoch != self._epoch:
            raise IllegalState("the message was delivered before a failover")
        await self._call(op, settle_args([message.tag], requeue=requeue, tx=tx))
        message._settled = True
        message._tx = self

    async def ack(self, message: AsyncMessage) -> None:
        """Stage the ack of a message received outside the transaction."""
        await self._settle(message, "ack")

    async def nack(self, message: AsyncMessage, requeue: bool = True) -> None:
        """Stage the rejection of a message received outside the transaction."""
        await self._settle(message, "nack", requeue)

    async def commit(self) -> None:
        """Commit; returns once durable. Raises TransactionRolledBack if it could not."""
        if self.state is TxState.NEW:
            self.state = TxState.COMMITTED
            return
        tx = await self._ensure()
        staged, self._staged = self._staged, []
        if staged:
            results = await asyncio.gather(*staged, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                await self.rollback()
                if self._doomed():
                    raise TransactionRolledBack(
                        "the connection failed over: the transaction rolled back"
                    ) from errors[0]
                raise errors[0]
        try:
            await self._call("tx_commit", {"tx": tx})
        except TransactionRolledBack:
            self.state = TxState.ROLLED_BACK
            raise
        self.state = TxState.COMMITTED

    async def rollback(self) -> None:
        """Roll back: staged sends are dropped, consumed messages redelivered."""
        if self.state is not TxState.ACTIVE:
            self.state = TxState.ROLLED_BACK if self.state is TxState.NEW else self.state
            return
        self.state = TxState.ROLLED_BACK
        self._staged = []
        if self._doomed():
            return  # the broker already rolled it back
        await self._call("tx_rollback", {"tx": self.tx_id})

    async def __aenter__(self) -> AsyncTransaction:
        await self._ensure()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.commit()
        elif self.state is TxState.ACTIVE:
            # The original exception matters more; the broker rolls back on loss anyway.
            with contextlib.suppress(TxBrokerError):
                await self.rollback()
