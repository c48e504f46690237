"""AMQP clients and their channels where an operator looks: the REST API
(``/api/connections``), ``/metrics``, and ``txbroker connections``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.amqp.support import AmqpBroker
from tests.support import ROOT, free_port


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AmqpBroker, httpx.Client]]:
    """A broker with the AMQP and HTTP listeners."""
    http_port = free_port()
    running = AmqpBroker(tmp_path_factory.mktemp("amqp-http") / "data", "--http-port",
                         str(http_port))
    running.start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30)
    try:
        yield running, client
    finally:
        client.close()
        running.kill()


def amqp_connections(http: httpx.Client) -> list[dict[str, Any]]:
    response = http.get("/api/connections")
    assert response.status_code == 200, response.text
    return [c for c in response.json() if c["protocol"] == "amqp"]


def test_rest_metrics_and_cli_show_a_live_connections_channels(
        broker: tuple[AmqpBroker, httpx.Client]) -> None:
    amqp, http = broker
    assert amqp_connections(http) == []
    conn = pika.BlockingConnection(pika.URLParameters(amqp.amqp_url))
    try:
        plain = conn.channel()  # 1: nothing
        confirming = conn.channel()  # 2: confirm mode
        confirming.confirm_delivery()
        consuming = conn.channel()  # 3: tx mode, a consumer with prefetch 7, 3 unacked
        consuming.queue_declare("seen", durable=True)
        for i in range(3):
            confirming.basic_publish("", "seen", b"%d" % i)
        consuming.basic_qos(prefetch_count=7)
        got: list[Any] = []
        consuming.basic_consume("seen", lambda ch, m, p, b: got.append(m), consumer_tag="watch")
        consuming.tx_select()
        deadline = time.monotonic() + 10
        while len(got) < 3:
            assert time.monotonic() < deadline
            conn.process_data_events(time_limit=0.1)
        (found,) = amqp_connections(http)
        assert (found["subscriptions"], found["unacked"], found["transactions"]) == (1, 3, 1)
        assert found["channels"] == [
            {"number": plain.channel_number, "state": "open", "consumers": 0,
             "consumer_tags": [], "prefetch": 0, "unacked": 0, "mode": "none"},
            {"number": confirming.channel_number, "state": "open", "consumers": 0,
             "consumer_tags": [], "prefetch": 0, "unacked": 0, "mode": "confirm"},
            {"number": consuming.channel_number, "state": "open", "consumers": 1,
             "consumer_tags": ["watch"], "prefetch": 7, "unacked": 3, "mode": "tx"},
        ]
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(http.get("/metrics").text)
                   for s in f.samples}
        assert samples[("txbroker_connections", (("protocol", "amqp"),))] == 1.0
        for mode in ("none", "confirm", "tx"):
            assert samples[("txbroker_amqp_channels", (("mode", mode),))] == 1.0
        env = {k: v for k, v in os.environ.items() if k != "TXBROKER_DEBUG"}
        listed = json.loads(subprocess.run(
            [sys.executable, "-m", "txbroker.cli", "connections", "--url", amqp.url, "--json"],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=120).stdout)
        assert [c["channels"] for c in listed if c["protocol"] == "amqp"] == \
            [found["channels"]]
        table = subprocess.run(
            [sys.executable, "-m", "txbroker.cli", "connections", "--url", amqp.url],
            cwd=ROOT, env={**env, "COLUMNS": "200"}, capture_output=True, text=True,
            check=True, timeout=120).stdout
        assert "amqp" in table and " tx " in table and " confirm " in table
        consuming.basic_cancel("watch")  # the cancelled consumer's unacked stay
        (found,) = amqp_connections(http)
        assert [(c["number"], c["consumers"], c["unacked"]) for c in found["channels"]] == [
            (plain.channel_number, 0, 0), (confirming.channel_number, 0, 0),
            (consuming.channel_number, 0, 3)]
        plain.close()
        (found,) = amqp_connections(http)
        assert [c["number"] for c in found["channels"]] == [confirming.channel_number,
                                                           consuming.channel_number]
    finally:
        conn.close()
    deadline = time.monotonic() + 10
    while amqp_connections(http):
        assert time.monotonic() < deadline, "the connection is still listed"
        time.sleep(0.05)
