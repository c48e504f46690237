"""AMQP 0-9-1 over TLS (``--amqps-port``) with the TLS settings the other listeners use."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from tests.amqp.support import AmqpBroker, RawAmqp
from tests.support import free_port
from tests.tls_support import Pki, make_pki, tls_args
from txbroker.protocol.amqp import PROTOCOL_HEADER


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[AmqpBroker]:
    amqps = free_port()
    made = AmqpBroker(tmp_path_factory.mktemp("amqps") / "data",
                      *tls_args(pki, free_port(), "--amqps-port", str(amqps)))
    made.amqps_port = amqps  # type: ignore[attr-defined]
    made.start()
    try:
        yield made
    finally:
        made.kill()


def test_ready_line_names_amqps(broker: AmqpBroker) -> None:
    assert f", AMQP {broker.amqp_port}," in broker.ready_line
    assert f", AMQPS {broker.amqps_port} (data " in broker.ready_line  # type: ignore[attr-defined]


def test_pika_over_tls(broker: AmqpBroker, pki: Pki) -> None:
    context = ssl.create_default_context(cafile=str(pki.ca))
    params = pika.ConnectionParameters(
        "127.0.0.1", broker.amqps_port,  # type: ignore[attr-defined]
        ssl_options=pika.SSLOptions(context, "127.0.0.1"))
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.confirm_delivery()
    ch.basic_publish("", queue, b"over amqps", pika.BasicProperties(delivery_mode=2))
    assert ch.basic_get(queue, auto_ack=True)[2] == b"over amqps"
    conn.close()


def test_client_that_does_not_trust_the_broker_fails(broker: AmqpBroker, pki: Pki) -> None:
    context = ssl.create_default_context(cafile=str(pki.other_ca))
    params = pika.ConnectionParameters(
        "127.0.0.1", broker.amqps_port,  # type: ignore[attr-defined]
        ssl_options=pika.SSLOptions(context, "127.0.0.1"), connection_attempts=1)
    with pytest.raises(ssl.SSLCertVerificationError):
        pika.BlockingConnection(params)


def test_tls_client_on_the_plaintext_port_gets_the_protocol_header(broker: AmqpBroker) -> None:
    raw = RawAmqp(broker.amqp_port)
    try:
        raw.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello's start
        assert raw.read() == (0, PROTOCOL_HEADER)
        assert raw.closed()
    finally:
        raw.close()


def test_amqps_needs_a_certificate(tmp_path: Path) -> None:
    broker = AmqpBroker(tmp_path / "data", "--amqps-port", str(free_port()))
    with pytest.raises(RuntimeError, match=r"amqps_port \d+ needs tls_cert and tls_key"):
        broker.start()
