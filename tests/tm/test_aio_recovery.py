"""``recover_async`` (``tm/aio_recovery.py``) against a real broker and a real
PostgreSQL: the asyncio coordinator is killed after its votes (no decision: rolled
back) or after its decision (committed), and asyncio recovery finishes the job."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

import txbroker
from tests.support import ROOT, BrokerProcess
from tests.tm.pg import PostgresServer
from txbroker.client.aio import open_connection
from txbroker.tm import DecisionLog
from txbroker.tm.aio_recovery import AsyncBrokerResource, AsyncPostgresResource, recover_async


@pytest.fixture
def store() -> str:
    return "journal"


@pytest.mark.parametrize("step", ["after_votes", "after_decision"])
def test_recover_async_after_a_coordinator_kill(broker: BrokerProcess, postgres: PostgresServer,
                                                orders: str, tmp_path: Path, step: str) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.send("orders", b"order-1", message_id="order-1")
    log_path = tmp_path / "tm.log"
    assert broker.proc is not None
    run = subprocess.run(
        [sys.executable, "-m", "tests.tm.coordinator_aio", broker.url, orders, str(log_path),
         step, "coordinator", str(broker.proc.pid), str(postgres.data)], cwd=ROOT,
        capture_output=True, text=True, timeout=60)
    assert run.returncode == -9, run.stderr[-2000:]
    decided = step == "after_decision"
    decisions = DecisionLog(log_path)
    assert (decisions.open_decisions != set()) == decided

    async def recover() -> None:
        conn = await open_connection(broker.url, reconnect=False, timeout=5)
        pg = await psycopg.AsyncConnection.connect(orders, autocommit=True)
        try:
            report = await recover_async(decisions, [AsyncBrokerResource(conn),
                                                     AsyncPostgresResource(pg)])
            assert report.clean, report
            done = report.committed if decided else report.rolled_back
            assert sorted(name for name, _ in done) == ["postgres", "txbroker"]
            assert await conn.tpc_recover() == []
        finally:
            await conn.close()
            await pg.close()

    asyncio.run(recover())
    with txbroker.connect(broker.url) as conn, \
            psycopg.connect(orders, autocommit=True) as pg:
        assert pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        row = pg.execute("SELECT count(*) FROM orders").fetchone() == (1,)
        assert row == decided
        got = conn.receive("orders", timeout=1.0 if row else 30.0)
        assert (got is None) == row
    assert decisions.open_decisions == set()
    decisions.close()
