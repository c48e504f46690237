"""STOMP's text, without I/O: frames, header escaping, version and heart-beat
negotiation, and the encoders of the frames a server writes.

Split out of ``protocol/stomp.py`` (the codec, which re-exports every name
here): the codec parses with :func:`unescape` and sends with
:func:`encode_frame`; the server's edge writes MESSAGE, RECEIPT and ERROR
frames with :func:`encode_message`, :func:`encode_receipt` and
:func:`encode_error` directly (no :class:`Frame` object per message).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from txbroker.errors import FrameTooLarge, ProtocolError
from txbroker.protocol.native import LocalProtocolError

#: Versions this codec speaks, oldest first.
SUPPORTED_VERSIONS: Final = ("1.0", "1.1", "1.2")
#: Frames that may carry a body; every other frame MUST NOT (STOMP 1.2 "Body").
BODY_COMMANDS: Final = frozenset(["SEND", "MESSAGE", "ERROR"])
#: Headers that are the protocol's, not the message's: a SEND's headers other
#: than these travel with the message, and a MESSAGE frame never repeats them
#: from the message (it writes its own ``destination``, ``message-id`` ...).
PROTOCOL_HEADERS: Final = frozenset(
    ["destination", "transaction", "receipt", "content-length", "persistent", "message-id",
     "subscription", "ack", "redelivered"]
)
#: Frames whose headers are never escaped (STOMP 1.2 "Value Encoding").
UNESCAPED_COMMANDS: Final = frozenset(["CONNECT", "STOMP", "CONNECTED"])

class StompProtocolError(ProtocolError):
    """The peer broke STOMP. ``receipt_id``: the bad frame's ``receipt`` header, if known."""

    def __init__(self, message: str, receipt_id: str | None = None) -> None:
        super().__init__(message)
        self.receipt_id = receipt_id


class StompFrameTooLarge(StompProtocolError, FrameTooLarge):
    """A frame, a header line or the number of headers is above its limit."""


@dataclass(slots=True, init=False)  # its own __init__: compiled (a generated one is not)
class Frame:
    """One STOMP frame: a command, headers (first occurrence wins) and a body."""

    command: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def __init__(self, command: str, headers: dict[str, str] | None = None,
                 body: bytes = b"") -> None:
        self.command = command
        self.headers = {} if headers is None else headers
        self.body = body


# ---------------------------------------------------------------- escaping
_ESCAPE_12: Final = str.maketrans({"\\": "\\\\", "\r": "\\r", "\n": "\\n", ":": "\\c"})
_ESCAPE_11: Final = str.maketrans({"\\": "\\\\", "\n": "\\n", ":": "\\c"})
_UNESCAPES: Final[dict[str, dict[str, str]]] = {
    "1.2": {"r": "\r", "n": "\n", "c": ":", "\\": "\\"},
    "1.1": {"n": "\n", "c": ":", "\\": "\\"},
}
_ESCAPE_RE: Final = re.compile(r"\\(.?)", re.DOTALL)


def escape(value: str, version: str) -> str:
    """Escape a header name or value for ``version`` (1.0: unchanged)."""
    if version == "1.2":
        return value.translate(_ESCAPE_12)
    if version == "1.1":
        return value.translate(_ESCAPE_11)
    return value


def unescape(value: str, version: str) -> str:
    """Undo :func:`escape`; an undefined escape raises :class:`StompProtocolError`."""
    if "\\" not in value:
        return value
    table = _UNESCAPES.get(version)
    if table is None:
        return value  # STOMP 1.0 has no escaping

    def replace(match: re.Match[str]) -> str:
        found = table.get(match.group(1))
        if found is None:
            raise StompProtocolError(
                f"undefined escape sequence {match.group(0)!r} in a header (STOMP {version} "
                f"defines only {', '.join(chr(92) + k for k in table)})"
            )
        return found

    return _ESCAPE_RE.sub(replace, value)


# ---------------------------------------------------------------- negotiation
def negotiate_version(accept_version: str | None) -> str | None:
    """The highest version both sides speak (``None``: no common version).

    A CONNECT without ``accept-version`` is a STOMP 1.0 client.
    """
    if accept_version is None:
        return "1.0"
    offered = {v.strip() for v in accept_version.split(",")}
    for version in reversed(SUPPORTED_VERSIONS):
        if version in offered:
            return version
    return None


def parse_heartbeat(value: str | None) -> tuple[int, int]:
    """``"cx,cy"`` → ``(cx, cy)`` in ms; absent means ``(0, 0)``.

    Raises :class:`StompProtocolError` unless it is two non-negative integers.
    """
    if value is None:
        return 0, 0
    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise StompProtocolError(
            f"heart-beat must be two non-negative integers 'cx,cy', not {value!r}"
        )
    return int(parts[0]), int(parts[1])


def negotiate_heartbeat(
    client: tuple[int, int], server_send_min: int, server_receive_min: int
) -> tuple[int, int]:
    """Heart-beat intervals (ms) as ``(server sends every, server expects every)``.

    ``client`` is the CONNECT's ``(cx, cy)``: cx = the client can send every cx
    ms, cy = it wants to receive every cy ms (0 = cannot / does not want).
    The server can send every ``server_send_min`` ms and wants to hear from
    the client at least that often but not more often than every
    ``server_receive_min`` ms. STOMP 1.2 "Heart-beating": each direction is
    ``max`` of what one side can do and the other wants, 0 if either says 0.

    Put the result in the CONNECTED ``heart-beat`` header as ``"out,in"``: the
    client then computes the same two numbers.
    """
    cx, cy = client
    out = max(server_send_min, cy) if cy and server_send_min else 0
    inbound = max(cx, server_receive_min) if cx and server_receive_min else 0
    return out, inbound


# ---------------------------------------------------------------- encoding
def encode_error(message: str, receipt_id: str | None = None, version: str = "1.2",
                 detail: str = "") -> bytes:
    """An ERROR frame: ``message`` header, ``receipt-id`` if known, text body.

    Usable before any version was agreed (use ``"1.0"``: newlines are then
    replaced, since 1.0 cannot escape them).
    """
    if version == "1.0":
        message = message.replace("\n", " ").replace("\r", " ")
    lines = ["ERROR", f"message:{escape(message, version)}"]
    if receipt_id is not None:
        lines.append(f"receipt-id:{escape(receipt_id, version)}")
    body = (detail or message).encode("utf-8") + b"\n"
    lines.append("content-type:text/plain;charset=utf-8")
    lines.append(f"content-length:{len(body)}")
    return ("\n".join(lines) + "\n\n").encode("utf-8") + body + b"\x00"


def encode_receipt(receipt_id: str, version: str) -> bytes:
    """A RECEIPT frame for the frame that carried ``receipt:receipt_id``."""
    return f"RECEIPT\nreceipt-id:{escape(receipt_id, version)}\n\n\x00".encode()


def message_head(destination: str, subscription: str, version: str) -> str:
    """The first lines of every MESSAGE frame of one subscription (command,
    ``destination``, ``subscription``): made once per SUBSCRIBE, handed to
    :func:`encode_message` for each message."""
    return (f"MESSAGE\ndestination:{escape(destination, version)}\n"
            f"subscription:{escape(subscription, version)}\n")


def encode_message(head: str, message_id: str, body: bytes, version: str, *,
                   ack: str | None = None, redelivered: bool = False,
                   headers: Mapping[str, str] | None = None) -> bytes:
    """A MESSAGE frame: ``head`` (:func:`message_head`), ``message-id``, ``ack``
    (the id an ACK/NACK names, STOMP 1.2 client modes), ``redelivered:true`` on a
    redelivery, the message's own ``headers`` and ``content-length``.

    Of the message's headers, :data:`PROTOCOL_HEADERS` are left out (the frame
    writes its own), and so, in STOMP 1.0, is any header that cannot travel
    unescaped (a newline, or a ``:`` in the name).
    """
    return encode_message_head(head, message_id, len(body), version, ack=ack,
                               redelivered=redelivered, headers=headers) + body + b"\x00"


def encode_message_head(head: str, message_id: str, body_length: int, version: str, *,
                        ack: str | None = None, redelivered: bool = False,
                        headers: Mapping[str, str] | None = None) -> bytes:
    """The bytes of :func:`encode_message`'s frame before its body (the body and the
    NUL follow): an edge that writes the three pieces with one ``join`` copies the
    body once, not three times."""
    parts = [head, "message-id:", message_id, "\n"]
    if ack is not None:
        parts += ("ack:", ack, "\n")
    if redelivered:
        parts.append("redelivered:true\n")
    if headers:
        for name, value in headers.items():
            if name in PROTOCOL_HEADERS:
                continue
            if version == "1.0" and ("\n" in value or "\n" in name or ":" in name):
                continue  # STOMP 1.0 cannot escape: such a header cannot travel
            parts += (escape(name, version), ":", escape(value, version), "\n")
    parts += ("content-length:", str(body_length), "\n\n")
    return "".join(parts).encode()


def encode_frame(frame: Frame, version: str) -> bytes:
    """One frame's bytes, its headers escaped for ``version`` (CONNECT, STOMP and
    CONNECTED never are); ``content-length`` is always written for a body."""
    command = frame.command
    body = frame.body
    esc = "1.0" if command in UNESCAPED_COMMANDS else version
    lines = [command]
    headers = frame.headers
    for name, value in headers.items():
        if name == "content-length":
            continue
        if esc == "1.0" and ("\n" in name or "\n" in value or ":" in name or "\r" in value):
            raise LocalProtocolError(
                f"header {name!r} of a {command} frame cannot be sent unescaped (STOMP {esc})"
            )
        lines.append(f"{escape(name, esc)}:{escape(value, esc)}")
    if body or command in BODY_COMMANDS:
        lines.append(f"content-length:{len(body)}")
    return ("\n".join(lines) + "\n\n").encode("utf-8") + body + b"\x00"
