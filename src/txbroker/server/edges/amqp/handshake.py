"""The AMQP 0-9-1 handshake's pieces: what we offer, the connection's phases and
their table, and the SASL responses we read (``server/edges/amqp/connection_methods.py``
runs them).

The handshake (AMQP 0-9-1 section 2.2.4); the server speaks first after the
protocol header::

    C: "AMQP" 0 0 9 1           S: connection.start (mechanisms "PLAIN AMQPLAIN")
    C: connection.start-ok      S: connection.tune  (channel_max, frame_max, heartbeat)
                                   — or connection.close 403 (wrong user/password)
    C: connection.tune-ok
    C: connection.open "/"      S: connection.open-ok — or close 530 (other vhosts)
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Final

from pamqp import decode as pamqp_decode

from txbroker.protocol.amqp import DEFAULT_FRAME_MAX, FRAME_MIN_SIZE

log = logging.getLogger("txbroker.amqp")

#: The AMQP port (IANA ``amqp``; RabbitMQ's default).
DEFAULT_AMQP_PORT: Final = 5672
#: Channels per connection we offer in connection.tune (RabbitMQ's default 2047).
DEFAULT_CHANNEL_MAX: Final = 2047
#: Heartbeat interval we offer (s; RabbitMQ's default 60); the client's tune-ok decides.
DEFAULT_HEARTBEAT_S: Final = 60
#: A connection that has not opened within this time is closed (RabbitMQ's
#: ``handshake_timeout`` is 10 s).
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 10.0
#: After our connection.close, the socket closes when close-ok comes or after this.
CLOSE_WAIT_S: Final = 2.0
#: SASL mechanisms offered in connection.start.
MECHANISMS: Final = ("PLAIN", "AMQPLAIN")


@dataclass(frozen=True, slots=True)
class AmqpSettings:
    """The AMQP listener's settings."""

    frame_max: int = DEFAULT_FRAME_MAX
    channel_max: int = DEFAULT_CHANNEL_MAX
    heartbeat_s: int = DEFAULT_HEARTBEAT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S

    def validate(self) -> None:
        """Raise ValueError on settings that cannot work."""
        if self.frame_max < FRAME_MIN_SIZE:
            raise ValueError(f"AMQP frame_max must be at least {FRAME_MIN_SIZE}")
        if not 1 <= self.channel_max <= 65535:
            raise ValueError("AMQP channel_max must be 1..65535")
        if not 0 <= self.heartbeat_s <= 65535:
            raise ValueError("AMQP heartbeat must be 0..65535 s")


class Phase(enum.Enum):
    """The connection's handshake state."""

    AWAIT_HEADER = "await-header"
    AWAIT_START_OK = "await-start-ok"
    AWAIT_TUNE_OK = "await-tune-ok"
    AWAIT_OPEN = "await-open"
    OPEN = "open"
    #: we sent connection.close: only close-ok (or close) is read
    CLOSING = "closing"
    CLOSED = "closed"


#: (phase, method on channel 0) -> next phase; anything else on channel 0 is 503
#: COMMAND_INVALID (505 before the connection is open).
TRANSITIONS: Final[dict[tuple[Phase, str], Phase]] = {
    # Rule 1: the client answers connection.start with its credentials.
    (Phase.AWAIT_START_OK, "Connection.StartOk"): Phase.AWAIT_TUNE_OK,
    # Rule 2: then accepts (or lowers) our tuning.
    (Phase.AWAIT_TUNE_OK, "Connection.TuneOk"): Phase.AWAIT_OPEN,
    # Rule 3: then opens the virtual host "/".
    (Phase.AWAIT_OPEN, "Connection.Open"): Phase.OPEN,
    # Rule 4: an open connection closes on the client's word (we answer close-ok)...
    (Phase.OPEN, "Connection.Close"): Phase.CLOSED,
    # Rule 5: ... or on ours (the client answers close-ok; a crossing close counts too).
    (Phase.CLOSING, "Connection.CloseOk"): Phase.CLOSED,
    (Phase.CLOSING, "Connection.Close"): Phase.CLOSED,
    # Rule 6: connection.blocked/unblocked are the server's; a client's update-secret
    # is not supported (540 below).
}


def credentials(mechanism: str, response: Any) -> tuple[str | None, str | None]:
    """(user, password) of a PLAIN (``authzid NUL user NUL password``) or AMQPLAIN
    (a field table with LOGIN and PASSWORD) response; (None, None) if malformed."""
    raw = response.encode("utf-8", "surrogateescape") if isinstance(response, str) \
        else bytes(response or b"")
    if mechanism == "PLAIN":
        parts = raw.split(b"\x00")
        if len(parts) != 3:
            return None, None
        try:
            return parts[1].decode(), parts[2].decode()
        except UnicodeDecodeError:
            return None, None
    if mechanism == "AMQPLAIN":
        try:
            _, table = pamqp_decode.field_table(len(raw).to_bytes(4, "big") + raw)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            log.info("AMQP: malformed AMQPLAIN response: %s", exc)
            return None, None
        login, password = table.get("LOGIN"), table.get("PASSWORD")
        if isinstance(login, bytes):
            login = login.decode("utf-8", "replace")
        if isinstance(password, bytes):
            password = password.decode("utf-8", "replace")
        if isinstance(login, str) and isinstance(password, str):
            return login, password
    return None, None
