"""The native port of a broker that serves no clients: a shared-store standby, a
replicated backup.

Theory of operation
-------------------
:class:`StandbyConnection` answers every ``hello`` with the ``Standby`` error (code
32) and closes, so a client moves on to the next address of its failover list at once
and an operator who points a tool at it reads why. A ``hello`` with ``probe: true``
and the broker's users may ask ``stats`` and ``ping`` (``txbroker ha status``) and the
node's ``extra`` ops (``ha_promote`` on a replicated backup).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, cast

from txbroker.errors import AuthenticationFailed, BadRequest, BrokerError, ProtocolError, Standby
from txbroker.protocol.native import (
    PROTOCOL_VERSION,
    Err,
    NativeConnection,
    Ok,
    Request,
    Role,
    encode_error,
)
from txbroker.server.config import ServerConfig
from txbroker.server.security.auth import Authenticator

if TYPE_CHECKING:
    from txbroker.server.edges.http.standby import StandbyHttp

__all__ = ["PROBE_OPS", "BackupPorts", "StandbyConnection", "shared_store_refusal"]

#: Ops a probing client may send to a standby (``txbroker ha status``).
PROBE_OPS: Final = frozenset({"stats", "ping"})


def shared_store_refusal(config: ServerConfig, active: str | None, op: str) -> str:
    """Why a shared-store standby refuses ``op`` (``active``: the HA address of the
    active it follows, None when it follows nobody yet)."""
    if op == "hello":
        where = active or config.ha_peer
        return (f"this broker ({config.host}:{config.port}) is the standby of a "
                f"shared-store pair (the active is at HA address {where}): try the next "
                "address")
    return f"this broker is the standby of a shared-store pair: {op!r} is served by the active"


class StandbyConnection(asyncio.Protocol):
    """A native client of a broker that serves none (a shared-store standby, a
    replicated backup): refused with ``Standby`` (``refusal`` says why), except a
    probe (``hello`` with ``probe: true`` and the broker's users), which may ask
    ``stats`` and ``ping`` and the ``extra`` ops (``ha_promote`` on a backup)."""

    def __init__(self, config: ServerConfig, auth: Authenticator, *,
                 refusal: Callable[[str], str], status: Callable[[], dict[str, Any]],
                 role: Callable[[], str],
                 extra: dict[str, Callable[[dict[str, Any]], Any]] | None = None) -> None:
        self.config = config
        self.auth = auth
        self.refusal = refusal
        self.status = status
        self.role = role
        self.extra = extra or {}
        self.codec = NativeConnection(Role.SERVER, max_frame_size=config.max_frame_size)
        self.transport: asyncio.Transport | None = None
        self.probe = False
        self._later: set[asyncio.Future[None]] = set()  #: answers still to come

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Answer each request (see :meth:`answer`)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.codec.receive_data(data)
        try:
            while events := self.codec.drain():
                for event in events:
                    if not isinstance(event, Request):
                        raise ProtocolError("clients may only send requests")
                    out, close = self.answer(event)
                    transport.write(out)
                    if close:
                        transport.close()
                        return
        except ProtocolError as exc:
            transport.write(encode_error(0, int(exc.code), str(exc)))
            transport.close()

    async def _answer_later(self, rid: int, result: Awaitable[Any]) -> None:
        """The reply to an op that answers later (``ha_promote`` asks the peers)."""
        try:
            out = self.codec.send(Ok(rid, await result))
        except BrokerError as exc:
            out = self.codec.send(Err(rid, exc.wire_code, exc.message))
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(out)

    def answer(self, request: Request) -> tuple[bytes, bool]:
        """The reply to ``request`` and whether to close afterwards."""
        try:
            result = self._result(request)
        except BrokerError as exc:
            return self.codec.send(Err(request.rid, exc.wire_code, exc.message)), True
        if inspect.isawaitable(result):  # answered when it is done (ha_promote asks peers)
            task = asyncio.ensure_future(self._answer_later(request.rid, result))
            self._later.add(task)
            task.add_done_callback(self._later.discard)
            return b"", False
        return self.codec.send(Ok(request.rid, result)), False

    def _result(self, request: Request) -> Any:
        if request.op == "hello" and not self.probe:
            args = request.args
            if args.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
                raise BadRequest(f"unsupported protocol version {args.get('version')!r}")
            if args.get("probe") is not True:
                raise Standby(self.refusal("hello"))
            if not self.auth.check(args.get("user"), args.get("password")):
                raise AuthenticationFailed("wrong user or password")
            self.probe = True
            return {"server": "txbroker", "version": PROTOCOL_VERSION, "role": self.role()}
        if self.probe and request.op in PROBE_OPS:
            return {"ha": self.status()} if request.op == "stats" else None
        if self.probe and request.op in self.extra:
            return self.extra[request.op](request.args)
        raise Standby(self.refusal(request.op))


class BackupPorts:
    """A replicated backup's client ports: the native port refuses with ``Standby``
    (a probe may ask for the status and ``ha_promote``); with ``--http-port`` the HTTP
    port serves ``/api/ha`` and the promotion (``server/edges/http/standby.py``)."""

    def __init__(self, config: ServerConfig, *, status: Callable[[], dict[str, Any]],
                 promote: Callable[[dict[str, Any]], Any], refusal: Callable[[str], str],
                 role: Callable[[], str]) -> None:
        self.config = config
        self.status = status
        self.promote = promote
        self.refusal = refusal
        self.role = role
        self._native: asyncio.Server | None = None
        self._http: tuple[asyncio.Server, StandbyHttp] | None = None

    async def open(self) -> None:
        """Listen on the configured client ports."""
        config = self.config
        auth = Authenticator(config.users)
        loop = asyncio.get_running_loop()
        if config.port:
            self._native = await loop.create_server(
                lambda: StandbyConnection(config, auth, refusal=self.refusal,
                                          status=self.status, role=self.role,
                                          extra={"ha_promote": self.promote}),
                config.host, config.port, reuse_address=True)
        if config.http_port:
            # imported here, at the start of a backup, not while it is being promoted: the
            # HTTP edge (Starlette, uvicorn) took 0.18-0.23 s to import at load 9
            from txbroker.server.edges.http.standby import StandbyHttp

            http = StandbyHttp(auth, status=self.status, promote=self.promote,
                               refusal=self.refusal)
            listener = await loop.create_server(http.protocol, config.host, config.http_port,
                                                reuse_address=True)
            self._http = (listener, http)

    def close(self) -> None:
        """Close the backup's client ports (the native refuser, the HTTP one)."""
        if self._native is not None:
            self._native.close()
            self._native = None
        if self._http is not None:
            listener, http = self._http
            listener.close()
            http.close()
            self._http = None
