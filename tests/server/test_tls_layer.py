"""The TLS layer of the listeners (``server/security/tls.py``) in process, on asyncio's loop and on
uvloop: an echo protocol behind ``tls_factory`` gets exactly the bytes the client
sent (3 MB, many records), a plaintext client and a client that distrusts the
certificate are refused with one WARNING line each, and the real protocol sees the
client's close."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from tests.tls_support import Pki, make_pki
from txbroker.server.security.tls import server_context, tls_factory

pytestmark = pytest.mark.timeout(60)
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


class Echo(asyncio.Protocol):
    """Writes back what it reads; records what happened to it."""

    events: list[str]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.events.append("made")
        assert transport.get_extra_info("ssl_object") is not None
        assert transport.get_extra_info("peername")[0] == "127.0.0.1"

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        self.events.append("eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append("lost")


def run(loop_name: str, scenario: Callable[[], Any]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("loop_name", LOOPS)
def test_echo_over_the_tls_layer(loop_name: str, pki: Pki) -> None:
    events: list[str] = []
    payload = bytes(range(256)) * 12_000  # ~3 MB: many 16 KiB records each way

    class Recorder(Echo):
        def __init__(self) -> None:
            self.events = events

    async def scenario() -> None:
        context = server_context(pki.server_cert, pki.server_key)
        server = await asyncio.get_running_loop().create_server(
            tls_factory(Recorder, context, "echo"), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = ssl.create_default_context(cafile=str(pki.ca))
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client,
                                                       server_hostname="localhost")
        writer.write(payload)
        assert await reader.readexactly(len(payload)) == payload
        writer.close()
        await writer.wait_closed()
        while "lost" not in events:
            await asyncio.sleep(0.01)
        server.close()

    run(loop_name, scenario)
    assert events[0] == "made" and events[-1] == "lost"


@pytest.mark.parametrize("loop_name", LOOPS)
def test_refusals_are_one_line_each(loop_name: str, pki: Pki,
                                    caplog: pytest.LogCaptureFixture) -> None:
    made: list[str] = []

    class Recorder(Echo):
        def __init__(self) -> None:
            self.events = made

    async def scenario() -> None:
        context = server_context(pki.server_cert, pki.server_key)
        server = await asyncio.get_running_loop().create_server(
            tls_factory(Recorder, context, "echo"), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        # a port check: connect, close, say nothing (no line; it goes first, so that
        # its line, if any, would come before the two awaited below)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()
        # a plaintext client: closed at its first bytes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"PING\n")
        assert await reader.read() == b""
        writer.close()
        # a client that does not trust the certificate
        other = ssl.create_default_context(cafile=str(pki.other_ca))
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.open_connection("127.0.0.1", port, ssl=other,
                                          server_hostname="localhost")
        while len([r for r in caplog.records if r.name == "txbroker.server.security.tls"]) < 2:
            await asyncio.sleep(0.01)
        server.close()

    with caplog.at_level(logging.INFO, logger="txbroker.server.security.tls"):
        run(loop_name, scenario)
    lines = [r for r in caplog.records if r.name == "txbroker.server.security.tls"]
    assert [r.levelname for r in lines] == ["WARNING", "WARNING"]
    first, second = (r.getMessage() for r in lines)
    assert first.startswith("echo: TLS handshake with 127.0.0.1:")
    assert first.endswith("failed: not a TLS handshake (first bytes b'PI': a plaintext client?)")
    assert second.startswith("echo: TLS handshake with 127.0.0.1:")
    # an asyncio client (either loop) drops its alert when it aborts the connection
    assert second.endswith("failed: the client closed the connection during the handshake "
                           "(does it trust this broker's certificate?)")
    assert made == []  # the real protocol never saw them
