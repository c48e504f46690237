"""Sans-IO codec of STOMP 1.2 (accepting 1.0 and 1.1), see ``docs/stomp.md``.

Theory of operation
-------------------
A :class:`StompConnection` is one side of one STOMP connection, without the
TCP: the caller hands it the bytes it read (:meth:`~StompConnection.receive_data`)
and gets back :class:`Frame` events (:meth:`~StompConnection.next_event` or,
faster, :meth:`~StompConnection.drain`); it hands it frames to write
(:meth:`~StompConnection.send`) and gets back bytes. No socket, loop, clock or
file is touched here, as in ``h11``. Heart-beat *negotiation* lives here too
(:func:`negotiate_heartbeat`); the timers that send and check heart-beats
belong to the edge.

A frame on the wire (STOMP 1.2, section "Augmented BNF")::

    COMMAND EOL
    name:value EOL        (0 or more headers; repeated names: the first wins)
    EOL
    body                  (content-length octets if that header is given,
    NUL                    else everything up to the first NUL)
    *EOL                  (EOLs between frames are heart-beats)

    EOL = [CR] LF

Header escaping depends on the negotiated version: 1.2 decodes ``\\r \\n \\c
\\\\``, 1.1 decodes ``\\n \\c \\\\``, 1.0 decodes nothing; any other escape is a
protocol error. ``CONNECT``/``STOMP`` and ``CONNECTED`` frames are never
escaped (the spec keeps them 1.0-compatible). The codec learns the version
from the ``CONNECTED`` frame: the server's codec when it *sends* it, the
client's when it *receives* it.

Which frames may travel when is one table, :data:`TRANSITIONS`; the headers
each command must carry are :data:`REQUIRED_HEADERS` (both in ``stomp_states.py``,
re-exported here).

Errors: a frame the *peer* got wrong (unknown command, missing header, bad
escape, a frame above the limits, a body where none is allowed, a frame out
of order) raises :class:`StompProtocolError` (its :attr:`~StompProtocolError.receipt_id`
is the offending frame's ``receipt`` header, when it could be read) and moves
the receiving side to :attr:`ConnectionState.ERROR`: every later
``next_event``/``drain`` raises again. Sending stays allowed, so that a server
can write its ``ERROR`` frame before it closes. A frame *we* got wrong raises
:class:`~txbroker.protocol.native.LocalProtocolError` and changes nothing.

Typical edge loop (a server)::

    codec.receive_data(data)
    try:
        while frames := codec.drain():      # an error after valid frames
            handle(frames)                  # is raised by the *next* drain()
    except StompProtocolError as exc:
        transport.write(encode_error(str(exc), exc.receipt_id, codec.version))
        transport.close()

Speed: the receive buffer is one ``bytearray``; heads are found with
``bytearray.find`` (C speed), header values are unescaped only when they
contain a backslash, and the consumed prefix is deleted once per ``drain``.
A frame whose body is still arriving keeps its parsed head, so a large body
read in many chunks is neither re-parsed nor re-scanned.
"""

from __future__ import annotations

from typing import Final

from txbroker.protocol.native import NEED_DATA, LocalProtocolError, NeedData
from txbroker.protocol.stomp_encoding import (
    BODY_COMMANDS,
    PROTOCOL_HEADERS,
    SUPPORTED_VERSIONS,
    UNESCAPED_COMMANDS,
    Frame,
    StompFrameTooLarge,
    StompProtocolError,
    encode_error,
    encode_frame,
    encode_message,
    encode_message_head,
    encode_receipt,
    escape,
    message_head,
    negotiate_heartbeat,
    negotiate_version,
    parse_heartbeat,
    unescape,
)
from txbroker.protocol.stomp_states import (
    CLIENT_COMMANDS,
    REQUIRED_HEADERS,
    SERVER_COMMANDS,
    TRANSITIONS,
    ConnectionState,
    Role,
    order_message,
)

__all__ = [
    "BODY_COMMANDS",
    "CLIENT_COMMANDS",
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MAX_HEADERS",
    "DEFAULT_MAX_HEADER_SIZE",
    "NEED_DATA",
    "PROTOCOL_HEADERS",
    "REQUIRED_HEADERS",
    "SERVER_COMMANDS",
    "SUPPORTED_VERSIONS",
    "TRANSITIONS",
    "ConnectionState",
    "Frame",
    "LocalProtocolError",
    "NeedData",
    "Role",
    "StompConnection",
    "StompFrameTooLarge",
    "StompProtocolError",
    "encode_error",
    "encode_frame",
    "encode_message",
    "encode_message_head",
    "encode_receipt",
    "escape",
    "message_head",
    "negotiate_heartbeat",
    "negotiate_version",
    "parse_heartbeat",
    "unescape",
]

#: Default limit on one frame (head + body): 8 MiB, twice the broker's default
#: max message size, the same as the native protocol's frame limit.
DEFAULT_MAX_FRAME_SIZE: Final = 8 * 1024 * 1024
#: Default limit on the number of header lines of one frame (ActiveMQ's STOMP
#: transport uses the same value, ``maxHeaders`` = 1000).
DEFAULT_MAX_HEADERS: Final = 1000
#: Default limit on one header line, name and value (ActiveMQ's
#: ``maxHeaderLength`` = 10 KiB). The whole head is bounded by
#: ``max_headers * max_header_size`` and by the frame limit.
DEFAULT_MAX_HEADER_SIZE: Final = 10 * 1024
#: A server's codec stops after these: later frames are parsed with the agreed version.
_OPENING_COMMANDS: Final = frozenset(["CONNECT", "STOMP"])


# ---------------------------------------------------------------- the codec
_NUL: Final = b"\x00"


class StompConnection:
    """One side of a STOMP connection, without I/O. See the module docstring.

    Limits bound what we *receive*: ``max_frame_size`` (head + body),
    ``max_headers`` (header lines of one frame), ``max_header_size`` (one
    header line).
    """

    __slots__ = (
        "_allowed",
        "_buffer",
        "_error",
        "_known_commands",
        "_max_head",
        "_partial",
        "_required",
        "_scan_from",
        "heartbeats_received",
        "max_frame_size",
        "max_header_size",
        "max_headers",
        "role",
        "state",
        "version",
    )

    def __init__(
        self,
        role: Role,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    ) -> None:
        if max_frame_size < 64 or max_headers < 1 or max_header_size < 16:
            raise ValueError("STOMP limits are too small to carry any frame")
        self.role = role
        self.max_frame_size = max_frame_size
        self.max_headers = max_headers
        self.max_header_size = max_header_size
        self._max_head = min(max_frame_size, max_headers * max_header_size)
        self._known_commands = CLIENT_COMMANDS if role is Role.SERVER else SERVER_COMMANDS
        #: The state (see :data:`TRANSITIONS`; ``_allowed`` is its row for this state).
        self.state = ConnectionState.CONNECTING
        self._allowed: dict[str, ConnectionState] = {}
        self._set_state(ConnectionState.CONNECTING)
        #: The agreed version ("1.0" until CONNECTED travels).
        self.version = "1.0"
        self._required: dict[str, tuple[str, ...]] = {}
        self._set_version("1.0")
        #: EOLs received between frames (the peer's heart-beats).
        self.heartbeats_received = 0
        self._buffer = bytearray()
        self._error: StompProtocolError | None = None
        #: A frame whose head is parsed and whose body is still arriving:
        #: (command, headers, body start, content-length or -1, receipt)
        self._partial: tuple[str, dict[str, str], int, int, str | None] | None = None
        self._scan_from = 0  #: where to resume looking for the head's end / the NUL

    # ------------------------------------------------------------------ state
    @property
    def buffered(self) -> int:
        """Bytes received but not yet turned into frames (a partial frame at EOF)."""
        return len(self._buffer)

    # -------------------------------------------------------------- receiving
    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes read from the peer. Ignored once in the ERROR state."""
        if self._error is None:
            self._buffer += data

    def next_event(self) -> Frame | NeedData:
        """The next complete frame, or :data:`NEED_DATA`."""
        frames = self._parse(1)
        return frames[0] if frames else NEED_DATA

    def drain(self) -> list[Frame]:
        """Every complete frame buffered (empty list = need more data).

        If a violation follows valid frames, those are returned first and the
        error is raised by the next call: call ``drain`` until it returns an
        empty list (``while frames := codec.drain(): ...``).
        """
        return self._parse(-1)

    def _fail(self, error: StompProtocolError) -> None:
        self._error = error
        self._set_state(ConnectionState.ERROR)
        self._buffer = bytearray()
        self._partial = None

    def _parse(self, limit: int) -> list[Frame]:
        if self._error is not None:
            raise type(self._error)(f"connection is in ERROR state: {self._error}",
                                    self._error.receipt_id)
        buf = self._buffer
        frames: list[Frame] = []
        pos = 0
        failure: StompProtocolError | None = None
        try:
            while limit != 0:
                frame, pos = self._parse_one(buf, pos)
                if frame is None:
                    break
                frames.append(frame)
                limit -= 1
                if frame.command in _OPENING_COMMANDS:
                    break  # the edge negotiates the version before we parse on
        except StompProtocolError as exc:
            failure = exc
        if failure is not None:
            self._fail(failure)
            if not frames:
                raise failure
            return frames
        if pos:
            del buf[:pos]
            if self._partial is not None:
                cmd, hdrs, start, length, receipt = self._partial
                self._partial = (cmd, hdrs, start - pos, length, receipt)
            self._scan_from = max(0, self._scan_from - pos)
        return frames

    def _parse_one(self, buf: bytearray, pos: int) -> tuple[Frame | None, int]:
        """Parse the frame at ``pos``: ``(frame, end)``, or ``(None, pos)`` for "need
        data" (``pos`` moved past heart-beats; a partial frame starts there)."""
        size = len(buf)
        partial = self._partial
        if partial is None:
            while pos < size and (buf[pos] == 10 or buf[pos] == 13):  # heart-beats
                if buf[pos] == 10:
                    self.heartbeats_received += 1
                pos += 1
            if pos >= size:
                return None, pos
            # the head ends at the first empty line: LF LF, or LF CR LF
            start = pos if self._scan_from <= pos + 2 else self._scan_from - 2
            head_end = buf.find(b"\n\n", start)
            crlf = buf.find(b"\n\r\n", start, head_end + 1 if head_end >= 0 else size)
            if crlf >= 0:
                head_end, body_start = crlf, crlf + 3
            elif head_end >= 0:
                body_start = head_end + 2
            else:
                if size - pos > self._max_head:
                    raise StompFrameTooLarge(
                        f"a frame head of more than {self._max_head} bytes (max headers x "
                        f"max header size)")
                self._scan_from = size
                return None, pos
            command, headers, receipt = self._parse_head(buf, pos, head_end)
            text = headers.get("content-length")
            if text is None:
                length = -1
            elif text.isdigit() and text.isascii():
                length = int(text)
                if body_start - pos + length > self.max_frame_size:
                    raise StompFrameTooLarge(
                        f"{command} frame of {body_start - pos + length} bytes exceeds the "
                        f"limit of {self.max_frame_size} (max frame size)", receipt)
            else:
                raise StompProtocolError(
                    f"content-length must be a non-negative integer, not {text[:40]!r}",
                    receipt)
            scan_from = body_start
        else:
            command, headers, body_start, length, receipt = partial
            scan_from = self._scan_from
        if length >= 0:
            end = body_start + length
            if size <= end:
                self._keep_partial(pos, command, headers, body_start, length, receipt, scan_from)
                return None, pos
            if buf[end] != 0:
                raise StompProtocolError(
                    f"{command} frame: the {length} body bytes given by content-length are "
                    f"not followed by NUL", receipt)
        else:
            end = buf.find(_NUL, scan_from)
            if end < 0:
                self._keep_partial(pos, command, headers, body_start, length, receipt, size)
                return None, pos
        frame = Frame(command, headers, bytes(buf[body_start:end]))
        if partial is not None:
            self._partial = None
        self._scan_from = 0
        self._check(frame, receipt)
        return frame, end + 1

    def _keep_partial(self, pos: int, command: str, headers: dict[str, str], body_start: int,
                      length: int, receipt: str | None, scan_from: int) -> None:
        """The head is parsed, the body incomplete: remember, check the size limit."""
        if len(self._buffer) - pos > self.max_frame_size:
            raise StompFrameTooLarge(
                f"{command} frame exceeds the limit of {self.max_frame_size} bytes "
                f"(max frame size) without its terminating NUL", receipt)
        self._partial = (command, headers, body_start, length, receipt)
        self._scan_from = scan_from

    def _parse_head(
        self, buf: bytearray, pos: int, head_end: int
    ) -> tuple[str, dict[str, str], str | None]:
        try:
            text = buf[pos:head_end].decode("utf-8")
        except UnicodeDecodeError:
            raise StompProtocolError("frame headers are not valid UTF-8") from None
        if "\r" in text:  # CR LF line ends (a raw CR is only allowed there)
            text = text.replace("\r\n", "\n")
            if text.endswith("\r"):
                text = text[:-1]
        lines = text.split("\n")
        command = lines[0]
        if command not in self._known_commands:
            shown = command if len(command) <= 40 else command[:40] + "…"
            raise StompProtocolError(
                f"unknown command {shown!r} (a {self.role.value} accepts "
                f"{', '.join(sorted(self._known_commands))})")
        del lines[0]
        if len(lines) > self.max_headers:
            raise StompFrameTooLarge(
                f"{command} frame has {len(lines)} headers, more than the limit of "
                f"{self.max_headers} (max headers)")
        if len(text) > self.max_header_size:
            longest = max(lines, key=len, default="")
            if len(longest) > self.max_header_size:
                raise StompFrameTooLarge(
                    f"{command} frame has a header line of {len(longest)} characters, more "
                    f"than the limit of {self.max_header_size} (max header size)")
        pairs = [line.split(":", 1) for line in lines]
        try:
            headers: dict[str, str] = dict(reversed(pairs))
        except ValueError:  # a line without ':'
            bad = next(line for line in lines if ":" not in line)
            receipt = next((p[1] for p in pairs if len(p) == 2 and p[0] == "receipt"), None)
            raise StompProtocolError(
                f"{command} frame has a malformed header line {bad[:60]!r} "
                f"(expected name:value)", receipt) from None
        if "" in headers:
            raise StompProtocolError(f"{command} frame has a header with an empty name",
                                     headers.get("receipt"))
        if "\\" in text and command not in UNESCAPED_COMMANDS and self.version != "1.0":
            headers = self._unescape_headers(command, pairs)
        return command, headers, headers.get("receipt")

    def _unescape_headers(self, command: str, pairs: list[list[str]]) -> dict[str, str]:
        headers: dict[str, str] = {}
        version = self.version
        for name, value in pairs:
            try:
                name = unescape(name, version)
                value = unescape(value, version)
            except StompProtocolError as exc:
                raw_receipt = next((p[1] for p in pairs if p[0] == "receipt"), None)
                raise StompProtocolError(f"{command} frame: {exc}", raw_receipt) from None
            if name not in headers:  # STOMP 1.2: the first occurrence wins
                headers[name] = value
        return headers

    def _set_state(self, state: ConnectionState) -> None:
        self.state = state
        role = self.role
        self._allowed = {cmd: after for (r, before, cmd), after in TRANSITIONS.items()
                         if r is role and before is state}

    def _set_version(self, version: str) -> None:
        self.version = version
        self._required = {cmd: names for (cmd, v), names in REQUIRED_HEADERS.items()
                          if v == version}

    def _check(self, frame: Frame, receipt: str | None) -> None:
        """Order (:data:`TRANSITIONS`), required headers, body rules."""
        command = frame.command
        after = self._allowed.get(command)
        if after is None:
            raise StompProtocolError(order_message(self.role, self.state, command), receipt)
        if frame.body and command not in BODY_COMMANDS:
            raise StompProtocolError(
                f"a {command} frame must not have a body (only SEND, MESSAGE and ERROR may)",
                receipt)
        if command == "CONNECTED":
            version = frame.headers.get("version", "1.0")
            if version not in SUPPORTED_VERSIONS:
                raise StompProtocolError(f"the server chose unsupported version {version!r}")
            self._set_version(version)
        required = self._required.get(command)
        if required:
            headers = frame.headers
            for name in required:
                if name not in headers:
                    raise StompProtocolError(
                        f"{command} frame is missing the required header {name!r} "
                        f"(STOMP {self.version})", receipt)
        if after is not self.state:
            self._set_state(after)

    # ---------------------------------------------------------------- sending
    def send(self, frame: Frame) -> bytes:
        """Encode one frame (escaped for the agreed version).

        Raises :class:`LocalProtocolError` for a command our role may not send.
        A server's codec learns the version from the CONNECTED frame it sends.
        """
        allowed = SERVER_COMMANDS if self.role is Role.SERVER else CLIENT_COMMANDS
        if frame.command not in allowed:
            raise LocalProtocolError(f"a STOMP {self.role.value} cannot send {frame.command}")
        if frame.body and frame.command not in BODY_COMMANDS:
            raise LocalProtocolError(f"a {frame.command} frame must not have a body")
        if frame.command == "CONNECTED":
            version = frame.headers.get("version", "1.0")
            if version not in SUPPORTED_VERSIONS:
                raise LocalProtocolError(f"unsupported version {version!r}")
            self._set_version(version)
        data = encode_frame(frame, self.version)
        if frame.command == "ERROR" and self.role is Role.SERVER:
            self._set_state(ConnectionState.CLOSED)
        return data

    def heartbeat(self) -> bytes:
        """The bytes of one heart-beat (an EOL)."""
        return b"\n"
