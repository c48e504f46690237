"""The asyncio transaction manager (txbroker.tm.aio): its contract with fake
participants, group commit of the decision log, and a real dequeue + insert."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest

import txbroker
from tests.support import BrokerProcess
from txbroker.client.aio import open_connection
from txbroker.tm import DecisionLog, RolledBack, TMError, recover
from txbroker.tm.aio import (
    AsyncBrokerParticipant,
    AsyncPostgresParticipant,
    AsyncTransactionManager,
)
from txbroker.xid import Xid


class AsyncFake:
    """An asyncio participant that records calls; ``finish`` also records whether the
    transaction's decision was already in the log file (durability before phase two)."""

    def __init__(self, name: str, journal: list[str], log_path: Path, *, no: bool = False,
                 read_only: bool = False, finish_fails: bool = False) -> None:
        self.sort_key = self.name = name
        self.journal = journal
        self.log_path = log_path
        self.no, self.read_only, self.finish_fails = no, read_only, finish_fails
        self.prepared: set[Xid] = set()
        self.committed: list[Xid] = []
        self.decided_at_finish: list[bool] = []

    async def begin(self, xid: Xid) -> None:
        self.journal.append(f"begin {self.name}")

    async def vote(self, xid: Xid) -> bool:
        self.journal.append(f"vote {self.name}")
        await asyncio.sleep(0)
        if self.no:
            raise RuntimeError("no")
        if not self.read_only:
            self.prepared.add(xid)
        return self.read_only

    async def commit_one_phase(self, xid: Xid) -> None:
        self.journal.append(f"1pc {self.name}")
        self.committed.append(xid)

    async def finish(self, xid: Xid, commit: bool) -> bool:
        self.journal.append(f"{'commit' if commit else 'rollback'} {self.name}")
        text = self.log_path.read_text() if self.log_path.exists() else ""
        self.decided_at_finish.append(f"C {xid.gtrid.decode()}\n" in text)
        if self.finish_fails:
            return False
        self.prepared.discard(xid)
        if commit:
            self.committed.append(xid)
        return True

    async def abort(self, xid: Xid) -> None:
        self.journal.append(f"abort {self.name}")

    def recover(self) -> list[Xid]:
        return sorted(self.prepared, key=str)

    def resolve(self, xid: Xid, commit: bool) -> None:
        self.prepared.discard(xid)
        if commit:
            self.committed.append(xid)


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "tm.log"


def test_two_phase_commit_logs_before_phase_two(log_path: Path) -> None:
    async def main() -> tuple[list[str], AsyncTransactionManager, AsyncFake]:
        tm = AsyncTransactionManager(log_path)
        journal: list[str] = []
        b, a = AsyncFake("b", journal, log_path), AsyncFake("a", journal, log_path)
        async with await tm.begin([b, a]):
            pass
        tm.close()
        return journal, tm, a

    journal, tm, a = asyncio.run(main())
    assert journal == ["begin a", "begin b", "vote a", "vote b", "commit a", "commit b"]
    assert a.decided_at_finish == [True]
    # one sync for the decision, one for the END at close
    assert tm.log.open_decisions == set() and tm.decisions.batches == 1 and tm.log.syncs == 2
    assert tm.counters == {"committed": 1, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}
    assert DecisionLog(log_path).open_decisions == set()  # C then E on disk


def test_group_commit_one_sync_for_concurrent_decisions(log_path: Path) -> None:
    async def main() -> tuple[AsyncTransactionManager, list[AsyncFake]]:
        tm = AsyncTransactionManager(log_path)
        fakes = []

        async def one(i: int) -> None:
            journal: list[str] = []
            pair = [AsyncFake(f"a{i}", journal, log_path), AsyncFake(f"b{i}", journal,
                                                                     log_path)]
            fakes.extend(pair)
            gtx = await tm.begin(pair)
            await gtx.commit()

        await asyncio.gather(*(one(i) for i in range(20)))
        tm.close()
        return tm, fakes

    tm, fakes = asyncio.run(main())
    assert tm.counters["committed"] == 20
    assert tm.decisions.decided == 20
    # the 20 decisions reached the log at the same time: fewer syncs than decisions
    assert tm.log.syncs == tm.decisions.batches + 1 and 1 <= tm.decisions.batches < 20
    assert all(f.decided_at_finish == [True] for f in fakes)
    assert all(len(f.committed) == 1 for f in fakes)


def test_no_vote_rolls_back_the_yes_voters_and_logs_nothing(log_path: Path) -> None:
    async def main() -> tuple[list[str], AsyncTransactionManager, AsyncFake]:
        tm = AsyncTransactionManager(log_path)
        journal: list[str] = []
        a = AsyncFake("a", journal, log_path)
        gtx = await tm.begin([a, AsyncFake("b", journal, log_path, no=True)])
        with pytest.raises(RolledBack, match="b voted no"):
            await gtx.commit()
        with pytest.raises(TMError):
            await gtx.commit()
        tm.close()
        return journal, tm, a

    journal, tm, a = asyncio.run(main())
    assert journal == ["begin a", "begin b", "vote a", "vote b", "rollback a", "abort b"]
    assert a.prepared == set() and a.committed == []
    assert tm.log.syncs == 0 and log_path.read_bytes() == b""
    assert tm.counters["rolled_back"] == 1


def test_a_failed_begin_aborts_the_started_branches(log_path: Path) -> None:
    class NoBegin(AsyncFake):
        async def begin(self, xid: Xid) -> None:
            self.journal.append(f"begin {self.name}")
            raise RuntimeError("resource down")

    async def main() -> list[str]:
        tm = AsyncTransactionManager(log_path)
        journal: list[str] = []
        with pytest.raises(RuntimeError, match="resource down"):
            await tm.begin([NoBegin("b", journal, log_path), AsyncFake("a", journal, log_path)])
        tm.close()
        return journal

    assert asyncio.run(main()) == ["begin a", "begin b", "abort a"]
    assert log_path.read_bytes() == b""


def test_read_only_and_one_phase(log_path: Path) -> None:
    async def main() -> tuple[list[str], AsyncTransactionManager]:
        tm = AsyncTransactionManager(log_path)
        journal: list[str] = []
        gtx = await tm.begin([AsyncFake("a", journal, log_path, read_only=True),
                              AsyncFake("b", journal, log_path, read_only=True)])
        await gtx.commit()
        gtx = await tm.begin([AsyncFake("c", journal, log_path)])
        await gtx.commit()
        tm.close()
        return journal, tm

    journal, tm = asyncio.run(main())
    assert journal == ["begin a", "begin b", "vote a", "vote b", "begin c", "1pc c"]
    assert tm.log.syncs == 0
    assert tm.counters == {"committed": 1, "rolled_back": 0, "one_phase": 1, "in_doubt": 0}


def test_failed_finish_keeps_the_decision_for_recovery(log_path: Path) -> None:
    async def main() -> tuple[AsyncTransactionManager, AsyncFake, AsyncFake]:
        tm = AsyncTransactionManager(log_path)
        journal: list[str] = []
        a = AsyncFake("a", journal, log_path)
        b = AsyncFake("b", journal, log_path, finish_fails=True)
        gtx = await tm.begin([a, b])
        await gtx.commit()
        tm.close()
        return tm, a, b

    tm, a, b = asyncio.run(main())
    assert tm.counters["in_doubt"] == 1 and len(b.prepared) == 1
    decisions = DecisionLog(log_path)
    assert len(decisions.open_decisions) == 1
    report = recover(decisions, [a, b])
    assert report.clean and [name for name, _ in report.committed] == ["b"]
    assert b.prepared == set() and decisions.open_decisions == set()
    decisions.close()
    assert DecisionLog(log_path).open_decisions == set()


def test_failed_decision_write_leaves_branches_prepared(log_path: Path) -> None:
    """A decision that cannot be written: the commit raises, phase two does not start,
    the prepared branches stay for recovery (which rolls them back: no decision)."""
    async def main() -> tuple[AsyncFake, AsyncFake]:
        tm = AsyncTransactionManager(log_path)
        journal: list[str] = []
        a, b = AsyncFake("a", journal, log_path), AsyncFake("b", journal, log_path)
        gtx = await tm.begin([a, b])
        tm.log._file.close()  # the write fails
        with pytest.raises(ValueError):
            await gtx.commit()
        assert journal == ["begin a", "begin b", "vote a", "vote b"]
        return a, b

    a, b = asyncio.run(main())
    assert len(a.prepared) == len(b.prepared) == 1
    decisions = DecisionLog(log_path)
    report = recover(decisions, [a, b])
    assert report.clean and len(report.rolled_back) == 2 and a.committed == []
    decisions.close()


def test_decide_many_is_one_sync_and_reloads(log_path: Path) -> None:
    decisions = DecisionLog(log_path)
    decisions.decide_many([b"\x01" * 16, b"\x02" * 16])
    decisions.decide_many([])
    assert decisions.syncs == 1
    decisions.forget(b"\x01" * 16)
    decisions.close()
    assert DecisionLog(log_path).open_decisions == {b"\x02" * 16}


def test_crash_points_are_passed_in_order(log_path: Path) -> None:
    """The asyncio manager's named fault points (ASYNC_STEPS), in the order of a commit."""
    from txbroker.tm.aio import ASYNC_STEPS

    async def main() -> list[str]:
        journal: list[str] = []
        tm = AsyncTransactionManager(log_path, hook=lambda step: journal.append(step))
        async with await tm.begin([AsyncFake("b", journal, log_path),
                                   AsyncFake("a", journal, log_path)]):
            pass
        tm.close()
        return journal

    journal = asyncio.run(main())
    assert journal == ["begin a", "begin b", "before_prepare", "vote a", "vote b",
                       "after_votes", "after_decision", "commit a", "commit b"]
    assert [step for step in journal if step in ASYNC_STEPS] == list(ASYNC_STEPS)


# ---------------------------------------------------------------- a real broker + PostgreSQL
def test_dequeue_and_insert_many_in_flight(broker: BrokerProcess, orders: str,
                                           log_path: Path) -> None:
    with txbroker.connect(broker.url) as conn:
        for i in range(12):
            conn.send("orders", f"order-{i}".encode(), message_id=f"order-{i}")

    async def slot(tm: AsyncTransactionManager, n: int) -> None:
        conn = await open_connection(broker.url)
        pg = await psycopg.AsyncConnection.connect(orders)
        try:
            parts = [AsyncBrokerParticipant(conn), AsyncPostgresParticipant(pg)]
            for _ in range(n):
                async with await tm.begin(parts):
                    message = await conn.receive("orders", timeout=5)
                    assert message is not None
                    await message.ack()
                    await pg.execute("INSERT INTO orders (id, body) VALUES (%s, %s)",
                                     (message.message_id, message.body))
        finally:
            await pg.close()
            await conn.close()

    async def main() -> AsyncTransactionManager:
        tm = AsyncTransactionManager(log_path)
        await asyncio.gather(*(slot(tm, 3) for _ in range(4)))
        tm.close()
        return tm

    tm = asyncio.run(main())
    assert tm.counters == {"committed": 12, "rolled_back": 0, "one_phase": 0, "in_doubt": 0}
    assert tm.decisions.decided == 12 and tm.log.open_decisions == set()
    with txbroker.connect(broker.url) as conn, psycopg.connect(orders, autocommit=True) as pg:
        rows = pg.execute("SELECT id FROM orders ORDER BY id").fetchall()
        assert sorted(r[0] for r in rows) == sorted(f"order-{i}" for i in range(12))
        assert pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        assert conn.queue_info("orders")["depth"] == 0
        assert conn.xa_branches() == [] and conn.tpc_recover() == []


def test_insert_failure_rolls_back_the_dequeue(broker: BrokerProcess, orders: str,
                                               log_path: Path) -> None:
    """A duplicate key makes PostgreSQL refuse the insert; rollback puts the message
    back and leaves nothing prepared."""
    with psycopg.connect(orders, autocommit=True) as pg:
        pg.execute("INSERT INTO orders (id, body) VALUES ('order-1', 'x')")
    with txbroker.connect(broker.url) as conn:
        conn.send("orders", b"order-1", message_id="order-1")

    async def main() -> AsyncTransactionManager:
        tm = AsyncTransactionManager(log_path)
        conn = await open_connection(broker.url)
        pg = await psycopg.AsyncConnection.connect(orders)
        try:
            with pytest.raises(psycopg.errors.UniqueViolation):
                async with await tm.begin([AsyncBrokerParticipant(conn),
                                           AsyncPostgresParticipant(pg)]):
                    message = await conn.receive("orders", timeout=5)
                    assert message is not None
                    await message.ack()
                    await pg.execute("INSERT INTO orders (id, body) VALUES (%s, %s)",
                                     (message.message_id, message.body))
        finally:
            await pg.close()
            await conn.close()
        tm.close()
        return tm

    tm = asyncio.run(main())
    assert tm.counters["rolled_back"] == 1 and tm.log.syncs == 0
    with txbroker.connect(broker.url) as conn, psycopg.connect(orders, autocommit=True) as pg:
        assert pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        assert conn.xa_branches() == []
        again = conn.receive("orders", timeout=5)
        assert again is not None and again.message_id == "order-1"


@pytest.mark.parametrize("fail", [False, True], ids=["commit", "rollback"])
def test_receive_before_begin_the_ack_joins_the_branch(broker: BrokerProcess, orders: str,
                                                       log_path: Path, fail: bool) -> None:
    """The bench's overlap: the receive runs alongside ``tm.begin`` (it may reach the
    broker before ``xa_start``); the ack, sent after it, stages the consumption in the
    branch: consumed exactly when the row is committed."""
    with txbroker.connect(broker.url) as conn:
        conn.send("orders", b"order-7", message_id="order-7")
    if fail:
        with psycopg.connect(orders, autocommit=True) as pg:
            pg.execute("INSERT INTO orders (id, body) VALUES ('order-7', 'taken')")

    async def main() -> AsyncTransactionManager:
        tm = AsyncTransactionManager(log_path)
        conn = await open_connection(broker.url)
        pg = await psycopg.AsyncConnection.connect(orders)
        parts = [AsyncBrokerParticipant(conn), AsyncPostgresParticipant(pg)]
        try:
            message, gtx = await asyncio.gather(conn.receive("orders", timeout=5),
                                                tm.begin(parts))
            assert message is not None
            await message.ack()
            try:
                await pg.execute("INSERT INTO orders (id, body) VALUES (%s, %s)",
                                 (message.message_id, message.body))
            except psycopg.errors.UniqueViolation:
                await gtx.rollback()
            else:
                await gtx.commit()
        finally:
            await pg.close()
            await conn.close()
        tm.close()
        return tm

    tm = asyncio.run(main())
    assert tm.counters["rolled_back" if fail else "committed"] == 1
    with txbroker.connect(broker.url) as conn, psycopg.connect(orders, autocommit=True) as pg:
        body = pg.execute("SELECT body FROM orders WHERE id = 'order-7'").fetchone()
        assert body == ((b"taken",) if fail else (b"order-7",))
        assert pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        assert conn.xa_branches() == []
        again = conn.receive("orders", timeout=2)
        assert (again is not None) == fail
        if again is not None:
            assert again.message_id == "order-7" and again.redelivered
