"""The REST API (``/api/…``) and ``/metrics`` as a Starlette application.

Every endpoint turns its path, query and JSON body into one call of the
operation layer (a :class:`~txbroker.server.ops.Session` method, or the same
core command the native op of that name calls) through :class:`Gate`, and
its result into JSON. Decisions (what may be purged, where a DLQ re-drives to,
who may act) are the operation layer's; this module checks only the HTTP
shape of a request (JSON, types of the fields it reads) and maps refusals to
statuses (``calls.http_status``): ``{"error": text, "code": name}``.

The routes are listed once, in :func:`routes`; ``openapi.py`` documents each
(a test checks that every route is in the document).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from txbroker._version import __version__
from txbroker.errors import BadRequest, BrokerError, IllegalState
from txbroker.server.edges.http.calls import REALM, Gate, HttpServerPort, error_code, http_status
from txbroker.server.edges.http.console import console_routes
from txbroker.server.edges.http.metrics import BrokerCollector
from txbroker.server.edges.http.openapi import OPENAPI, SORT_KEYS
from txbroker.server.edges.http.rates import RateMeter
from txbroker.server.edges.native import router_handlers
from txbroker.server.ops import Session
from txbroker.xid import Xid

#: Request bodies above this are refused (413): settings and small arguments only.
MAX_BODY_BYTES: Final = 1024 * 1024
#: Messages a browse returns when ``limit`` is not given.
DEFAULT_BROWSE: Final = 10
#: Messages a move takes when ``limit`` is not given (core/admin.py caps it).
DEFAULT_MOVE: Final = 1000
#: Items a worker thread encodes to JSON per call (about 1 ms of GIL per 100 queues).
JSON_SLICE: Final = 200
#: Status names of the HTTP errors Starlette raises itself (no route, wrong method).
HTTP_CODES: Final = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "TOO_LARGE",
                     415: "UNSUPPORTED_MEDIA_TYPE", 400: "BAD_REQUEST"}

Endpoint = Callable[[Request], Awaitable[Response]]
#: Queues one page of ``GET /api/queues`` may hold (the console asks for 25..250).
MAX_PAGE: Final = 1000


def queue_page(queues: list[dict[str, Any]], name: str, sort: str, descending: bool,
               offset: int, limit: int) -> tuple[list[dict[str, Any]], int]:
    """The queues whose name contains ``name`` (any case), sorted by ``sort``,
    ``limit`` of them from ``offset``; and how many matched. Only the page is
    encoded, so the console's list of 10,000 queues costs the broker one pass
    over them and a small reply."""
    needle = name.lower()
    matched = [q for q in queues if needle in str(q["name"]).lower()] if needle else queues
    matched.sort(key=lambda q: str(q["name"]))
    if sort == "kind":  # stable sorts: equal values stay in name order
        matched.sort(key=lambda q: str(q["kind"]), reverse=descending)
    elif sort != "name":  # a count (a topic lacks some: they count as 0)
        matched.sort(key=lambda q: int(q.get(sort) or 0), reverse=descending)
    elif descending:
        matched.reverse()
    return matched[offset:offset + limit], len(matched)



def error_response(status: int, message: str, code: str) -> JSONResponse:
    """``{"error": message, "code": code}`` with ``status`` (and a Basic challenge
    on 401)."""
    headers = {"WWW-Authenticate": f'Basic realm="{REALM}"'} if status == 401 else None
    return JSONResponse({"error": message, "code": code}, status_code=status, headers=headers)


def encode_json(value: Any) -> bytes:
    """JSON bytes as Starlette's JSONResponse writes them."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def encode_json_list(items: list[Any]) -> bytes:
    """:func:`encode_json` of a list, a slice at a time: the C encoder holds the
    GIL for a whole call, so one call over 10,000 queues would stall the loop
    (on another thread) as long as it runs; a slice takes a few milliseconds."""
    parts = [encode_json(items[start:start + JSON_SLICE])[1:-1]
             for start in range(0, len(items), JSON_SLICE)]
    return b"[" + b",".join(part for part in parts if part) + b"]"


def body_json(message: dict[str, Any]) -> dict[str, Any]:
    """A browsed message for JSON: the body as UTF-8 text when it is, else base64."""
    body: bytes = message["body"]
    try:
        text, encoding = body.decode("utf-8"), "text"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(body).decode("ascii"), "base64"
    return {**message, "body": text, "body_encoding": encoding}


async def read_json(request: Request, *, required: bool) -> dict[str, Any]:
    """The request's JSON object (``{}`` when there is no body and none is required)."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise HTTPException(413, f"request body above {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        if required:
            raise BadRequest("a JSON object is required")
        return {}
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise HTTPException(415, "the body must be application/json")
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"bad JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object")
    return value


def field(data: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """``data[name]`` if it is a ``kind`` (an int is never a bool), else BadRequest."""
    value = data.get(name, default)
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"field {name!r} must be of type {kind.__name__}")
    return value


def query_int(request: Request, name: str, default: int) -> int:
    """An integer query parameter."""
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError as exc:
        raise BadRequest(f"query parameter {name!r} must be an integer") from exc


def xid_of(request: Request) -> Xid:
    """The branch named in the path (XAER_INVAL when malformed)."""
    return Xid.parse(request.path_params["xid"])


class HttpApi:
    """The endpoints over one server's operation layer."""

    def __init__(self, server: HttpServerPort) -> None:
        self.server = server
        self.gate = Gate(server)
        self.collector = BrokerCollector(server)
        self.rates = RateMeter()

    async def _run(self, request: Request, operation: Callable[[Session, int, int], Any]
                   ) -> Any:
        client = request.client
        return await self.gate.call(
            operation, authorization=request.headers.get("authorization"),
            peer=(client.host, client.port) if client is not None else None)

    # ------------------------------------------------------------- overview
    async def overview(self, request: Request) -> Response:
        """Version, uptime, store, HA role, broker-wide counts."""
        def run(session: Session, rid: int, now: int) -> Any:
            stats = session.stats()
            config = session.ops.config
            store = {"kind": config.store, "sync": config.sync,
                     "dir_flags": config.dir_flags if config.store == "dir" else None}
            store.update(stats.pop("store", {}))
            return {"version": __version__, "uptime_seconds": stats.pop("uptime_seconds", None),
                    "store": store, "ha": stats.pop("ha", None), "stats": stats}
        return JSONResponse(await self._run(request, run))

    # ------------------------------------------------------------- queues
    async def queue_list(self, request: Request) -> Response:
        """Every queue and topic (``?kind=queue|topic`` to choose); with ``limit``,
        one page of them (:func:`queue_page`), the number that match in
        ``X-Total-Count``."""
        params = request.query_params
        kind = params.get("kind")
        if kind not in (None, "queue", "topic"):
            raise BadRequest("kind must be 'queue' or 'topic'")
        paged = "limit" in params
        if paged:
            limit, offset = query_int(request, "limit", 0), query_int(request, "offset", 0)
            sort, order = params.get("sort", "name"), params.get("order", "asc")
            if not 0 <= limit <= MAX_PAGE or offset < 0:
                raise BadRequest(f"limit must be 0..{MAX_PAGE} and offset at least 0")
            if sort not in SORT_KEYS or order not in ("asc", "desc"):
                raise BadRequest(f"sort must be one of {', '.join(SORT_KEYS)}; "
                                 "order asc or desc")
        found = await self._run(request, lambda s, rid, now: s.core.queue_list())
        self.rates.annotate(found, complete=True)
        found = [q for q in found if kind is None or q["kind"] == kind]
        headers: dict[str, str] = {}
        if paged:
            found, total = queue_page(found, params.get("name", ""), sort, order == "desc",
                                      offset, limit)
            headers["X-Total-Count"] = str(total)
        # fresh dicts: encoded on a worker thread (10,000 queues are ~5 MB of JSON)
        body = await asyncio.get_running_loop().run_in_executor(None, encode_json_list, found)
        return Response(body, media_type="application/json", headers=headers)

    async def queue_create(self, request: Request) -> Response:
        """Create a queue or topic: ``{"name", "kind"?, "settings"?}``."""
        data = await read_json(request, required=True)
        name = field(data, "name", str, None)
        if name is None:
            raise BadRequest("field 'name' is required")
        kind = field(data, "kind", str, "queue")
        settings = field(data, "settings", dict, {})
        info = await self._run(request, lambda s, rid, now: s.declare(
            rid, name, now, kind=kind, settings=settings))
        return JSONResponse(info, status_code=201)

    async def queue_info(self, request: Request) -> Response:
        """One queue's or topic's info."""
        name = request.path_params["name"]
        info = await self._run(request, lambda s, rid, now: s.core.queue_info(name))
        self.rates.annotate([info])
        return JSONResponse(info)

    async def queue_update(self, request: Request) -> Response:
        """Change settings: the body is a map of settings."""
        name = request.path_params["name"]
        settings = await read_json(request, required=True)
        return JSONResponse(await self._run(
            request, lambda s, rid, now: s.update(rid, name, settings, now)))

    async def queue_delete(self, request: Request) -> Response:
        """Delete a queue (and its messages) or a topic (and its subscriptions)."""
        name = request.path_params["name"]
        return JSONResponse(await self._run(request, lambda s, rid, now: s.delete(rid, name, now)))

    async def queue_purge(self, request: Request) -> Response:
        """Drop ready and scheduled messages (in-flight ones stay)."""
        name = request.path_params["name"]
        await read_json(request, required=False)
        return JSONResponse(await self._run(request, lambda s, rid, now: s.purge(rid, name, now)))

    async def queue_browse(self, request: Request) -> Response:
        """The first ``limit`` messages, not consumed."""
        name = request.path_params["name"]
        limit = query_int(request, "limit", DEFAULT_BROWSE)
        found = await self._run(request, lambda s, rid, now: s.browse(name, limit))
        return JSONResponse([body_json(m) for m in found])

    async def queue_move(self, request: Request) -> Response:
        """Move (re-drive) messages: ``{"to"?, "limit"?}``."""
        name = request.path_params["name"]
        data = await read_json(request, required=False)
        target = field(data, "to", str, None)
        limit = field(data, "limit", int, DEFAULT_MOVE)
        return JSONResponse(await self._run(
            request, lambda s, rid, now: s.move(rid, name, target, limit, now)))

    # ------------------------------------------------------------- connections
    async def connection_list(self, request: Request) -> Response:
        """Every connection (this request's own HTTP session included)."""
        return JSONResponse(await self._run(request, lambda s, rid, now: s.connections()))

    async def connection_close(self, request: Request) -> Response:
        """Close one connection."""
        text = request.path_params["id"]
        if not text.isdigit():
            raise BadRequest("a connection id is an integer")
        target = int(text)
        return JSONResponse(await self._run(
            request, lambda s, rid, now: s.ops.close_connection(s, target)))

    # ------------------------------------------------------------- XA
    async def xa_list(self, request: Request) -> Response:
        """Every XA branch: state, age, counts."""
        return JSONResponse(await self._run(request, lambda s, rid, now: s.core.xa_list(now)))

    async def xa_commit(self, request: Request) -> Response:
        """Heuristic commit of a prepared branch."""
        return await self._heuristic(request, commit=True)

    async def xa_rollback(self, request: Request) -> Response:
        """Heuristic rollback of a prepared branch."""
        return await self._heuristic(request, commit=False)

    async def _heuristic(self, request: Request, *, commit: bool) -> Response:
        xid = xid_of(request)
        await self._run(request, lambda s, rid, now: s.xa_heuristic(rid, xid, commit, now))
        return JSONResponse({"xid": str(xid),
                             "state": "heuristic_committed" if commit
                             else "heuristic_rolled_back"})

    async def xa_forget(self, request: Request) -> Response:
        """Forget a heuristically completed branch."""
        xid = xid_of(request)
        await self._run(request, lambda s, rid, now: s.xa_forget(rid, xid, now))
        return JSONResponse({"xid": str(xid), "forgotten": True})

    # ------------------------------------------------------------- router
    async def router_show(self, request: Request) -> Response:
        """What ``txbroker router show`` prints — facilities, partitions with their
        servers and roles, transactions by state (``?facility=`` for one), the
        counters — and ``stats`` (transactions in flight by state, exceptions)."""
        facility = request.query_params.get("facility")

        def run(session: Session, rid: int, now: int) -> Any:
            shown = router_handlers.rtr_show(
                session, rid, {} if facility is None else {"facility": facility}, now)
            return {**shown, "stats": session.core.router_stats()}
        return JSONResponse(await self._run(request, run))

    async def router_exceptions(self, request: Request) -> Response:
        """The exception transactions (``?facility=`` for one facility's)."""
        facility = request.query_params.get("facility")
        args = {} if facility is None else {"facility": facility}
        return JSONResponse(await self._run(
            request, lambda s, rid, now: router_handlers.rtr_exceptions(s, rid, args, now)))

    async def router_exception_commit(self, request: Request) -> Response:
        """Commit an exception transaction by hand (admin)."""
        args = {"tid": request.path_params["tid"]}
        return JSONResponse(await self._run(
            request, lambda s, rid, now: router_handlers.rtr_exception_commit(s, rid, args, now)))

    async def router_exception_discard(self, request: Request) -> Response:
        """Discard an exception transaction (admin)."""
        args = {"tid": request.path_params["tid"]}
        return JSONResponse(await self._run(
            request, lambda s, rid, now: router_handlers.rtr_exception_discard(s, rid, args, now)))

    async def router_retire_shadow(self, request: Request) -> Response:
        """Retire a partition's secondary site (admin): what was kept for it goes."""
        args = {"facility": request.path_params["facility"],
                "partition": request.path_params["partition"]}
        return JSONResponse(await self._run(
            request, lambda s, rid, now: router_handlers.rtr_retire_shadow(s, rid, args, now)))

    # ------------------------------------------------------------- documents
    async def ha_promote(self, request: Request) -> Response:
        """``POST /api/ha/promote`` on a broker that serves: refused (409), for only a
        replicated backup can be promoted; a backup answers it on its own HTTP port
        (``standby.py``)."""
        def run(session: Session, rid: int, now: int) -> Any:
            role = (session.stats().get("ha") or {}).get("role")
            what = f"the {role}" if role else "not one of an HA group"
            raise IllegalState(f"this broker serves clients ({what}): only a backup of a "
                               "replicated group can be promoted")
        return JSONResponse(await self._run(request, run))

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI 3 document of this API (no authentication: it is public)."""
        return JSONResponse(OPENAPI)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text exposition, read from the live state at scrape time (on
        the loop), formatted on a worker thread from that snapshot (plain data), so
        that a scrape of 10,000 queues holds the loop only while reading."""
        snapshot = await self._run(request, lambda s, rid, now: self.collector.snapshot())
        data = await asyncio.get_running_loop().run_in_executor(None, generate_latest, snapshot)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def routes(api: HttpApi) -> list[Route]:
    """Every route: (path, endpoint, methods). More specific paths come first:
    queue names may contain ``/`` (send it as ``%2F`` or as is)."""
    q = "/api/queues/{name:path}"
    return [
        Route("/api/overview", api.overview, methods=["GET"]),
        Route("/api/queues", api.queue_list, methods=["GET"]),
        Route("/api/queues", api.queue_create, methods=["POST"]),
        Route(q + "/messages", api.queue_browse, methods=["GET"]),
        Route(q + "/purge", api.queue_purge, methods=["POST"]),
        Route(q + "/move", api.queue_move, methods=["POST"]),
        Route(q, api.queue_info, methods=["GET"]),
        Route(q, api.queue_update, methods=["PATCH"]),
        Route(q, api.queue_delete, methods=["DELETE"]),
        Route("/api/connections", api.connection_list, methods=["GET"]),
        Route("/api/connections/{id}", api.connection_close, methods=["DELETE"]),
        Route("/api/xa", api.xa_list, methods=["GET"]),
        Route("/api/xa/{xid}/commit", api.xa_commit, methods=["POST"]),
        Route("/api/xa/{xid}/rollback", api.xa_rollback, methods=["POST"]),
        Route("/api/xa/{xid}", api.xa_forget, methods=["DELETE"]),
        Route("/api/router", api.router_show, methods=["GET"]),
        Route("/api/router/exceptions", api.router_exceptions, methods=["GET"]),
        Route("/api/router/exceptions/{tid}/commit", api.router_exception_commit,
              methods=["POST"]),
        Route("/api/router/exceptions/{tid}", api.router_exception_discard,
              methods=["DELETE"]),
        Route("/api/router/facilities/{facility}/partitions/{partition}/shadow",
              api.router_retire_shadow, methods=["DELETE"]),
        Route("/api/ha/promote", api.ha_promote, methods=["POST"]),
        Route("/api/openapi.json", api.openapi, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]


async def _broker_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BrokerError)
    return error_response(http_status(exc), exc.message, error_code(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail),
                          HTTP_CODES.get(exc.status_code, str(exc.status_code)))


def build_app(server: HttpServerPort) -> Starlette:
    """The ASGI application of one server: the API and the console's files."""
    api = HttpApi(server)
    return Starlette(routes=[*routes(api), *console_routes()], exception_handlers={
        BrokerError: _broker_error, HTTPException: _http_error})


__all__ = ["HttpApi", "build_app", "routes"]
