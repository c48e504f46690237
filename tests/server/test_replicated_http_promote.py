"""``POST /api/ha/promote`` (issue 29 §3; docs/replication.md, "Promotion"): a backup's
HTTP port promotes it with no CLI to start, answers ``GET /api/ha`` and refuses
everything else with 503 STANDBY; it needs the broker's users; a broker that serves
clients refuses the promotion (409)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import txbroker
from tests.ha_support import READY_PREFIX
from tests.replicated_support import BACKUP_PREFIX, Group, wait_for
from tests.support import free_port
from txbroker.server.security.auth import hash_password

USER, PASSWORD = "alice", "s3cret"


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[tuple[Group, dict[str, int]]]:
    """Three replicated brokers with users and an HTTP port each; ``a`` the primary."""
    config = tmp_path / "users.toml"
    config.write_text(f'[users]\n{USER} = "{hash_password(PASSWORD)}"\n')
    http = {name: free_port() for name in "abc"}
    group = Group(tmp_path, 3, "--config", str(config),
                  node_args={name: ["--http-port", str(port)] for name, port in http.items()})
    try:
        for node in group.nodes:
            group.spawn(node)
        for node in group.nodes:
            node.wait_line(BACKUP_PREFIX)
        yield group, http
    finally:
        group.stop()


def url(http: dict[str, int], name: str, path: str) -> str:
    return f"http://127.0.0.1:{http[name]}{path}"


def ready_backups(client: httpx.Client, overview: str) -> int:
    """Backups the primary counts as ready (its ``GET /api/overview``)."""
    ha = client.get(overview, auth=(USER, PASSWORD)).json()["ha"]
    return sum(1 for b in ha["replication"]["backups"] if b["state"] == "ready")


def test_http_promotion_of_a_backup(trio: tuple[Group, dict[str, int]]) -> None:
    group, http = trio
    auth = (USER, PASSWORD)
    with httpx.Client(timeout=30) as client:
        # a backup's HTTP port: the status, 503 for the API, 401 without credentials
        status = client.get(url(http, "b", "/api/ha"), auth=auth)
        assert status.status_code == 200 and status.json()["role"] == "backup"
        refused = client.get(url(http, "b", "/api/queues"), auth=auth)
        assert refused.status_code == 503 and refused.json()["code"] == "STANDBY"
        assert "is a backup of a replicated group" in refused.json()["error"]
        anonymous = client.post(url(http, "a", "/api/ha/promote"))
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"] == 'Basic realm="txbroker"'
        wrong = client.post(url(http, "a", "/api/ha/promote"), auth=(USER, "wrong"))
        assert wrong.status_code == 401 and wrong.json()["code"] == "AUTHENTICATION_FAILED"
        assert group.a.role == "backup"

        promoted = client.post(url(http, "a", "/api/ha/promote"), auth=auth)
        assert promoted.status_code == 200, promoted.text
        # a group of three asks its peers first: both answered, and both promised the
        # first term
        assert promoted.json() == {"node": "a", "promoting": True, "term": 1,
                                   "heard": ["b", "c"], "promised": ["b", "c"]}
        group.a.wait_line(READY_PREFIX)
        wait_for(lambda: ready_backups(client, url(http, "a", "/api/overview")) == 2 or None,
                 60, "two ready backups")

        # now a's port is the full API; promoting a broker that serves is refused
        again = client.post(url(http, "a", "/api/ha/promote"), auth=auth)
        assert again.status_code == 409 and again.json()["code"] == "ILLEGAL_STATE"
        assert "the primary" in again.json()["error"]
        assert client.get(url(http, "a", "/api/queues"), auth=auth).status_code == 200

        with txbroker.connect(f"txb://{USER}:{PASSWORD}@{group.a.address}") as conn:
            conn.send("orders", b"before the kill")
        group.kill9(group.a)
        promoted = client.post(url(http, "b", "/api/ha/promote"), auth=auth)
        assert promoted.status_code == 200, promoted.text
        group.b.wait_line(READY_PREFIX)
        with txbroker.connect(f"txb://{USER}:{PASSWORD}@{group.b.address}") as conn:
            message = conn.receive("orders", timeout=10)
            assert message is not None and message.body == b"before the kill"
            message.ack()


def test_a_broker_without_ha_refuses_the_promotion(tmp_path: Path) -> None:
    from tests.support import BrokerProcess

    port = free_port()
    broker = BrokerProcess(tmp_path / "data", "--http-port", str(port)).start()
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/api/ha/promote", timeout=30)
        assert reply.status_code == 409 and reply.json()["code"] == "ILLEGAL_STATE"
        assert "not one of an HA group" in reply.json()["error"]
    finally:
        broker.kill()
