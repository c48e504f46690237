"""The web console's static files (docs/console.md): ``/console/`` serves
``static/`` from inside the package, and ``/`` redirects there.

The console is plain HTML, CSS and JavaScript modules with no build step and
no CDN: the browser loads them from the broker and calls the REST API under
``/api/`` like any other client (with the user's HTTP Basic credentials when
the broker has users). The files themselves are public: they hold no data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

#: Where the console's files are (shipped as package data, see pyproject.toml).
STATIC_DIR: Final = Path(__file__).with_name("static")
#: The URL path the console is served under.
CONSOLE_PATH: Final = "/console"


async def to_console(request: Request) -> Response:
    """``/``: the console's page."""
    return RedirectResponse(CONSOLE_PATH + "/", status_code=307)


def console_routes() -> list[BaseRoute]:
    """The redirect from ``/`` and the static files under ``/console/``."""
    return [Route("/", to_console, methods=["GET"]),
            Mount(CONSOLE_PATH, app=StaticFiles(directory=STATIC_DIR, html=True),
                  name="console")]


__all__ = ["CONSOLE_PATH", "STATIC_DIR", "console_routes"]
