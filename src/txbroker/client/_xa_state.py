"""What one connection knows of the XA branches it works on, across failovers.

Theory of operation
-------------------
The broker keeps an *unprepared* branch in memory only; a *prepared* one is in
the store. So a failover to another broker (a shared-store standby, or the
same broker restarted) loses the unprepared branches of this connection and
keeps the prepared ones. A plain break of the TCP connection loses nothing:
the broker keeps the associated branch for ``xa_reattach_ms`` and the client
resumes it (``start(TMRESUME)``, ``_failover.py``).

:class:`XaBranchState` remembers

* ``associated`` — the branch this connection is associated with (started,
  not yet ended): sends and acks outside a local transaction go into it;
* ``unprepared`` — every branch this connection started and has not yet
  prepared, committed or rolled back, with the session epoch it was last
  known alive in;
* ``lost`` — those a failover lost, and ``broken``: why the associated
  branch could not be resumed (None when it was, or there is none).

The rules, one per situation (seed 004: "an XA transaction is active from
start"; an active branch is rolled back by a failover):

===========================================  ===========================================
situation                                    the client
===========================================  ===========================================
failover, associated branch resumed          carries on in it (same broker, TCP break)
failover, associated branch not resumed      ``lost``; ``broken`` set: sends and acks of
                                             the connection raise it (their work would
                                             leave the branch) until ``end``/``rollback``
``end``/``prepare``/``commit`` of a lost     XAError ``XA_RBCOMMFAIL`` without a round
branch                                       trip (``end`` also clears ``broken``)
``rollback`` of a lost branch                done: the failover rolled it back
the broker answers ``XAER_NOTA`` for an      the branch was lost with the broker: the
unprepared branch of an older epoch          same as a lost branch (above)
``prepare`` succeeded; commit; rollback      no longer ``unprepared`` (a prepared branch
                                             is in the store and survives)
===========================================  ===========================================
"""

from __future__ import annotations

from typing import Final

from txbroker.errors import XA_RBCOMMFAIL, XAER_NOTA, XAError

__all__ = ["LOST_IN_FAILOVER", "XaBranchState"]

#: The message of a branch lost in a failover.
LOST_IN_FAILOVER: Final = "branch {xid} was rolled back: it was not prepared when the " \
                          "connection failed over ({reason})"


class XaBranchState:
    """The XA branches of one connection (see the module docstring)."""

    __slots__ = ("associated", "broken", "lost", "unprepared")

    def __init__(self) -> None:
        #: the branch (Xid text) this connection is associated with, resumed after a failover
        self.associated: str | None = None
        #: why the associated branch could not be resumed after a failover (None: it was)
        self.broken: str | None = None
        #: Xid text -> the session epoch it was last known alive in
        self.unprepared: dict[str, int] = {}
        #: Xid text -> why it is lost
        self.lost: dict[str, str] = {}

    # ----------------------------------------------------------- what the client did
    def starting(self, xid: str, epoch: int | None) -> None:
        """``start`` is being sent (on the session of ``epoch``, None: not known yet)."""
        self.associated = xid
        self.lost.pop(xid, None)
        if epoch is not None:
            self.unprepared[xid] = epoch

    def started(self, xid: str, epoch: int) -> None:
        """The broker of the session of ``epoch`` accepted ``start``."""
        self.unprepared[xid] = epoch

    def start_failed(self, xid: str) -> None:
        """``start`` was refused: no association."""
        if self.associated == xid:
            self.associated = None

    def ended(self, xid: str) -> None:
        """``end`` was sent: the association is over."""
        if self.associated == xid:
            self.associated = None
            self.broken = None

    def prepared(self, xid: str) -> None:
        """``prepare`` succeeded: the branch is in the store."""
        self.unprepared.pop(xid, None)

    def completed(self, xid: str) -> None:
        """``commit`` or ``rollback`` was sent: nothing to remember of it."""
        self.unprepared.pop(xid, None)
        self.lost.pop(xid, None)
        self.ended(xid)

    # ----------------------------------------------------------- failover
    def resumed(self, epoch: int) -> None:
        """The associated branch was resumed on the session of ``epoch``."""
        if self.associated is not None:
            self.unprepared[self.associated] = epoch

    def resume_failed(self, reason: str) -> None:
        """The associated branch could not be resumed: it is lost."""
        xid = self.associated
        if xid is None:
            return
        self.lost[xid] = reason
        self.broken = reason

    def check_work(self) -> None:
        """Before a send or an ack outside a local transaction: raise the rollback error
        of the associated branch if a failover lost it (the work would not be in it)."""
        if self.broken is not None and self.associated is not None:
            raise XAError(XA_RBCOMMFAIL, LOST_IN_FAILOVER.format(xid=self.associated,
                                                                 reason=self.broken)
                          + "; end or roll it back")

    # ----------------------------------------------------------- checks
    def check_lost(self, op: str, xid: str) -> bool:
        """Before ``op`` on ``xid``: raise the rollback error of a lost branch; True when
        the request need not be sent (``rollback`` of a lost branch: done)."""
        reason = self.lost.get(xid)
        if reason is None:
            return False
        if op == "xa_rollback":
            self.completed(xid)
            return True
        if op == "xa_end":
            self.ended(xid)
        elif op == "xa_commit":
            self.completed(xid)
        raise XAError(XA_RBCOMMFAIL, LOST_IN_FAILOVER.format(xid=xid, reason=reason))

    def translate(self, op: str, xid: str, error: XAError, epoch: int | None) -> bool:
        """The broker refused ``op`` on ``xid`` with ``error``: if that is an unknown
        branch this connection worked on before a failover (``XAER_NOTA``), it was
        lost with the old broker: raise its rollback error; True when ``op`` is done
        after all (a ``rollback``). False: ``error`` stands."""
        known = self.unprepared.get(xid)
        if error.errcode != XAER_NOTA or known is None or known == epoch:
            return False
        self.lost[xid] = f"the broker no longer knows it: {error.message}"
        return self.check_lost(op, xid)
