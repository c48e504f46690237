"""Fixtures: one STOMP broker process per test module, clients that close themselves."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.stomp.support import StompBroker, StompClient

#: Small heart-beat floor so that heart-beat tests take a fraction of a second.
TEST_HEARTBEAT_MIN_MS = 100


@pytest.fixture(scope="module")
def stomp_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StompBroker]:
    """A broker with the STOMP listener on free loopback ports, killed at the end."""
    broker = StompBroker(tmp_path_factory.mktemp("stomp") / "data",
                         "--heartbeat-min-ms", str(TEST_HEARTBEAT_MIN_MS),
                         "--heartbeat-grace", "2.0", "--connect-timeout", "2")
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def connect(stomp_broker: StompBroker) -> Iterator[Callable[..., StompClient]]:
    """``connect(version="1.2", **headers)``: a connected client, closed after the test."""
    made: list[StompClient] = []

    def make(version: str = "1.2", **headers: str) -> StompClient:
        client = StompClient(stomp_broker.stomp_port)
        made.append(client)
        client.connect(version, **headers)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def queue() -> str:
    """A fresh queue destination."""
    return f"/queue/t-{uuid.uuid4().hex[:10]}"
