"""What client and server controllers share: the connection's router port, the
registration, the inbox of pushes, pipelined errors, events and closing.

Theory of operation
-------------------
One :class:`RouterPort` rides each async connection (``AsyncConnection.extensions
["rtr"]``): the broker pushes every router message as a native ``PUSH`` with the
event name ``rtr`` and the ``controller`` id in its body; the port hands it to
the controller registered under that id (a push that overtakes the reply of its
``rtr_register`` — both in one read — is kept until the id is bound). A
connection may carry many controllers.

Each controller owns an *inbox* (a deque and a wake-up event) of decoded
:class:`~txbroker.router.constants.RouterMessage` values; ``receive()`` takes from
it. When the session breaks, the port tells each controller
(``on_session_lost``: the client notes the transaction it must ask about, the
server ends its transaction with REJECTED reason LOST); the client's failover
(``txbroker.client._failover``) then calls :meth:`RouterPort.restore` on the new
session *before* it becomes current: every controller registers again (a new
id) and the client asks ``rtr_outcome``. Requests made meanwhile wait for the
port's ``ready`` event, then for the session, so they always carry the new id.
When no broker answers (or the connection is closed) every controller fails its
waiters with the ConnectionLost of the connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from types import TracebackType
from typing import Any, Final, Self

from txbroker.client.aio import AsyncConnection, open_connection
from txbroker.client.options import ConnectOptions
from txbroker.errors import BrokerError, ConnectionLost, IllegalState, ProtocolError
from txbroker.router.constants import (
    USER_EVENT_MAX,
    USER_EVENT_MIN,
    EventRanges,
    PartitionMap,
    RouterMessage,
    event_ranges,
)

__all__ = ["PUSH_EVENT", "AsyncControllerBase", "Inbox", "RouterPort"]

log = logging.getLogger("txbroker.router")

#: The native push event name of every router message.
PUSH_EVENT: Final = "rtr"
#: Pushes kept for a controller id not bound yet (its ``rtr_register`` reply is on its way).
MAX_EARLY_PUSHES: Final = 10_000

#: What an inbox holds: a message, or an error for ``receive()`` to raise.
Inbox = deque[RouterMessage | BaseException]


class RouterPort:
    """The router's part of one async connection (see the module docstring)."""

    def __init__(self, connection: AsyncConnection) -> None:
        self.connection = connection
        #: controllers by their id on the current session
        self.by_id: dict[int, AsyncControllerBase] = {}
        #: every registered controller, in registration order (restored in that order)
        self.registered: list[AsyncControllerBase] = []
        #: set while requests may go out (cleared from a lost session to its restore)
        self.ready = asyncio.Event()
        self.ready.set()
        self._early: dict[int, list[dict[str, Any]]] = {}

    @classmethod
    def of(cls, connection: AsyncConnection) -> RouterPort:
        """The port of ``connection`` (made and registered on first use)."""
        port = connection.extensions.get(PUSH_EVENT)
        if not isinstance(port, RouterPort):
            port = cls(connection)
            connection.extensions[PUSH_EVENT] = port
        return port

    def bind(self, controller_id: int, controller: AsyncControllerBase) -> None:
        """``controller`` is ``controller_id`` on the current session."""
        self.by_id[controller_id] = controller
        for data in self._early.pop(controller_id, ()):
            controller.on_push(data)

    def forget(self, controller: AsyncControllerBase) -> None:
        """``controller`` unregistered or closed."""
        self.by_id = {k: v for k, v in self.by_id.items() if v is not controller}
        if controller in self.registered:
            self.registered.remove(controller)

    # ------------------------------------------------- ConnectionExtension

    def on_push(self, data: dict[str, Any], epoch: int) -> None:
        """An ``rtr`` push: to its controller."""
        controller_id = data.get("controller")
        if type(controller_id) is not int:
            raise ProtocolError(f"rtr push without a controller id: {data!r}")
        controller = self.by_id.get(controller_id)
        if controller is not None:
            controller.on_push(data)
        else:
            early = self._early.setdefault(controller_id, [])
            if len(early) < MAX_EARLY_PUSHES:
                early.append(data)

    def on_session_lost(self) -> None:
        """Every controller id dies with the session."""
        self.ready.clear()
        self.by_id.clear()
        self._early.clear()
        for controller in list(self.registered):
            controller.on_session_lost()

    async def restore(self, call: Any, epoch: int) -> None:
        """Register every controller again on the new session."""
        self.by_id.clear()
        self._early.clear()
        for controller in list(self.registered):
            await controller.restore(call)
        self.ready.set()

    def on_failed(self, error: BaseException) -> None:
        """No broker left, or the connection closed."""
        for controller in list(self.registered):
            controller.on_failed(error)
        self.ready.set()


class AsyncControllerBase:
    """A registration of a connection with the router: its inbox, requests and events.

    ``connection`` is an :class:`~txbroker.client.aio.AsyncConnection` (shared:
    closing the controller leaves it open) or a URL (the controller connects when
    it registers, with ``options`` of ``txbroker.aio.connect``, and closes it).
    """

    _kind: str = "client"

    def __init__(self, connection: AsyncConnection | str, **options: Any) -> None:
        if isinstance(connection, AsyncConnection):
            self._connection: AsyncConnection | None = connection
            self._url: str | None = None
        else:
            ConnectOptions.from_kwargs(dict(options))  # checked now
            self._connection, self._url = None, connection
        #: close the connection at close (it was opened for this controller)
        self._owns = self._url is not None
        self._options = options
        self._port: RouterPort | None = None
        self._id: int | None = None
        self._register_args: dict[str, Any] | None = None
        self._map: PartitionMap | None = None
        self._inbox: Inbox = deque()
        self._wake = asyncio.Event()
        self._failed: BaseException | None = None
        self._closed = False
        #: errors of pipelined requests, raised by the next call that reports them
        self._errors: list[BaseException] = []
        self._last_register_reply: dict[str, Any] = {}

    # ------------------------------------------------------------ properties

    @property
    def connection(self) -> AsyncConnection:
        """The connection it is registered on (IllegalState before registering)."""
        if self._connection is None:
            raise IllegalState("not registered yet")
        return self._connection

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def controller_id(self) -> int | None:
        """The broker's id of this registration on the current session (None if none)."""
        return self._id

    @property
    def partition_map(self) -> PartitionMap | None:
        """The facility's partitions as the broker said at registration."""
        return self._map

    @property
    def registration(self) -> dict[str, Any]:
        """The last ``rtr_register`` reply (controller, facility, key_type, partitions …)."""
        return dict(self._last_register_reply)

    # ---------------------------------------------------------- registering

    async def _register(self, args: dict[str, Any]) -> dict[str, Any]:
        if self._register_args is not None:
            raise IllegalState("this controller is already registered "
                               f"(facility {self._register_args['facility']!r})")
        if self._closed:
            raise ConnectionLost("the controller is closed")
        if self._connection is None:
            assert self._url is not None
            self._connection = await open_connection(self._url, **self._options)
        port = RouterPort.of(self._connection)
        reply = await self._connection.request("rtr_register", args)
        self._port = port
        self._register_args = args
        self._bind(reply)
        port.registered.append(self)
        return self.registration

    def _bind(self, reply: Any) -> None:
        if not isinstance(reply, dict) or type(reply.get("controller")) is not int:
            raise ProtocolError(f"malformed rtr_register reply: {reply!r}")
        self._last_register_reply = reply
        self._map = PartitionMap.from_reply(reply)
        self._id = reply["controller"]
        assert self._port is not None
        self._port.bind(reply["controller"], self)

    @staticmethod
    def _events_arg(events: EventRanges) -> list[list[int]]:
        return event_ranges(events)

    # --------------------------------------------------------------- inbox

    def _put(self, item: RouterMessage | BaseException) -> None:
        self._inbox.append(item)
        self._wake.set()

    def on_push(self, data: dict[str, Any]) -> None:
        """A push for this controller (on the loop)."""
        try:
            message = RouterMessage.from_push(data)
        except ProtocolError as exc:
            self._put(exc)
            return
        self._on_message(message)

    def _on_message(self, message: RouterMessage) -> None:
        self._put(message)

    async def _next_item(self, timeout: float | None) -> RouterMessage | BaseException | None:
        """The next inbox item; None after ``timeout`` seconds (None: wait forever)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._inbox:
            if self._failed is not None:
                raise self._failed
            self._wake.clear()
            if deadline is None:
                await self._wake.wait()
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):
                    await self._wake.wait()
            except TimeoutError:
                if not self._inbox:
                    return None
        return self._inbox.popleft()

    def _raise_pipelined(self) -> None:
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error

    def _collect(self, future: asyncio.Future[Any]) -> None:
        """Done callback of a pipelined request: keep its broker error."""
        if future.cancelled():
            return
        error = future.exception()
        if isinstance(error, BrokerError):
            self._errors.append(error)

    # ------------------------------------------------------------- requests

    def _check_usable(self) -> None:
        if self._closed:
            raise ConnectionLost("the controller is closed")
        if self._failed is not None:
            raise self._failed
        if self._register_args is None:
            raise IllegalState("register first (register_facility / register_partition)")

    async def _port_ready(self) -> None:
        """Wait until a lost session is restored (this controller registered again)."""
        self._check_usable()
        port = self._port
        assert port is not None
        if not port.ready.is_set():
            await port.ready.wait()
            self._check_usable()

    async def _call(self, op: str, args: dict[str, Any]) -> Any:
        """A request on behalf of this controller, with its current id."""
        await self._port_ready()
        assert self._connection is not None
        return await self._connection.request(op, {**args, "controller": self._id})

    def _pipeline(self, op: str, args: dict[str, Any]) -> asyncio.Future[Any]:
        """A request sent without waiting; its broker error is collected."""
        self._check_usable()
        assert self._connection is not None
        future = self._connection.request_nowait(op, {**args, "controller": self._id})
        future.add_done_callback(self._collect)
        return future

    def _notify(self, op: str, args: dict[str, Any]) -> None:
        """A request with request id 0 (no reply), if a session is live."""
        if self._connection is not None and self._port is not None and self._port.ready.is_set():
            self._connection.notify(op, {**args, "controller": self._id})

    async def send_event(self, number: int, body: bytes = b"", *,
                         recipient: str | None = None) -> int:
        """Broadcast user event ``number`` (0..255) with ``body``: from a client to the
        facility's servers, from a server to its clients. ``recipient`` names the
        receivers (``*`` and ``%`` wildcards); None reaches every subscriber of the
        number that has — or has not — a name. Returns how many received it."""
        if type(number) is not int or not USER_EVENT_MIN <= number <= USER_EVENT_MAX:
            raise ValueError(f"a user event number is {USER_EVENT_MIN}..{USER_EVENT_MAX}, "
                             f"not {number!r}")
        reply = await self._call("rtr_event", {"number": number, "body": bytes(body),
                                               "recipient": recipient})
        return int(reply.get("delivered", 0)) if isinstance(reply, dict) else 0

    # ------------------------------------------------------- session events

    def on_session_lost(self) -> None:
        """The session broke: this id is dead (subclasses add their transaction)."""
        self._id = None

    async def restore(self, call: Any) -> None:
        """Register again on the new session (``call`` sends on it)."""
        if self._register_args is None or self._closed:
            return
        try:
            reply = await call("rtr_register", self._register_args)
            self._bind(reply)
        except BrokerError as exc:  # e.g. the facility is gone: this controller is done
            log.warning("txbroker.router: registering again failed: %s", exc)
            self.on_failed(exc)
            return
        await self._restored(call)

    async def _restored(self, call: Any) -> None:
        """Hook: after registering again (the client asks for its outcome here)."""

    def on_failed(self, error: BaseException) -> None:
        """No broker left (or closed): every waiter raises ``error``."""
        if self._failed is None:
            self._failed = error
        self._wake.set()

    # -------------------------------------------------------------- closing

    async def close(self) -> None:
        """Unregister (a server's open transaction is handled as if it died) and close
        the connection if this controller opened it."""
        if self._closed:
            return
        try:
            if self._register_args is not None and self._failed is None and self._id is not None:
                try:
                    await self._call("rtr_unregister", {})
                except (BrokerError, ConnectionLost, TimeoutError) as exc:
                    log.debug("txbroker.router: unregister failed: %s", exc)
        finally:
            self._closed = True
            if self._port is not None:
                self._port.forget(self)
            self.on_failed(ConnectionLost("the controller is closed"))
            if self._owns and self._connection is not None:
                await self._connection.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

