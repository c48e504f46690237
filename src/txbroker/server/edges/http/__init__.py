"""The HTTP edge: the REST API under ``/api/``, its OpenAPI document and
Prometheus ``/metrics`` on ``--http-port`` (docs/http.md).

Theory of operation
-------------------
HTTP is served on the broker's own event loop, so the API reads and changes
the one copy of the state with no lock. The application is Starlette
(``api.py``); the HTTP/1.1 protocol is uvicorn's ``H11Protocol``, an asyncio
protocol like the native and STOMP connections, so :class:`HttpEdge` hands
its factory to ``BrokerServer.listen`` — the one place listeners are opened,
after the operation layer's listen check — and no uvicorn ``Server`` runs.
Each request is a short session of the operation layer (``calls.py``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from txbroker.server.edges.http.api import build_app
from txbroker.server.edges.http.calls import HttpServerPort

#: Seconds an idle keep-alive connection stays open (uvicorn's default is 5).
KEEP_ALIVE_SECONDS: Final = 5


class HttpEdge:
    """The HTTP listener's protocol factory and its open connections."""

    def __init__(self, server: HttpServerPort) -> None:
        self.app = build_app(server)
        self.config = Config(self.app, lifespan="off", http="h11", log_config=None,
                             access_log=False, proxy_headers=False, server_header=False,
                             timeout_keep_alive=KEEP_ALIVE_SECONDS)
        self.config.load()
        # uvicorn's access and error loggers stay under "uvicorn.*"; ours names the edge
        logging.getLogger("uvicorn.error").propagate = True
        self.state = ServerState()

    def protocol(self) -> asyncio.Protocol:
        """A new connection's protocol (``loop.create_server``'s factory)."""
        return H11Protocol(config=self.config, server_state=self.state, app_state={})

    def close(self) -> None:
        """Shutdown: close every open HTTP connection (after their current response)."""
        for connection in list(self.state.connections):
            connection.shutdown()


__all__ = ["HttpEdge", "HttpServerPort"]
