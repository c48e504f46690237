"""The transaction manager's contract with fake participants (no I/O but the log)."""

from __future__ import annotations

from pathlib import Path

import pytest

from txbroker.tm import RolledBack, TransactionManager, recover
from txbroker.xid import Xid


class Fake:
    """A participant and resource that records calls; ``prepared`` is its in-doubt set."""

    def __init__(self, name: str, journal: list[str], *, no: bool = False,
                 read_only: bool = False, finish_fails: bool = False) -> None:
        self.sort_key = self.name = name
        self.journal = journal
        self.no, self.read_only, self.finish_fails = no, read_only, finish_fails
        self.prepared: set[Xid] = set()
        self.committed: list[Xid] = []

    def begin(self, xid: Xid) -> None:
        self.journal.append(f"begin {self.name}")

    def vote(self, xid: Xid) -> bool:
        self.journal.append(f"vote {self.name}")
        if self.no:
            raise RuntimeError("no")
        if not self.read_only:
            self.prepared.add(xid)
        return self.read_only

    def commit_one_phase(self, xid: Xid) -> None:
        self.journal.append(f"1pc {self.name}")
        self.committed.append(xid)

    def finish(self, xid: Xid, commit: bool) -> bool:
        self.journal.append(f"{'commit' if commit else 'rollback'} {self.name}")
        if self.finish_fails:
            return False  # left in doubt (finish must not raise)
        self.prepared.discard(xid)
        if commit:
            self.committed.append(xid)
        return True

    def abort(self, xid: Xid) -> None:
        self.journal.append(f"abort {self.name}")

    def recover(self) -> list[Xid]:
        return sorted(self.prepared)

    def resolve(self, xid: Xid, commit: bool) -> None:
        self.prepared.discard(xid)
        if commit:
            self.committed.append(xid)


@pytest.fixture
def tm(tmp_path: Path) -> TransactionManager:
    return TransactionManager(tmp_path / "tm.log")


def test_two_phase_order_and_log(tm: TransactionManager) -> None:
    journal: list[str] = []
    b, a = Fake("b", journal), Fake("a", journal)
    with tm.begin([b, a]):
        pass
    assert journal == ["begin a", "begin b", "vote a", "vote b", "commit a", "commit b"]
    assert tm.log.open_decisions == set() and tm.log.syncs == 1


def test_single_participant_commits_in_one_phase_without_logging(tm: TransactionManager) -> None:
    journal: list[str] = []
    with tm.begin([Fake("a", journal)]):
        pass
    assert journal == ["begin a", "1pc a"] and tm.log.syncs == 0


def test_vote_no_rolls_back_voters_and_aborts_the_rest(tm: TransactionManager) -> None:
    journal: list[str] = []
    parts = [Fake("a", journal), Fake("b", journal, no=True), Fake("c", journal)]
    with pytest.raises(RolledBack), tm.begin(parts):
        pass
    assert journal[3:] == ["vote a", "vote b", "rollback a", "abort b", "abort c"]
    assert tm.log.syncs == 0


def test_read_only_voters_need_no_phase_two(tm: TransactionManager) -> None:
    journal: list[str] = []
    with tm.begin([Fake("a", journal, read_only=True), Fake("b", journal, read_only=True)]):
        pass
    assert "commit a" not in journal and tm.log.syncs == 0


def test_exception_in_the_block_rolls_back(tm: TransactionManager) -> None:
    journal: list[str] = []
    with pytest.raises(ValueError), tm.begin([Fake("a", journal), Fake("b", journal)]):
        raise ValueError("app failure")
    assert journal[2:] == ["abort a", "abort b"]


def test_failed_finish_is_completed_by_recovery(tmp_path: Path) -> None:
    journal: list[str] = []
    tm = TransactionManager(tmp_path / "tm.log")
    a, b = Fake("a", journal), Fake("b", journal, finish_fails=True)
    gtx = tm.begin([a, b])
    gtx.commit()
    assert a.committed and not b.committed and len(tm.log.open_decisions) == 1
    tm.close()
    # a restart: the decision is in the log, b still holds its branch prepared
    tm2 = TransactionManager(tmp_path / "tm.log")
    report = recover(tm2.log, [a, b])
    assert report.clean and [x for _, x in report.committed] == [gtx.xid_of(b)]
    assert b.committed and tm2.log.open_decisions == set()


def test_recovery_presumes_abort_without_a_decision(tmp_path: Path) -> None:
    journal: list[str] = []
    tm = TransactionManager(tmp_path / "tm.log")
    a = Fake("a", journal)
    a.prepared.add(Xid(0x5458424D, b"00" * 16, b"a"))
    report = recover(tm.log, [a])
    assert report.rolled_back and not a.prepared and not a.committed


def test_a_one_phase_commit_cut_off_is_in_doubt_never_rolled_back() -> None:
    """Issue 25's audit: a one-phase commit whose connection broke before the answer
    may have committed: InDoubt, not RolledBack (the caller would redo the work)."""
    from txbroker.errors import XA_RBCOMMFAIL, XAER_RMFAIL, ConnectionLost, XAError
    from txbroker.tm.manager import InDoubt, RolledBack, one_phase_failure

    class PgError(Exception):  # psycopg's shape: an SQLSTATE from the server, or None
        def __init__(self, sqlstate: str | None) -> None:
            super().__init__(sqlstate)
            self.sqlstate = sqlstate

    in_doubt = [ConnectionLost("lost"), TimeoutError(), ConnectionResetError(),
                PgError(None)]
    rolled_back = [XAError(XA_RBCOMMFAIL, "rolled back"), PgError("40001"),
                   PgError("23505"), ValueError("refused")]
    assert [type(one_phase_failure(e)) for e in in_doubt] == [InDoubt] * 4
    assert [type(one_phase_failure(e)) for e in rolled_back] == [RolledBack] * 4
    assert type(one_phase_failure(XAError(XAER_RMFAIL, "rm failed"))) is InDoubt


def test_crash_points_are_passed_in_order(tmp_path: Path) -> None:
    """The sync manager's named fault points (STEPS), in the order of a commit over three
    participants, between the participant calls they name."""
    from txbroker.tm import STEPS

    journal: list[str] = []
    tm = TransactionManager(tmp_path / "tm.log", hook=lambda step: journal.append(step))
    with tm.begin([Fake("c", journal), Fake("a", journal), Fake("b", journal)]):
        pass
    assert journal == ["begin a", "begin b", "begin c", "before_prepare", "vote a",
                       "between_prepares", "vote b", "between_prepares", "vote c",
                       "after_decision", "commit a", "between_commits", "commit b",
                       "between_commits", "commit c"]
    assert set(journal) >= set(STEPS)


def test_a_no_stops_the_crash_points_and_a_failed_begin_aborts_in_order(
        tmp_path: Path) -> None:
    journal: list[str] = []
    tm = TransactionManager(tmp_path / "tm.log", hook=lambda step: journal.append(step))
    with pytest.raises(RolledBack), tm.begin([Fake("a", journal, no=True),
                                              Fake("b", journal)]):
        pass
    assert journal == ["begin a", "begin b", "before_prepare", "vote a", "abort a",
                       "abort b"]

    class NoBegin(Fake):
        def begin(self, xid: Xid) -> None:
            super().begin(xid)
            raise RuntimeError("resource down")

    journal.clear()
    with pytest.raises(RuntimeError, match="resource down"):
        tm.begin([Fake("a", journal), NoBegin("b", journal), Fake("c", journal)])
    assert journal == ["begin a", "begin b", "abort a"]
    assert tm.counters == {"committed": 0, "rolled_back": 1, "one_phase": 0, "in_doubt": 0}


class RecoversWhileVoting(Fake):
    """A participant whose vote runs the manager's recovery first: a recovery that
    comes at the worst moment, with ``a`` prepared and nothing decided yet."""

    def __init__(self, name: str, journal: list[str], tm: TransactionManager,
                 resources: list[Fake]) -> None:
        super().__init__(name, journal)
        self.tm, self.resources = tm, resources
        self.reports: list[object] = []

    def vote(self, xid: Xid) -> bool:
        self.reports.append(self.tm.recover(self.resources))
        return super().vote(xid)


def test_recovery_through_the_manager_leaves_its_transactions_in_flight_alone(
        tm: TransactionManager) -> None:
    journal: list[str] = []
    a = Fake("a", journal)
    b = RecoversWhileVoting("b", journal, tm, [])
    b.resources = [a, b]
    gtx = tm.begin([a, b])
    assert tm.in_flight == {gtx.gtrid}
    gtx.commit()
    (report,) = b.reports
    # a's branch was prepared and undecided: an orphan to a recovery that did not know
    assert report.in_flight == [("a", gtx.xid_of(a))]  # type: ignore[attr-defined]
    assert report.rolled_back == [] and report.clean  # type: ignore[attr-defined]
    assert a.committed == [gtx.xid_of(a)] and b.committed == [gtx.xid_of(b)]
    assert tm.in_flight == set() and tm.log.open_decisions == set()


def test_a_recovery_that_does_not_know_the_transactions_in_flight_rolls_them_back(
        tm: TransactionManager) -> None:
    """Why the manager passes them: the bare function sees an orphan."""
    journal: list[str] = []
    a = Fake("a", journal)
    prepared_a = Xid(0x5458424D, b"00" * 16, b"a")
    a.prepared.add(prepared_a)
    assert recover(tm.log, [a], in_flight={bytes(16)}).in_flight == [("a", prepared_a)]
    assert a.prepared == {prepared_a}
    assert recover(tm.log, [a]).rolled_back == [("a", prepared_a)] and not a.prepared


def test_a_failed_begin_or_a_rollback_leaves_nothing_in_flight(
        tm: TransactionManager) -> None:
    journal: list[str] = []

    class FailsBegin(Fake):
        def begin(self, xid: Xid) -> None:
            raise RuntimeError("refused")

    with pytest.raises(Exception, match="refused"):
        tm.begin([Fake("a", journal), FailsBegin("b", journal)])
    assert tm.in_flight == set()
    gtx = tm.begin([Fake("a", journal)])
    gtx.rollback()
    assert tm.in_flight == set()
