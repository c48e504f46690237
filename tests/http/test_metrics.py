"""``/metrics`` parsed with prometheus_client's parser against known traffic."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import txbroker
from tests.http.conftest import HttpBroker, start
from tests.http.test_api import info, wait_for


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[HttpBroker]:
    """A broker of its own: the broker-wide counters start at 0."""
    running = start(tmp_path / "data")
    yield running
    running.http.close()
    running.process.kill()


def scrape(broker: HttpBroker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    response = broker.http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def per_queue(samples: dict[Any, float], name: str) -> dict[str, float]:
    """The samples of one metric by queue."""
    return {dict(labels)["queue"]: value for (metric, labels), value in samples.items()
            if metric == name}


def test_metrics_match_known_traffic(fresh: HttpBroker) -> None:
    with txbroker.connect(fresh.url) as conn:
        conn.declare_queue("m.q", max_deliveries=1, dead_letter_queue="m.dlq")
        conn.declare_queue("m.dlq")
        conn.declare_queue("m.ttl")
        for n in range(5):
            conn.send("m.q", b"x" * (n + 1))  # 1 + 2 + 3 + 4 + 5 bytes
        for _ in range(2):
            message = conn.receive("m.q", timeout=10)
            assert message is not None
            message.ack()
        rejected = conn.receive("m.q", timeout=10)
        assert rejected is not None
        rejected.nack()  # max_deliveries 1: to m.dlq
        held = conn.receive("m.q", timeout=10)  # stays in flight
        assert held is not None
        conn.send("m.ttl", b"short-lived", ttl=0.001)
        xid = conn.xid(1, b"metrics", b"b")
        conn.tpc_begin(xid)
        conn.send("m.q", b"prepared")
        conn.tpc_prepare()
        wait_for(lambda: info(fresh, "m.ttl")["expired"] == 1, "the TTL to run out")
        wait_for(lambda: info(fresh, "m.q")["dead_lettered"] == 1, "the dead-lettering")

        samples = scrape(fresh)
        overview = fresh.http.get("/api/overview").json()

        def q(metric: str) -> dict[str, float]:
            return per_queue(samples, metric)

        assert q("txbroker_queue_messages") == {"m.q": 1, "m.dlq": 1, "m.ttl": 0}
        assert q("txbroker_queue_messages_in_flight") == {"m.q": 1, "m.dlq": 0, "m.ttl": 0}
        assert q("txbroker_queue_consumers") == {"m.q": 0, "m.dlq": 0, "m.ttl": 0}
        # in m.q: the 4 and 5 byte bodies (one ready, one in flight); in m.dlq: 3 bytes
        assert q("txbroker_queue_bytes") == {"m.q": 9, "m.dlq": 3, "m.ttl": 0}
        assert q("txbroker_queue_enqueued_total") == {"m.q": 5, "m.dlq": 1, "m.ttl": 1}
        assert q("txbroker_queue_dequeued_total") == {"m.q": 2, "m.dlq": 0, "m.ttl": 0}
        assert q("txbroker_queue_expired_total") == {"m.q": 0, "m.dlq": 0, "m.ttl": 1}
        assert q("txbroker_queue_dead_lettered_total") == {"m.q": 1, "m.dlq": 0, "m.ttl": 0}
        assert samples[("txbroker_messages_acked_total", ())] == 2
        assert samples[("txbroker_messages_expired_total", ())] == 1
        assert samples[("txbroker_messages_dead_lettered_total", ())] == 1
        assert samples[("txbroker_queues", ())] == 3
        assert samples[("txbroker_xa_branches", (("state", "prepared"),))] == 1
        assert samples[("txbroker_xa_branches", (("state", "active"),))] == 0
        # the native client, and the scrape's own HTTP session
        assert samples[("txbroker_connections", (("protocol", "native"),))] == 1
        assert samples[("txbroker_connections", (("protocol", "http"),))] == 1
        assert samples[("txbroker_connections", (("protocol", "stomp"),))] == 0
        store = overview["store"]
        assert samples[("txbroker_store_appends_total", ())] == store["appends"]
        assert samples[("txbroker_store_syncs_total", ())] == store["syncs"]
        assert samples[("txbroker_store_written_bytes_total", ())] == store["bytes_written"]
        assert samples[("txbroker_store_body_cache_bytes", ())] == store["body_cache_bytes"]
        batches = samples[("txbroker_store_batch_seconds_count", ())]
        assert batches >= 1
        assert samples[("txbroker_store_batch_seconds_bucket", (("le", "+Inf"),))] == batches
        assert samples[("txbroker_store_batch_entries_count", ())] == batches
        assert samples[("txbroker_info", (("store", "journal"), ("sync", "fdatasync"),
                                          ("version", txbroker.__version__)))] == 1
        assert ("txbroker_ha_role", (("mode", "shared-store"), ("role", "active"))) \
            not in samples  # no HA: no role
        held.ack()


def test_metric_names_follow_the_conventions(fresh: HttpBroker) -> None:
    """A ``txbroker_`` prefix; counters end in ``_total``; units in the name."""
    response = fresh.http.get("/metrics")
    families = list(text_string_to_metric_families(response.text))
    assert families
    for family in families:
        assert family.name.startswith("txbroker_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_entries"))


def test_ha_role_is_exported_when_the_broker_is_one_of_a_pair() -> None:
    """The HA part's status (``stats()["ha"]``) becomes ``txbroker_ha_role``."""
    from collections import Counter

    from prometheus_client import generate_latest

    from txbroker.server.edges.http.metrics import Snapshot

    def role_samples(ha: Any) -> list[tuple[str, dict[str, str], float]]:
        snapshot = Snapshot(queues=[], stats={"ha": ha} if ha else {}, store=None,
                            batch_seconds=None, batch_entries=None, connections=Counter(),
                            xa_states=Counter(), store_kind="journal", sync="fdatasync")
        text = generate_latest(snapshot).decode()
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "txbroker_ha_role"]

    assert role_samples({"mode": "shared-store", "role": "active", "peer": "h:1"}) == [
        ("txbroker_ha_role", {"mode": "shared-store", "role": "active"}, 1.0)]
    assert role_samples(None) == []
