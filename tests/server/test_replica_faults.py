"""The named fault points of a replicated backup (``server/ha/faults.py``): what a spec
arms, that a ``vote_fail`` point fires once, and that an unknown spec is refused (the
process tests arm them with ``serve --replica-fault``)."""

from __future__ import annotations

import pytest

from txbroker.core.records import Kind
from txbroker.server.ha.faults import LOCAL_COMMIT, ReplicaFaults


def test_vote_fail_of_a_kind_fires_once_on_that_kind_only() -> None:
    faults = ReplicaFaults()
    faults.arm("vote_fail:11")
    assert faults.vote_fail == 11 and not faults.freeze_after_local_commit
    assert not faults.votes_fail(int(Kind.TX), b"")
    assert faults.votes_fail(11, b"")
    assert not faults.votes_fail(11, b"")  # once per process
    faults.arm("vote_fail:11")  # armed again: fires again
    assert faults.votes_fail(11, b"")


def test_vote_fail_local_commit_takes_a_tx_entry() -> None:
    faults = ReplicaFaults()
    faults.arm("vote_fail:local_commit")
    assert faults.vote_fail == LOCAL_COMMIT
    assert faults.votes_fail(int(Kind.TX), b"")


def test_freeze_after_local_commit_and_disarm() -> None:
    faults = ReplicaFaults()
    faults.arm("freeze_after:local_commit")
    assert faults.freeze_after_local_commit and faults.vote_fail is None
    assert not faults.votes_fail(int(Kind.TX), b"")
    faults.disarm()
    assert not faults.freeze_after_local_commit


@pytest.mark.parametrize("spec", ["", "vote_fail", "vote_fail:", "vote_fail:x",
                                  "freeze_after:11", "crash:local_commit"])
def test_an_unknown_point_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown replica fault point"):
        ReplicaFaults().arm(spec)
