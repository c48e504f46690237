"""The router's sync face: thin wrappers that run the async controllers on a loop thread.

Like :mod:`txbroker.client.sync`: a controller made from a URL runs its own
connection on a private event-loop thread; one made from a sync
:class:`~txbroker.client.sync.Connection` runs on that connection's thread
(``Connection.run_async``) and leaves it open at close. Every method hands the
async controller's coroutine to the loop and waits for its outcome; the
exceptions are the async controller's.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from txbroker.client._portal import LoopThread
from txbroker.client.aio import AsyncConnection, open_connection
from txbroker.client.sync import Connection
from txbroker.router._base import AsyncControllerBase
from txbroker.router.client import AsyncTransactionController, ClientState
from txbroker.router.constants import EventRanges, Key, PartitionMap, Role, RouterMessage
from txbroker.router.server import (
    DEFAULT_SERVER_REASON,
    AsyncServerTransactionController,
    ServerState,
)

__all__ = ["ServerTransactionController", "TransactionController"]

T = TypeVar("T")
A = TypeVar("A", bound=AsyncControllerBase)


class _SyncController(Generic[A]):
    """Runs an async controller: on its own loop thread (URL) or a connection's."""

    def __init__(self, connection: Connection | str, make: Any, **options: Any) -> None:
        self._portal: LoopThread | None = None
        if isinstance(connection, Connection):
            self._run_on: Any = connection.run_async
            async def build_shared() -> A:
                return make(connection.async_connection)  # type: ignore[no-any-return]
            self._inner: A = self._run(build_shared())
            return
        portal = LoopThread()
        self._portal = portal
        self._run_on = portal.call

        async def build_owned() -> A:
            conn: AsyncConnection = await open_connection(connection, **options)
            inner: A = make(conn)
            inner._owns = True  # the controller closes the connection it opened
            return inner

        try:
            self._inner = self._run(build_owned())
        except BaseException:
            portal.stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        result: T = self._run_on(coro)
        return result

    @property
    def async_controller(self) -> A:
        """The async controller this one runs (lives on the loop thread)."""
        return self._inner

    @property
    def controller_id(self) -> int | None:
        """The broker's id of this registration on the current session."""
        return self._inner.controller_id

    @property
    def partition_map(self) -> PartitionMap | None:
        """The facility's partitions as the broker said at registration."""
        return self._inner.partition_map

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._inner.closed

    def send_event(self, number: int, body: bytes = b"", *, recipient: str | None = None) -> int:
        """Broadcast user event ``number`` (0..255); returns how many received it."""
        return self._run(self._inner.send_event(number, body, recipient=recipient))

    def close(self) -> None:
        """Unregister; close the connection (and its thread) if this controller opened it."""
        try:
            if not self._inner.closed:
                self._run(self._inner.close())
        finally:
            if self._portal is not None:
                self._portal.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class TransactionController(_SyncController[AsyncTransactionController]):
    """A client of a facility (sync). ``connection``: a :class:`~txbroker.client.sync.
    Connection` or a URL (``options``: those of ``txbroker.connect``). See
    :class:`~txbroker.router.client.AsyncTransactionController` for the semantics."""

    def __init__(self, connection: Connection | str, **options: Any) -> None:
        super().__init__(connection, AsyncTransactionController, **options)

    @property
    def tid(self) -> str | None:
        """The current transaction's id."""
        return self._inner.tid

    @property
    def state(self) -> ClientState:
        """Where the current transaction is."""
        return self._inner.state

    def register_facility(self, facility: str, *, recipient: str | None = None,
                          events: EventRanges = ()) -> dict[str, Any]:
        """Register as a client of ``facility`` (NotFound if it is not defined)."""
        return self._run(self._inner.register_facility(facility, recipient=recipient,
                                                       events=list(events)))

    def start_transaction(self, *, tid: str | None = None) -> str:
        """Start a transaction; returns its tid (IllegalState before the last outcome);
        ``tid`` as for the async one."""
        return self._run(self._inner.start_transaction(tid=tid))

    def send(self, body: bytes, *, key: Key, headers: dict[str, Any] | None = None) -> str:
        """Send a message to the partition owning ``key`` (pipelined); returns its name."""
        return self._run(self._inner.send(body, key=key, headers=headers))

    def accept(self) -> None:
        """Accept the transaction; receive() gives the outcome."""
        self._run(self._inner.accept())

    def set_accept(self, body: bytes | None = None, *, key: Key | None = None,
                   headers: dict[str, Any] | None = None) -> None:
        """Send the last message and accept in one request."""
        self._run(self._inner.set_accept(body, key=key, headers=headers))

    def reject(self, reason: str = "CLIENT") -> None:
        """Reject the transaction (IllegalState once accepted)."""
        self._run(self._inner.reject(reason))

    def receive(self, timeout: float | None = None) -> RouterMessage | None:
        """The next outcome or event; None after ``timeout`` seconds."""
        return self._run(self._inner.receive(timeout))


class ServerTransactionController(_SyncController[AsyncServerTransactionController]):
    """A server of one partition (sync). ``connection``: a Connection or a URL;
    ``inactivity_timeout_ms``: reject a partly received transaction after that long
    without a message. See :class:`~txbroker.router.server.AsyncServerTransactionController`."""

    def __init__(self, connection: Connection | str, *,
                 inactivity_timeout_ms: int | None = None, **options: Any) -> None:
        def make(conn: AsyncConnection) -> AsyncServerTransactionController:
            return AsyncServerTransactionController(
                conn, inactivity_timeout_ms=inactivity_timeout_ms)

        super().__init__(connection, make, **options)

    @property
    def tid(self) -> str | None:
        """The current transaction's id (None while waiting for a new one)."""
        return self._inner.tid

    @property
    def state(self) -> ServerState:
        """Where the current transaction is."""
        return self._inner.state

    @property
    def partition(self) -> str | None:
        """The partition this server registered for."""
        return self._inner.partition

    @property
    def inactivity_timeout_ms(self) -> int | None:
        """The server inactivity timeout (None: none)."""
        return self._inner.inactivity_timeout_ms

    def register_partition(self, facility: str, key_range: str | Sequence[Key],
                           role: Role = Role.PRIMARY, *, explicit_prepare: bool = False,
                           recipient: str | None = None,
                           events: EventRanges = ()) -> dict[str, Any]:
        """Register as a server of a partition (its name or ``(low, high)``)."""
        return self._run(self._inner.register_partition(
            facility, key_range, role, explicit_prepare=explicit_prepare,
            recipient=recipient, events=list(events)))

    def receive(self, timeout: float | None = None) -> RouterMessage | None:
        """The next message, outcome or event; None after ``timeout`` seconds."""
        return self._run(self._inner.receive(timeout))

    def accept_transaction(self) -> None:
        """Vote to accept."""
        self._run(self._inner.accept_transaction())

    def set_accept(self) -> None:
        """Vote to accept without waiting for the broker."""
        self._run(self._inner.set_accept())

    def reject_transaction(self, reason: str = DEFAULT_SERVER_REASON) -> None:
        """Vote to reject (before voting accept)."""
        self._run(self._inner.reject_transaction(reason))

    def acknowledge_outcome(self) -> None:
        """The outcome is applied: the router may forget the transaction."""
        self._run(self._inner.acknowledge_outcome())

    def set_recovery_retry_count(self, count: int) -> dict[str, Any]:
        """Set the partition's recovery retry count (the seed's SetRecoveryRetryCount)."""
        return self._run(self._inner.set_recovery_retry_count(count))
