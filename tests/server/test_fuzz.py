"""Hypothesis throws bytes and odd requests at a live broker; it must answer
with errors, keep other clients working and keep stored data intact."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import txbroker
from tests.support import BrokerProcess, RawClient

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12,
)
ops = st.sampled_from(["send", "receive", "ack", "nack", "subscribe", "unsubscribe",
                       "tx_begin", "tx_commit", "tx_rollback", "queue_declare", "queue_update",
                       "queue_delete", "queue_purge", "queue_info", "topic_subscribe", "hello",
                       "nonsense"])
requests = st.tuples(st.integers(0, 2**32), ops, st.dictionaries(
    st.sampled_from(["dest", "queue", "body", "tags", "tx", "name", "sub", "timeout_ms",
                     "prefetch", "settings", "priority", "headers", "kind", "topic"]),
    values, max_size=5))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(Path(tmp_path_factory.mktemp("fuzz")) / "data").start()
    with txbroker.connect(proc.url) as conn:
        conn.declare_queue("precious")
        for i in range(20):
            conn.send("precious", b"keep-%d" % i)
    try:
        yield proc
    finally:
        proc.kill()


def _drain_socket(sock: socket.socket) -> None:
    sock.settimeout(0.2)
    try:
        while sock.recv(65536):
            pass
    except (TimeoutError, OSError):
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=200))
def test_random_bytes(live: BrokerProcess, data: bytes) -> None:
    raw = RawClient(live.port)
    raw.send_raw(data)
    _drain_socket(raw.sock)
    raw.close()


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(requests, min_size=1, max_size=8))
def test_random_requests(live: BrokerProcess, batch: list[tuple[int, str, dict[str, object]]],
                         ) -> None:
    raw = RawClient(live.port)
    raw.request(1, "hello", {"version": 1})
    for rid, op, args in batch:
        if op == "queue_delete" or op == "queue_purge" or args.get("dest") == "precious":
            args = {**args, "name": "scratch"}  # never destroy the reference data on purpose
        if args.get("queue") == "precious" or args.get("name") == "precious":
            continue
        payload = msgpack.packb([0, rid, op, args], use_bin_type=True)
        raw.send_raw(len(payload).to_bytes(4, "big") + payload)
    _drain_socket(raw.sock)
    raw.close()


def test_stored_data_intact_after_fuzzing(live: BrokerProcess) -> None:
    with txbroker.connect(live.url) as conn:
        info = conn.queue_info("precious")
        assert info["depth"] + info["in_flight"] == 20
        conn.ping()
