"""TLS on the listeners (issue 16): the native protocol over TLS (``txbs://``) with the
sync and async clients and the CLI, STOMP over TLS with stomp.py and stompman, mutual
TLS, refusals (a wrong CA, a wrong host name, a plaintext client on a TLS port, a TLS
client on a plaintext port), bad configuration, and failover across ``txbs://``
addresses.

The CA and the certificates are made at run time with ``openssl``
(``tests/tls_support.py``). Every broker is a real ``txbroker serve`` process;
every wait is bounded and nothing is timed.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import stomp
import stompman

import txbroker
import txbroker.aio
from tests.stomp.support import StompEvents
from tests.support import ROOT, BrokerProcess, free_port
from tests.tls_support import Pki, make_pki, tls_args
from txbroker.errors import ConnectionLost

pytestmark = pytest.mark.timeout(120)
WAIT = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


class TlsBroker:
    """A broker with plaintext and TLS listeners for the native protocol, and STOMP
    over TLS."""

    def __init__(self, data: Path, pki: Pki, *extra: str) -> None:
        self.tls_port = free_port()
        self.stomp_tls_port = free_port()
        self.proc = BrokerProcess(data, *tls_args(pki, self.tls_port, "--stomp-tls-port",
                                                  str(self.stomp_tls_port), *extra))
        self.port = self.proc.port
        self.stomp_port = 0

    @property
    def tls_url(self) -> str:
        return f"txbs://127.0.0.1:{self.tls_port}"

    def log_lines(self, text: str) -> list[str]:
        """The broker's log lines that contain ``text``."""
        return [line for line in self.proc.log_path.read_text().splitlines() if text in line]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[TlsBroker]:
    stomp_port = free_port()
    made = TlsBroker(tmp_path_factory.mktemp("tls") / "data", pki, "--stomp-port",
                     str(stomp_port))
    made.stomp_port = stomp_port
    made.proc.start()
    try:
        yield made
    finally:
        made.proc.kill()


def fresh() -> str:
    return f"tls-{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------- native protocol


def test_ready_line_names_every_listener(broker: TlsBroker) -> None:
    assert broker.proc.ready_line.startswith(
        f"txbroker ready on 127.0.0.1:{broker.port}, STOMP {broker.stomp_port}, "
        f"TLS {broker.tls_port}, "
        f"STOMP TLS {broker.stomp_tls_port} (data ")


def test_sync_client_over_tls(broker: TlsBroker, pki: Pki) -> None:
    name = fresh()
    with txbroker.connect(broker.tls_url, tls_ca=str(pki.ca), timeout=WAIT) as conn:
        conn.send(name, b"over tls", message_id="m-1")
        msg = conn.receive(name, timeout=WAIT)
        assert msg is not None and msg.body == b"over tls" and msg.message_id == "m-1"
        msg.ack(wait=True)
        with conn.transaction() as tx:
            tx.send(name, b"in a transaction")
            tx.send(name, b"x" * 1_000_000)  # many TLS records in one frame
        first = conn.receive(name, timeout=WAIT)
        second = conn.receive(name, timeout=WAIT)
        assert first is not None and first.body == b"in a transaction"
        assert second is not None and second.body == b"x" * 1_000_000
        first.ack(wait=True)
        second.ack(wait=True)
        assert conn.queue_info(name)["depth"] == 0
    # the plaintext listener serves the same broker
    with txbroker.connect(f"txb://127.0.0.1:{broker.port}", timeout=WAIT) as plain:
        plain.ping()


def test_async_client_over_tls(broker: TlsBroker, pki: Pki) -> None:
    name = fresh()

    async def main() -> None:
        async with txbroker.aio.connect(broker.tls_url, tls_ca=pki.ca, timeout=WAIT) as conn:
            await conn.send(name, b"a1")
            tx = conn.transaction()
            await tx.send(name, b"a2")
            await tx.rollback()
            tx = conn.transaction()
            await tx.send(name, b"a3")
            await tx.commit()
            got = []
            while (msg := await conn.receive(name, timeout=1)) is not None:
                got.append(msg.body)
                await msg.ack(wait=True)
            assert got == [b"a1", b"a3"]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_ssl_context_option(broker: TlsBroker, pki: Pki) -> None:
    context = ssl.create_default_context(cafile=str(pki.ca))
    with txbroker.connect(broker.tls_url, ssl_context=context, timeout=WAIT) as conn:
        conn.ping()


def test_a_client_with_another_ca_refuses_the_broker(broker: TlsBroker, pki: Pki) -> None:
    with pytest.raises(ConnectionLost) as caught:
        txbroker.connect(broker.tls_url, tls_ca=str(pki.other_ca), timeout=WAIT)
    assert str(caught.value) == (
        f"no broker of the list answered: 127.0.0.1:{broker.tls_port}: TLS: the broker's "
        "certificate is not trusted: unable to get local issuer certificate (check tls_ca "
        "/ ssl_context and the host name)")


def test_the_host_name_is_checked(broker: TlsBroker, pki: Pki) -> None:
    with pytest.raises(ConnectionLost, match=r"Hostname mismatch, certificate is not valid "
                                             r"for 'broker\.example'"):
        txbroker.connect(broker.tls_url, tls_ca=str(pki.ca), timeout=WAIT,
                         tls_server_hostname="broker.example")
    with txbroker.connect(broker.tls_url, tls_ca=str(pki.ca), timeout=WAIT,
                          tls_server_hostname="localhost") as conn:
        conn.ping()
    with txbroker.connect(f"txbs://localhost:{broker.tls_port}", tls_ca=str(pki.ca),
                          timeout=WAIT) as conn:
        conn.ping()


def test_a_plaintext_client_on_the_tls_port_is_refused(broker: TlsBroker, pki: Pki) -> None:
    before = broker.log_lines("not a TLS handshake")
    with pytest.raises(ConnectionLost, match="closed the connection"):
        txbroker.connect(f"txb://127.0.0.1:{broker.tls_port}", timeout=WAIT)
    lines = broker.log_lines("not a TLS handshake")[len(before):]
    assert len(lines) == 1
    assert ("WARNING txbroker.server.security.tls: native protocol over TLS: TLS handshake with "
            "127.0.0.1:") in lines[0]
    assert lines[0].endswith("failed: not a TLS handshake (first bytes b'\\x00\\x00': a "
                             "plaintext client?)")
    # a STOMP client on the STOMP TLS port: the same
    with socket.create_connection(("127.0.0.1", broker.stomp_tls_port), timeout=WAIT) as sock:
        sock.sendall(b"CONNECT\naccept-version:1.2\n\n\x00")
        assert sock.recv(100) == b""
    lines = broker.log_lines("not a TLS handshake")[len(before):]
    assert len(lines) == 2 and "STOMP over TLS: TLS handshake with 127.0.0.1:" in lines[1]
    assert "Traceback" not in broker.proc.log_path.read_text()
    with txbroker.connect(broker.tls_url, tls_ca=str(pki.ca), timeout=WAIT) as conn:
        conn.ping()  # still serving


def test_a_tls_client_on_the_plaintext_port_is_refused(broker: TlsBroker, pki: Pki) -> None:
    with pytest.raises(ConnectionLost) as caught:
        txbroker.connect(f"txbs://127.0.0.1:{broker.port}", tls_ca=str(pki.ca), timeout=WAIT)
    assert str(caught.value).startswith(
        f"no broker of the list answered: 127.0.0.1:{broker.port}: TLS handshake failed: ")
    assert str(caught.value).endswith("(is it a TLS port?)")
    with txbroker.connect(f"txb://127.0.0.1:{broker.port}", timeout=WAIT) as conn:
        conn.ping()  # still serving
    # a STOMP client over TLS on the plaintext STOMP port: closed at its first bytes
    context = ssl.create_default_context(cafile=str(pki.ca))
    with socket.create_connection(("127.0.0.1", broker.stomp_port), timeout=WAIT) as sock, \
            pytest.raises(ssl.SSLError, match="UNEXPECTED_EOF_WHILE_READING"):
        context.wrap_socket(sock, server_hostname="localhost")
    lines = broker.log_lines("began a TLS handshake on this plaintext port")
    assert len(lines) == 1 and "WARNING txbroker.stomp: STOMP: 127.0.0.1:" in lines[0]
    with socket.create_connection(("127.0.0.1", broker.stomp_port), timeout=WAIT) as sock:
        sock.sendall(b"CONNECT\naccept-version:1.2\n\n\x00")
        assert sock.recv(9) == b"CONNECTED"  # still serving


def test_cli_over_tls(broker: TlsBroker, pki: Pki) -> None:
    name = fresh()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "txbroker.cli", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    sent = cli("send", name, "hello over tls", "--url", broker.tls_url, "--tls-ca",
               str(pki.ca))
    assert sent.returncode == 0, sent.stderr
    got = cli("recv", name, "--url", broker.tls_url, "--tls-ca", str(pki.ca))
    assert got.returncode == 0, got.stderr
    assert got.stdout.split(" ", 1)[1] == "hello over tls\n"
    status = cli("ha", "status", "--url", broker.tls_url, "--tls-ca", str(pki.ca))
    assert status.returncode == 0, status.stderr
    assert status.stdout == (f"127.0.0.1:{broker.tls_port}  single broker (not a member of an "
                             "HA pair)\n")
    refused = cli("stat", "--url", broker.tls_url, "--tls-ca", str(pki.other_ca))
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        f"error: no broker of the list answered: 127.0.0.1:{broker.tls_port}: TLS: the "
        "broker's certificate is not trusted: unable to get local issuer certificate "
        "(check tls_ca / ssl_context and the host name)"]


# ---------------------------------------------------------------- STOMP


class Collector(StompEvents):
    def on_disconnected(self) -> None:
        """Not an event here: these tests expect one frame after another."""

    def next(self, kind: str) -> Any:
        got, frame = self.events.get(timeout=WAIT)
        assert got == kind, (got, frame.headers if frame is not None else None)
        return frame


def test_stomppy_over_tls(broker: TlsBroker, pki: Pki) -> None:
    destination = f"/queue/{fresh()}"
    hosts = [("127.0.0.1", broker.stomp_tls_port)]
    conn = stomp.Connection12(hosts, reconnect_attempts_max=1, timeout=5)
    conn.set_ssl(for_hosts=hosts, ca_certs=str(pki.ca))
    listener = Collector()
    conn.set_listener("collector", listener)
    conn.connect(wait=False)
    listener.next("connected")
    try:
        conn.send(destination, "over stomp+tls", headers={"persistent": "true",
                                                          "receipt": "r1"})
        assert listener.next("receipt").headers["receipt-id"] == "r1"
        conn.subscribe(destination, id="s1", ack="client-individual")
        frame = listener.next("message")
        assert frame.body == "over stomp+tls"
        conn.ack(frame.headers["ack"], receipt="r2")
        assert listener.next("receipt").headers["receipt-id"] == "r2"
    finally:
        conn.disconnect()
    with txbroker.connect(broker.tls_url, tls_ca=str(pki.ca), timeout=WAIT) as native:
        assert native.queue_info(destination.removeprefix("/queue/"))["depth"] == 0


def test_stompman_over_tls(broker: TlsBroker, pki: Pki) -> None:
    destination = f"/queue/{fresh()}"
    context = ssl.create_default_context(cafile=str(pki.ca))

    async def main() -> None:
        got: asyncio.Queue[stompman.MessageFrame] = asyncio.Queue()

        async def handler(frame: stompman.MessageFrame) -> None:
            await got.put(frame)

        params = [stompman.ConnectionParameters(host="127.0.0.1", port=broker.stomp_tls_port,
                                                login="guest", passcode="guest")]
        async with stompman.Client(params, ssl=context, connect_retry_interval=1,
                                   connect_timeout=5) as client:
            await client.send(b"over stompman+tls", destination,
                              headers={"persistent": "true"}, receipt_timeout=5)
            sub = await client.subscribe(destination, handler, receipt_timeout=5,
                                         on_suppressed_exception=lambda exc, frame: None)
            frame = await asyncio.wait_for(got.get(), WAIT)
            assert frame.body == b"over stompman+tls"
            await sub.unsubscribe()

    asyncio.run(asyncio.wait_for(main(), 60))


# ---------------------------------------------------------------- mutual TLS


def test_mutual_tls(tmp_path: Path, pki: Pki) -> None:
    made = TlsBroker(tmp_path / "data", pki, "--tls-ca", str(pki.ca))
    with made.proc:
        with txbroker.connect(made.tls_url, tls_ca=str(pki.ca), tls_cert=str(pki.client_cert),
                              tls_key=str(pki.client_key), timeout=WAIT) as conn:
            conn.send("m", b"with a client certificate")
        with pytest.raises(ConnectionLost):
            # TLS 1.3: the client's side of the handshake ends before the broker checks
            # for its certificate; the broker's alert then breaks the hello
            txbroker.connect(made.tls_url, tls_ca=str(pki.ca), timeout=WAIT)
        lines = made.log_lines("TLS handshake with")
        assert len(lines) == 1 and "native protocol over TLS" in lines[0]
        assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in lines[0]


# ---------------------------------------------------------------- configuration


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "txbroker.cli", "serve", "--data",
                           str(tmp_path / "data"), "--stomp-port", "0",
                           "--amqp-port", "0", *args], cwd=ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", ["no cert", "no key", "missing cert", "key is a directory",
                                  "not pem", "key mismatch", "encrypted key", "port clash",
                                  "config file"])
def test_bad_tls_config_is_refused_in_one_line(tmp_path: Path, pki: Pki, case: str) -> None:
    port, tls = free_port(), free_port()
    cert, key = str(pki.server_cert), str(pki.server_key)
    base = ["--port", str(port), "--tls-port", str(tls)]
    if case == "no cert":
        args, expected = base, (f"tls_port {tls} needs tls_cert and tls_key (the certificate "
                                "chain and its private key)")
    elif case == "no key":
        args, expected = [*base, "--tls-cert", cert], "tls_cert given without tls_key (its " \
                                                      "private key)"
    elif case == "missing cert":
        missing = tmp_path / "missing.pem"
        args = [*base, "--tls-cert", str(missing), "--tls-key", key]
        expected = f"tls_cert {missing}: No such file or directory"
    elif case == "key is a directory":
        args = [*base, "--tls-cert", cert, "--tls-key", str(tmp_path)]
        expected = f"tls_key {tmp_path}: Is a directory"
    elif case == "not pem":
        junk = tmp_path / "junk.pem"
        junk.write_text("not a certificate\n")
        args = [*base, "--tls-cert", str(junk), "--tls-key", key]
        expected = f"tls_cert {junk}: not a PEM file with a certificate"
    elif case == "key mismatch":
        other = pki.ca.with_name("other-ca.key")
        args = [*base, "--tls-cert", cert, "--tls-key", str(other)]
        expected = f"tls_key {other} does not belong to the certificate in tls_cert {cert}"
    elif case == "encrypted key":
        encrypted = tmp_path / "encrypted.key"
        subprocess.run(["openssl", "ec", "-in", key, "-aes256", "-passout", "pass:secret",
                        "-out", str(encrypted)], check=True, capture_output=True, timeout=60)
        args = [*base, "--tls-cert", cert, "--tls-key", str(encrypted)]
        expected = (f"tls_key {encrypted}: the private key is encrypted (give an unencrypted "
                    "PEM key)")
    elif case == "port clash":
        args = ["--port", str(port), "--tls-port", str(port), "--tls-cert", cert,
                "--tls-key", key]
        expected = f"tls_port and port are both {port}: each listener needs its own port"
    else:
        config = tmp_path / "broker.toml"
        config.write_text(f'[server]\nport = {port}\nstomp_tls_port = {tls}\n'
                          f'tls_cert = "{cert}"\n')
        args, expected = ["--config", str(config)], "tls_cert given without tls_key (its " \
                                                    "private key)"
    result = _serve(tmp_path, *args)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"error: {expected}"]
    assert result.stdout == ""
    assert not (tmp_path / "data").exists()  # refused before anything was created


# ---------------------------------------------------------------- failover


def test_failover_across_txbs_addresses(tmp_path: Path, pki: Pki) -> None:
    """The broker behind the first address is killed; one on the same store starts
    behind the second; the client moves over TLS and finds the message."""
    data = tmp_path / "data"
    first = TlsBroker(data, pki)
    second = TlsBroker(data, pki)
    moved = threading.Event()
    calls: list[tuple[str, str]] = []

    def on_failover(old: str, new: str) -> None:
        calls.append((old, new))
        moved.set()

    url = f"txbs://127.0.0.1:{first.tls_port},127.0.0.1:{second.tls_port}"
    first.proc.start()
    try:
        with txbroker.connect(url, tls_ca=str(pki.ca), timeout=WAIT, failover_timeout=90,
                              on_failover=on_failover) as conn:
            conn.send("kept", b"before the failover")
            first.proc.kill()
            second.proc.start()
            assert moved.wait(90)
            assert calls == [(f"127.0.0.1:{first.tls_port}", f"127.0.0.1:{second.tls_port}")]
            msg = conn.receive("kept", timeout=WAIT)
            assert msg is not None and msg.body == b"before the failover"
            msg.ack(wait=True)
    finally:
        first.proc.kill()
        second.proc.kill()


# ---------------------------------------------------------------- docs


def test_the_test_ca_commands_of_the_docs_run(tmp_path: Path) -> None:
    """docs/tls.md's openssl block, run as written: a CA, a broker certificate and a
    client certificate that ``openssl verify`` accepts."""
    text = (ROOT / "docs" / "tls.md").read_text()
    section = text.split("## A test CA with openssl", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    result = subprocess.run(["bash", "-euc", block], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["broker.pem: OK", "client.pem: OK"]
    context = ssl.create_default_context(cafile=str(tmp_path / "pki" / "ca.pem"))
    context.load_cert_chain(tmp_path / "pki" / "broker.pem", tmp_path / "pki" / "broker.key")


# ---------------------------------------------------------------- HTTPS


def test_https_serves_the_api_and_refuses_plaintext(tmp_path: Path, pki: Pki) -> None:
    """``--https-port``: the HTTP routes over the same TLS layer (API, /metrics,
    console); a plaintext HTTP request there gets no answer and one log line."""
    import httpx

    https_port = free_port()
    made = TlsBroker(tmp_path / "data", pki, "--https-port", str(https_port))
    made.proc.start()
    try:
        assert f", HTTPS {https_port} (data " in made.proc.ready_line
        base = f"https://127.0.0.1:{https_port}"
        context = ssl.create_default_context(cafile=str(pki.ca))
        with httpx.Client(verify=context, timeout=WAIT) as http:
            overview = http.get(f"{base}/api/overview")
            assert overview.status_code == 200
            assert overview.json()["version"] == txbroker.__version__
            assert "txbroker_info" in http.get(f"{base}/metrics").text
            console = http.get(f"{base}/", follow_redirects=True)
            assert console.status_code == 200 and "<html" in console.text.lower()
        with httpx.Client(timeout=WAIT) as http, pytest.raises(httpx.ConnectError):
            http.get(f"{base}/api/overview")  # the broker's certificate is not trusted
        with httpx.Client(timeout=WAIT) as http, pytest.raises(httpx.TransportError):
            http.get(f"http://127.0.0.1:{https_port}/api/overview")
        assert len(made.log_lines("HTTP over TLS")) >= 2  # listening, and the refusal
    finally:
        made.proc.kill()
