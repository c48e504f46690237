"""The HA links' security with real processes (issue 29, item 4; docs/ha.md,
"Securing the HA links"): on both HA ports — the shared-store heartbeat link and the
replication link — a peer without the secret, with a wrong one, or speaking
something else (random bytes, HTTP, plaintext on a TLS port) is refused, logged
with why, counted in ``ha status``, and harms nothing: the brokers keep serving
and their own peers stay attached. A broker started with the wrong secret never
joins. Without a secret the link works as before and the broker warns at start.

Every wait is on something observable (a log line, ``ha status``) and bounded.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

import txbroker
from tests.ha_support import HOST, HaNode, HaPair, free_ports
from tests.replicated_support import Group, wait_for
from tests.tls_support import HA_SECRET, ha_link_args, make_pki
from txbroker.protocol.ha_auth import (
    INITIATOR_LABEL,
    NONCE_SIZE,
    LinkHandshake,
    Side,
    encode_line,
    proof_of,
)

WRONG = "a-wrong-secret-of-enough-length"
#: What a stranger may send: random bytes, an HTTP request, the old link's first line.
FOREIGN = [bytes(range(7, 200)), b"GET / HTTP/1.1\r\nHost: broker\r\n\r\n",
           b'{"txbroker_ha":1,"type":"standby","node":"x:1","lock":""}\n']


def exchange(port: int, data: bytes, context: ssl.SSLContext | None = None) -> bytes:
    """Send ``data`` to an HA port; everything it answers until it closes."""
    with socket.create_connection((HOST, port), timeout=10) as raw:
        sock: socket.socket = raw
        if context is not None:
            sock = context.wrap_socket(raw, server_hostname=HOST)
        sock.sendall(data)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):
                answer += chunk
        return answer


def guessing_peer(port: int, link: str, secret: str | None,
                  context: ssl.SSLContext | None = None) -> list[dict[str, object]]:
    """A peer that ignores the responder's proof and answers with a proof made from
    ``secret`` (None: says it has no secret): the lines the HA port answered."""
    mine = b"\x01" * NONCE_SIZE
    auth = "hmac-sha256" if secret is not None else "none"
    hello = encode_line("hello", link=link, auth=auth,
                        nonce=mine.hex() if secret is not None else "")
    with socket.create_connection((HOST, port), timeout=10) as raw:
        sock: socket.socket = raw
        if context is not None:
            sock = context.wrap_socket(raw, server_hostname=HOST)
        sock.sendall(hello)
        reader = sock.makefile("rb")
        lines = [json.loads(reader.readline())]
        if lines[0]["type"] == "challenge" and secret is not None:
            theirs = bytes.fromhex(str(lines[0]["nonce"]))
            proof = proof_of(secret.encode(), INITIATOR_LABEL, link, mine, theirs)
            sock.sendall(encode_line("proof", proof=proof.hex()))
            lines += [json.loads(line) for line in reader.readlines()]
        return lines


def a_real_peer(port: int, link: str, secret: str, context: ssl.SSLContext | None = None
                ) -> bool:
    """Whether the handshake with the right secret succeeds (the port is healthy)."""
    handshake = LinkHandshake(Side.INITIATOR, link, secret.encode(), b"\x02" * NONCE_SIZE)
    with socket.create_connection((HOST, port), timeout=10) as raw:
        sock: socket.socket = raw
        if context is not None:
            sock = context.wrap_socket(raw, server_hostname=HOST)
        sock.sendall(handshake.start())
        while not (handshake.done or handshake.failed):
            data = sock.recv(4096)
            if not data:
                break
            sock.sendall(handshake.receive_data(data))
        return handshake.done


def refuses_strangers(port: int, link: str, log_has: object, refused: object,
                      context: ssl.SSLContext | None = None) -> None:
    """Every kind of stranger on ``port`` is refused, logged and counted."""
    assert callable(log_has) and callable(refused)
    before = refused()
    for data in FOREIGN:
        assert exchange(port, data, context) == b""  # closed without an answer
    wait_for(lambda: log_has("on the HA port: the peer is not a txbroker HA peer (it sent "
                             "b'GET / HTTP/1.1"), 15, "the HTTP request to be logged")
    lines = guessing_peer(port, link, WRONG, context)
    assert [line["type"] for line in lines] == ["challenge", "refused"]
    assert "wrong proof of the HA secret" in str(lines[1]["reason"])
    lines = guessing_peer(port, link, None, context)
    assert lines[0]["type"] == "refused"
    assert "requires the HA secret and the peer has none" in str(lines[0]["reason"])
    wait_for(lambda: log_has("wrong proof of the HA secret (a wrong secret, or a replay)"),
             15, "the wrong proof to be logged")
    wait_for(lambda: refused() >= before + len(FOREIGN) + 2, 15, "every refusal counted")
    assert a_real_peer(port, link, HA_SECRET, context)


# ----------------------------------------------------------------- shared store
@contextlib.contextmanager
def secured_pair(tmp_path: Path, *, tls: bool) -> Iterator[HaPair]:
    args = ha_link_args(tmp_path / "link", tls=tls)
    with HaPair(tmp_path / "pair", *args, heartbeat_interval=0.5,
                activation_interval=2.0) as pair:
        yield pair


def peer_context(tmp_path: Path) -> ssl.SSLContext:
    """What a broker's HA link connects with (the test CA's peer certificate)."""
    pki = tmp_path / "link" / "pki"
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.load_cert_chain(pki / "peer.pem", pki / "peer.key")
    return context


@pytest.mark.parametrize("tls", [False, True], ids=["secret", "secret+tls"])
def test_shared_store_ports_refuse_strangers_and_wrong_secrets(tmp_path: Path,
                                                               tls: bool) -> None:
    with secured_pair(tmp_path, tls=tls) as pair:
        a, b = pair.nodes
        context = peer_context(tmp_path) if tls else None
        for node in (a, b):  # the active's HA port, and the standby's
            refuses_strangers(node.ha_port, "shared-store", node.log_has,
                              lambda n=node: n.status()["link"]["refused"], context)
        # nothing harmed: the pair serves, the standby follows the active
        with txbroker.connect(pair.url, timeout=10) as conn:
            conn.send("q", b"still fine")
            assert conn.queue_info("q")["depth"] == 1
        status = b.status()
        assert status["role"] == "standby" and status["following"] == f"{HOST}:{a.ha_port}"
        assert status["link"]["auth"] == "hmac-sha256" and status["link"]["tls"] is tls
        assert a.status()["standby"] == f"{HOST}:{b.ha_port}"


def test_a_standby_with_the_wrong_secret_never_joins_nor_takes_over(tmp_path: Path) -> None:
    """B is started with another secret: it cannot follow A (both log why), stays a
    standby (A holds the lock), and A serves on."""
    args = ha_link_args(tmp_path / "link", tls=False)
    wrong = ha_link_args(tmp_path / "wrong", tls=False, secret=WRONG)
    pair = HaPair(tmp_path / "pair", heartbeat_interval=0.5, activation_interval=2.0)
    a, b = pair.nodes
    try:
        a.spawn(b, [*pair.args, *args])
        a.wait_line("txbroker ready on")
        b.spawn(a, [*pair.args, *wrong])
        b.wait_line("txbroker standby on HA")
        wait_for(lambda: b.log_has("the peer's proof of the HA secret is wrong: the two "
                                   "brokers' HA secrets differ"), 15, "B to say why")
        wait_for(lambda: a.log_has("it refused this broker: the peer's proof of the HA "
                                   "secret is wrong"), 15, "A to log the refusal")
        assert b.status()["following"] is None and a.status()["standby"] is None
        with txbroker.connect(f"txb://{a.address}", timeout=10) as conn:
            conn.send("q", b"served")
        assert b.status()["role"] == "standby"
    finally:
        pair.stop()


def test_without_a_secret_the_link_works_and_warns(tmp_path: Path) -> None:
    with HaPair(tmp_path / "pair", heartbeat_interval=0.5, activation_interval=2.0) as pair:
        a, b = pair.nodes
        assert a.log_has("is unauthenticated: anyone who can reach its port can pose as a peer")
        wait_for(lambda: b.status()["following"] == f"{HOST}:{a.ha_port}", 15,
                 "B to follow A")
        assert b.status()["link"] == {"auth": "none", "tls": False, "accepted": 0,
                                      "refused": 0, "last_refusal": "", "in_handshake": 0}


def test_a_plaintext_peer_on_a_tls_ha_port_is_refused(tmp_path: Path) -> None:
    """TLS on: a peer that does not begin a TLS handshake is refused at its first bytes;
    one that presents no certificate is refused by the handshake; a peer that trusts
    another CA refuses the broker."""
    with secured_pair(tmp_path, tls=True) as pair:
        a, b = pair.nodes
        assert exchange(a.ha_port, encode_line("hello", link="shared-store", auth="none",
                                               nonce="")) == b""
        wait_for(lambda: a.log_has("HA link (shared-store) over TLS: TLS handshake with "), 15,
                 "the TLS layer to log the plaintext peer")
        assert a.log_has("not a TLS handshake")
        anonymous = ssl.create_default_context(cafile=str(tmp_path / "link/pki/ca.pem"))
        with contextlib.suppress(OSError):  # no client certificate: the port ends the link
            assert not a_real_peer(a.ha_port, "shared-store", HA_SECRET, anonymous)
        wait_for(lambda: a.log_has("PEER_DID_NOT_RETURN_A_CERTIFICATE"), 15,
                 "the TLS layer to log the peer without a certificate")
        distrustful = ssl.create_default_context(
            cafile=str(tmp_path / "link/pki/other-ca.pem"))
        with pytest.raises(ssl.SSLCertVerificationError):
            exchange(a.ha_port, b"x", distrustful)
        assert b.status()["following"] == f"{HOST}:{a.ha_port}"
        with txbroker.connect(pair.url, timeout=10) as conn:
            conn.send("q", b"fine")


def test_a_flood_of_idle_connections_is_capped(tmp_path: Path) -> None:
    """Connections that never begin the handshake hold at most MAX_PENDING_HANDSHAKES
    slots (each for HANDSHAKE_TIMEOUT); one more is closed at once; the pair is
    unharmed, and once they are gone a peer passes again."""
    from txbroker.server.ha.link import MAX_PENDING_HANDSHAKES

    with secured_pair(tmp_path, tls=False) as pair:
        a, b = pair.nodes
        with contextlib.ExitStack() as stack:
            idle = [stack.enter_context(socket.create_connection((HOST, a.ha_port)))
                    for _ in range(MAX_PENDING_HANDSHAKES)]
            wait_for(lambda: a.status()["link"]["in_handshake"] == len(idle), 15,
                     "the idle connections to be taken")
            with socket.create_connection((HOST, a.ha_port), timeout=10) as extra:
                assert extra.recv(100) == b""  # closed at once, before the idle ones
            assert a.log_has("connections are in the HA handshake already")
            with txbroker.connect(pair.url, timeout=10) as conn:
                conn.send("q", b"served meanwhile")
        wait_for(lambda: a_real_peer(a.ha_port, "shared-store", HA_SECRET), 15,
                 "a peer to pass again")
        assert b.status()["following"] == f"{HOST}:{a.ha_port}"


def test_a_third_broker_with_the_right_secret_is_still_refused_as_a_second_standby(
        tmp_path: Path) -> None:
    """Authentication comes first; the link's own rules still apply after it."""
    with secured_pair(tmp_path, tls=False) as pair:
        a, _ = pair.nodes
        third = HaNode("c", pair.root, free_ports(3))
        third.spawn(a, pair.args)
        assert third.proc is not None and third.proc.wait(timeout=30) == 1
        assert "already has a standby" in third.log_path.read_text()


# ----------------------------------------------------------------- replicated
@pytest.mark.parametrize("tls", [False, True], ids=["secret", "secret+tls"])
def test_replication_ports_refuse_strangers_and_wrong_secrets(tmp_path: Path,
                                                              tls: bool) -> None:
    args = ha_link_args(tmp_path / "link", tls=tls)
    context = peer_context(tmp_path) if tls else None
    with Group(tmp_path / "group", 2, *args) as g:
        a, b = g.nodes
        for node in (a, b):  # the primary's HA port, and a backup's
            refuses_strangers(node.ha_port, "replicated", node.log_has,
                              lambda n=node: n.status()["link"]["refused"], context)
        with txbroker.connect(g.url, timeout=10) as conn:
            conn.send("q", b"replicated")
        assert g.wait_ready_backups(1, primary=a) == {"b": "ready"}
        status = a.status()
        assert status["link"]["auth"] == "hmac-sha256" and status["link"]["tls"] is tls
        assert status["link"]["accepted"] >= 1  # b's join


def test_a_backup_with_the_wrong_secret_never_joins(tmp_path: Path) -> None:
    args = ha_link_args(tmp_path / "link", tls=False)
    wrong = ha_link_args(tmp_path / "wrong", tls=False, secret=WRONG)
    g = Group(tmp_path / "group", 3, *args)
    g.c.args = wrong  # after the common arguments: its secret file wins
    try:
        for node in g.nodes:
            g.spawn(node)
        for node in g.nodes:
            node.wait_line("txbroker backup on HA")
        g.promote(g.a, cli=False)
        g.wait_ready_backups(1)
        wait_for(lambda: g.c.log_has("HA: peer 127.0.0.1:") and g.c.log_has(
            "the two brokers' HA secrets differ"), 15, "c to say why", g.describe)
        wait_for(lambda: g.a.log_has("it refused this broker"), 15, "a to log c's refusal")
        with txbroker.connect(g.url, timeout=10) as conn:
            conn.send("q", b"x")
        assert g.backup_states(g.a) == {"b": "ready"}
        # c's problem is its last attempt's (a or b, every 0.3 s): wait for one that
        # reached a peer (a clean-clone CI run under load once read a refused connect)
        wait_for(lambda: "HA secrets differ" in g.c.status()["problem"], 15,
                 "c to report the secrets", g.describe)
    finally:
        g.stop()


def test_secret_settings_are_checked_at_start(tmp_path: Path) -> None:
    from txbroker.server.config import load_config

    short = tmp_path / "short.secret"
    short.write_text("abc\n")
    ha = dict(ha="replicated", ha_port=free_ports(1)[0], ha_peers="127.0.0.1:1")
    with pytest.raises(ValueError, match="at least 16 are needed"):
        load_config(None, ha_secret_file=str(short), **ha)
    with pytest.raises(ValueError, match="No such file"):
        load_config(None, ha_secret_file=str(tmp_path / "missing"), **ha)
    with pytest.raises(ValueError, match="not both"):
        load_config(None, ha_secret=HA_SECRET, ha_secret_file=str(short), **ha)
    with pytest.raises(ValueError, match=r"\[ha\] tls needs tls_cert and tls_key"):
        load_config(None, ha_tls=True, **ha)
    pki = make_pki(tmp_path / "pki")
    with pytest.raises(ValueError, match="needs a CA to verify the peers"):
        load_config(None, ha_tls=True, tls_cert=str(pki.peer_cert),
                    tls_key=str(pki.peer_key), **ha)
    config_file = tmp_path / "broker.toml"
    config_file.write_text(f'[ha]\nsecret = "{HA_SECRET}"\ntls = true\ntls_ca = "{pki.ca}"\n'
                           f'[server]\ntls_cert = "{pki.peer_cert}"\n'
                           f'tls_key = "{pki.peer_key}"\n')
    config = load_config(config_file, **ha)
    assert config.ha_secret_bytes() == HA_SECRET.encode() and config.ha_tls
    assert HA_SECRET not in repr(config)
    config_file.write_text("[ha]\npassword = 1\n")
    with pytest.raises(ValueError, match=r"unknown \[ha\] keys"):
        load_config(config_file, **ha)


def test_a_backup_verifies_the_primarys_certificate(tmp_path: Path) -> None:
    """c trusts another CA for its HA links: it refuses the primary's certificate
    (and says so), never joins, and the group goes on without it."""
    args = ha_link_args(tmp_path / "link", tls=True)
    g = Group(tmp_path / "group", 3, *args)
    g.c.args = ["--ha-tls-ca", str(tmp_path / "link" / "pki" / "other-ca.pem")]
    try:
        for node in g.nodes:
            g.spawn(node)
        for node in g.nodes:
            node.wait_line("txbroker backup on HA")
        g.promote(g.a, cli=False)
        g.wait_ready_backups(1)
        wait_for(lambda: g.c.log_has(f"HA: peer 127.0.0.1:{g.a.ha_port}: TLS: the peer's "
                                     "certificate is refused: self-signed certificate in "
                                     "certificate chain"), 15, "c to say why", g.describe)
        with txbroker.connect(g.url, timeout=10) as conn:
            conn.send("q", b"x")
        assert g.backup_states(g.a) == {"b": "ready"}
    finally:
        g.stop()
