"""The HA links' handshake (``protocol/ha_auth.py``): two sides talk in memory —
whole, one byte at a time, with trailing bytes; wrong and missing secrets, a
replayed proof, a reflected proof, and peers that are not txbroker HA peers."""

from __future__ import annotations

import itertools
import json

import pytest

from txbroker.protocol.ha_auth import (
    INITIATOR_LABEL,
    NONCE_SIZE,
    PREFIX,
    Failure,
    HandshakeState,
    LinkHandshake,
    Side,
    encode_line,
    proof_of,
)

SECRET = b"s3cret-s3cret-s3cret"
_counter = itertools.count(1)


def nonce() -> bytes:
    """A distinct nonce per call (the edge draws random ones)."""
    return next(_counter).to_bytes(NONCE_SIZE, "big")


def pair(initiator_secret: bytes | None, responder_secret: bytes | None,
         link: str = "replicated", responder_link: str | None = None
         ) -> tuple[LinkHandshake, LinkHandshake]:
    return (LinkHandshake(Side.INITIATOR, link, initiator_secret, nonce()),
            LinkHandshake(Side.RESPONDER, responder_link or link, responder_secret, nonce()))


def run(initiator: LinkHandshake, responder: LinkHandshake, split: int = 0) -> list[bytes]:
    """Drive both sides until neither has anything to send; ``split`` > 0 feeds each
    message in pieces of that many bytes. Returns the transcript."""
    transcript: list[bytes] = []
    to_responder = initiator.start()
    to_initiator = b""
    while to_responder or to_initiator:
        if to_responder:
            transcript.append(to_responder)
            to_initiator = _feed(responder, to_responder, split)
            to_responder = b""
        if to_initiator:
            transcript.append(to_initiator)
            to_responder = _feed(initiator, to_initiator, split)
            to_initiator = b""
    return transcript


def _feed(side: LinkHandshake, data: bytes, split: int) -> bytes:
    if not split:
        return side.receive_data(data)
    out = b""
    for i in range(0, len(data), split):
        out += side.receive_data(data[i:i + split])
    return out


@pytest.mark.parametrize("split", [0, 1, 7])
def test_a_shared_secret_is_proved_both_ways(split: int) -> None:
    initiator, responder = pair(SECRET, SECRET)
    transcript = run(initiator, responder, split)
    assert initiator.done and responder.done
    assert initiator.authenticated and responder.authenticated
    types = [json.loads(line)["type"] for line in transcript]
    assert types == ["hello", "challenge", "proof", "ok"]
    assert all(line.startswith(PREFIX) for line in transcript)
    assert not any(SECRET in line or SECRET.hex().encode() in line for line in transcript)


def test_no_secret_on_both_sides_is_hello_then_ok() -> None:
    initiator, responder = pair(None, None)
    transcript = run(initiator, responder)
    assert initiator.done and responder.done
    assert not initiator.authenticated and not responder.authenticated
    assert [json.loads(line)["type"] for line in transcript] == ["hello", "ok"]


def test_a_wrong_secret_is_caught_by_the_initiator_first() -> None:
    initiator, responder = pair(b"another-secret-16ch", SECRET)
    run(initiator, responder)
    assert initiator.failed and initiator.failure is Failure.REFUSED_PEER
    assert "HA secrets differ" in initiator.reason
    assert responder.failed and responder.failure is Failure.REFUSED_BY_PEER
    assert "HA secrets differ" in responder.reason


def test_a_peer_guessing_the_proof_is_refused_by_the_responder() -> None:
    responder = LinkHandshake(Side.RESPONDER, "replicated", SECRET, nonce())
    hello = encode_line("hello", link="replicated", auth="hmac-sha256", nonce=nonce().hex())
    challenge = json.loads(responder.receive_data(hello))
    assert challenge["type"] == "challenge"
    answer = responder.receive_data(encode_line("proof", proof="00" * 32))
    assert responder.failed and responder.failure is Failure.REFUSED_PEER
    assert "wrong proof of the HA secret" in responder.reason
    assert json.loads(answer)["type"] == "refused"


def test_a_replayed_proof_fails() -> None:
    """A recorded initiator's lines, replayed against a new responder (a new nonce)."""
    initiator, responder = pair(SECRET, SECRET)
    transcript = run(initiator, responder)
    hello, proof = transcript[0], transcript[2]
    fresh = LinkHandshake(Side.RESPONDER, "replicated", SECRET, nonce())
    fresh.receive_data(hello)
    fresh.receive_data(proof)
    assert fresh.failed and "wrong proof" in fresh.reason


def test_the_responders_proof_cannot_be_reflected() -> None:
    """A peer that sends back the responder's own proof as its proof fails (labels)."""
    initiator_nonce = nonce()
    responder = LinkHandshake(Side.RESPONDER, "replicated", SECRET, nonce())
    challenge = json.loads(responder.receive_data(encode_line(
        "hello", link="replicated", auth="hmac-sha256", nonce=initiator_nonce.hex())))
    responder.receive_data(encode_line("proof", proof=challenge["proof"]))
    assert responder.failed
    right = proof_of(SECRET, INITIATOR_LABEL, "replicated", initiator_nonce,
                     bytes.fromhex(challenge["nonce"]))
    assert right.hex() != challenge["proof"]


@pytest.mark.parametrize("initiator_secret, responder_secret, text", [
    (None, SECRET, "this broker requires the HA secret and the peer has none"),
    (SECRET, None, "the peer has an HA secret and this broker has none"),
])
def test_a_secret_on_one_side_only_is_refused(initiator_secret: bytes | None,
                                              responder_secret: bytes | None,
                                              text: str) -> None:
    initiator, responder = pair(initiator_secret, responder_secret)
    run(initiator, responder)
    assert responder.failed and responder.failure is Failure.REFUSED_PEER
    assert text in responder.reason
    assert initiator.failed and initiator.failure is Failure.REFUSED_BY_PEER
    assert text in initiator.reason


def test_an_initiator_with_a_secret_never_takes_an_unproved_ok() -> None:
    """A rogue responder that answers ok at once is not followed."""
    initiator = LinkHandshake(Side.INITIATOR, "replicated", SECRET, nonce())
    initiator.start()
    answer = initiator.receive_data(encode_line("ok"))
    assert initiator.failed and "without proving the HA secret" in initiator.reason
    assert json.loads(answer)["type"] == "refused"


def test_the_links_must_match() -> None:
    initiator, responder = pair(SECRET, SECRET, "shared-store", "replicated")
    run(initiator, responder)
    assert responder.failed and "this is a replicated HA port" in responder.reason
    assert initiator.failed and initiator.failure is Failure.REFUSED_BY_PEER


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    bytes(range(256)),
    b'{"txbroker_ha":1,"type":"standby","node":"h:1"}\n',  # the link without handshake
    b"\x00\x00\x00\x10" + b"\x92\xa4join",  # a replication frame without handshake
])
def test_a_foreign_peer_is_refused_at_its_first_differing_byte(data: bytes) -> None:
    for feed in (data, data[:1]):  # whole, and its first byte alone
        responder = LinkHandshake(Side.RESPONDER, "shared-store", SECRET, nonce())
        answer = responder.receive_data(feed)
        if feed[:1] == b"{" and len(feed) == 1:
            assert responder.state is HandshakeState.AWAIT_HELLO  # could still be ours
            continue
        assert answer == b""  # no answer to a stranger
        assert responder.failed and responder.failure is Failure.FOREIGN
        assert "the peer is not a txbroker HA peer" in responder.reason


def test_an_endless_line_and_other_versions_are_refused() -> None:
    responder = LinkHandshake(Side.RESPONDER, "replicated", None, b"")
    responder.receive_data(PREFIX + b"1" * 2000)
    assert responder.failed and "a line above" in responder.reason
    responder = LinkHandshake(Side.RESPONDER, "replicated", None, b"")
    responder.receive_data(b'{"txbroker_ha_auth":2,"type":"hello"}\n')
    assert responder.failed and "handshake version 2" in responder.reason


def test_bytes_after_the_handshake_are_a_violation() -> None:
    """Neither side may speak before the other saw ok: trailing bytes are refused."""
    responder = LinkHandshake(Side.RESPONDER, "replicated", None, b"")
    responder.receive_data(encode_line("hello", link="replicated", auth="none", nonce="")
                           + b"\x00\x00\x00\x05extra")
    assert responder.failed and "spoke before the handshake ended" in responder.reason


def test_a_line_out_of_order_is_foreign() -> None:
    responder = LinkHandshake(Side.RESPONDER, "replicated", SECRET, nonce())
    responder.receive_data(encode_line("proof", proof="00" * 32))
    assert responder.failed and responder.failure is Failure.FOREIGN
    assert "'proof' while this side was await-hello" in responder.reason


def test_malformed_fields_are_refused_with_the_reason() -> None:
    responder = LinkHandshake(Side.RESPONDER, "replicated", SECRET, nonce())
    answer = responder.receive_data(encode_line("hello", link="replicated",
                                                auth="hmac-sha256", nonce="abc"))
    assert responder.failed and "malformed hello: nonce must be 64 hex digits" in \
        responder.reason
    assert json.loads(answer)["type"] == "refused"


def test_misuse_is_a_local_error() -> None:
    with pytest.raises(ValueError):
        LinkHandshake(Side.INITIATOR, "gossip", None, b"")
    with pytest.raises(ValueError):
        LinkHandshake(Side.INITIATOR, "replicated", SECRET, b"short")
    with pytest.raises(ValueError):
        encode_line("gossip")


@pytest.mark.parametrize("data", [
    b'{"txbroker_ha":1,"type":"standby","node":"x:1","lock":""}\n',
    b"\x00\x00\x00\x1a\x92\xa4join\x82\xa4node\xa1a\xa7version\x01",
])
def test_a_broker_from_before_the_handshake_is_named(data: bytes) -> None:
    responder = LinkHandshake(Side.RESPONDER, "replicated", None, b"")
    responder.receive_data(data)
    assert responder.failed and "a txbroker from before the HA handshake" in responder.reason
