"""The crash matrix of the asyncio manager: kill -9 the coordinator or the broker at
each of its steps (``ASYNC_STEPS``), restart, recover. Afterwards the message is
consumed exactly when the row exists, nothing is in doubt, no heuristic outcome."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

import txbroker
from tests.support import ROOT, BrokerProcess
from tests.tm.pg import PostgresServer
from txbroker.tm import BrokerResource, DecisionLog, PostgresResource, recover
from txbroker.tm.aio import ASYNC_STEPS

CASES = [(mode, step) for mode in ("coordinator", "broker") for step in ASYNC_STEPS]


@pytest.fixture
def store() -> str:
    return "journal"


@pytest.mark.parametrize(("mode", "step"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_async_kill_at_each_step(broker: BrokerProcess, postgres: PostgresServer, orders: str,
                                 tmp_path: Path, mode: str, step: str) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.send("orders", b"order-1", message_id="order-1")
    log_path = tmp_path / "tm.log"
    assert broker.proc is not None
    run = subprocess.run(
        [sys.executable, "-m", "tests.tm.coordinator_aio", broker.url, orders, str(log_path),
         step, mode, str(broker.proc.pid), str(postgres.data)], cwd=ROOT,
        capture_output=True, text=True, timeout=60)
    if mode == "coordinator":
        assert run.returncode == -9, run.stderr[-2000:]
    else:
        assert run.returncode == 0 and "RESULT" in run.stdout, run.stderr[-2000:]
        broker.proc.wait(timeout=10)
        broker.start()
    # decided: the coordinator died after the decision, or it carried on past the votes
    # (the broker died after preparing: its commit fails and waits for recovery)
    decided = step == "after_decision" or (mode == "broker" and step == "after_votes")
    decisions = DecisionLog(log_path)
    assert (decisions.open_decisions != set()) == decided
    with txbroker.connect(broker.url) as conn, \
            psycopg.connect(orders, autocommit=True) as pg:
        report = recover(decisions, [BrokerResource(conn), PostgresResource(pg)])
        assert report.clean, report
        assert conn.tpc_recover() == []
        assert pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        row = pg.execute("SELECT count(*) FROM orders").fetchone() == (1,)
        got = conn.receive("orders", timeout=1.0 if row else 30.0)
        assert (got is None) == row, (mode, step, report, run.stdout)
        # decided: committed by phase two or by recovery; otherwise presumed abort
        assert row == decided
    assert decisions.open_decisions == set()
    decisions.close()
