"""The client's side of TLS without a broker: ``txbs://`` URLs, the TLS options and
the transport they choose (docs/tls.md). The handshakes themselves are in
tests/server/test_tls.py."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

import txbroker
from txbroker.client.options import ConnectOptions
from txbroker.client.transport import TCPTransport
from txbroker.client.url import DEFAULT_TLS_PORT, ClientURL, HostPort, parse_url


def test_txbs_urls() -> None:
    assert parse_url("txbs://a:1,b") == ClientURL(
        (HostPort("a", 1), HostPort("b", DEFAULT_TLS_PORT)), tls=True)
    assert parse_url("TXBS://u:secret@h:7/") == ClientURL((HostPort("h", 7),), "u", "secret",
                                                          tls=True)
    assert str(parse_url("txbs://u:secret@h:7,[::1]:8")) == "txbs://u:***@h:7,[::1]:8"
    assert parse_url("txb://h").tls is False
    assert str(parse_url("txb://h:1")) == "txb://h:1"
    with pytest.raises(ValueError, match=r"unsupported scheme 'txbss'.*or txbs://"):
        parse_url("txbss://h:1")


def test_a_txbs_url_gets_a_tls_transport(tmp_path: Path) -> None:
    options = ConnectOptions.from_kwargs({"tls_server_hostname": "broker.example"})
    chosen = options.for_url(parse_url("txbs://127.0.0.1:1"))
    transport = chosen.transport
    assert isinstance(transport, TCPTransport)
    assert transport.server_hostname == "broker.example"
    context = transport.ssl_context
    assert context is not None
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert chosen.for_url(parse_url("txbs://127.0.0.1:1")).transport is transport  # once


def test_an_ssl_context_is_used_as_given() -> None:
    context = ssl.create_default_context()
    chosen = ConnectOptions.from_kwargs({"ssl_context": context}).for_url(
        parse_url("txbs://h:1"))
    assert isinstance(chosen.transport, TCPTransport)
    assert chosen.transport.ssl_context is context
    assert chosen.transport.server_hostname is None  # each address's own host


def test_a_txb_url_stays_plaintext() -> None:
    options = ConnectOptions.from_kwargs({})
    assert options.for_url(parse_url("txb://h:1")) is options
    assert isinstance(options.transport, TCPTransport)
    assert options.transport.ssl_context is None


def test_a_replaced_transport_is_kept() -> None:
    class Fake:
        async def open(self, host: str, port: int) -> object:
            raise OSError("not used")

    fake = Fake()
    options = ConnectOptions.from_kwargs({"transport": fake})
    assert options.for_url(parse_url("txbs://h:1")).transport is fake


@pytest.mark.parametrize(("url", "options", "error", "message"), [
    ("txb://h:1", {"tls_ca": "ca.pem"}, ValueError,
     "tls_ca: TLS options need a txbs:// URL, not txb://h:1"),
    ("txb://h:1", {"tls_server_hostname": "x"}, ValueError,
     "tls_server_hostname: TLS options need a txbs:// URL, not txb://h:1"),
    ("txbs://h:1", {"ssl_context": ssl.create_default_context(), "tls_ca": "ca.pem"},
     ValueError, "give ssl_context or tls_ca/tls_cert/tls_key, not both"),
    ("txbs://h:1", {"ssl_context": "yes"}, TypeError, "ssl_context must be an ssl.SSLContext"),
    ("txbs://h:1", {"tls_key": "k.pem"}, ValueError,
     "tls_key needs tls_cert (the client certificate)"),
    ("txbs://h:1", {"tls_ca": "/nonexistent/ca.pem"}, ValueError,
     "tls_ca /nonexistent/ca.pem: cannot load it ([Errno 2] No such file or directory)"),
])
def test_bad_tls_options_are_refused_at_connect(url: str, options: dict[str, object],
                                               error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        txbroker.connect(url, **options)
    assert str(caught.value) == message
