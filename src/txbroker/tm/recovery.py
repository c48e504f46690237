"""Recovery of the transaction manager after a crash.

Theory of operation
-------------------
Read the decision log (its open COMMIT decisions), ask every resource for the
branches it holds prepared with our format id, commit those whose global id
was decided, roll back the rest (presumed abort: no decision means abort),
then forget every decision whose branches are all resolved. Anything that
cannot be resolved — a resource that does not answer, a resolve that fails,
a heuristic outcome — is reported, never hidden; run recovery again later.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from txbroker.errors import XA_HEURCOM, XA_HEURRB, XAER_NOTA, XAError
from txbroker.tm.log import DecisionLog
from txbroker.tm.participants import Resource
from txbroker.xid import Xid

log = logging.getLogger("txbroker.tm")


@dataclass
class RecoveryReport:
    """What :func:`recover` did."""

    committed: list[tuple[str, Xid]] = field(default_factory=list)
    rolled_back: list[tuple[str, Xid]] = field(default_factory=list)
    heuristic: list[tuple[str, Xid, str]] = field(default_factory=list)
    unresolved: list[tuple[str, str]] = field(default_factory=list)  #: (resource, reason)

    @property
    def clean(self) -> bool:
        """Nothing left in doubt and no heuristic outcome."""
        return not self.heuristic and not self.unresolved


def recover(decisions: DecisionLog, resources: Sequence[Resource]) -> RecoveryReport:
    """Resolve every in-doubt branch of ``resources`` from the decision log."""
    report = RecoveryReport()
    decided = set(decisions.open_decisions)
    blocked: set[bytes] = set()
    all_answered = True
    for resource in resources:
        try:
            found = resource.recover()
        except Exception as exc:
            all_answered = False
            report.unresolved.append((resource.name, f"recover failed: {exc}"))
            continue
        for xid in found:
            try:
                gtrid = bytes.fromhex(xid.gtrid.decode())
            except ValueError:
                report.unresolved.append((resource.name, f"{xid}: not one of ours"))
                continue
            commit = gtrid in decided
            try:
                resource.resolve(xid, commit)
            except XAError as exc:
                if exc.errcode in (XA_HEURCOM, XA_HEURRB):
                    report.heuristic.append((resource.name, xid, exc.message))
                elif exc.errcode != XAER_NOTA:
                    blocked.add(gtrid)
                    report.unresolved.append((resource.name, f"{xid}: {exc}"))
                continue
            except Exception as exc:
                blocked.add(gtrid)
                report.unresolved.append((resource.name, f"{xid}: {exc}"))
                continue
            (report.committed if commit else report.rolled_back).append((resource.name, xid))
            log.info("recovery: %s %s on %s", "committed" if commit else "rolled back", xid,
                     resource.name)
    if all_answered:
        for gtrid in decided - blocked:
            decisions.forget(gtrid)
        decisions.flush()
    return report
