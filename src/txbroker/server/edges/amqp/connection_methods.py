"""The methods of AMQP's connection class on channel 0: the handshake's steps and
connection.close (docs/amqp.md).

Theory of operation
-------------------
The connection (``connection.py``) hands every method of channel 0 to
:func:`connection_method`, which looks the (phase, method) pair up in the handshake
table (``TRANSITIONS`` in ``handshake.py``) and runs the step: connection.start
once the protocol header came (:func:`start`), the login of start-ok, the limits of
tune-ok, the vhost of open, and the two sides of connection.close. A method the
table does not allow in this phase is a connection error (503/504, 540 for a
connection method we do not run once open). What needs a socket or a clock
(writing, the timers, shutting the transport) stays with the connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pamqp import commands

from txbroker._version import __version__
from txbroker.errors import BrokerError
from txbroker.protocol.amqp import FRAME_MIN_SIZE, AmqpProtocolError, ReplyCode
from txbroker.server.edges.amqp.handshake import MECHANISMS, TRANSITIONS, Phase, credentials

if TYPE_CHECKING:
    from txbroker.server.edges.amqp.connection import AmqpServerConnection

__all__ = ["connection_method", "start"]


def start(conn: AmqpServerConnection) -> None:
    """The protocol header came: connection.start (or the refusal of the admission)."""
    if conn.refusal is not None:
        error = conn.refusal
        code = ReplyCode.NOT_ALLOWED if error.code.name == "TOO_MANY_CONNECTIONS" \
            else ReplyCode.ACCESS_REFUSED
        conn.close_connection(code, f"{code.name} - {error.message}")
        return
    conn.phase = Phase.AWAIT_START_OK
    conn.write(conn.codec.send_method(0, commands.Connection.Start(
        server_properties={
            "product": "txbroker", "version": __version__,
            "platform": "Python", "information": "docs/amqp.md",
            "capabilities": {
                "publisher_confirms": True, "basic.nack": True,
                "consumer_cancel_notify": True, "exchange_exchange_bindings": False,
                "connection.blocked": True, "authentication_failure_close": True,
                "per_consumer_qos": True, "direct_reply_to": False,
            },
        },
        mechanisms=" ".join(MECHANISMS), locales="en_US")))


def connection_method(conn: AmqpServerConnection, method: Any) -> None:
    """Run a method of channel 0 as the handshake table allows it in this phase."""
    name = method.name
    if conn.phase is Phase.CLOSING and name not in ("Connection.CloseOk",
                                                    "Connection.Close"):
        return  # spec 2.3.5: after close, the peer's frames are dropped
    following = TRANSITIONS.get((conn.phase, name))
    if following is None:
        code = ReplyCode.COMMAND_INVALID if conn.phase is Phase.OPEN \
            else ReplyCode.UNEXPECTED_FRAME
        if name.startswith("Connection.") and conn.phase is Phase.OPEN:
            code = ReplyCode.NOT_IMPLEMENTED
        raise AmqpProtocolError(code, f"{name} is not expected now "
                                f"({conn.phase.value})", class_id=method.index >> 16,
                                method_id=method.index & 0xFFFF)
    if name == "Connection.StartOk":
        _start_ok(conn, method)
        if conn.phase is Phase.CLOSING:
            return
    elif name == "Connection.TuneOk":
        _tune_ok(conn, method)
    elif name == "Connection.Open":
        if method.virtual_host not in ("/", ""):
            conn.phase = following
            conn.close_connection(ReplyCode.NOT_ALLOWED,
                                  f"NOT_ALLOWED - vhost {method.virtual_host} not found",
                                  method.index >> 16, method.index & 0xFFFF)
            return
        conn.write(conn.codec.send_method(0, commands.Connection.OpenOk()))
        conn.cancel_timer()
        conn.arm_heartbeat()
    elif name == "Connection.Close":
        conn.write(conn.codec.send_method(0, commands.Connection.CloseOk()))
        conn.phase = following
        conn.shut()
        return
    elif name == "Connection.CloseOk":
        conn.phase = following
        conn.shut()
        return
    conn.phase = following


def _start_ok(conn: AmqpServerConnection, method: Any) -> None:
    assert conn.session is not None
    capabilities = (method.client_properties or {}).get("capabilities")
    conn.blocked_capable = isinstance(capabilities, dict) and \
        capabilities.get("connection.blocked") is True
    mechanism = method.mechanism
    user, password = credentials(mechanism, method.response)
    if mechanism not in MECHANISMS or user is None:
        conn.close_connection(ReplyCode.ACCESS_REFUSED,
                              f"ACCESS_REFUSED - unsupported authentication mechanism "
                              f"or malformed response ({mechanism!r})")
        return
    try:
        conn.session.authenticate(user, password)
    except BrokerError:
        conn.close_connection(ReplyCode.ACCESS_REFUSED,
                              f"ACCESS_REFUSED - Login was refused using authentication "
                              f"mechanism {mechanism}. For details see the broker "
                              "logfile.")
        return
    settings = conn.settings
    conn.write(conn.codec.send_method(0, commands.Connection.Tune(
        settings.channel_max, settings.frame_max, settings.heartbeat_s)))


def _tune_ok(conn: AmqpServerConnection, method: Any) -> None:
    settings = conn.settings
    frame_max = int(method.frame_max)
    if frame_max and not FRAME_MIN_SIZE <= frame_max <= settings.frame_max:
        raise AmqpProtocolError(ReplyCode.NOT_ALLOWED,
                                f"frame_max {frame_max} is outside {FRAME_MIN_SIZE}.."
                                f"{settings.frame_max}")
    conn.codec.set_frame_max(frame_max)
    channel_max = int(method.channel_max)
    if channel_max > settings.channel_max:
        raise AmqpProtocolError(ReplyCode.NOT_ALLOWED,
                                f"channel_max {channel_max} is above "
                                f"{settings.channel_max}")
    conn.channel_max = channel_max or settings.channel_max
    conn.heartbeat_s = int(method.heartbeat)
