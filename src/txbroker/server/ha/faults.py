"""Named fault points of a replicated backup, for tests (house rule: crash points are
steps tests can break on purpose, as ``tm/manager.py``'s ``hook(step)``).

Theory of operation
-------------------
:data:`FAULTS` is the process's registry. A test in the process arms it
(``FAULTS.arm("vote_fail:11")``, ``FAULTS.disarm()``); a test that starts a broker
process passes ``txbroker serve --replica-fault SPEC``, read once at start. Unarmed
(always, outside tests) no point does anything. The points:

==============================  ========================================================
``vote_fail:KIND``              the backup votes fail on the first streamed entry of
                                record kind ``KIND`` (``core/records/``), as a backup
                                whose disk refused it would
``vote_fail:local_commit``      ... on the first streamed entry that commits a local
                                transaction or a one-phase XA commit (a ``TX``, or the
                                ``XA_PREPARE`` of an internal branch: a voted commit,
                                ``core/local_tx.py``)
``freeze_after:local_commit``   the backup writes and acknowledges the first such entry,
                                then neither writes nor acknowledges any streamed entry
                                after it (a copy holding a voted commit without its
                                outcome, when promoted)
==============================  ========================================================

A ``vote_fail`` point fires once per process: a backup that joins again after its
failed vote is sound.
"""

from __future__ import annotations

from typing import Final

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.xid import Xid, is_local_tx_xid

__all__ = ["FAULTS", "LOCAL_COMMIT", "ReplicaFaults", "is_local_commit"]

#: The entry a ``:local_commit`` point names.
LOCAL_COMMIT: Final = "local_commit"
#: The points' names (before the colon).
VOTE_FAIL: Final = "vote_fail"
FREEZE_AFTER: Final = "freeze_after"


def is_local_commit(kind: int, meta: bytes) -> bool:
    """Does this entry commit a local transaction (a ``TX``, or a voted commit's
    ``XA_PREPARE`` of an internal branch)?"""
    if kind == Kind.TX:
        return True
    return kind == Kind.XA_PREPARE and is_local_tx_xid(
        Xid.parse(records.XaPrepare.decode(meta).xid))


class ReplicaFaults:
    """The armed fault points of this process (see the module docstring)."""

    def __init__(self) -> None:
        #: the entry a ``vote_fail`` point names: a record kind, LOCAL_COMMIT, or None
        self.vote_fail: int | str | None = None
        #: ``freeze_after:local_commit`` is armed
        self.freeze_after_local_commit = False
        self._fired = False

    def arm(self, spec: str) -> None:
        """Arm the point ``spec`` names (ValueError for an unknown one)."""
        point, _, argument = spec.partition(":")
        if point == VOTE_FAIL and argument == LOCAL_COMMIT:
            self.vote_fail = LOCAL_COMMIT
        elif point == VOTE_FAIL and argument.isdigit():
            self.vote_fail = int(argument)
        elif point == FREEZE_AFTER and argument == LOCAL_COMMIT:
            self.freeze_after_local_commit = True
        else:
            raise ValueError(f"unknown replica fault point {spec!r} (known: vote_fail:KIND, "
                             "vote_fail:local_commit, freeze_after:local_commit)")
        self._fired = False

    def disarm(self) -> None:
        """No point armed."""
        self.vote_fail = None
        self.freeze_after_local_commit = False
        self._fired = False

    def votes_fail(self, kind: int, meta: bytes) -> bool:
        """Pass ``vote_fail`` with a streamed entry: True (once) when it is the named one."""
        fault = self.vote_fail
        if fault is None or self._fired:
            return False
        hit = is_local_commit(kind, meta) if fault == LOCAL_COMMIT else kind == fault
        if hit:
            self._fired = True
        return hit


#: The process's fault points (armed by tests, or by ``serve --replica-fault``).
FAULTS: Final = ReplicaFaults()
