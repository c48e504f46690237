"""The opening handshake of both HA links: peers prove a shared secret, never send it.

Theory of operation
-------------------
Every connection to an HA port — the shared-store heartbeat link
(``protocol/ha.py``) and the replication link (``protocol/replication.py``) —
begins with this handshake (after TLS when the link has it, docs/ha.md,
"Securing the HA links"). The side that connects (a standby, a backup) is the
**initiator**; the side that listens (an active, a primary, a backup answering
a join) is the **responder**::

    initiator                                    responder
    hello {link, auth, nonce: Ni}           ->
                                            <-   challenge {nonce: Nr, proof: Pr}
    (checks Pr)  proof {proof: Pi}          ->
                                                 (checks Pi)
                                            <-   ok

    Pr = HMAC-SHA256(secret, "txbroker-ha responder" 0 link 0 Ni 0 Nr)
    Pi = HMAC-SHA256(secret, "txbroker-ha initiator" 0 link 0 Ni 0 Nr)

Each proof covers a nonce the *other* side has just drawn (:data:`NONCE_SIZE`
random bytes, drawn at the edge — this module takes them as arguments), so a
recorded proof is worthless on a new connection: a replay fails. The two proofs
carry different labels, so one side's proof cannot be reflected back as the
other's, and the link's name, so a proof for one link does not open the other.
The secret never crosses the wire. The responder proves itself first: an
initiator — a backup about to copy a primary's state, a standby about to trust a
heartbeat — never follows a peer that does not know the secret either.

Without a secret on both sides (``auth: "none"``) the handshake is
``hello`` → ``ok``: the link works unauthenticated, as before this handshake
existed (the broker logs a warning at start). A secret on one side only is
refused, with a reason that names the mismatch.

Wire format
-----------
One JSON object per line (UTF-8, ``\\n``-terminated, at most :data:`MAX_LINE`
bytes), each beginning with :data:`PREFIX` (``{"txbroker_ha_auth":``, then the
version, :data:`AUTH_VERSION`). A peer whose bytes differ from the prefix — random
bytes, an HTTP request, a TLS handshake on a plaintext port — is not a txbroker HA
peer: refused at its first byte that differs, without an answer.

===========  ==========  =====================================================
type         sent by     fields
===========  ==========  =====================================================
``hello``    initiator   ``link`` (``shared-store`` | ``replicated``), ``auth``
                         (``hmac-sha256`` | ``none``), ``nonce`` (hex; ``""``
                         with ``none``)
``challenge`` responder  ``nonce``, ``proof`` (hex)
``proof``    initiator   ``proof`` (hex)
``ok``       responder   —
``refused``  either      ``reason`` — then the sender closes
===========  ==========  =====================================================

After ``ok`` the link's own protocol runs on the same connection, the initiator
speaking first; so a byte after the line that completes the handshake, on either
side, is a violation.

No socket, loop, clock or randomness here (``server/ha/link.py`` is the I/O).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
from typing import Any, Final

__all__ = ["AUTH_VERSION", "LINKS", "MAX_LINE", "NONCE_SIZE", "PREFIX", "Failure",
           "HandshakeState", "LinkHandshake", "Side", "encode_line", "proof_of"]

#: The version every line carries.
AUTH_VERSION: Final = 1
#: How every line begins (the version follows).
PREFIX: Final = b'{"txbroker_ha_auth":'
#: The longest line either side accepts (the handshake's lines are under 300 bytes).
MAX_LINE: Final = 1024
#: Random bytes of each side's nonce: 256 bits, the HMAC-SHA256 output size (NIST SP
#: 800-90A's security strength for the key-sized nonce); never repeats in practice.
NONCE_SIZE: Final = 32
#: Bytes of a proof: an HMAC-SHA256 digest.
PROOF_SIZE: Final = hashlib.sha256().digest_size
#: The links a hello may name.
LINKS: Final = frozenset({"shared-store", "replicated"})
#: The ``auth`` values: a shared secret, or none configured.
AUTH_HMAC: Final = "hmac-sha256"
AUTH_NONE: Final = "none"
TYPES: Final = frozenset({"hello", "challenge", "proof", "ok", "refused"})
#: How a broker from before this handshake begins each link (told apart in the log):
#: the shared-store link's first line, the replication link's ``join`` frame (its
#: msgpack array header and type, after the 4-byte length).
OLD_SHARED_STORE_LINK: Final = b'{"txbroker_ha":'
OLD_REPLICATION_JOIN: Final = b"\x92\xa4join"
#: The labels that make the two sides' proofs differ (no reflection).
INITIATOR_LABEL: Final = b"txbroker-ha initiator"
RESPONDER_LABEL: Final = b"txbroker-ha responder"


class Side(enum.Enum):
    """Which end of the connection this handshake is."""

    INITIATOR = "initiator"  #: connected (a standby, a backup)
    RESPONDER = "responder"  #: accepted (the HA port's listener)


class HandshakeState(enum.Enum):
    """Where a handshake stands."""

    AWAIT_HELLO = "await-hello"  #: responder, nothing received yet
    AWAIT_CHALLENGE = "await-challenge"  #: initiator, hello sent
    AWAIT_PROOF = "await-proof"  #: responder, challenge sent
    AWAIT_OK = "await-ok"  #: initiator, proof sent
    DONE = "done"  #: the link's own protocol may run
    FAILED = "failed"  #: see ``failure``; close the connection


class Failure(enum.Enum):
    """Why a handshake failed (``LinkHandshake.failure``)."""

    FOREIGN = "foreign"  #: the peer does not speak this handshake (not a txbroker HA peer)
    REFUSED_PEER = "refused-peer"  #: we refused the peer (no or wrong secret, wrong link)
    REFUSED_BY_PEER = "refused-by-peer"  #: the peer refused us (it said why)


def encode_line(kind: str, **fields: Any) -> bytes:
    """One line: ``{"txbroker_ha_auth": 1, "type": kind, **fields}``."""
    if kind not in TYPES:
        raise ValueError(f"unknown HA handshake message type {kind!r}")
    return json.dumps({"txbroker_ha_auth": AUTH_VERSION, "type": kind, **fields},
                      separators=(",", ":")).encode() + b"\n"


def proof_of(secret: bytes, label: bytes, link: str, initiator_nonce: bytes,
             responder_nonce: bytes) -> bytes:
    """HMAC-SHA256 of the label, the link and both nonces under the secret."""
    message = b"\0".join((label, link.encode(), initiator_nonce, responder_nonce))
    return hmac.new(secret, message, hashlib.sha256).digest()


def _hex_field(message: dict[str, Any], name: str, size: int) -> bytes:
    value = message.get(name)
    if not isinstance(value, str) or len(value) != 2 * size:
        raise ValueError(f"{name} must be {2 * size} hex digits")
    return bytes.fromhex(value)


class LinkHandshake:
    """One side of one connection's handshake (module docstring).

    ``start()`` gives the bytes to send first (the initiator's hello); then each
    ``receive_data(data)`` gives the bytes to send back. Once ``state`` is DONE the
    link's protocol takes over; once it is FAILED, ``failure`` and ``reason`` say
    why, and the connection is to be closed after the bytes returned are sent.
    """

    def __init__(self, side: Side, link: str, secret: bytes | None, nonce: bytes) -> None:
        if link not in LINKS:
            raise ValueError(f"unknown HA link {link!r}")
        if secret is not None and not secret:
            raise ValueError("an empty secret (give None for no secret)")
        if secret is not None and len(nonce) != NONCE_SIZE:
            raise ValueError(f"the nonce must be {NONCE_SIZE} bytes")
        self.side = side
        self.link = link
        self.secret = secret
        self.nonce = nonce if secret is not None else b""
        self.peer_nonce = b""
        self.state = (HandshakeState.AWAIT_HELLO if side is Side.RESPONDER
                      else HandshakeState.AWAIT_CHALLENGE)
        self.failure: Failure | None = None
        self.reason = ""
        self.authenticated = False  #: the peer proved the secret (False with auth none)
        self._buffer = bytearray()
        self._started = False

    # ------------------------------------------------------------------ driving
    def start(self) -> bytes:
        """The first bytes to send: the initiator's hello (the responder sends none)."""
        if self._started or self.side is Side.RESPONDER:
            return b""
        self._started = True
        auth = AUTH_HMAC if self.secret is not None else AUTH_NONE
        return encode_line("hello", link=self.link, auth=auth, nonce=self.nonce.hex())

    def receive_data(self, data: bytes) -> bytes:
        """Feed bytes from the peer; the bytes to send back."""
        if self.state in (HandshakeState.DONE, HandshakeState.FAILED):
            if data and self.state is HandshakeState.DONE:
                return self._foreign(bytes(data), "sent more after the handshake ended")
            return b""
        self._buffer += data
        out = bytearray()
        while self.state not in (HandshakeState.DONE, HandshakeState.FAILED):
            head = bytes(self._buffer[:len(PREFIX)])
            if not PREFIX.startswith(head):
                return bytes(out) + self._foreign(bytes(self._buffer[:60]))
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > MAX_LINE:
                    return bytes(out) + self._foreign(bytes(self._buffer[:60]),
                                                      f"a line above {MAX_LINE} bytes")
                break
            line = bytes(self._buffer[:end])
            del self._buffer[:end + 1]
            out += self._on_line(line)
        if self.done and self._buffer:
            return bytes(out) + self._foreign(bytes(self._buffer[:60]),
                                              "spoke before the handshake ended")
        return bytes(out)

    @property
    def done(self) -> bool:
        """The handshake succeeded: the link's protocol may run."""
        return self.state is HandshakeState.DONE

    @property
    def failed(self) -> bool:
        """The handshake failed: close the connection (``failure``, ``reason``)."""
        return self.state is HandshakeState.FAILED

    # ------------------------------------------------------------------ failures
    def _fail(self, failure: Failure, reason: str) -> None:
        self.state = HandshakeState.FAILED
        self.failure = failure
        self.reason = reason
        self._buffer.clear()

    def _foreign(self, sample: bytes, what: str = "") -> bytes:
        """Not this handshake: refused without an answer."""
        who = "port" if self.side is Side.INITIATOR else "peer"
        detail = f"; it {what}" if what else ""
        if sample.startswith(OLD_SHARED_STORE_LINK) or sample[4:10] == OLD_REPLICATION_JOIN:
            detail += ("; a txbroker from before the HA handshake: upgrade every broker of "
                       "the group")
        self._fail(Failure.FOREIGN, f"the peer is not a txbroker HA {who} (it sent "
                                    f"{sample[:60]!r}{detail})")
        return b""

    def _refuse(self, reason: str) -> bytes:
        """We refuse the peer: say why, then close."""
        self._fail(Failure.REFUSED_PEER, reason)
        return encode_line("refused", reason=reason)

    # ------------------------------------------------------------------ the table
    def _on_line(self, line: bytes) -> bytes:
        try:
            message = json.loads(line)
        except ValueError:
            return self._foreign(line)
        if not isinstance(message, dict):
            return self._foreign(line)
        version = message.get("txbroker_ha_auth")
        if version != AUTH_VERSION:
            self._fail(Failure.FOREIGN, f"the peer speaks HA handshake version {version!r}; "
                                        f"this broker speaks {AUTH_VERSION}")
            return b""
        kind = message.get("type")
        if kind == "refused":  # Rule 0: either side may refuse at any step
            self._fail(Failure.REFUSED_BY_PEER, str(message.get("reason", "")))
            return b""
        rule = _RULES.get((self.state, kind if isinstance(kind, str) else ""))
        if rule is None:
            return self._foreign(line[:60], f"sent {kind!r} while this side was "
                                            f"{self.state.value}")
        try:
            return rule(self, message)
        except ValueError as exc:
            return self._refuse(f"malformed {kind}: {exc}")

    def _on_hello(self, message: dict[str, Any]) -> bytes:
        """Rule 1 (responder): a hello names our link and our kind of auth; with a
        secret, answer a challenge carrying our proof; without, answer ok."""
        link, auth = message.get("link"), message.get("auth")
        if link != self.link:
            return self._refuse(f"this is a {self.link} HA port; the peer speaks the "
                                f"{link} link (check --ha and the peer addresses)")
        if auth == AUTH_NONE:
            if self.secret is not None:
                return self._refuse("this broker requires the HA secret and the peer has "
                                    "none configured ([ha] secret on both)")
            self.state = HandshakeState.DONE
            return encode_line("ok")
        if auth != AUTH_HMAC:
            return self._refuse(f"unknown HA auth {auth!r}")
        if self.secret is None:
            return self._refuse("the peer has an HA secret and this broker has none "
                                "configured ([ha] secret on both)")
        self.peer_nonce = _hex_field(message, "nonce", NONCE_SIZE)
        proof = proof_of(self.secret, RESPONDER_LABEL, self.link, self.peer_nonce, self.nonce)
        self.state = HandshakeState.AWAIT_PROOF
        return encode_line("challenge", nonce=self.nonce.hex(), proof=proof.hex())

    def _on_challenge(self, message: dict[str, Any]) -> bytes:
        """Rule 2 (initiator): the responder's proof must check out before we prove
        ourselves (a peer that does not know the secret is never followed)."""
        if self.secret is None:
            return self._refuse("the peer requires an HA secret and this broker has none "
                                "configured ([ha] secret on both)")
        self.peer_nonce = _hex_field(message, "nonce", NONCE_SIZE)
        expected = proof_of(self.secret, RESPONDER_LABEL, self.link, self.nonce,
                            self.peer_nonce)
        if not hmac.compare_digest(expected, _hex_field(message, "proof", PROOF_SIZE)):
            return self._refuse("the peer's proof of the HA secret is wrong: the two "
                                "brokers' HA secrets differ")
        self.authenticated = True
        self.state = HandshakeState.AWAIT_OK
        proof = proof_of(self.secret, INITIATOR_LABEL, self.link, self.nonce, self.peer_nonce)
        return encode_line("proof", proof=proof.hex())

    def _on_proof(self, message: dict[str, Any]) -> bytes:
        """Rule 3 (responder): the initiator's proof, over our fresh nonce."""
        assert self.secret is not None
        expected = proof_of(self.secret, INITIATOR_LABEL, self.link, self.peer_nonce,
                            self.nonce)
        if not hmac.compare_digest(expected, _hex_field(message, "proof", PROOF_SIZE)):
            return self._refuse("wrong proof of the HA secret (a wrong secret, or a replay)")
        self.authenticated = True
        self.state = HandshakeState.DONE
        return encode_line("ok")

    def _on_ok(self, message: dict[str, Any]) -> bytes:
        """Rule 4 (initiator): ok ends the handshake — after our proof, or at once
        when neither side has a secret. With a secret, an ok that skipped the
        challenge comes from a peer that proved nothing: refused."""
        if self.state is HandshakeState.AWAIT_CHALLENGE and self.secret is not None:
            return self._refuse("the peer accepted us without proving the HA secret (it has "
                                "none configured?)")
        self.state = HandshakeState.DONE
        return b""


#: (state, message type) -> rule. Anything else (a line out of order, a type that does
#: not travel in that direction) means the peer is not this handshake.
_RULES: Final = {
    (HandshakeState.AWAIT_HELLO, "hello"): LinkHandshake._on_hello,
    (HandshakeState.AWAIT_CHALLENGE, "challenge"): LinkHandshake._on_challenge,
    (HandshakeState.AWAIT_CHALLENGE, "ok"): LinkHandshake._on_ok,
    (HandshakeState.AWAIT_PROOF, "proof"): LinkHandshake._on_proof,
    (HandshakeState.AWAIT_OK, "ok"): LinkHandshake._on_ok,
}
