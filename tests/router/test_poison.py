"""The poison transaction and the three-strikes rule (issue 15, seed 000).

A transfer of :data:`POISON` kills (SIGKILL) every server of partition A that
receives it; a monitor restarts each server that dies, as an operator's process
supervisor would. The router presents it again after each loss until the
partition's retry count is exceeded, then rejects it with SRVDIED and flags it
an exception transaction: ``txbroker router exceptions list`` shows it,
``discard`` removes it. The partition serves other transfers all along.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from examples.bank import bank
from tests.router.bankrig import LOAD_TIMEOUT, BankRig, Child, accounts, wait_for
from tests.support import ROOT, BrokerProcess
from tests.tm.pg import PostgresServer

#: The poison transfer's amount (ordinary transfers are 1..150).
POISON = 777
#: Ordinary transfers that run beside the poison one.
TRANSFERS = 60


@pytest.fixture
def rig(tmp_path: Path, broker: BrokerProcess, postgres: PostgresServer) -> Iterator[BankRig]:
    """The bank's databases reset and its facility defined on a fresh broker; every
    process the test starts is killed afterwards."""
    rig = BankRig(tmp_path, broker, postgres.dsn)
    try:
        yield rig
    finally:
        rig.close()


def cli(url: str, *args: str) -> str:
    """``txbroker router …``; its stdout (fails the test on a non-zero exit)."""
    done = subprocess.run([sys.executable, "-m", "txbroker.cli", "router", *args,
                           "--url", url], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("retry_count", [3, 1])
def test_poison_rejected_after_retry_count(rig: BankRig, retry_count: int) -> None:
    url = rig.broker.url
    if retry_count != 3:  # 3 is the default; the operator changes it with the CLI
        cli(url, "set-partition", bank.FACILITY, "A", "--retry-count", str(retry_count))
    show = bank.admin(url, "rtr_show", facility=bank.FACILITY)
    parts = {p["name"]: p for p in show["facilities"][0]["partitions"]}
    assert parts["A"]["retry_count"] == retry_count

    poison_env = {"POISON_AMOUNT": str(POISON)}

    def restart(dead: Child) -> Child:
        return rig.server("A", "server-A", env=poison_env)

    servers = [rig.server("A", "server-A", env=poison_env)]
    rig.servers_b(2, explicit_prepare=True)
    steady = rig.client("steady", TRANSFERS, seed=40, args=["--cross-only", *accounts(0, 2)])
    with rig.supervised(servers, restart) as died:
        poison = rig.client("poison", 1, seed=41, args=["--cross-only", *accounts(1, 2),
                                                        "--poison", str(POISON)])
        assert poison.wait(LOAD_TIMEOUT) == 0, poison.stderr.read_text()[-2000:]
        assert steady.wait(LOAD_TIMEOUT) == 0, steady.stderr.read_text()[-2000:]
        wait_for(lambda: all(s.alive() for s in servers), 30, "the last restart")
    # every presentation of the poison killed a server: the first one and retry_count
    # replays, then the router gave up
    assert len(died) == retry_count + 1
    assert all(child.proc is not None and child.proc.returncode == -9 for child in died)
    assert all([w[0] for w in child.lines()][-1] == "POISON" for child in died)
    (tid,) = [w[1] for w in poison.lines() if w[0] == "START"]
    assert [w[:4] for w in poison.lines() if w[0] == "OUTCOME"] == [
        ["OUTCOME", tid, "REJECTED", "SRVDIED"]]

    listed = json.loads(cli(url, "exceptions", "list", "--json"))
    assert [e["tid"] for e in listed] == [tid]
    assert listed[0]["reason"] == "SRVDIED"
    assert listed[0]["strikes"] == retry_count + 1
    report = rig.check()
    assert report.violations == []
    assert report.exceptions == [tid]
    assert report.outcomes["ACCEPTED"] + report.outcomes["REJECTED"] == TRANSFERS + 1
    assert report.reasons["REJECTED:SRVDIED"] == 1
    # the partition served every ordinary transfer, before and after the poison
    steady_outcomes = [w for w in steady.lines() if w[0] == "OUTCOME"]
    assert len(steady_outcomes) == TRANSFERS
    assert all(w[3] != "SRVDIED" for w in steady_outcomes)

    cli(url, "exceptions", "discard", tid)
    assert json.loads(cli(url, "exceptions", "list", "--json")) == []
    assert bank.admin(url, "rtr_exceptions") == []
    assert rig.check().violations == []
