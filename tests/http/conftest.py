"""Brokers with HTTP on a free port: an open one (loopback, no users) and one with
users (HTTP Basic), each shared by a test module; tests use their own queues."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import txbroker
from tests.support import BrokerProcess, free_port
from txbroker.server.security.auth import hash_password

USER, PASSWORD = "alice", "s3cret"


@dataclass
class HttpBroker:
    """A broker process and an HTTP client on its HTTP port."""

    process: BrokerProcess
    http_port: int
    http: httpx.Client
    amqp_port: int = 0  #: the AMQP listener's port (0: off)

    @property
    def url(self) -> str:
        """The native URL (with the user, on the broker with users)."""
        return self.process.url


def start(data: Path, *args: str, amqp: bool = False) -> HttpBroker:
    """A broker with ``--http-port`` on a free port (and ``amqp``: ``--amqp-port``)."""
    port = free_port()
    amqp_port = free_port() if amqp else 0
    extra = ["--amqp-port", str(amqp_port)] if amqp else []
    process = BrokerProcess(data, "--http-port", str(port), *extra, *args).start()
    return HttpBroker(process, port, httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                 timeout=30), amqp_port)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpBroker]:
    """An open broker (no users): loopback, no credentials needed."""
    running = start(tmp_path_factory.mktemp("http") / "data")
    yield running
    running.http.close()
    running.process.kill()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpBroker]:
    """A broker with one user, ``alice``."""
    root = tmp_path_factory.mktemp("http-users")
    config = root / "broker.toml"
    config.write_text(f'[users]\n{USER} = "{hash_password(PASSWORD)}"\n')
    running = start(root / "data", "--config", str(config))
    yield running
    running.http.close()
    running.process.kill()


def dead_letter_two(url: str) -> None:
    """Queue ``work`` (max_deliveries 1) dead-letters into ``work.dlq``: two messages
    are sent and nacked there, so two are on their way into the DLQ."""
    with txbroker.connect(url) as conn:
        conn.declare_queue("work", max_deliveries=1, dead_letter_queue="work.dlq")
        conn.declare_queue("work.dlq")
        for body in (b"a", b"b"):
            conn.send("work", body)
        for _ in range(2):
            message = conn.receive("work", timeout=10)
            assert message is not None
            message.nack()  # max_deliveries=1: dead-lettered
