"""The router across HA (issue 28 §2): bank transfers run while the active of a
shared-store pair, or the primary of a replicated trio, is killed with -9. The
clients and servers fail over by their URL's host list; the new active (or
promoted backup) has the router's journal — it is messages of the store — and
replays what was accepted. Afterwards every invariant holds exactly
(examples/bank/check.py): money conserved, every ACCEPTED transfer applied once
on both sides, every REJECTED or UNKNOWN one on none."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.ha_support import HaPair
from tests.replicated_support import Group
from tests.router.bankrig import LOAD_TIMEOUT, BankRig, accounts, wait_for
from tests.tm.pg import PostgresServer

#: Transfers per client: enough that the kill falls mid-load.
TRANSFERS = 60

pytestmark = pytest.mark.timeout(400)


def run_load_through_a_kill(rig: BankRig, kill_and_take_over: Callable[[], None]) -> None:
    rig.server("A", explicit_prepare=True)
    rig.servers_b(2, explicit_prepare=True, handler=True)
    clients = [rig.client(f"client{i}", TRANSFERS, seed=90 + i, args=accounts(i, 2))
               for i in range(2)]
    wait_for(lambda: all(rig.outcomes(c) >= 15 for c in clients), LOAD_TIMEOUT,
             "15 outcomes of each client before the kill")
    kill_and_take_over()
    for client in clients:
        assert client.wait(LOAD_TIMEOUT) == 0, client.stderr.read_text()[-2000:]
    report = rig.check()
    assert report.violations == [], report.as_dict()
    assert sum(report.outcomes.values()) == 2 * TRANSFERS
    assert set(report.outcomes) <= {"ACCEPTED", "REJECTED", "UNKNOWN"}, report.as_dict()
    assert report.outcomes["ACCEPTED"] > 0
    assert report.exceptions == []


def test_router_survives_a_shared_store_takeover(tmp_path: Path,
                                                 postgres: PostgresServer) -> None:
    with HaPair(tmp_path / "ha") as pair:
        rig = BankRig(tmp_path, SimpleNamespace(url=pair.url),  # type: ignore[arg-type]
                      postgres.dsn)
        try:
            def kill_and_take_over() -> None:
                old = pair.kill9(pair.active())
                assert pair.active() is pair.peer(old)
                pair.restart(old)  # back as the standby

            run_load_through_a_kill(rig, kill_and_take_over)
        finally:
            rig.close()


def test_router_survives_a_replicated_promotion(tmp_path: Path,
                                                postgres: PostgresServer) -> None:
    group = Group(tmp_path / "group", 3).start()
    try:
        rig = BankRig(tmp_path, SimpleNamespace(url=group.url),  # type: ignore[arg-type]
                      postgres.dsn)
        try:
            def kill_and_take_over() -> None:
                old = group.kill9(group.primary())
                group.promote(group.backups()[0])
                group.restart(old)

            run_load_through_a_kill(rig, kill_and_take_over)
        finally:
            rig.close()
    finally:
        group.stop()
