"""The REST API against a real broker process: every endpoint, and bad input."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx
import pytest

import txbroker
from tests.http.conftest import PASSWORD, USER, HttpBroker, dead_letter_two
from txbroker.errors import ConnectionLost, TxBrokerError
from txbroker.server.edges.http.api import HttpApi, routes
from txbroker.server.edges.http.openapi import OPENAPI

JSON = {"content-type": "application/json"}


def error(response: httpx.Response, status: int, code: str) -> str:
    """Assert an error reply; return its text."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "code"}
    assert body["code"] == code
    return str(body["error"])


def info(broker: HttpBroker, name: str) -> dict[str, Any]:
    response = broker.http.get(f"/api/queues/{name}")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def wait_for(check: Any, what: str, timeout: float = 20.0) -> None:
    """Poll ``check()`` until true (state the broker reaches asynchronously)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ----------------------------------------------------------------- the document
def test_every_route_is_in_the_openapi_document(broker: HttpBroker) -> None:
    served = broker.http.get("/api/openapi.json")
    assert served.status_code == 200
    assert served.json() == OPENAPI
    documented = {(path, method) for path, ops in OPENAPI["paths"].items() for method in ops}
    api = HttpApi.__new__(HttpApi)  # the routes only name its methods
    for route in routes(api):
        path = route.path.replace("{name:path}", "{name}")
        for method in route.methods or ():
            if method != "HEAD":
                assert (path, method.lower()) in documented, (path, method)
    assert len(documented) == sum(len([m for m in r.methods or () if m != "HEAD"])
                                  for r in routes(api))


def test_overview(broker: HttpBroker) -> None:
    body = broker.http.get("/api/overview").json()
    assert body["version"] == txbroker.__version__
    assert body["store"]["kind"] == "journal"
    assert body["store"]["sync"] == "fdatasync"
    assert body["ha"] is None
    assert body["uptime_seconds"] >= 0
    assert {"queues", "messages", "sent", "acked", "connections"} <= set(body["stats"])


# ----------------------------------------------------------------- queues
def test_queue_lifecycle(broker: HttpBroker) -> None:
    http = broker.http
    created = http.post("/api/queues", json={"name": "life", "settings": {"max_messages": 10}})
    assert created.status_code == 201
    assert created.json()["settings"]["max_messages"] == 10
    assert http.post("/api/queues", json={"name": "life"}).status_code == 201  # same: no-op
    error(http.post("/api/queues", json={"name": "life", "settings": {"max_messages": 5}}),
          409, "ALREADY_EXISTS")
    with txbroker.connect(broker.url) as conn:
        for n in range(3):
            conn.send("life", f"m{n}".encode())
    listed = {q["name"]: q for q in http.get("/api/queues").json()}
    assert {k: listed["life"][k] for k in ("kind", "depth", "in_flight", "consumers", "bytes",
                                           "enqueued", "dequeued")} == {
        "kind": "queue", "depth": 3, "in_flight": 0, "consumers": 0, "bytes": 6,
        "enqueued": 3, "dequeued": 0}
    changed = http.patch("/api/queues/life", json={"max_messages": 20, "ingress": False})
    assert changed.status_code == 200
    assert (changed.json()["settings"]["max_messages"], changed.json()["settings"]["ingress"]) \
        == (20, False)
    assert "unknown queue setting 'colour'" in error(
        http.patch("/api/queues/life", json={"colour": "red"}), 400, "BAD_REQUEST")
    error(http.patch("/api/queues/life", json={"max_messages": "many"}), 400, "BAD_REQUEST")
    assert http.delete("/api/queues/life").json() == {"deleted": 3}
    assert error(http.get("/api/queues/life"), 404, "NOT_FOUND") == "no queue 'life'"
    error(http.delete("/api/queues/life"), 404, "NOT_FOUND")
    error(http.patch("/api/queues/life", json={"max_messages": 1}), 404, "NOT_FOUND")


def test_topics_are_listed_and_filtered(broker: HttpBroker) -> None:
    http = broker.http
    assert http.post("/api/queues", json={"name": "news", "kind": "topic"}).status_code == 201
    topics = http.get("/api/queues", params={"kind": "topic"}).json()
    assert [t["name"] for t in topics if t["name"] == "news"] == ["news"]
    assert all(t["kind"] == "topic" for t in topics)
    assert all(q["kind"] == "queue" for q in http.get("/api/queues?kind=queue").json())
    error(http.get("/api/queues?kind=exchange"), 400, "BAD_REQUEST")
    error(http.post("/api/queues", json={"name": "news2", "kind": "exchange"}), 400,
          "BAD_REQUEST")


def test_browse_does_not_consume(broker: HttpBroker) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.declare_queue("browse")
        conn.send("browse", b"low", headers={"k": "v"}, message_id="m-low")
        conn.send("browse", b"\xff\x00", priority=9)
        conn.send("browse", "grüße".encode())
    response = broker.http.get("/api/queues/browse/messages")
    assert response.status_code == 200
    found = response.json()
    assert [(m["body"], m["body_encoding"], m["priority"], m["size"]) for m in found] == [
        (base64.b64encode(b"\xff\x00").decode(), "base64", 9, 2),
        ("low", "text", 4, 3), ("grüße", "text", 4, 7)]
    assert found[1]["headers"] == {"k": "v"}
    assert found[1]["message_id"] == "m-low"
    assert [m["delivery_count"] for m in found] == [0, 0, 0]
    assert [m["state"] for m in found] == ["ready"] * 3
    assert all(m["timestamp_ms"] > 0 for m in found)
    assert len(broker.http.get("/api/queues/browse/messages?limit=1").json()) == 1
    assert info(broker, "browse")["depth"] == 3
    error(broker.http.get("/api/queues/browse/messages?limit=0"), 400, "BAD_REQUEST")
    error(broker.http.get("/api/queues/browse/messages?limit=x"), 400, "BAD_REQUEST")
    error(broker.http.get("/api/queues/nope/messages"), 404, "NOT_FOUND")


def test_purge_of_a_consumed_queue_leaves_unacked_messages(broker: HttpBroker) -> None:
    """RabbitMQ's semantics: purge drops the ready messages; the in-flight ones stay
    with their consumer, who may still ack them (or get them redelivered)."""
    with txbroker.connect(broker.url) as conn:
        conn.declare_queue("purge")
        for n in range(5):
            conn.send("purge", b"m%d" % n)
        sub = conn.subscribe("purge", prefetch=2)
        taken = [sub.get(timeout=10), sub.get(timeout=10)]
        assert all(m is not None for m in taken)
        wait_for(lambda: info(broker, "purge")["in_flight"] == 2, "2 in flight")
        response = broker.http.post("/api/queues/purge/purge")
        assert response.status_code == 200
        assert response.json() == {"purged": 3}
        after = info(broker, "purge")
        assert (after["depth"], after["in_flight"], after["consumers"]) == (0, 2, 1)
        for message in taken:
            assert message is not None
            message.ack()
        wait_for(lambda: info(broker, "purge")["messages"] == 0, "acks applied")
        assert info(broker, "purge")["dequeued"] == 2
    error(broker.http.post("/api/queues/nope/purge"), 404, "NOT_FOUND")


def test_redrive_a_dead_letter_queue(broker: HttpBroker) -> None:
    http = broker.http
    dead_letter_two(broker.url)
    with txbroker.connect(broker.url) as conn:
        wait_for(lambda: info(broker, "work.dlq")["depth"] == 2, "dead-lettered")
        assert info(broker, "work")["dead_lettered"] == 2
        error(http.post("/api/queues/work.dlq/move", json={"to": "nowhere"}), 404, "NOT_FOUND")
        error(http.post("/api/queues/work.dlq/move", json={"limit": "all"}), 400, "BAD_REQUEST")
        error(http.post("/api/queues/work.dlq/move", json={"to": "work.dlq"}), 400,
              "BAD_REQUEST")
        assert "dead-lettering to 'work'" in error(http.post("/api/queues/work/move"), 400,
                                                   "BAD_REQUEST")
        one = http.post("/api/queues/work.dlq/move", json={"limit": 1})
        assert one.json() == {"moved": 1, "to": "work"}
        rest = http.post("/api/queues/work.dlq/move")  # the origin found by the broker
        assert rest.json() == {"moved": 1, "to": "work"}
        assert (info(broker, "work.dlq")["depth"], info(broker, "work")["depth"]) == (0, 2)
        assert [m["body"] for m in http.get("/api/queues/work/messages").json()] == ["a", "b"]
        again = conn.receive("work", timeout=10)
        assert again is not None and again.body == b"a"
        again.ack()


# ----------------------------------------------------------------- connections
def test_list_and_close_connections(broker: HttpBroker) -> None:
    http = broker.http
    with txbroker.connect(broker.url, reconnect=False) as conn:  # no failover: stays closed
        conn.declare_queue("conns")
        sub = conn.subscribe("conns", prefetch=5)
        found = http.get("/api/connections").json()
        native = [c for c in found if c["protocol"] == "native" and c["subscriptions"] == 1]
        assert len(native) == 1
        assert native[0]["user"] is None
        assert native[0]["address"].startswith("127.0.0.1:")
        assert any(c["protocol"] == "http" for c in found)  # this request's own session
        closed = http.delete(f"/api/connections/{native[0]['id']}")
        assert closed.json() == {"closed": native[0]["id"]}
        wait_for(lambda: info(broker, "conns")["consumers"] == 0, "the consumer gone")
        del sub
    error(http.delete("/api/connections/999999"), 404, "NOT_FOUND")
    error(http.delete("/api/connections/abc"), 400, "BAD_REQUEST")


# ----------------------------------------------------------------- XA
def test_xa_heuristic_rollback_and_forget(broker: HttpBroker) -> None:
    http = broker.http
    with txbroker.connect(broker.url) as conn:
        conn.declare_queue("xa-q")
        xid = conn.xid(7, b"http-gtrid", b"b1")
        conn.tpc_begin(xid)
        conn.send("xa-q", b"in doubt")
        conn.tpc_prepare()
    text = str(xid)
    branches = [b for b in http.get("/api/xa").json() if b["xid"] == text]
    assert [(b["state"], b["sent"]) for b in branches] == [("prepared", 1)]
    done = http.post(f"/api/xa/{text}/rollback")
    assert done.json() == {"xid": text, "state": "heuristic_rolled_back"}
    assert [b["state"] for b in http.get("/api/xa").json() if b["xid"] == text] == [
        "heuristic_rolled_back"]
    assert info(broker, "xa-q")["depth"] == 0
    error(http.post(f"/api/xa/{text}/commit"), 409, "XAER_PROTO")
    assert http.delete(f"/api/xa/{text}").json() == {"xid": text, "forgotten": True}
    error(http.delete(f"/api/xa/{text}"), 404, "XAER_NOTA")
    error(http.post("/api/xa/not-an-xid/commit"), 400, "XAER_INVAL")


def test_xa_heuristic_commit(broker: HttpBroker) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.declare_queue("xa-c")
        xid = conn.xid(7, b"http-commit", b"b1")
        conn.tpc_begin(xid)
        conn.send("xa-c", b"committed by hand")
        conn.tpc_prepare()
    done = broker.http.post(f"/api/xa/{xid}/commit")
    assert done.json()["state"] == "heuristic_committed"
    assert [m["body"] for m in broker.http.get("/api/queues/xa-c/messages").json()] == [
        "committed by hand"]


# ----------------------------------------------------------------- bad requests
def test_bad_requests(broker: HttpBroker) -> None:
    http = broker.http
    assert "bad JSON" in error(http.post("/api/queues", content=b"{x", headers=JSON), 400,
                               "BAD_REQUEST")
    error(http.post("/api/queues", content=b"[1]", headers=JSON), 400, "BAD_REQUEST")
    error(http.post("/api/queues", json={}), 400, "BAD_REQUEST")
    error(http.post("/api/queues", json={"name": 5}), 400, "BAD_REQUEST")
    error(http.post("/api/queues"), 400, "BAD_REQUEST")
    error(http.post("/api/queues", content=b"name=x",
                    headers={"content-type": "application/x-www-form-urlencoded"}),
          415, "UNSUPPORTED_MEDIA_TYPE")
    error(http.get("/api/nothing"), 404, "NOT_FOUND")
    error(http.get("/apix"), 404, "NOT_FOUND")
    error(http.put("/api/queues"), 405, "METHOD_NOT_ALLOWED")
    error(http.post("/api/xa"), 405, "METHOD_NOT_ALLOWED")
    error(http.post("/api/queues", content=b"x" * (1024 * 1024 + 1), headers=JSON), 413,
          "TOO_LARGE")


# ----------------------------------------------------------------- authentication
def test_a_broker_with_users_requires_basic_auth(secured: HttpBroker) -> None:
    http = secured.http
    for path in ("/api/overview", "/api/queues", "/metrics"):
        missing = http.get(path)
        error(missing, 401, "AUTHENTICATION_FAILED")
        assert missing.headers["www-authenticate"] == 'Basic realm="txbroker"'
        error(http.get(path, auth=(USER, "wrong")), 401, "AUTHENTICATION_FAILED")
        error(http.get(path, auth=("mallory", PASSWORD)), 401, "AUTHENTICATION_FAILED")
        assert http.get(path, auth=(USER, PASSWORD)).status_code == 200
    error(http.get("/api/queues", headers={"authorization": "Bearer abc"}), 401,
          "AUTHENTICATION_FAILED")
    error(http.get("/api/queues", headers={"authorization": "Basic !!!"}), 401,
          "AUTHENTICATION_FAILED")
    # refused before anything is done
    error(http.post("/api/queues", json={"name": "sneaky"}), 401, "AUTHENTICATION_FAILED")
    names = [q["name"] for q in http.get("/api/queues", auth=(USER, PASSWORD)).json()]
    assert "sneaky" not in names
    assert http.get("/api/openapi.json").status_code == 200  # the document is public
    created = http.post("/api/queues", json={"name": "by-alice"}, auth=(USER, PASSWORD))
    assert created.status_code == 201
    users = [c["user"] for c in http.get("/api/connections", auth=(USER, PASSWORD)).json()]
    assert users == [USER]


def test_closed_connection_sees_its_connection_lost(broker: HttpBroker) -> None:
    """An operator's close is a lost connection for the client (it fails over or raises)."""
    with txbroker.connect(broker.url, reconnect=False) as conn:
        conn.declare_queue("closed")
        mine = [c for c in broker.http.get("/api/connections").json()
                if c["protocol"] == "native"]
        assert len(mine) == 1
        broker.http.delete(f"/api/connections/{mine[0]['id']}")
        with pytest.raises((ConnectionLost, TxBrokerError)):
            for _ in range(100):
                conn.ping()
                time.sleep(0.05)


def test_every_refusal_code_has_an_http_status() -> None:
    """Every ErrorCode but INTERNAL (500) and XA (by XA code) has its status, and the
    table names no code that does not exist (FORBIDDEN comes with the ACL change)."""
    from txbroker.errors import ErrorCode
    from txbroker.server.edges.http.calls import STATUS_OF_CODE

    names = {code.name for code in ErrorCode}
    assert names - set(STATUS_OF_CODE) == {"INTERNAL", "XA"}
    assert set(STATUS_OF_CODE) - names <= {"FORBIDDEN"}


def test_a_page_of_queues(broker: HttpBroker) -> None:
    """?limit= pages the list (the console's queue list): filtered by name, sorted,
    X-Total-Count says how many match."""
    http = broker.http
    with txbroker.connect(broker.url) as conn:
        for n, depth in enumerate((2, 0, 3, 1, 2)):
            conn.declare_queue(f"Paged.{n}")
            for _ in range(depth):
                conn.send(f"Paged.{n}", b"x")
    whole = http.get("/api/queues")
    assert "x-total-count" not in whole.headers  # no limit: every queue, as before

    def page(**params: Any) -> tuple[list[str], int]:
        response = http.get("/api/queues", params=params)
        assert response.status_code == 200, response.text
        return [q["name"] for q in response.json()], int(response.headers["x-total-count"])

    assert page(name="paged.", limit=2) == (["Paged.0", "Paged.1"], 5)
    assert page(name="PAGED.", limit=2, offset=4) == (["Paged.4"], 5)
    assert page(name="paged.", limit=10, offset=9) == ([], 5)
    assert page(name="paged.", limit=0) == ([], 5)
    assert page(name="paged.", limit=3, sort="depth", order="desc") == (
        ["Paged.2", "Paged.0", "Paged.4"], 5)  # equal depths in name order
    assert page(name="paged.", limit=5, sort="depth")[0] == [
        "Paged.1", "Paged.3", "Paged.0", "Paged.4", "Paged.2"]
    assert page(name="paged.", limit=5, order="desc")[0][0] == "Paged.4"
    assert page(name="paged.3", limit=5, kind="queue") == (["Paged.3"], 1)
    assert page(name="paged.", limit=5, kind="topic") == ([], 0)
    for bad in ({"limit": -1}, {"limit": 1001}, {"limit": 5, "offset": -1},
                {"limit": "x"}, {"limit": 5, "sort": "colour"},
                {"limit": 5, "order": "up"}):
        error(http.get("/api/queues", params=bad), 400, "BAD_REQUEST")


def test_router_show_and_exceptions(broker: HttpBroker) -> None:
    """Issue 28 §2: the router in the REST API — facilities, partitions and their
    servers, transactions by state, exception transactions with discard."""
    from txbroker.router import Role, ServerTransactionController, TransactionController

    http = broker.http
    with txbroker.connect(broker.url) as conn:
        conn.request("rtr_define", {"facility": "HTTPBANK", "partitions": [
            {"name": "A", "low": 0, "high": 99, "retry_count": 0}]})
    with TransactionController(broker.url) as client:
        client.register_facility("HTTPBANK")
        with ServerTransactionController(broker.url) as server:
            server.register_partition("HTTPBANK", "A")
            shown = http.get("/api/router", params={"facility": "HTTPBANK"}).json()
            [facility] = shown["facilities"]
            [partition] = facility["partitions"]
            assert (partition["name"], [s["role"] for s in partition["servers"]]) == (
                "A", ["primary"])
            tid = client.start_transaction()
            client.send(b"poison", key=1)
            client.accept()
            assert server.receive(timeout=30) is not None
        message = client.receive(timeout=30)  # the server left before voting: SRVDIED
        assert message is not None and message.reason == "SRVDIED"
    listed = http.get("/api/router/exceptions", params={"facility": "HTTPBANK"}).json()
    assert [e["tid"] for e in listed] == [tid]
    assert http.get("/api/router").json()["stats"]["exceptions"] == 1
    assert http.delete(f"/api/router/exceptions/{tid}").json() == {
        "tid": tid, "state": "DISCARDED"}
    error(http.delete(f"/api/router/exceptions/{tid}"), 404, "NOT_FOUND")
    error(http.get("/api/router", params={"facility": "NOPE"}), 404, "NOT_FOUND")
    assert http.get("/api/router/exceptions").json() == []
    # a secondary site retired (admin; answered once durable): not shadowed any more
    retire = "/api/router/facilities/HTTPBANK/partitions/A/shadow"
    with ServerTransactionController(broker.url) as shadow:
        shadow.register_partition("HTTPBANK", "A", Role.SHADOW)
        error(http.delete(retire), 409, "ILLEGAL_STATE")  # its shadow is registered

    def servers() -> list[Any]:
        [shown] = http.get("/api/router", params={"facility": "HTTPBANK"}).json()["facilities"]
        return list(shown["partitions"][0]["servers"])

    deadline = time.monotonic() + 10  # until the broker has seen the shadow leave
    while servers():
        assert time.monotonic() < deadline, "the shadow server is still registered"
        time.sleep(0.01)
    assert http.delete(retire).json() == {"facility": "HTTPBANK", "partition": "A",
                                          "released": 0}
    [facility] = http.get("/api/router", params={"facility": "HTTPBANK"}).json()["facilities"]
    assert [p["shadowed"] for p in facility["partitions"]] == [False]
    error(http.delete("/api/router/facilities/HTTPBANK/partitions/Z/shadow"), 404,
          "NOT_FOUND")

