"""Recovery of the transaction manager after a crash.

Theory of operation
-------------------
Read the decision log (its open COMMIT decisions), ask every resource for the
branches it holds prepared with our format id, commit those whose global id
was decided, roll back the rest (presumed abort: no decision means abort),
then forget every decision whose branches are all resolved.

**Transactions in flight.** A branch prepared by a transaction that has not
decided yet looks exactly like an orphan; rolled back under it, the transaction
would then commit its other branches (and a "not found" commit of this one counts
as done): the broker and the database would disagree (the ``xa-live``
simulation's ``recovery-in-flight`` plant). So recovery skips the global ids the
manager has in flight — :meth:`TransactionManager.recover` and
:meth:`AsyncTransactionManager.recover` pass them (``in_flight``) — reports those
branches as such, and keeps their decisions; a process that runs recovery while
its own transactions run must recover through its manager. Anything that
cannot be resolved — a resource that does not answer, a resolve that fails,
a heuristic outcome — is reported, never hidden; run recovery again later.

What happens to each branch found is one table, :data:`RESOLUTIONS`
(decided?, how the resolve went) -> (report, keep the decision); the
coordinator's own rules are :data:`txbroker.tm.engine.RULES`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from txbroker.errors import XA_HEURCOM, XA_HEURRB, XAER_NOTA, XAError
from txbroker.tm.log import DecisionLog
from txbroker.tm.participants import Resource
from txbroker.xid import Xid

log = logging.getLogger("txbroker.tm")


class Resolved(enum.Enum):
    """How a resource answered recovery's commit or rollback of one in-doubt branch."""

    OK = "ok"  #: done
    GONE = "gone"  #: XAER_NOTA: already complete (e.g. finished by the coordinator)
    HEURISTIC = "heuristic"  #: XA_HEURCOM / XA_HEURRB: the resource decided on its own
    FAILED = "failed"  #: any other error: still in doubt


class Outcome(enum.Enum):
    """Where recovery reports one branch."""

    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    HEURISTIC = "heuristic"
    UNRESOLVED = "unresolved"
    NOT_REPORTED = "not reported"


#: Recovery, per branch found prepared: (decided?, how the resolve went) -> (where it
#: is reported, whether its decision must stay in the log).
RESOLUTIONS: dict[tuple[bool, Resolved], tuple[Outcome, bool]] = {
    # A decision exists: the branch was committed.
    (True, Resolved.OK): (Outcome.COMMITTED, False),
    # No decision (presumed abort): the branch was rolled back.
    (False, Resolved.OK): (Outcome.ROLLED_BACK, False),
    # Already complete: nothing to report, nothing to keep.
    (True, Resolved.GONE): (Outcome.NOT_REPORTED, False),
    (False, Resolved.GONE): (Outcome.NOT_REPORTED, False),
    # A heuristic outcome is reported, never hidden; the resource keeps it (forget is
    # an operator's act), so the decision need not stay.
    (True, Resolved.HEURISTIC): (Outcome.HEURISTIC, False),
    (False, Resolved.HEURISTIC): (Outcome.HEURISTIC, False),
    # Any other failure: still in doubt; keep the decision for the next run.
    (True, Resolved.FAILED): (Outcome.UNRESOLVED, True),
    (False, Resolved.FAILED): (Outcome.UNRESOLVED, True),
}


def resolved(error: Exception | None) -> Resolved:
    """Classify the error (or None) of a resource's commit or rollback of one branch."""
    if error is None:
        return Resolved.OK
    if isinstance(error, XAError):
        if error.errcode in (XA_HEURCOM, XA_HEURRB):
            return Resolved.HEURISTIC
        if error.errcode == XAER_NOTA:
            return Resolved.GONE
    return Resolved.FAILED


def global_id(gtrid_text: bytes) -> bytes | None:
    """The global id of one of our branches (its gtrid is the id as hex text), or None
    when the branch is not one of ours."""
    try:
        return bytes.fromhex(gtrid_text.decode())
    except ValueError:
        return None


@dataclass
class RecoveryReport:
    """What :func:`recover` did."""

    committed: list[tuple[str, Xid]] = field(default_factory=list)
    rolled_back: list[tuple[str, Xid]] = field(default_factory=list)
    heuristic: list[tuple[str, Xid, str]] = field(default_factory=list)
    unresolved: list[tuple[str, str]] = field(default_factory=list)  #: (resource, reason)
    #: branches of transactions in flight in this manager: left to them
    in_flight: list[tuple[str, Xid]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Nothing left in doubt and no heuristic outcome."""
        return not self.heuristic and not self.unresolved


class Tally:
    """Recovery's bookkeeping, shared by :func:`recover` and the asyncio form
    (:func:`txbroker.tm.aio_recovery.recover_async`): which global ids are decided,
    where each branch found is reported (:data:`RESOLUTIONS`), and which decisions may
    be forgotten at the end."""

    def __init__(self, decisions: DecisionLog, in_flight: Collection[bytes] = ()) -> None:
        self.report = RecoveryReport()
        self.decisions = decisions
        #: the decisions open when recovery began: those it may forget at the end
        self.decided = set(decisions.open_decisions)
        #: global ids of the manager's transactions in flight, a live view (a recovery
        #: waits on its resources; a transaction may begin or end meanwhile): checked
        #: when each branch is resolved, and again at the end
        self.in_flight = in_flight
        self.blocked: set[bytes] = set(in_flight)
        self.all_answered = True

    def recover_failed(self, resource: str, exc: Exception) -> None:
        """A resource did not list its branches: no decision is forgotten this time."""
        self.all_answered = False
        self.report.unresolved.append((resource, f"recover failed: {exc}"))

    def commit_of(self, resource: str, xid: Xid) -> bool | None:
        """Whether branch ``xid`` is to be committed; None (reported) when it is not
        one of ours."""
        gtrid = global_id(xid.gtrid)
        if gtrid is None:
            self.report.unresolved.append((resource, f"{xid}: not one of ours"))
            return None
        if gtrid in self.in_flight:
            self.report.in_flight.append((resource, xid))
            self.blocked.add(gtrid)
            return None
        # the log as it is now: a transaction that decided and left this branch to
        # recovery since recovery began is decided
        return gtrid in self.decided or gtrid in self.decisions.open_decisions

    def resolved(self, resource: str, xid: Xid, commit: bool,
                 error: Exception | None) -> None:
        """Report how the resolve of ``xid`` went (``error``: None when it went well)."""
        outcome, keep = RESOLUTIONS[commit, resolved(error)]
        if keep:
            gtrid = global_id(xid.gtrid)
            assert gtrid is not None
            self.blocked.add(gtrid)
        if outcome is Outcome.COMMITTED:
            self.report.committed.append((resource, xid))
        elif outcome is Outcome.ROLLED_BACK:
            self.report.rolled_back.append((resource, xid))
        elif outcome is Outcome.HEURISTIC:
            assert isinstance(error, XAError)
            self.report.heuristic.append((resource, xid, error.message))
        elif outcome is Outcome.UNRESOLVED:
            self.report.unresolved.append((resource, f"{xid}: {error}"))
        if outcome in (Outcome.COMMITTED, Outcome.ROLLED_BACK):
            log.info("recovery: %s %s on %s", outcome.value.replace("_", " "), xid,
                     resource)

    def finish(self, decisions: DecisionLog) -> RecoveryReport:
        """Forget the decisions whose branches are all resolved (only when every
        resource answered); the report."""
        if self.all_answered:
            for gtrid in self.decided - self.blocked - set(self.in_flight):
                decisions.forget(gtrid)
            decisions.flush()
        return self.report


def recover(decisions: DecisionLog, resources: Sequence[Resource],
            in_flight: Collection[bytes] = ()) -> RecoveryReport:
    """Resolve every in-doubt branch of ``resources`` from the decision log, except
    those of the global ids ``in_flight`` (transactions of this log still running:
    module docstring; :meth:`TransactionManager.recover` passes its own)."""
    tally = Tally(decisions, in_flight)
    for resource in resources:
        try:
            found = resource.recover()
        except Exception as exc:
            tally.recover_failed(resource.name, exc)
            continue
        for xid in found:
            commit = tally.commit_of(resource.name, xid)
            if commit is None:
                continue
            error: Exception | None = None
            try:
                resource.resolve(xid, commit)
            except Exception as exc:
                error = exc
            tally.resolved(resource.name, xid, commit, error)
    return tally.finish(decisions)
