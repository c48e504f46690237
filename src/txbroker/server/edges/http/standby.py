"""The HTTP port of a broker that serves no clients yet: a replicated backup.

A backup has no broker to run the REST API against (its copy is replayed, not
served), but its ``--http-port`` is where an operator or a cluster manager
reaches it. So while it is a backup the port answers three things:

* ``POST /api/ha/promote`` — promote this backup, what ``txbroker ha promote``
  asks over the native port, with no CLI to start: 200 ``{"node": …,
  "promoting": true}`` once the promotion is under way (with etcd: ``"via":
  "etcd"``, the key is taken first; a group of three or more without etcd asks
  its peers first and adds ``"term"`` and the peers ``"heard"``), 409
  ``ILLEGAL_STATE`` with the reason when it may not be promoted
  (docs/replication.md, "Who may be promoted");
* ``GET /api/ha`` — its HA status (what ``txbroker ha status`` prints);
* anything else — 503 ``STANDBY``, saying what this broker is.

Both need the broker's users (HTTP Basic), as the native probe does; a broker
without users answers loopback clients only (as ``Operations.open`` decides). The listener
is closed when the backup becomes the primary, just before the full HTTP edge
opens on the same port (``server/ha/replicated.py``). Like :class:`HttpEdge`,
uvicorn's ``H11Protocol`` is the protocol and Starlette the application.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from txbroker.errors import AuthenticationFailed, BrokerError, Standby
from txbroker.server.edges.http.calls import REALM, basic_credentials, error_code, http_status
from txbroker.server.ops import is_loopback
from txbroker.server.security.auth import Authenticator

__all__ = ["StandbyHttp"]

#: Every method a refused request may use (the 503 is the same for all of them).
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def _error(error: BrokerError) -> Response:
    headers = ({"WWW-Authenticate": f'Basic realm="{REALM}"'}
               if isinstance(error, AuthenticationFailed) else None)
    return JSONResponse({"error": error.message, "code": error_code(error)},
                        status_code=http_status(error), headers=headers)


class StandbyHttp:
    """The backup's HTTP application and its protocol factory (module docstring).

    ``status()`` is the HA status, ``promote(args)`` asks for promotion (raising a
    BrokerError when refused), ``refusal(what)`` says why anything else is refused.
    """

    def __init__(self, auth: Authenticator, *, status: Callable[[], dict[str, Any]],
                 promote: Callable[[dict[str, Any]], Any],
                 refusal: Callable[[str], str]) -> None:
        self.auth = auth
        self.status = status
        self.promote = promote
        self.refusal = refusal
        app = Starlette(routes=[
            Route("/api/ha", self._status, methods=["GET"]),
            Route("/api/ha/promote", self._promote, methods=["POST"]),
            Route("/{path:path}", self._refuse, methods=METHODS),
        ])
        self.config = Config(app, lifespan="off", http="h11", log_config=None,
                             access_log=False, proxy_headers=False, server_header=False)
        self.config.load()
        self.state = ServerState()

    def protocol(self) -> asyncio.Protocol:
        """A new connection's protocol (``loop.create_server``'s factory)."""
        return H11Protocol(config=self.config, server_state=self.state, app_state={})

    def close(self) -> None:
        """Close every open connection (after its current response)."""
        for connection in list(self.state.connections):
            connection.shutdown()

    def _authenticate(self, request: Request) -> None:
        credentials = basic_credentials(request.headers.get("authorization"))
        if self.auth.open:  # as Operations.open decides for every other edge
            client = request.client
            if client is not None and not is_loopback(client.host):
                raise AuthenticationFailed("the broker has no users configured and serves "
                                           "loopback only")
            return
        if credentials is None:
            raise AuthenticationFailed("this broker requires a user: HTTP Basic authentication")
        if not self.auth.check(*credentials):
            raise AuthenticationFailed("wrong user or password")

    async def _status(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except BrokerError as exc:
            return _error(exc)
        return JSONResponse(self.status())

    async def _promote(self, request: Request) -> Response:
        try:
            self._authenticate(request)
            result = self.promote({})  # no arguments: a body is ignored
            if inspect.isawaitable(result):  # a group that asks its peers first
                result = await result
            return JSONResponse(result)
        except BrokerError as exc:
            return _error(exc)

    async def _refuse(self, request: Request) -> Response:
        return _error(Standby(self.refusal(f"{request.method} {request.url.path}")))
