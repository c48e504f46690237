"""Local transactions of the async client.

A transaction remembers the session epoch it began in (see ``_engine.py``).
Seed 004 (TIBCO EMS): a transaction is *active* once it sent or received a
message; a failover rolls an active one back — its next operation or its
commit raises TransactionRolledBack, and the broker redelivers the messages
it had received (its session is gone, or the broker restarted). A
transaction that has done nothing yet just goes on: it is begun again on the
new session.

``tx_begin`` is sent lazily, by the first operation. The rules
(``worked``: it sent, received, acked or nacked a message)::

    state        event                          action                       next
    -----------  -----------------------------  ---------------------------  -----------
    NEW          first operation, begin()       tx_begin                     ACTIVE
    NEW          commit() / rollback()          nothing sent                 COMMITTED /
                                                                             ROLLED_BACK
    ACTIVE       send/receive/ack/nack          worked = True                ACTIVE
    ACTIVE       failover, not worked           none (tx_begin again by the  NEW
                                                next operation)
    ACTIVE       failover, worked               raise TransactionRolledBack  ROLLED_BACK
                                                (its next operation, commit)  (failed over)
    ACTIVE       commit()                       tx_commit                    COMMITTED, or
                                                                             ROLLED_BACK
    ACTIVE       commit(), the session breaks   raise TransactionInDoubt     IN_DOUBT
                 after tx_commit went out       (it may have committed)
    ACTIVE       rollback()                     tx_rollback (nothing after   ROLLED_BACK
                                                a failover)
    ROLLED_BACK  any operation, commit()        TransactionRolledBack if a   ROLLED_BACK
                                                failover did it, else
                                                TransactionError
    COMMITTED    any operation                  TransactionError             COMMITTED
    IN_DOUBT     any operation                  TransactionError             IN_DOUBT

A failover is noticed when the operation runs (the connection's session
epoch is not the transaction's), so the table's "failover" rows are applied
by :meth:`AsyncTransaction._check` before each operation — and again after every
await inside one (``commit`` awaits the staged acks first), so that a commit is
only ever sent on the transaction's own session.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from txbroker.client._engine import Engine
from txbroker.client._session import Session
from txbroker.client.async_objects import AsyncMessage
from txbroker.client.operations import (
    BrokerLimits,
    ReceiveRequest,
    SendRequest,
    receive_face,
    send_face,
    settle_args,
)
from txbroker.errors import (
    ConnectionLost,
    IllegalState,
    TransactionError,
    TransactionInDoubt,
    TransactionRolledBack,
    TxBrokerError,
)

if TYPE_CHECKING:
    from txbroker.client.aio import AsyncConnection

__all__ = ["AsyncTransaction", "TxState"]

#: The message of a transaction rolled back by a failover.
FAILED_OVER: Final = "the connection failed over: the transaction rolled back"


class TxState(enum.Enum):
    """Life of a client-side transaction."""

    NEW = "new"  # no tx_begin sent yet (it is sent by the first operation)
    ACTIVE = "active"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled back"
    IN_DOUBT = "in doubt"  # the session broke while its commit was on its way


class AsyncTransaction:
    """A local transaction: ``async with conn.transaction() as tx`` commits on normal exit,
    rolls back on an exception. See the module docstring for what a failover does."""

    def __init__(self, connection: AsyncConnection) -> None:
        self._connection = connection
        self._engine: Engine = connection._engine
        self.state = TxState.NEW
        self.tx_id: int | None = None
        self._epoch: int | None = None
        self._staged: list[asyncio.Future[Any]] = []
        #: it sent, received, acked or nacked a message (seed 004: it is "active")
        self._worked = False
        #: a failover rolled it back
        self._failed_over = False

    def _doomed(self) -> bool:
        return self._epoch is not None and self._engine.epoch != self._epoch

    def _rolled_back_by_failover(self) -> TransactionRolledBack:
        self.state = TxState.ROLLED_BACK
        self._failed_over = True
        self._staged = []
        return TransactionRolledBack(FAILED_OVER)

    def _check(self) -> None:
        """Apply a failover that happened since the last operation; raise if the
        transaction cannot take one more operation."""
        if self.state is TxState.ACTIVE and self._doomed():
            if self._worked:
                raise self._rolled_back_by_failover()
            # nothing happened in it yet: begin it again on the new session
            self.state, self.tx_id, self._epoch, self._staged = TxState.NEW, None, None, []
        if self.state is TxState.ROLLED_BACK and self._failed_over:
            raise TransactionRolledBack(FAILED_OVER)
        if self.state not in (TxState.NEW, TxState.ACTIVE):
            raise TransactionError(f"the transaction is already {self.state.value}")

    async def _ensure(self) -> int:
        """Begin if not yet begun; the transaction id. Raises as :meth:`_check`."""
        self._check()
        while self.state is TxState.NEW:
            result, epoch = await self._engine.call(
                "tx_begin", {}, timeout=self._engine.options.timeout
            )
            self.tx_id = int(result["tx"])
            self._epoch = epoch
            self.state = TxState.ACTIVE
            self._check()  # a failover right after the reply: NEW again (nothing done yet)
        assert self.tx_id is not None
        return self.tx_id

    def _session(self) -> Session:
        """The live session of the transaction, right after :meth:`_ensure` (which saw
        it live: no await in between)."""
        session = self._engine.session
        assert session is not None and session.epoch == self._epoch
        return session

    async def _call(self, op: str, args: dict[str, Any], *, commit: bool = False) -> Any:
        try:
            result, epoch = await self._engine.call(
                op, args, timeout=self._engine.options.timeout, resend=False
            )
        except TxBrokerError as exc:
            if commit and isinstance(exc, ConnectionLost):
                raise  # the commit went out: in doubt, not rolled back (commit())
            if self._doomed() and self._worked and self.state is TxState.ACTIVE:
                raise self._rolled_back_by_failover() from exc
            raise
        if epoch != self._epoch:
            raise self._rolled_back_by_failover()
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
        self._worked = True
        await self._call("send", args)

    @receive_face
    async def receive(self, request: ReceiveRequest) -> AsyncMessage | None:
        """Receive a message consumed by the transaction (its ack is staged at once)."""
        return await self._receive(request)

    async def _receive(self, request: ReceiveRequest) -> AsyncMessage | None:
        await self._ensure()
        while True:
            message = await self._connection._receive(request)
            if message is None:
                return None
            try:
                tx = await self._ensure()  # a failover meanwhile: begun again, or rolled back
                if message._epoch == self._epoch:
                    session = self._session()
                    break
            except BaseException:
                self._engine.give_back(message._epoch, message.tag)
                raise
            # delivered on a session a failover ended (the broker took it back): again
        self._worked = True
        message._settled = True
        message._tx = self
        staged_ack = settle_args([message.tag], tx=tx)
        self._staged.append(self._engine.pipeline(session, "ack", staged_ack))
        return message

    async def _settle(self, message: AsyncMessage, op: str, requeue: bool = True) -> None:
        if message._tx is self:
            self._check()
            if op == "ack":
                return  # already staged by receive()
            raise IllegalState("the message was consumed by this transaction: roll it back")
        if message._settled:
            raise IllegalState(f"message {message.tag} was already acknowledged or rejected")
        tx = await self._ensure()
        if message._epoch != self._epoch or message._given_back():
            raise IllegalState("the message was delivered before a failover, or given back "
                               "by recover(): the broker redelivers it")
        self._worked = True
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
        """Commit; returns once durable. Raises TransactionRolledBack if it could not (a
        failover rolled it back, if it had sent or received a message)."""
        if self.state is not TxState.NEW:
            self._check()
        if self.state is TxState.NEW:  # never begun, or did nothing before a failover
            self.state = TxState.COMMITTED
            return
        tx = await self._ensure()
        staged, self._staged = self._staged, []
        if staged:
            results = await asyncio.gather(*staged, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                if self._doomed():
                    raise self._rolled_back_by_failover() from errors[0]
                await self.rollback()
                raise errors[0]
        self._check()  # a failover while the acks were awaited: never commit elsewhere
        if self.tx_id is None:  # _check began it anew (it had done nothing): no commit
            self.state = TxState.COMMITTED
            return
        # _check saw the transaction's session live: tx_commit goes out on it now (no
        # await before the write), so a ConnectionLost of it means "sent, no answer"
        try:
            await self._call("tx_commit", {"tx": tx}, commit=True)
        except TransactionRolledBack:
            self.state = TxState.ROLLED_BACK
            raise
        except ConnectionLost as exc:
            if self.state is TxState.ROLLED_BACK:
                raise
            self.state = TxState.IN_DOUBT
            raise TransactionInDoubt(
                "the connection broke after the commit was sent and before its answer: "
                "the transaction may have committed") from exc
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
