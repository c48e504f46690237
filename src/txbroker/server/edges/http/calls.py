"""How one HTTP request becomes operations of the operation layer.

Each request is one short session of the operation layer (``server/ops/operations.py``):
:meth:`Gate.call` admits it (``Operations.open``: loopback only for an open
broker, ``max_connections``), authenticates it with the HTTP Basic credentials
(``Session.authenticate``, the same scrypt check as every protocol), runs the
operation, waits for the core's later answer when it is ``LATER`` (the
:class:`HttpSink` resolves a future when the server's effect runner hands it
the Reply or Fail), and ends the session. While it runs it is listed among
the connections with protocol ``http``.

Nothing here decides about a request: refusals are the operation layer's and
the core's ``BrokerError``; :func:`http_status` only maps their codes to HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from txbroker.core import LATER
from txbroker.errors import (
    XA_CODE_NAMES,
    XAER_INVAL,
    XAER_NOTA,
    XAER_RMFAIL,
    AuthenticationFailed,
    BrokerError,
    ShuttingDown,
    TxBrokerError,
    XAError,
)
from txbroker.server.ops import Delivery, Operations, Session, as_refusal

if TYPE_CHECKING:
    from txbroker.storage.interface import StoreStats

#: The realm of the ``WWW-Authenticate`` challenge.
REALM: Final = "txbroker"

#: HTTP status of each refusal code, by ErrorCode name (anything else: 500). By name,
#: so that FORBIDDEN (the ACL change) is 403 as soon as the code exists.
STATUS_OF_CODE: Final[dict[str, int]] = {
    "FORBIDDEN": 403,
    "BAD_REQUEST": 400,
    "PROTOCOL": 400,
    "FRAME_TOO_LARGE": 413,
    "MESSAGE_TOO_LARGE": 413,
    "AUTHENTICATION_FAILED": 401,
    "NOT_AUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "UNKNOWN_OP": 404,
    "ALREADY_EXISTS": 409,
    "ILLEGAL_STATE": 409,
    "DISABLED": 409,
    "QUOTA_EXCEEDED": 409,
    "TRANSACTION": 409,
    "TRANSACTION_ROLLED_BACK": 409,
    "TOO_MANY_UNACKED": 409,
    "TOO_MANY_CONNECTIONS": 503,
    "STORAGE_FAILED": 503,
    "SHUTTING_DOWN": 503,
    "STANDBY": 503,
}
#: XA codes with their own HTTP status (other XA refusals are 409: the branch's state).
STATUS_OF_XA_CODE: Final[dict[int, int]] = {XAER_NOTA: 404, XAER_INVAL: 400, XAER_RMFAIL: 503}


def http_status(error: BrokerError) -> int:
    """The HTTP status of a refusal."""
    if isinstance(error, XAError):
        return STATUS_OF_XA_CODE.get(error.errcode, 409)
    return STATUS_OF_CODE.get(error.code.name, 500)


def error_code(error: BrokerError) -> str:
    """The ``code`` of an error reply: the ErrorCode's name, or the XA code's."""
    if isinstance(error, XAError):
        return XA_CODE_NAMES.get(error.errcode, str(error.errcode))
    return error.code.name


def basic_credentials(header: str | None) -> tuple[str, str] | None:
    """``(user, password)`` from an ``Authorization: Basic …`` header; None when
    there is none; AuthenticationFailed when it is not valid Basic credentials."""
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        raise AuthenticationFailed("only HTTP Basic authentication is supported")
    try:
        user, sep, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise AuthenticationFailed("malformed Basic credentials") from exc
    if not sep:
        raise AuthenticationFailed("malformed Basic credentials")
    return user, password


class HttpServerPort(Protocol):
    """What the HTTP edge needs from the running server (``app.BrokerServer``)."""

    @property
    def ops(self) -> Operations:
        """The operation layer."""

    def stats(self) -> dict[str, Any]:
        """The counters ``txbroker stat`` prints (``ServerPort.stats``)."""

    def store_stats(self) -> StoreStats | None:
        """The store's counters and histograms (None before recovery / after stop)."""


class HttpSink:
    """The operation layer's view of one HTTP request (a ``SessionSink``): the
    answers the core gives later resolve futures; there are no deliveries."""

    def __init__(self) -> None:
        self.waiting: dict[int, asyncio.Future[Any]] = {}

    def answer(self, rid: int, result: Any) -> None:
        """The core's later reply."""
        future = self.waiting.pop(rid, None)
        if future is not None and not future.done():
            future.set_result(result)

    def refuse(self, rid: int, error: BrokerError) -> None:
        """The core's later refusal."""
        future = self.waiting.pop(rid, None)
        if future is not None and not future.done():
            future.set_exception(error)

    def deliver(self, delivery: Delivery) -> None:
        """Never called: an HTTP session neither subscribes nor receives."""

    def cancelled(self, sub: int, reason: str) -> None:
        """Never called (no subscriptions)."""

    def push(self, event: str, data: dict[str, Any]) -> None:
        """Router pushes: none reach an HTTP request (it registers no controller)."""

    def flush(self) -> None:
        """Nothing is gathered."""

    def hold_input(self, held: bool) -> None:
        """Nothing to hold: the HTTP server reads the request, not this sink."""

    def abort(self) -> None:
        """Nothing to cut: the request's connection is the HTTP server's."""

    def close(self) -> None:
        """Shutdown or an operator closed it: fail what still waits."""
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(ShuttingDown("the connection was closed"))
        self.waiting.clear()


#: ``operation(session, rid, now)`` -> the result, or LATER.
Operation = Callable[[Session, int, int], Any]
#: The request id of the one request of an HTTP session.
RID: Final = 1


class Gate:
    """Runs operations for HTTP requests: see the module docstring."""

    def __init__(self, server: HttpServerPort) -> None:
        self.server = server
        self.ops = server.ops

    async def call(self, operation: Operation, *, authorization: str | None,
                   peer: tuple[str, int] | None) -> Any:
        """Admit, authenticate, run ``operation``; its result (or raise BrokerError)."""
        ops = self.ops
        sink = HttpSink()
        address = f"{peer[0]}:{peer[1]}" if peer else None
        session = ops.open(sink, peer[0] if peer else None, protocol="http", address=address)
        try:
            credentials = basic_credentials(authorization)
            if credentials is None and not ops.auth.open:
                raise AuthenticationFailed("this broker requires a user: HTTP Basic "
                                           "authentication")
            user, password = credentials if credentials is not None else (None, None)
            session.authenticate(user, password)
            try:
                result = operation(session, RID, ops.now())
            except TxBrokerError as exc:
                raise as_refusal(exc) from exc
            if result is LATER:
                future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                sink.waiting[RID] = future
                session.started(RID, result)
                ops.run_effects()
                return await future
            ops.run_effects()
            return result
        finally:
            session.end()
