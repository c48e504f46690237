"""The operations added with the HTTP API, on the native protocol too, and the
durability of a move (a kill -9 right after its reply)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import txbroker
from tests.http.conftest import HttpBroker, start
from tests.support import STORES, BrokerProcess, RawClient, store_args

OK, ERR = 1, 2


def hello(port: int) -> RawClient:
    client = RawClient(port)
    assert client.call(1, "hello", version=1)[0] == OK
    return client


def test_native_browse_move_and_connections(broker: HttpBroker) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.declare_queue("n.src")
        conn.declare_queue("n.dst")
        conn.send("n.src", b"\x00one", message_id="one")
        conn.send("n.src", b"two")
    client = hello(broker.process.port)
    try:
        frame = client.call(2, "queue_browse", name="n.src", limit=5)
        assert frame[0] == OK
        assert [(m["body"], m["message_id"], m["state"]) for m in frame[3]] == [
            (b"\x00one", "one", "ready"), (b"two", None, "ready")]
        assert client.call(3, "queue_browse", name="n.src", limit=0)[0] == ERR
        assert client.call(4, "queue_browse", name="nope")[0] == ERR
        moved = client.call(5, "queue_move", name="n.src", to="n.dst", limit=1)
        assert moved[0] == OK and moved[3] == {"moved": 1, "to": "n.dst"}
        listed = client.call(6, "conn_list")
        assert listed[0] == OK
        mine = [c for c in listed[3] if c["protocol"] == "native"]
        assert len(mine) == 1 and mine[0]["authenticated"] is True
        refused = client.call(7, "conn_close", id=10**9)
        assert refused[0] == ERR
    finally:
        client.close()
    depths = {q["name"]: q["depth"] for q in broker.http.get("/api/queues").json()}
    assert (depths["n.src"], depths["n.dst"]) == (1, 1)


@pytest.mark.parametrize("store", STORES)
def test_a_move_survives_a_kill(tmp_path: Path, store: str) -> None:
    running = start(tmp_path / "data", *store_args(store))
    try:
        with txbroker.connect(running.url) as conn:
            conn.declare_queue("k.src")
            conn.declare_queue("k.dst")
            for n in range(5):
                conn.send("k.src", b"m%d" % n)
        reply = running.http.post("/api/queues/k.src/move", json={"to": "k.dst", "limit": 3})
        assert reply.json() == {"moved": 3, "to": "k.dst"}  # answered once durable
        running.process.kill()  # SIGKILL
    finally:
        running.http.close()
    again = BrokerProcess(tmp_path / "data", "--http-port", str(running.http_port),
                          *store_args(store)).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{running.http_port}") as http:
            browsed = {name: [m["body"] for m in
                              http.get(f"/api/queues/{name}/messages").json()]
                       for name in ("k.src", "k.dst")}
        assert browsed == {"k.src": ["m3", "m4"], "k.dst": ["m0", "m1", "m2"]}
        with txbroker.connect(again.url) as conn:
            message = conn.receive("k.dst", timeout=10)
            assert message is not None and message.body == b"m0"
            message.ack()
    finally:
        again.kill()
