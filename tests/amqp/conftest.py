"""Fixtures: one broker process with the AMQP listener per test module."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.amqp.support import AmqpBroker


@pytest.fixture(scope="module")
def amqp_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AmqpBroker]:
    """A broker (``txbroker serve``) with AMQP on a free loopback port, killed at the end."""
    broker = AmqpBroker(tmp_path_factory.mktemp("amqp") / "data")
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def queue_name() -> str:
    """A fresh queue name."""
    return f"t-{uuid.uuid4().hex[:10]}"
