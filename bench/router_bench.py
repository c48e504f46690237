"""Benchmark: the transaction router's bank transfers against the same transfer over XA.

    python bench/router_bench.py [--procs 2] [--count 300] [--rounds 3] [--dsn DSN]

One broker (journal, fdatasync) and one PostgreSQL (a private one unless --dsn) on this
machine. For each case, ``--procs`` client processes (examples/bank/client.py) each
run ``--count`` transfers, served by ``--procs`` server processes per partition
(role concurrent; examples/bank/server.py, PostgreSQL behind each):

- ``rtr-1p-implicit`` / ``rtr-1p-explicit``: both legs in partition A (one server
  votes), implicit or explicit prepare;
- ``rtr-2p-implicit`` / ``rtr-2p-explicit``: a leg in A and one in B (two votes);
- ``xa-2db``: the same transfer as one ``txbroker.tm`` global transaction over the
  two databases (debit in bank_a, credit in bank_b: XA prepare on both, the TM's
  decision log, commit), in ``--procs`` processes;
- ``replay``: the time from the kill -9 of A's primary server (it kills itself before
  voting) to that transaction's outcome at the client, with a standby registered.

Transactions/s is counted from the first START to the last OUTCOME in the client
logs (process start-up excluded); p50/p99 are per-transfer latencies at the client.
Each figure is the median of ``--rounds`` rounds. Results: bench/results/router-*.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.bank import bank  # noqa: E402
from tests.support import free_port  # noqa: E402


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """The machine's description and its load before the run."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_before": loadavg()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a running process has used so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_cpu(proc: subprocess.Popen[str]) -> float:
    """Wait for a child to exit; the CPU seconds it used (its rusage)."""
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class Broker:
    """``txbroker serve`` on a fresh data directory (journal, fdatasync)."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.url = f"txb://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(root / "broker"),
               "--port", str(self.port), "--stomp-port", "0",
               "--amqp-port", "0", "--http-port", "0",
               "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("txbroker ready"):
            raise SystemExit(f"broker did not start: {line!r}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


class Fleet:
    """Bank servers and clients as processes; every one is killed by :meth:`close`."""

    def __init__(self, url: str, dsn: str, root: Path) -> None:
        self.url, self.dsn = url, dsn
        self.root = Path(tempfile.mkdtemp(dir=root))  # fresh logs for every round
        self.procs: list[subprocess.Popen[str]] = []
        self.serial = 0

    def _start(self, kind: str, args: list[str], env: dict[str, str] | None = None
               ) -> tuple[subprocess.Popen[str], Path]:
        self.serial += 1
        log = self.root / f"{kind}-{self.serial}.log"
        cmd = [sys.executable, "-m", f"examples.bank.{kind}", "--url", self.url, "--log",
               str(log), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        self.procs.append(proc)
        return proc, log

    def server(self, partition: str, role: str, explicit: bool,
               env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Path]:
        args = ["--partition", partition, "--dsn", self.dsn, "--role", role]
        proc, log = self._start("server", args + ["--explicit-prepare"] * explicit, env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("bank server ready"):
            raise SystemExit(f"server did not start: {line!r}")
        return proc, log

    def client(self, count: int, seed: int, args: list[str]) -> tuple[subprocess.Popen[str],
                                                                       Path]:
        return self._start("client", ["--count", str(count), "--seed", str(seed), *args])

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        self.procs.clear()


def client_figures(logs: list[Path]) -> dict[str, Any]:
    """tx/s (first START to last OUTCOME), latency percentiles and outcome counts."""
    starts, ends, latencies = [], [], []
    outcomes: dict[str, int] = {}
    for log in logs:
        for words in (line.split() for line in log.read_text().splitlines()):
            if words and words[0] == "START":
                starts.append(float(words[5]))
            elif words and words[0] == "OUTCOME":
                latencies.append(float(words[4]))
                ends.append(float(words[5]))
                outcomes[words[2]] = outcomes.get(words[2], 0) + 1
    seconds = max(ends) - min(starts)
    return {"transactions": len(latencies), "seconds": round(seconds, 3),
            "tx_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(percentile(latencies, 0.50), 2),
            "p99_ms": round(percentile(latencies, 0.99), 2), "outcomes": outcomes}


def rtr_round(url: str, broker_pid: int, dsn: str, root: Path, partitions: int,
              explicit: bool, procs: int, count: int, seed: int) -> dict[str, Any]:
    """One round of router transfers; checked with the bank's invariants afterwards."""
    from examples.bank.check import check

    bank.setup_databases(dsn)
    fleet = Fleet(url, dsn, root)
    broker_cpu = cpu_seconds(broker_pid)
    try:
        servers = [fleet.server(partition, "concurrent", explicit)[0]
                   for partition in ("A", "B")[:partitions] for _ in range(procs)]
        server_cpu = sum(cpu_seconds(s.pid) for s in servers)
        accounts = "0-999" if partitions == 1 else "0-1999"
        clients = [fleet.client(count, seed + k, [f"--accounts={accounts}/{procs}+{k}"]
                                + ["--cross-only"] * (partitions == 2)) for k in range(procs)]
        client_cpu = sum(wait_cpu(proc) for proc, _ in clients)
        server_cpu = sum(cpu_seconds(s.pid) for s in servers) - server_cpu
        broker_cpu = cpu_seconds(broker_pid) - broker_cpu
        logs = [log for _, log in clients]
        figures = client_figures(logs)
        n = figures["transactions"]
        # CPU microseconds per transfer: where the two cores go (the clients' figure
        # includes their start-up)
        figures["cpu_us_per_tx"] = {"broker": round(1e6 * broker_cpu / n),
                                    "servers": round(1e6 * server_cpu / n),
                                    "clients": round(1e6 * client_cpu / n)}
        report = check(url, dsn, logs)
        figures["violations"] = len(report.violations)
        return figures
    finally:
        fleet.close()


def xa_worker(dsn: str, count: int, seed: int, accounts: list[int], log_dir: str,
              out: Any) -> None:
    """``count`` transfers, each a txbroker.tm global transaction over bank_a and bank_b."""
    import random

    import psycopg

    from txbroker.tm import PostgresParticipant, RolledBack, TransactionManager

    rng = random.Random(seed)
    tm = TransactionManager(Path(log_dir) / f"tm-{seed}.log")
    a_side = [k for k in accounts if k < 1000]
    b_side = [k for k in accounts if k >= 1000]
    latencies, starts, ends, outcomes = [], [], [], {"ACCEPTED": 0, "REJECTED": 0}
    with psycopg.connect(bank.database_dsn(dsn, "A")) as pg_a, \
            psycopg.connect(bank.database_dsn(dsn, "B")) as pg_b:
        for _ in range(count):
            a, b = rng.choice(a_side), rng.choice(b_side)
            amount = rng.randint(1, 150)
            (src, pg_src), (dst, pg_dst) = ((a, pg_a), (b, pg_b)) if rng.random() < 0.5 \
                else ((b, pg_b), (a, pg_a))
            started = time.time()
            gtx = tm.begin([PostgresParticipant(pg_a, "bank_a"),
                            PostgresParticipant(pg_b, "bank_b")])
            try:
                cur = pg_src.execute("UPDATE accounts SET balance = balance - %s "
                                     "WHERE id = %s AND balance >= %s", (amount, src, amount))
                if cur.rowcount != 1:
                    gtx.rollback()
                    outcomes["REJECTED"] += 1
                else:
                    pg_dst.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s",
                                   (amount, dst))
                    gtx.commit()
                    outcomes["ACCEPTED"] += 1
            except RolledBack:
                outcomes["REJECTED"] += 1
            now = time.time()
            starts.append(started)
            ends.append(now)
            latencies.append((now - started) * 1000)
    tm.close()
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((starts, ends, latencies, outcomes, usage.ru_utime + usage.ru_stime))


def xa_round(dsn: str, procs: int, count: int, seed: int) -> dict[str, Any]:
    """One round of XA transfers in ``procs`` processes; money must be conserved."""
    import psycopg

    bank.setup_databases(dsn)
    log_dir = tempfile.mkdtemp(prefix="txb-bench-tm-")
    queue: Any = multiprocessing.Queue()
    workers = [multiprocessing.Process(target=xa_worker, args=(
        dsn, count, seed + k, [n for n in range(2000) if n % procs == k], log_dir, queue))
        for k in range(procs)]
    for w in workers:
        w.start()
    results = [queue.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    shutil.rmtree(log_dir, ignore_errors=True)
    starts = [s for r in results for s in r[0]]
    ends = [e for r in results for e in r[1]]
    latencies = [x for r in results for x in r[2]]
    outcomes = {k: sum(r[3][k] for r in results) for k in ("ACCEPTED", "REJECTED")}
    total = 0
    for partition in ("A", "B"):
        with psycopg.connect(bank.database_dsn(dsn, partition)) as pg:
            total += pg.execute("SELECT sum(balance) FROM accounts").fetchone()[0]  # type: ignore[index]
    seconds = max(ends) - min(starts)
    return {"transactions": len(latencies), "seconds": round(seconds, 3),
            "tx_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(percentile(latencies, 0.50), 2),
            "p99_ms": round(percentile(latencies, 0.99), 2), "outcomes": outcomes,
            "violations": int(total != 2000 * bank.INITIAL_BALANCE),
            # CPU of the worker processes (start-up included; PostgreSQL's not counted,
            # as in the router cases)
            "cpu_us_per_tx": {"workers": round(1e6 * sum(r[4] for r in results)
                                               / len(latencies))}}


def replay_round(url: str, dsn: str, root: Path, seed: int) -> dict[str, Any]:
    """Kill -9 of A's primary (before its vote on its 20th transaction) with a standby
    registered: seconds from the kill to that transaction's outcome at the client."""
    bank.setup_databases(dsn)
    fleet = Fleet(url, dsn, root)
    try:
        _primary, primary_log = fleet.server("A", "primary", False,
                                            env={"BANK_CRASH_AT": "before_vote:20"})
        fleet.server("A", "standby", False)
        fleet.server("B", "primary", False)
        client, log = fleet.client(40, seed, ["--cross-only"])
        client.wait(timeout=300)
        crash = next(w for w in (line.split() for line in primary_log.read_text().splitlines())
                 if w and w[0] == "CRASH")
        tid, killed_at = crash[2], float(crash[3])
        outcome = next(w for w in (line.split() for line in log.read_text().splitlines())
                   if w and w[0] == "OUTCOME" and w[1] == tid)
        return {"replay_seconds": round(float(outcome[5]) - killed_at, 4),
                "outcome": outcome[2]}
    finally:
        fleet.close()


def median_of(rounds: list[dict[str, Any]], key: str) -> float:
    return round(float(statistics.median(r[key] for r in rounds)), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 2,
                        help="client processes, and server processes per partition")
    parser.add_argument("--count", type=int, default=300, help="transfers per client")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=None, help="a PostgreSQL server (default: private)")
    parser.add_argument("--only", default=None, help="comma-separated cases to run")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": machine(), "procs": args.procs,
                              "count_per_client": args.count, "rounds": args.rounds,
                              "cases": {}}
    root = Path(tempfile.mkdtemp(prefix="txb-rtr-bench-"))
    postgres = None
    if args.dsn is None:
        from tests.tm.pg import PostgresServer

        postgres = PostgresServer().start()
    dsn = args.dsn or postgres.dsn  # type: ignore[union-attr]
    broker = Broker(root)
    try:
        cases: dict[str, Any] = {
            f"rtr-{p}p-{mode}": (lambda r, p=p, e=(mode == "explicit"): rtr_round(
                broker.url, broker.proc.pid, dsn, root, p, e, args.procs, args.count,
                1000 * r))
            for p in (1, 2) for mode in ("implicit", "explicit")}
        cases["xa-2db"] = lambda r: xa_round(dsn, args.procs, args.count, 1000 * r)
        cases["replay"] = lambda r: replay_round(broker.url, dsn, root, 1000 * r)
        wanted = set(args.only.split(",")) if args.only else set(cases)
        if wanted - {"xa-2db"}:
            bank.define_facility(broker.url)
        for name, run in cases.items():
            if name not in wanted:
                continue
            rounds = [run(r) for r in range(args.rounds)]
            key = "replay_seconds" if name == "replay" else "tx_per_s"
            summary: dict[str, Any] = {"rounds": rounds, f"median_{key}": median_of(rounds, key)}
            if name != "replay":
                summary["median_p50_ms"] = median_of(rounds, "p50_ms")
                summary["median_p99_ms"] = median_of(rounds, "p99_ms")
                summary["violations"] = sum(r["violations"] for r in rounds)
            if name != "replay":
                summary["cpu_us_per_tx"] = [r["cpu_us_per_tx"] for r in rounds]
            report["cases"][name] = summary
            print(name, json.dumps({k: v for k, v in summary.items() if k != "rounds"}),
                  flush=True)
    finally:
        broker.stop()
        if postgres is not None:
            postgres.stop()
        shutil.rmtree(root, ignore_errors=True)
    report["machine"]["load_after"] = loadavg()
    cases_done = report["cases"]
    if "xa-2db" in cases_done:
        xa = cases_done["xa-2db"]["median_tx_per_s"]
        report["ratios_to_xa"] = {name: round(c["median_tx_per_s"] / xa, 2)
                                  for name, c in cases_done.items()
                                  if name.startswith("rtr-")}
        print("router / XA:", report["ratios_to_xa"])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"router-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"load {report['machine']['load_before']} -> {report['machine']['load_after']}; "
          f"results: {path}")


if __name__ == "__main__":
    main()
