"""The one exception tree of txbroker and the stable wire error codes.

::

    TxBrokerError                 root of everything txbroker raises
    ├── ProtocolError             a peer broke the wire protocol (bad frame, unknown op)
    │   └── FrameTooLarge         a frame above the negotiated / configured limit
    ├── BrokerError               the broker refused a request; carries an ErrorCode
    │   ├── NotFound              unknown queue, subscription, consumer, message
    │   ├── AlreadyExists         queue or subscription already declared with other settings
    │   ├── QuotaExceeded         max messages / max bytes of a queue reached
    │   ├── Disabled              ingress or egress of a queue is switched off
    │   ├── MessageTooLarge       body above the broker's max message size
    │   ├── TooManyConnections    max connections reached
    │   ├── AuthenticationFailed  wrong user or password
    │   ├── Forbidden             the user's permissions (ACL) do not allow the request
    │   ├── TransactionError      wrong transaction use (no transaction, unknown id)
    │   │   └── TransactionRolledBack  the transaction could not commit and was rolled back
    │   ├── IllegalState          e.g. acking a message that is no longer in flight
    │   ├── XAError               an XA request failed; ``errcode`` is the XA code (XAER_*, XA_RB*)
    │   ├── StorageFailed         the store failed (fsync error); the broker stopped writing
    │   ├── ShuttingDown          the broker is stopping
    │   └── Standby               the broker is an HA standby: try the next address
    ├── StoreError                local store problems (not sent on the wire as such)
    │   ├── CorruptStore          checksum / format failure in the middle of the log
    │   └── StoreLocked           another process holds the data directory
    ├── ConnectionLost            the client lost its connection and could not fail over
    │   └── TransactionInDoubt    the connection broke while a commit was on its way
    ├── ReplicaVoteFailed         a ready backup could not write an entry (--ha replicated)
    └── EtcdError                 etcd refused a request (server/ha/etcd.py)
        └── EtcdUnavailable       no etcd endpoint answered (refused, timeout, 5xx)

Wire errors carry a stable :class:`ErrorCode`; :func:`error_for_code` maps a
code received from the broker back to the exception class, so clients raise
the same types the broker raised.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Stable error codes sent in ``err`` replies of the native protocol."""

    INTERNAL = 1
    PROTOCOL = 2
    FRAME_TOO_LARGE = 3
    UNKNOWN_OP = 4
    BAD_REQUEST = 5
    NOT_FOUND = 10
    ALREADY_EXISTS = 11
    QUOTA_EXCEEDED = 12
    DISABLED = 13
    MESSAGE_TOO_LARGE = 14
    TOO_MANY_CONNECTIONS = 15
    AUTHENTICATION_FAILED = 16
    NOT_AUTHENTICATED = 17
    FORBIDDEN = 18  #: the user's permissions ([acl], docs/security.md) do not allow it
    TRANSACTION = 20
    TRANSACTION_ROLLED_BACK = 21
    ILLEGAL_STATE = 22
    TOO_MANY_UNACKED = 23
    STORAGE_FAILED = 30
    SHUTTING_DOWN = 31
    STANDBY = 32  #: this broker is a standby (or backup) of an HA pair: it serves no clients
    XA = 40  #: an XA error; the wire code is ``XA_WIRE_BASE + errcode`` (see XAError)


class TxBrokerError(Exception):
    """Root of every exception txbroker raises."""


class ProtocolError(TxBrokerError):
    """The peer sent bytes that break the protocol."""

    code = ErrorCode.PROTOCOL


class FrameTooLarge(ProtocolError):
    """A frame's declared length is above the limit."""

    code = ErrorCode.FRAME_TOO_LARGE


class BrokerError(TxBrokerError):
    """The broker refused a request. ``code`` is the stable wire code."""

    code: ErrorCode = ErrorCode.INTERNAL
    retriable = False

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        """The error's text, without its code."""
        return str(self.args[0]) if self.args else ""

    @property
    def wire_code(self) -> int:
        """The integer sent in an ``err`` reply (XAError adds its XA code)."""
        return int(self.code)


class BadRequest(BrokerError):
    """A request with a missing, malformed or out-of-range argument."""

    code = ErrorCode.BAD_REQUEST


class NotFound(BrokerError):
    """The named queue, topic, subscription or transaction does not exist."""

    code = ErrorCode.NOT_FOUND


class AlreadyExists(BrokerError):
    """A declare names something that exists with other settings or kind."""

    code = ErrorCode.ALREADY_EXISTS


class QuotaExceeded(BrokerError):
    """The queue is full (``max_messages`` / ``max_bytes``); retry later."""

    code = ErrorCode.QUOTA_EXCEEDED
    retriable = True


class Disabled(BrokerError):
    """The queue does not accept messages (ingress off)."""

    code = ErrorCode.DISABLED


class MessageTooLarge(BrokerError):
    """A body above ``max_message_size``."""

    code = ErrorCode.MESSAGE_TOO_LARGE


class TooManyConnections(BrokerError):
    """The broker is at ``max_connections``; retry later."""

    code = ErrorCode.TOO_MANY_CONNECTIONS
    retriable = True


class AuthenticationFailed(BrokerError):
    """Wrong user or password."""

    code = ErrorCode.AUTHENTICATION_FAILED


class NotAuthenticated(BrokerError):
    """A request before a successful ``hello`` on a broker with users."""

    code = ErrorCode.NOT_AUTHENTICATED


class Forbidden(BrokerError):
    """The user may not do this on that destination (``[acl]``, docs/security.md);
    nothing was changed. Not retriable: the permissions are read at start."""

    code = ErrorCode.FORBIDDEN


class TransactionError(BrokerError):
    """A transaction request that its state does not allow."""

    code = ErrorCode.TRANSACTION


class TransactionRolledBack(TransactionError):
    """The transaction was rolled back (store failure, failover, its session ended)."""

    code = ErrorCode.TRANSACTION_ROLLED_BACK


class IllegalState(BrokerError):
    """A request the connection's state does not allow (e.g. ack of a delivery it does not hold)."""

    code = ErrorCode.ILLEGAL_STATE


class TooManyUnacked(BrokerError):
    """A prefetch above ``max_unacked_per_consumer``."""

    code = ErrorCode.TOO_MANY_UNACKED
    retriable = True


class StorageFailed(BrokerError):
    """The store failed: the broker takes no more writes."""

    code = ErrorCode.STORAGE_FAILED


class ShuttingDown(BrokerError):
    """The broker is stopping; retry on another broker or later."""

    code = ErrorCode.SHUTTING_DOWN
    retriable = True


class Standby(BrokerError):
    """The broker is the standby of an HA pair (docs/ha.md): it serves no clients
    until it takes over; a client moves on to the next address of its list."""

    code = ErrorCode.STANDBY
    retriable = True


# --------------------------------------------------------------------- XA codes
# The X/Open XA return codes (xa.h; javax.transaction.xa.XAException uses the same numbers).
XA_RBBASE = 100
XA_RBROLLBACK = 100  #: rolled back, no reason given
XA_RBCOMMFAIL = 101  #: rolled back: a communication failure
XA_RBDEADLOCK = 102  #: rolled back: a deadlock
XA_RBINTEGRITY = 103  #: rolled back: an integrity violation (an endpoint refused the work)
XA_RBOTHER = 104  #: rolled back for another reason (e.g. too many messages)
XA_RBPROTO = 105  #: rolled back: a protocol error in the resource manager
XA_RBTIMEOUT = 106  #: rolled back: the branch took too long
XA_RBTRANSIENT = 107  #: rolled back: may be retried
XA_RBEND = 107
XA_NOMIGRATE = 9
XA_HEURHAZ = 8  #: the branch may have been heuristically completed
XA_HEURCOM = 7  #: the branch was heuristically committed
XA_HEURRB = 6  #: the branch was heuristically rolled back
XA_HEURMIX = 5  #: partly committed, partly rolled back
XA_RETRY = 4  #: the resource manager cannot do it now: retry
XA_RDONLY = 3  #: the branch was read-only (did no work) and is gone after prepare
XA_OK = 0
XAER_ASYNC = -2  #: an asynchronous operation is outstanding
XAER_RMERR = -3  #: a resource manager error in the branch
XAER_NOTA = -4  #: the Xid is not a known branch
XAER_INVAL = -5  #: invalid arguments
XAER_PROTO = -6  #: the request is not allowed in the branch's state
XAER_RMFAIL = -7  #: the resource manager is unavailable
XAER_DUPID = -8  #: the Xid already exists
XAER_OUTSIDE = -9  #: the resource manager is doing work outside the global transaction

#: Names of the XA codes, for messages and the CLI.
XA_CODE_NAMES: dict[int, str] = {
    value: name
    for name, value in list(globals().items())
    if (name.startswith("XA_") or name.startswith("XAER_")) and isinstance(value, int)
    and name not in ("XA_RBBASE", "XA_RBEND")
}
#: An XA error travels as ``XA_WIRE_BASE + errcode`` (codes -9..107 -> 1991..2107).
XA_WIRE_BASE = 2000


class XAError(BrokerError):
    """An XA request failed. ``errcode`` is the XA code (XAER_*, XA_RB*, XA_HEUR*), the
    same number as ``javax.transaction.xa.XAException.errorCode``."""

    code = ErrorCode.XA

    def __init__(self, errcode: int, message: str = "") -> None:
        name = XA_CODE_NAMES.get(errcode, str(errcode))
        super().__init__(f"{name}: {message}" if message else name)
        self.errcode = errcode

    @property
    def rolled_back(self) -> bool:
        """True for the XA_RB* codes: the branch was rolled back."""
        return XA_RBBASE <= self.errcode <= XA_RBEND

    @property
    def wire_code(self) -> int:
        """``XA_WIRE_BASE`` plus the XA code, so a client can rebuild the XAError."""
        return XA_WIRE_BASE + self.errcode


class RemoteProtocolError(BrokerError):
    """The broker reported that our bytes broke the protocol."""

    code = ErrorCode.PROTOCOL


class StoreError(TxBrokerError):
    """A problem with the local store."""


class CorruptStore(StoreError):
    """A record failed its checksum or format check outside the torn tail."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        super().__init__(f"corrupt store: {path} at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class MalformedRecord(StoreError, ValueError):
    """A store entry's meta does not decode as its record kind (``core/records``): a
    field missing, extra or of the wrong type. A ``ValueError`` too, as every
    refused record was before the record classes existed."""


class StoreLocked(StoreError):
    """Another broker process holds the data directory."""


class ConnectionLost(TxBrokerError):
    """The connection broke and no broker of the failover list answered."""


class TransactionInDoubt(ConnectionLost):
    """The connection broke after a commit was sent and before its answer came: the
    transaction may have committed or not. Never "rolled back": resending its work
    could apply it twice (check the effect, or make the work idempotent)."""


class ReplicaVoteFailed(TxBrokerError):
    """A ready backup could not write a replicated entry (``--ha replicated``): an
    XA prepare it voted against fails (XA_RBROLLBACK). Never sent on the wire."""


class EtcdError(TxBrokerError):
    """etcd answered a request with an error (``server/ha/etcd.py``); ``grpc_code`` is
    etcd's gRPC status code (0 when unknown)."""

    def __init__(self, message: str, grpc_code: int = 0) -> None:
        super().__init__(message)
        self.grpc_code = grpc_code


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered: connection refused, timeout or a 5xx reply."""


_BY_CODE: dict[int, type[BrokerError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        NotFound,
        AlreadyExists,
        QuotaExceeded,
        Disabled,
        MessageTooLarge,
        TooManyConnections,
        AuthenticationFailed,
        NotAuthenticated,
        Forbidden,
        TransactionError,
        TransactionRolledBack,
        IllegalState,
        TooManyUnacked,
        StorageFailed,
        ShuttingDown,
        Standby,
        RemoteProtocolError,
    )
}


def error_for_code(code: int, message: str) -> BrokerError:
    """Build the exception matching a wire error code (unknown codes → BrokerError)."""
    if XA_WIRE_BASE - 100 <= code <= XA_WIRE_BASE + 200:
        errcode = code - XA_WIRE_BASE
        error = XAError(errcode)
        error.args = (message,)  # already "NAME: reason" as the broker wrote it
        return error
    cls = _BY_CODE.get(code)
    if cls is None:
        try:
            return BrokerError(message, ErrorCode(code))
        except ValueError:
            return BrokerError(message)
    return cls(message)
