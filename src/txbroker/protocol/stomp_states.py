"""The STOMP connection's states: which frames may travel when, with which headers.

One table, :data:`TRANSITIONS`, says which frame each side may receive in each
state and the state it leads to (a comment per rule); anything missing is a
protocol error, worded by :func:`order_message`. :data:`REQUIRED_HEADERS` lists the
headers each received command must carry, by negotiated version. The codec
(``protocol/stomp.py``, which re-exports these names) applies both to every frame
it receives.
"""

from __future__ import annotations

import enum
from typing import Final

from txbroker.protocol.stomp_encoding import SUPPORTED_VERSIONS

#: Frames a client sends (STOMP 1.2 "Client Frames"), ``CONNECT`` and ``STOMP`` included.
CLIENT_COMMANDS: Final = frozenset(
    ["CONNECT", "STOMP", "SEND", "SUBSCRIBE", "UNSUBSCRIBE", "ACK", "NACK", "BEGIN", "COMMIT",
     "ABORT", "DISCONNECT"]
)
#: Frames a server sends (STOMP 1.2 "Server Frames").
SERVER_COMMANDS: Final = frozenset(["CONNECTED", "MESSAGE", "RECEIPT", "ERROR"])


class Role(enum.Enum):
    """Which side of the connection this codec speaks for."""

    CLIENT = "client"
    SERVER = "server"


class ConnectionState(enum.Enum):
    """State of one connection, as the codec sees it (see :data:`TRANSITIONS`)."""

    #: Server: waiting for CONNECT/STOMP. Client: waiting for CONNECTED.
    CONNECTING = "connecting"
    #: The session is open: any frame of the peer's direction may travel.
    CONNECTED = "connected"
    #: Server: the client sent DISCONNECT and must send nothing more.
    DISCONNECTED = "disconnected"
    #: Client: the server sent ERROR; the connection is about to close.
    CLOSED = "closed"
    #: The peer broke the protocol; nothing more can be received.
    ERROR = "error"


_S = ConnectionState
#: (role, state, received command) -> next state. Anything missing is a
#: protocol error naming the command and the state.
TRANSITIONS: Final[dict[tuple[Role, ConnectionState, str], ConnectionState]] = {
    # Rule 1 (server): the first frame opens the session: CONNECT, or STOMP
    # (the 1.1+ spelling, so that the command cannot be mistaken for HTTP).
    (Role.SERVER, _S.CONNECTING, "CONNECT"): _S.CONNECTED,
    (Role.SERVER, _S.CONNECTING, "STOMP"): _S.CONNECTED,
    # Rule 2 (server): an open session takes every other client frame.
    **{(Role.SERVER, _S.CONNECTED, cmd): _S.CONNECTED
       for cmd in CLIENT_COMMANDS - {"CONNECT", "STOMP", "DISCONNECT"}},
    # Rule 3 (server): DISCONNECT is the client's last frame.
    (Role.SERVER, _S.CONNECTED, "DISCONNECT"): _S.DISCONNECTED,
    # Rule 4 (client): the server answers CONNECT with CONNECTED or ERROR.
    (Role.CLIENT, _S.CONNECTING, "CONNECTED"): _S.CONNECTED,
    (Role.CLIENT, _S.CONNECTING, "ERROR"): _S.CLOSED,
    # Rule 5 (client): an open session receives messages and receipts ...
    (Role.CLIENT, _S.CONNECTED, "MESSAGE"): _S.CONNECTED,
    (Role.CLIENT, _S.CONNECTED, "RECEIPT"): _S.CONNECTED,
    # Rule 6 (client): ... until an ERROR, after which the server closes.
    (Role.CLIENT, _S.CONNECTED, "ERROR"): _S.CLOSED,
}

#: Headers a received frame must carry, by (command, version). STOMP 1.0 did
#: not require ``id`` on SUBSCRIBE, and acknowledged by ``message-id``; 1.1 by
#: ``message-id`` + ``subscription``; 1.2 by the MESSAGE's ``ack`` value in ``id``.
#: CONNECT requires nothing: a missing ``accept-version`` means 1.0, and any
#: (or no) ``host`` is accepted.
REQUIRED_HEADERS: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    **{("SEND", v): ("destination",) for v in SUPPORTED_VERSIONS},
    ("SUBSCRIBE", "1.0"): ("destination",),
    ("SUBSCRIBE", "1.1"): ("destination", "id"),
    ("SUBSCRIBE", "1.2"): ("destination", "id"),
    ("UNSUBSCRIBE", "1.1"): ("id",),
    ("UNSUBSCRIBE", "1.2"): ("id",),
    ("ACK", "1.0"): ("message-id",),
    ("ACK", "1.1"): ("message-id", "subscription"),
    ("ACK", "1.2"): ("id",),
    ("NACK", "1.0"): ("message-id",),
    ("NACK", "1.1"): ("message-id", "subscription"),
    ("NACK", "1.2"): ("id",),
    **{(cmd, v): ("transaction",) for cmd in ("BEGIN", "COMMIT", "ABORT")
       for v in SUPPORTED_VERSIONS},
    **{("MESSAGE", v): ("destination", "message-id") for v in SUPPORTED_VERSIONS},
    **{("RECEIPT", v): ("receipt-id",) for v in SUPPORTED_VERSIONS},
}


def order_message(role: Role, state: ConnectionState, command: str) -> str:
    """The error message for ``command`` received out of order in ``state``."""
    if role is Role.SERVER:
        if state is ConnectionState.CONNECTING:
            return f"the first frame must be CONNECT or STOMP, not {command}"
        if command in ("CONNECT", "STOMP"):
            return f"{command} on a connection that is already connected"
        if state is ConnectionState.DISCONNECTED:
            return f"{command} after DISCONNECT: the client must send nothing more"
    elif state is ConnectionState.CONNECTING:
        return f"the first frame from a server must be CONNECTED or ERROR, not {command}"
    elif state is ConnectionState.CLOSED:
        return f"{command} after ERROR: the server must close the connection"
    return f"{command} is not allowed in state {state.value}"
