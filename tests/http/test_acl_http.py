"""Users and ACLs over HTTP (issue 16): each REST route through the one check of
the operation layer (docs/security.md, "For the HTTP edge"); a refusal is 403
``{"code": "FORBIDDEN"}`` and changes nothing; the audit lines say ``http``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import txbroker
from tests.server.test_acl import ACL, PASSWORD, Audit, event, forbidden, users_toml
from tests.support import BrokerProcess, free_port


@pytest.fixture(scope="module")
def http_acl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, int,
                                                                         Audit]]:
    base = tmp_path_factory.mktemp("acl-http")
    audit_path = base / "audit.jsonl"
    config = base / "broker.toml"
    config.write_text(f'[server]\naudit_log = "{audit_path}"\n\n' + users_toml() + ACL)
    port = free_port()
    with BrokerProcess(base / "data", "--config", str(config), "--http-port",
                       str(port)) as proc:
        yield proc, port, Audit(audit_path)


def call(port: int, user: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", auth=(user, PASSWORD),
                      timeout=30) as client:
        return client.request(method, path, **kwargs)


def test_routes(http_acl: tuple[BrokerProcess, int, Audit]) -> None:
    proc, port, audit = http_acl
    with txbroker.connect(f"txb://root:{PASSWORD}@127.0.0.1:{proc.port}",
                          reconnect=False) as root:
        root.send("orders.h", b"m1")
        root.send("billing.h", b"m2")
    audit.take()

    def refused(response: httpx.Response, user: str, action: str, where: str,
                op: str) -> None:
        assert response.status_code == 403
        assert response.json() == {"error": forbidden(user, action, where, op),
                                   "code": "FORBIDDEN"}

    # browse: bob on orders.* yes, billing no; alice (send only) no
    assert call(port, "bob", "GET", "/api/queues/orders.h/messages").json()[0]["body"] == "m1"
    refused(call(port, "bob", "GET", "/api/queues/billing.h/messages"),
            "bob", "browse", "'billing.h'", "browse")
    refused(call(port, "alice", "GET", "/api/queues/orders.h/messages"),
            "alice", "browse", "'orders.h'", "browse")
    # admin on a destination: dave on orders.*
    assert call(port, "dave", "POST", "/api/queues/orders.h/purge").json() == {"purged": 1}
    refused(call(port, "dave", "POST", "/api/queues/billing.h/purge"),
            "dave", "admin", "'billing.h'", "purge")
    refused(call(port, "alice", "DELETE", "/api/queues/orders.h"),
            "alice", "admin", "'orders.h'", "delete")
    refused(call(port, "dave", "POST", "/api/queues", json={"name": "billing.new"}),
            "dave", "admin", "'billing.new'", "declare")
    # move: admin on the source and send on the target
    refused(call(port, "dave", "POST", "/api/queues/orders.h/move", json={"to": "billing.h"}),
            "dave", "send", "'billing.h'", "move")
    # broker actions need admin on "#"
    refused(call(port, "dave", "GET", "/api/connections"),
            "dave", "admin", "the broker", "list_connections")
    refused(call(port, "dave", "POST", "/api/xa/00000001-67-62/rollback"),
            "dave", "admin", "the broker", "xa_heuristic")
    assert call(port, "root", "GET", "/api/connections").status_code == 200
    # nothing changed
    assert call(port, "root", "GET", "/api/queues/billing.h").json()["depth"] == 1
    assert call(port, "root", "GET", "/api/queues/billing.new").status_code == 404
    http = "http"
    assert audit.take() == [
        event("bob", "browse", "browse", "billing.h", "denied", http),
        event("alice", "browse", "browse", "orders.h", "denied", http),
        event("dave", "admin", "purge", "orders.h", "allowed", http),
        event("dave", "admin", "purge", "billing.h", "denied", http),
        event("alice", "admin", "delete", "orders.h", "denied", http),
        event("dave", "admin", "declare", "billing.new", "denied", http),
        event("dave", "admin", "move", "orders.h", "allowed", http),
        event("dave", "send", "move", "billing.h", "denied", http),
        event("dave", "admin", "list_connections", "", "denied", http),
        event("dave", "admin", "xa_heuristic", "00000001-67-62", "denied", http),
        event("root", "admin", "list_connections", "", "allowed", http),
    ]
