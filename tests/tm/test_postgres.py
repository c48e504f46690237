"""The transaction manager with a real broker and a real PostgreSQL: the classic case
(dequeue a message + insert a row, atomically), the reverse, a no vote, recovery."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

import txbroker
from tests.support import BrokerProcess
from txbroker.tm import (
    BrokerParticipant,
    BrokerResource,
    PostgresParticipant,
    PostgresResource,
    RolledBack,
    TransactionManager,
    recover,
)
from txbroker.tm.example import dequeue_and_insert, insert_and_send


def rows(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as pg:
        return [r[0] for r in pg.execute("SELECT id FROM orders ORDER BY id").fetchall()]


def prepared(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as pg:
        return int(pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0])


def test_dequeue_and_insert_then_insert_and_send(broker: BrokerProcess, orders: str,
                                                 tmp_path: Path) -> None:
    tm = TransactionManager(tmp_path / "tm.log")
    with txbroker.connect(broker.url) as conn, psycopg.connect(orders) as pg:
        for i in range(3):
            conn.send("orders", b"order-%d" % i)
        assert [dequeue_and_insert(tm, conn, pg, "orders") for _ in range(4)] == [
            "order-0", "order-1", "order-2", None]
        insert_and_send(tm, conn, pg, "shipped", "ship-1", b"parcel")
        got = conn.receive("shipped", timeout=5)
        assert got is not None and got.body == b"parcel" and got.message_id == "ship-1"
        got.ack(wait=True)
    assert rows(orders) == ["order-0", "order-1", "order-2", "ship-1"]
    assert tm.counters["committed"] == 4 and tm.log.open_decisions == set()
    assert prepared(orders) == 0


def test_postgres_votes_no_and_the_message_comes_back(broker: BrokerProcess, orders: str,
                                                      tmp_path: Path) -> None:
    with psycopg.connect(orders, autocommit=True) as pg:
        pg.execute("CREATE TABLE IF NOT EXISTS dedup (id text UNIQUE DEFERRABLE "
                   "INITIALLY DEFERRED)")
        pg.execute("TRUNCATE dedup")
        pg.execute("INSERT INTO dedup VALUES ('dup')")
    tm = TransactionManager(tmp_path / "tm.log")
    with txbroker.connect(broker.url) as conn, psycopg.connect(orders) as pg:
        conn.send("orders", b"dup")
        gtx = tm.begin([BrokerParticipant(conn), PostgresParticipant(pg)])
        message = conn.receive("orders", timeout=5)
        assert message is not None
        message.ack()
        pg.execute("INSERT INTO dedup VALUES (%s)", (message.body.decode(),))
        with pytest.raises(RolledBack, match="postgres voted no"):
            gtx.commit()  # the deferred unique check fails at PREPARE TRANSACTION
        again = conn.receive("orders", timeout=5)
        assert again is not None and again.body == b"dup" and again.redelivered
        assert conn.tpc_recover() == []
    assert prepared(orders) == 0


def test_recovery_commits_a_decided_transaction(broker: BrokerProcess, orders: str,
                                                tmp_path: Path) -> None:
    class Crash(BaseException):
        pass

    def hook(step: str) -> None:
        if step == "after_decision":
            raise Crash  # the coordinator dies after writing its decision

    tm = TransactionManager(tmp_path / "tm.log", hook=hook)
    conn, pg = txbroker.connect(broker.url), psycopg.connect(orders)
    conn.send("orders", b"o-1")
    with pytest.raises(Crash):
        dequeue_and_insert(tm, conn, pg, "orders")
    conn.close()  # the coordinator's connections go away with it
    pg.close()
    tm.close()
    assert prepared(orders) == 1 and rows(orders) == []
    tm2 = TransactionManager(tmp_path / "tm.log")
    with txbroker.connect(broker.url) as conn, psycopg.connect(orders, autocommit=True) as pg:
        report = recover(tm2.log, [BrokerResource(conn), PostgresResource(pg)])
        assert report.clean and len(report.committed) == 2
        assert conn.receive("orders", timeout=0.3) is None
        assert conn.tpc_recover() == []
    assert rows(orders) == ["o-1"] and prepared(orders) == 0
    assert tm2.log.open_decisions == set()
