"""The bank's invariants, checked after a run (exact, no tolerance).

    python -m examples.bank.check --url txb://127.0.0.1:5445 --dsn "…" client-*.log

1. Money is conserved: both databases together hold ``2000 * INITIAL_BALANCE``.
2. Every account holds exactly its initial balance plus the legs of the ACCEPTED
   transfers that touch it.
3. Every ACCEPTED tid is applied exactly once on each side it touches: one row in
   that database's ``applied`` table with the right number of legs and amount.
4. Every REJECTED tid (and every tid the broker never durably accepted, UNKNOWN)
   is applied on no side.
5. No database holds a tid the clients did not start.
6. Every exception transaction (``rtr_exceptions``, what ``txbroker router
   exceptions list`` prints) is REJECTED with reason SRVDIED and applied on no
   side, unless the operator committed it (``--committed TID``).

A transfer whose outcome the client did not log (the client or the broker was
killed, or a receive failed) is asked of the broker (``rtr_outcome``), waiting
while it is PENDING.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from examples.bank.bank import (
    DATABASES,
    INITIAL_BALANCE,
    PARTITIONS,
    admin,
    database_dsn,
    partition_of,
)

#: Seconds the checker waits for PENDING transactions to be decided.
PENDING_WAIT = 60.0


@dataclass
class Transfer:
    """One transfer as the client logs tell it."""

    tid: str
    source: int
    target: int
    amount: int
    outcome: str | None = None  # ACCEPTED / REJECTED / UNKNOWN (from the broker)
    reason: str | None = None
    asked_broker: bool = False

    def sides(self) -> dict[str, tuple[int, int]]:
        """Partition -> (legs, net amount) this transfer applies there."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for account, amount in ((self.source, -self.amount), (self.target, self.amount)):
            side = out[partition_of(account)]
            side[0] += 1
            side[1] += amount
        return {p: (legs, delta) for p, (legs, delta) in out.items()}


@dataclass
class Report:
    """What the checker found: counts, and every violated invariant."""

    outcomes: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    asked_broker: int = 0
    exceptions: list[str] = field(default_factory=list)
    total_money: int = 0
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"outcomes": dict(self.outcomes), "reasons": dict(self.reasons),
                "asked_broker": self.asked_broker, "exceptions": self.exceptions,
                "total_money": self.total_money, "violations": self.violations}


def read_logs(paths: list[Path]) -> dict[str, Transfer]:
    """The transfers the client logs started, with the outcomes they logged."""
    transfers: dict[str, Transfer] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            words = line.split()
            if not words:
                continue
            if words[0] == "START" and len(words) >= 5:
                tid = words[1]
                transfers[tid] = Transfer(tid, int(words[2]), int(words[3]), int(words[4]))
            elif words[0] == "OUTCOME" and len(words) >= 3:
                transfer = transfers[words[1]]
                transfer.outcome = words[2]
                transfer.reason = words[3] if len(words) > 3 and words[3] != "-" else None
    return transfers


def ask_broker(url: str, transfers: dict[str, Transfer], wait: float) -> None:
    """Fill in the outcomes the clients did not log, from ``rtr_outcome``."""
    deadline = time.monotonic() + wait
    for transfer in transfers.values():
        if transfer.outcome is not None:
            continue
        transfer.asked_broker = True
        while True:
            answer = admin(url, "rtr_outcome", tid=transfer.tid)
            if answer["state"] != "PENDING" or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # polling the broker's decision, bounded by ``wait``
        transfer.outcome, transfer.reason = answer["state"], answer.get("reason")


def read_databases(base_dsn: str) -> tuple[dict[str, dict[str, tuple[int, int]]],
                                           dict[int, int]]:
    """Per partition its ``applied`` rows (tid -> legs, delta); every account's balance."""
    applied: dict[str, dict[str, tuple[int, int]]] = {}
    balances: dict[int, int] = {}
    for partition in DATABASES:
        with psycopg.connect(database_dsn(base_dsn, partition), autocommit=True) as pg:
            applied[partition] = {tid: (legs, delta) for tid, legs, delta in
                                  pg.execute("SELECT tid, legs, delta FROM applied")}
            balances.update(pg.execute("SELECT id, balance FROM accounts").fetchall())
    return applied, balances


def check(url: str, base_dsn: str, logs: list[Path], *, committed: frozenset[str] = frozenset(),
          wait: float = PENDING_WAIT) -> Report:
    """Check every invariant; the report lists each violation."""
    report = Report()
    transfers = read_logs(logs)
    ask_broker(url, transfers, wait)
    applied, balances = read_databases(base_dsn)
    exceptions = admin(url, "rtr_exceptions")
    report.exceptions = sorted(e["tid"] for e in exceptions)
    bad = report.violations.append

    expected = {k: INITIAL_BALANCE for p in PARTITIONS.values() for k in range(p[0], p[1] + 1)}
    report.total_money = sum(balances.values())
    if report.total_money != len(expected) * INITIAL_BALANCE:
        bad(f"money not conserved: {report.total_money} != {len(expected) * INITIAL_BALANCE}")
    for transfer in transfers.values():
        outcome = transfer.outcome or "NONE"
        report.outcomes[outcome] += 1
        report.reasons[f"{outcome}:{transfer.reason}"] += 1
        report.asked_broker += transfer.asked_broker
        accepted = outcome == "ACCEPTED" or transfer.tid in committed
        if outcome not in ("ACCEPTED", "REJECTED", "UNKNOWN"):
            bad(f"{transfer.tid}: no outcome ({outcome})")
        for partition, (legs, delta) in transfer.sides().items():
            row = applied[partition].get(transfer.tid)
            if accepted and row != (legs, delta):
                bad(f"{transfer.tid} {outcome}: on {partition} applied {row}, "
                    f"expected {(legs, delta)}")
            if not accepted and row is not None:
                bad(f"{transfer.tid} {outcome} {transfer.reason}: applied on {partition} {row}")
        if accepted:
            expected[transfer.source] -= transfer.amount
            expected[transfer.target] += transfer.amount
    for partition, rows in applied.items():
        for tid in rows.keys() - transfers.keys():
            bad(f"{tid}: applied on {partition} but no client started it")
    wrong = {k: (balances.get(k), v) for k, v in expected.items() if balances.get(k) != v}
    if wrong:
        bad(f"{len(wrong)} balances differ from the accepted transfers (have, expected): "
            f"{dict(list(wrong.items())[:10])}")
    for tid in report.exceptions:
        transfer = transfers.get(tid)
        if transfer is None:
            continue
        if tid not in committed and (transfer.outcome, transfer.reason) != ("REJECTED",
                                                                             "SRVDIED"):
            bad(f"exception {tid}: outcome {transfer.outcome} {transfer.reason}, "
                f"expected REJECTED SRVDIED")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--committed", action="append", default=[],
                        help="an exception transaction the operator committed")
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    report = check(args.url, args.dsn, args.logs, committed=frozenset(args.committed))
    print(json.dumps(report.as_dict(), indent=1))
    raise SystemExit(1 if report.violations else 0)


if __name__ == "__main__":
    main()
