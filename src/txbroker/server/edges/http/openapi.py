"""The OpenAPI 3 document of the REST API, written as data (served at
``/api/openapi.json``; ``tests/http`` checks that every route is in it)."""

from __future__ import annotations

from typing import Any, Final

from txbroker._version import __version__

#: What ``GET /api/queues?limit=…`` sorts by (api.py checks it against this list).
SORT_KEYS: Final = ("name", "kind", "depth", "ready", "scheduled", "in_flight", "messages",
                    "consumers", "bytes", "enqueued", "dequeued", "expired", "dead_lettered")


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _ok(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": schema or {"type": "object"}}}}


def _op(summary: str, ok: dict[str, Any], *errors: int, body: dict[str, Any] | None = None,
        params: list[dict[str, Any]] | None = None, status: str = "200") -> dict[str, Any]:
    responses: dict[str, Any] = {status: ok, "401": _error("no or wrong credentials")}
    texts = {400: "bad JSON or arguments", 403: "not permitted (admin)",
             404: "unknown queue, branch, connection, facility or transaction",
             409: "refused in the current state", 415: "the body is not application/json"}
    for code in errors:
        responses[str(code)] = _error(texts[code])
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    return op


def _path(name: str, description: str, kind: str = "string") -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": kind}}


def _query(name: str, description: str, kind: str = "integer") -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": kind}}


QUEUE = _path("name", "queue or topic name (a '/' in it may be sent as %2F)")
XID = _path("xid", "Xid as FORMATID-GTRIDHEX-BQUALHEX")
QUEUE_REF = {"$ref": "#/components/schemas/Queue"}

#: The document.
OPENAPI: Final[dict[str, Any]] = {
    "openapi": "3.0.3",
    "info": {"title": "txbroker REST API", "version": __version__,
             "description": "Operate a txbroker broker (docs/http.md). With [users] "
                            "configured every call needs HTTP Basic credentials."},
    "components": {
        "securitySchemes": {"basic": {"type": "http", "scheme": "basic"}},
        "schemas": {
            "Error": {"type": "object", "required": ["error", "code"], "properties": {
                "error": {"type": "string"}, "code": {"type": "string"}}},
            "Queue": {"type": "object", "properties": {
                "name": {"type": "string"}, "kind": {"type": "string"},
                "depth": {"type": "integer"}, "in_flight": {"type": "integer"},
                "consumers": {"type": "integer"}, "bytes": {"type": "integer"},
                "enqueued": {"type": "integer"}, "dequeued": {"type": "integer"},
                "expired": {"type": "integer"}, "dead_lettered": {"type": "integer"},
                "enqueue_rate": {"type": "number", "nullable": True},
                "dequeue_rate": {"type": "number", "nullable": True},
                "settings": {"type": "object"}}},
            "Message": {"type": "object", "properties": {
                "id": {"type": "integer"}, "message_id": {"type": "string", "nullable": True},
                "headers": {"type": "object"}, "priority": {"type": "integer"},
                "timestamp_ms": {"type": "integer"}, "delivery_count": {"type": "integer"},
                "size": {"type": "integer"}, "state": {"type": "string"},
                "body": {"type": "string"},
                "body_encoding": {"type": "string", "enum": ["text", "base64"]}}},
        },
    },
    "security": [{"basic": []}],
    "paths": {
        "/api/overview": {"get": _op("Version, uptime, store, HA role, counters",
                                     _ok("the overview"))},
        "/api/queues": {
            "get": _op("Every queue and topic; with limit, one page of them", {**_ok(
                "the queues (with limit, one page)", {"type": "array", "items": QUEUE_REF}),
                "headers": {"X-Total-Count": {
                    "description": "with limit: how many queues match (all pages)",
                    "schema": {"type": "integer"}}}}, 400,
                params=[{"name": "kind", "in": "query", "required": False,
                         "schema": {"type": "string", "enum": ["queue", "topic"]}},
                        _query("limit", "0..1000: return one page of this many queues "
                                        "(without it: every queue, no paging)"),
                        _query("offset", "the page's first queue (default 0)"),
                        {"name": "name", "in": "query", "required": False,
                         "description": "only names containing this (any case)",
                         "schema": {"type": "string"}},
                        {"name": "sort", "in": "query", "required": False,
                         "description": "the field to sort by (default name; ties by name)",
                         "schema": {"type": "string", "enum": list(SORT_KEYS)}},
                        {"name": "order", "in": "query", "required": False,
                         "schema": {"type": "string", "enum": ["asc", "desc"]}}]),
            "post": _op("Create a queue or topic", _ok("created", QUEUE_REF), 400, 409, 415,
                        status="201", body={"type": "object", "required": ["name"],
                                            "properties": {
                                                "name": {"type": "string"},
                                                "kind": {"type": "string",
                                                         "enum": ["queue", "topic"]},
                                                "settings": {"type": "object"}}}),
        },
        "/api/queues/{name}": {
            "get": _op("One queue or topic", _ok("its info", QUEUE_REF), 404, params=[QUEUE]),
            "patch": _op("Change a queue's settings", _ok("its info", QUEUE_REF),
                         400, 404, 415, params=[QUEUE], body={"type": "object"}),
            "delete": _op("Delete a queue (its messages) or topic (its subscriptions)",
                          _ok("{deleted: n}"), 404, params=[QUEUE]),
        },
        "/api/queues/{name}/messages": {
            "get": _op("Browse: the first messages in delivery order, not consumed",
                       _ok("the messages", {"type": "array",
                                            "items": {"$ref": "#/components/schemas/Message"}}),
                       400, 404, params=[QUEUE, _query("limit", "1..1000, default 10")]),
        },
        "/api/queues/{name}/purge": {
            "post": _op("Drop ready and scheduled messages; in-flight ones stay",
                        _ok("{purged: n}"), 404, 409, params=[QUEUE]),
        },
        "/api/queues/{name}/move": {
            "post": _op("Move (re-drive) messages to another queue, by default the one "
                        "queue whose dead-letter or expiry queue this is",
                        _ok("{moved: n, to: queue}"), 400, 404, 415, params=[QUEUE],
                        body={"type": "object", "properties": {
                            "to": {"type": "string"},
                            "limit": {"type": "integer", "description": "1..10000, default "
                                                                        "1000"}}}),
        },
        "/api/connections": {
            "get": _op("Every connection (this request's own included)", _ok("connections")),
        },
        "/api/connections/{id}": {
            "delete": _op("Close a connection", _ok("{closed: id}"), 400, 404,
                          params=[_path("id", "connection id", "integer")]),
        },
        "/api/xa": {"get": _op("Every XA branch", _ok("branches"))},
        "/api/xa/{xid}/commit": {
            "post": _op("Heuristically commit a prepared branch", _ok("its new state"),
                        400, 404, 409, params=[XID]),
        },
        "/api/xa/{xid}/rollback": {
            "post": _op("Heuristically roll back a prepared branch", _ok("its new state"),
                        400, 404, 409, params=[XID]),
        },
        "/api/xa/{xid}": {
            "delete": _op("Forget a heuristically completed branch", _ok("forgotten"),
                          400, 404, 409, params=[XID]),
        },
        "/api/ha/promote": {
            "post": _op("Promote this broker, a backup of a replicated group (docs/replication.md; "
                        "served by the backup's HTTP port, which answers only this, GET /api/ha "
                        "and 503 STANDBY); a broker that serves clients refuses it",
                        _ok("{node, promoting: true[, via: etcd]}"), 409),
        },
        "/api/router": {
            "get": _op("The router: facilities, partitions, servers and roles, transactions "
                       "by state, counts", _ok("{facilities, stats}"), 404,
                       params=[_query("facility", "one facility only", "string")]),
        },
        "/api/router/exceptions": {
            "get": _op("The exception transactions", _ok("exception transactions"), 404,
                       params=[_query("facility", "one facility only", "string")]),
        },
        "/api/router/exceptions/{tid}/commit": {
            "post": _op("Commit an exception transaction by hand (admin)",
                        _ok("{tid, state}"), 400, 403, 404, 409,
                        params=[_path("tid", "transaction id", "string")]),
        },
        "/api/router/exceptions/{tid}": {
            "delete": _op("Discard an exception transaction (admin)", _ok("{tid, state}"),
                          400, 403, 404, 409, params=[_path("tid", "transaction id", "string")]),
        },
        "/api/router/facilities/{facility}/partitions/{partition}/shadow": {
            "delete": _op("Retire the partition's secondary site (admin): it is no longer "
                          "shadowed and the transactions kept for it go (409 while one of "
                          "its shadow servers is registered)",
                          _ok("{facility, partition, released}"), 400, 403, 404, 409,
                          params=[_path("facility", "facility name", "string"),
                                  _path("partition", "partition name", "string")]),
        },
        "/api/openapi.json": {"get": {"summary": "This document", "security": [],
                                      "responses": {"200": _ok("OpenAPI 3")}}},
        "/metrics": {"get": {"summary": "Prometheus text exposition (docs/http.md)",
                             "responses": {"200": {"description": "metrics", "content": {
                                 "text/plain": {"schema": {"type": "string"}}}},
                                 "401": _error("no or wrong credentials")}}},
    },
}

__all__ = ["OPENAPI"]
