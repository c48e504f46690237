"""Scenario ``xa-live`` (``sim/live_xa.py``): its parts — the PostgreSQL model, the
transaction manager's simulated log file, recovery over them — and its planted bugs.
The bounded seeds, the same-trace and the no-clock checks are ``test_sim.py``'s, for
every scenario."""

from __future__ import annotations

import asyncio
import random

import pytest

from txbroker.sim import PLANTS, run_seed
from txbroker.sim.pg_model import PgDatabase, PgError
from txbroker.sim.xa_parts import SimLogFile, TmDisk, XaLoop
from txbroker.tm.aio_recovery import AsyncPostgresResource, recover_async
from txbroker.tm.log import DecisionLog
from txbroker.tm.participants import branch_xid

XA_PLANTS = sorted(name for name, plant in PLANTS.items() if plant.scenario == "xa-live")


def test_the_scenario_has_its_plants() -> None:
    assert XA_PLANTS == ["forget-prepared-at-restart", "pg-loses-prepared",
                         "recovery-in-flight", "tm-commit-without-log"]


def test_a_plant_breaks_the_agreement_the_checkers_name() -> None:
    """(``test_sim.py`` checks that every plant is caught: these are caught at seed 0 or
    1.) Recovery under transactions in flight rolls back a prepared branch that the
    manager then commits: the checkers say which transaction and how."""
    violations = run_seed("xa-live", 0, "recovery-in-flight").violations
    assert any("the broker consumed it for good but the database did not commit its row"
               in v for v in violations), violations[:5]
    assert any("told committed, but database rolled back" in v for v in violations)


def test_the_decision_log_on_the_simulated_disk_keeps_what_was_synced() -> None:
    """The production DecisionLog through SimLogFile: synced decisions survive a kill,
    a torn tail is cut, compaction rewrites the file with the open decisions."""
    disk = TmDisk()
    log = DecisionLog("tm.log", file=SimLogFile(disk), compact_bytes=200)
    for n in range(12):
        log.decide(b"g%d" % n)
    for n in range(10):
        log.forget(b"g%d" % n)  # compaction past 200 bytes
    assert len(disk.synced) < 200
    log.decide(b"late")
    disk.written += b"1234abcd C 6"  # a write under way at the kill
    disk.crash(random.Random(3))
    again = DecisionLog("tm.log", file=SimLogFile(disk))
    assert again.open_decisions == {b"g10", b"g11", b"late"}
    assert disk.synced.endswith(b"\n")  # the torn piece is cut


def test_the_pg_model_keeps_prepared_work_and_loses_open_work_at_a_crash() -> None:
    loop = XaLoop(5)
    db = PgDatabase(loop)
    disk = TmDisk()
    decisions = DecisionLog("tm.log", file=SimLogFile(disk))
    committed_gtrid, rolled_gtrid = b"\x01" * 16, b"\x02" * 16

    async def main() -> None:
        process, _ = loop.spawn("127.0.0.20", db.serve())
        await asyncio.sleep(0.001)
        first, second, third = await db.connect(), await db.connect(), await db.connect()
        for conn, gtrid, key in ((first, committed_gtrid, "a"), (second, rolled_gtrid, "b")):
            xid = branch_xid(gtrid, "postgres")
            await conn.tpc_begin(conn.xid(xid.format_id, xid.gtrid.decode(),
                                          xid.bqual.decode()))
            await conn.insert(key, gtrid.hex())
            await conn.tpc_prepare()
        await third.tpc_begin(third.xid(1, "open", "x"))
        await third.insert("c", "open")
        with pytest.raises(PgError) as locked:
            await second.tpc_begin(second.xid(1, "other", "x"))
            await second.insert("c", "other")
        assert locked.value.sqlstate == "55P03"
        loop.kill(process)
        db.crash()
        with pytest.raises(PgError) as broken:
            await third.insert("d", "x")
        assert broken.value.sqlstate is None  # a connection error, as psycopg's
        loop.spawn("127.0.0.20", db.serve())
        await asyncio.sleep(0.001)
        decisions.decide(committed_gtrid)
        report = await recover_async(decisions, [AsyncPostgresResource(await db.connect())])
        assert report.clean and len(report.committed) == len(report.rolled_back) == 1

    loop.run(main())
    assert db.rows == {"a": committed_gtrid.hex()}
    assert db.prepared == {} and decisions.open_decisions == set()
    assert db.outcomes == {committed_gtrid.hex(): "committed", rolled_gtrid.hex(): "rolled back"}
