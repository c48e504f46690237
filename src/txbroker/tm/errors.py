"""The transaction manager's errors, and what a failed one-phase commit means.

::

    TxBrokerError
     └── TMError          a global transaction could not be carried out
          ├── RolledBack  a participant voted no: everything rolled back
          └── InDoubt     a one-phase commit was cut off: it may have committed
"""

from __future__ import annotations

from txbroker.errors import (
    XAER_RMERR,
    XAER_RMFAIL,
    ConnectionLost,
    TransactionRolledBack,
    TxBrokerError,
    XAError,
)

__all__ = ["InDoubt", "RolledBack", "TMError", "one_phase_failure"]


class TMError(TxBrokerError):
    """A global transaction could not be carried out."""


class RolledBack(TMError):
    """A participant voted no (or failed before the decision): everything rolled back."""


class InDoubt(TMError):
    """The only participant's one-phase commit lost its connection before the answer:
    it may have committed. Never reported as RolledBack, since redoing the work could
    apply it twice."""


def one_phase_failure(exc: BaseException) -> TMError:
    """What a failed one-phase commit means: RolledBack when the participant said it
    rolled back (an XA error, TransactionRolledBack, a refusal by the database);
    InDoubt when the connection or the resource manager failed while it committed
    (ConnectionLost, TimeoutError, OSError, XAER_RMFAIL/XAER_RMERR, or a psycopg error
    without an SQLSTATE: the connection)."""
    if isinstance(exc, XAError):  # the resource manager failed in the commit: unknown
        rolled_back = exc.errcode not in (XAER_RMFAIL, XAER_RMERR)
    elif isinstance(exc, TransactionRolledBack):
        rolled_back = True
    elif isinstance(exc, ConnectionLost | TimeoutError | OSError):
        rolled_back = False
    else:  # psycopg: an error from the server has an SQLSTATE; a broken connection not
        rolled_back = not (hasattr(exc, "sqlstate") and exc.sqlstate is None)
    if rolled_back:
        return RolledBack(f"one-phase commit failed: {exc}")
    return InDoubt(f"one-phase commit lost its connection, it may have committed: {exc}")
