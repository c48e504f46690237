"""Benchmark: XA dequeue + PostgreSQL insert, global tx/s, against PostgreSQL's own 2PC.

One command; it starts its own broker (journal store, ``--sync fdatasync``) and its
own PostgreSQL (``initdb`` in a temporary directory, a free port; default settings
except ``max_prepared_transactions`` and ``max_connections``, see tests/tm/pg.py),
then for each rep:

(a) fills a queue with ``--count`` messages and runs ``--workers`` worker
    **processes**; each runs an :class:`~txbroker.tm.aio.AsyncTransactionManager`
    (its own decision log, group commit across its transactions) with
    ``--inflight`` global transactions in flight, each on its own txbroker
    connection and psycopg connection: begin (xa_start pipelined + BEGIN), receive
    + ack, INSERT, commit (prepares concurrently, the decision synced, the commits
    concurrently). Checked after the rep: rows in PostgreSQL == messages gone from
    the queue == ``--count``, no prepared transaction in PostgreSQL, no branch left
    in the broker;
(b) PostgreSQL's own two-phase commit with the same processes and connections:
    BEGIN; the same INSERT; PREPARE TRANSACTION; COMMIT PREPARED (psycopg's
    ``tpc_begin`` / ``tpc_prepare`` / ``tpc_commit``). Checked the same way.

Reports the medians over ``--reps`` of both rates, their ratio (a)/(b), p50/p99
latency of one global transaction, the load average, and writes
bench/results/xa-<timestamp>.json::

    flock /tmp/txb-bench.lock python bench/xa_dequeue_insert.py --workers 4 \\
        --inflight 8 --count 10000 --reps 3

``--url``/``--dsn`` use a running broker / PostgreSQL instead (the table and the
queue are created and emptied).

``--threads N`` (issue 30: "a user with threads and the sync client is a user
too") runs both phases in ONE worker process with N threads instead, each with
a sync txbroker connection and a sync psycopg connection (bench/xa_sync_worker.py):
the XA phase through the sync ``TransactionManager`` (``--sync-driver tm``, the
default) or the ``tpc_*`` calls on both connections by hand (``--sync-driver
tpc``), PostgreSQL's phase with psycopg's sync ``tpc_*``. The report adds the wall
time of each step and the kernel's share of the worker's CPU::

    flock /tmp/txb-bench.lock python bench/xa_dequeue_insert.py --threads 8 \
        --count 3000 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

import txbroker  # noqa: E402
from txbroker.client.aio import open_connection  # noqa: E402
from txbroker.tm.aio import (  # noqa: E402
    AsyncBrokerParticipant,
    AsyncPostgresParticipant,
    AsyncTransactionManager,
)

TABLE = "bench_orders"
INSERT = f"INSERT INTO {TABLE} (id, body) VALUES (%s, %s)"
BODY = b"x" * 100


#: The only PostgreSQL settings the bench changes: two-phase commit needs prepared
#: transactions (default 0), and every in-flight transaction has its own connection.
PG_SETTINGS = {"max_prepared_transactions": 250, "max_connections": 250}


def bench_postgres(settings: dict[str, int]) -> Any:
    """tests/tm/pg.py's throw-away server (initdb in a temp dir, a free port) with
    ``settings``."""
    from tests.tm.pg import PostgresServer

    class BenchPostgres(PostgresServer):
        def pg_ctl_start(self) -> None:
            options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 " + \
                " ".join(f"-c {k}={v}" for k, v in settings.items())
            self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l",
                      str(self.root / "log"), "-w", "start")

    return BenchPostgres().start()


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


async def _xa_slot(tm: AsyncTransactionManager, url: str, dsn: str, queue: str, todo: int,
                   ready: list[Any], go: asyncio.Event, latencies: list[float],
                   spent: dict[str, float]) -> None:
    conn = await open_connection(url, timeout=30)
    pg = await psycopg.AsyncConnection.connect(dsn)
    try:
        broker, db = AsyncBrokerParticipant(conn), AsyncPostgresParticipant(pg)
        ready.append(1)
        await go.wait()
        for _ in range(todo):
            start = time.monotonic()
            # the receive overlaps the branches' begin (PostgreSQL's BEGIN round trip)
            # and shares a write with the pipelined xa_start; the ack, sent after
            # xa_start, is what puts the message in the branch
            gtx, message = await asyncio.gather(tm.begin([broker, db]),
                                                conn.receive(queue, timeout=10))
            t1 = time.monotonic()
            if message is None:
                raise RuntimeError("the queue ran dry before the count was reached")
            await pg.execute(INSERT, (message.message_id, message.body))
            t2 = time.monotonic()
            await message.ack()  # pipelined: one write with xa_end + xa_prepare
            t3 = time.monotonic()
            await gtx.commit()
            end = time.monotonic()
            latencies.append(end - start)
            spent["begin+receive"] += t1 - start
            spent["insert"] += t2 - t1
            spent["ack"] += t3 - t2
            for phase, seconds in gtx.timings.items():
                spent[f"commit.{phase}"] += seconds
    finally:
        await pg.close()
        await conn.close()


async def _pg_slot(dsn: str, worker: int, slot: int, todo: int, ready: list[Any],
                   go: asyncio.Event, latencies: list[float]) -> None:
    pg = await psycopg.AsyncConnection.connect(dsn)
    try:
        ready.append(1)
        await go.wait()
        for n in range(todo):
            start = time.monotonic()
            row = f"pg-{worker}-{slot}-{n}"
            await pg.tpc_begin(pg.xid(1, row, "postgres"))
            await pg.execute(INSERT, (row, BODY))
            await pg.tpc_prepare()
            await pg.tpc_commit()
            latencies.append(time.monotonic() - start)
    finally:
        await pg.close()


async def _worker_main(kind: str, worker: int, url: str, dsn: str, queue: str, slots: list[int],
                       log_dir: str, ready_q: Any, go_ev: Any) -> dict[str, Any]:
    latencies: list[float] = []
    spent: dict[str, float] = defaultdict(float)
    ready: list[Any] = []
    go = asyncio.Event()
    tm = AsyncTransactionManager(Path(log_dir) / f"tm-{worker}.log")
    if kind == "xa":
        tasks = [asyncio.create_task(_xa_slot(tm, url, dsn, queue, n, ready, go, latencies,
                                                  spent))
                 for n in slots]
    else:
        tasks = [asyncio.create_task(_pg_slot(dsn, worker, i, n, ready, go, latencies))
                 for i, n in enumerate(slots)]
    while len(ready) < len(tasks):
        for task in tasks:
            if task.done():
                task.result()  # raise a connection failure
        await asyncio.sleep(0.01)
    ready_q.put(worker)
    await asyncio.to_thread(go_ev.wait)
    start, cpu = time.monotonic(), time.process_time()
    go.set()
    await asyncio.gather(*tasks)
    end, cpu = time.monotonic(), time.process_time() - cpu
    tm.close()
    return {"start": start, "end": end, "latencies": latencies, "cpu": cpu,
            "counters": tm.counters, "decision_batches": tm.decisions.batches,
            "decisions": tm.decisions.decided, "spent": dict(spent)}


def _worker(kind: str, worker: int, url: str, dsn: str, queue: str, slots: list[int],
            log_dir: str, ready_q: Any, go_ev: Any, out_q: Any, driver: str = "tm") -> None:
    try:
        if kind.endswith("_sync"):  # --threads: one process, a thread per slot
            from xa_sync_worker import sync_worker_main
            out_q.put(("ok", worker, sync_worker_main(kind, driver, worker, url, dsn, queue,
                                                      slots, log_dir, ready_q, go_ev)))
            return
        try:
            import uvloop
            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            runner = asyncio.Runner()
        with runner:
            result = runner.run(_worker_main(kind, worker, url, dsn, queue, slots, log_dir,
                                             ready_q, go_ev))
        out_q.put(("ok", worker, result))
    except BaseException as exc:  # reported to the parent
        ready_q.put(worker)
        out_q.put(("error", worker, repr(exc)))


TICK = os.sysconf("SC_CLK_TCK")
_NEXT_TO_PYTHON = Path(sys.executable).parent / "py-spy"
PY_SPY = str(_NEXT_TO_PYTHON) if _NEXT_TO_PYTHON.exists() else "py-spy"


def _proc_cpu(pid: int, children: bool = False) -> float:
    """CPU seconds of ``pid`` (user + system; ``children``: plus its reaped children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def _pg_cpu(postmaster: int | None) -> float:
    """CPU seconds of a PostgreSQL cluster: the postmaster with its reaped backends, and
    the processes still running under it."""
    if postmaster is None:
        return 0.0
    total = _proc_cpu(postmaster, children=True)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == postmaster:
            total += _proc_cpu(int(stat.parent.name))
    return total


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_phase(kind: str, args: argparse.Namespace, url: str, dsn: str, log_dir: str,
              pids: dict[str, int | None], profile: Path | None = None) -> dict[str, Any]:
    """Run ``--workers`` processes once: the rate, latencies, the CPU each component
    spent per transaction, and the TM's counters. ``profile``: py-spy the broker and the
    first worker meanwhile (raw stacks into that directory)."""
    ctx = multiprocessing.get_context("spawn")
    ready_q, out_q, go_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    per_worker = _split(args.count, args.workers)
    procs = [ctx.Process(target=_worker, args=(kind, w, url, dsn, args.queue,
                                               _split(per_worker[w], args.inflight), log_dir,
                                               ready_q, go_ev, out_q, args.sync_driver))
             for w in range(args.workers)]
    for p in procs:
        p.start()
    for _ in procs:
        ready_q.get(timeout=120)
    load_before = os.getloadavg()
    cpu_before = (_proc_cpu(pids["broker"] or 0), _pg_cpu(pids["postgres"]),
                  time.monotonic())
    spies = []
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        targets = {"worker": procs[0].pid, "broker": pids["broker"]}
        spies = [subprocess.Popen(
            [PY_SPY, "record", "-f", "raw", "-r", "250", "-d", str(args.profile_seconds),
             "-o", str(profile / f"{kind}-{name}.raw"), "--pid", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in targets.items() if pid]
    go_ev.set()
    results = [out_q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for spy in spies:
        spy.wait(timeout=120)
    wall = time.monotonic() - cpu_before[2]
    data = [r[2] for r in results if r[0] == "ok"]
    cpu = {"broker": _proc_cpu(pids["broker"] or 0) - cpu_before[0],
           "postgres": _pg_cpu(pids["postgres"]) - cpu_before[1],
           "workers": sum(d["cpu"] for d in data)}
    errors = [r for r in results if r[0] != "ok"]
    if errors:
        raise RuntimeError(f"{kind} workers failed: {errors}")
    data = [r[2] for r in results]
    start = min(d["start"] for d in data)
    end = max(d["end"] for d in data)
    latencies = [x for d in data for x in d["latencies"]]
    out = {
        "tx_per_s": round(args.count / (end - start), 1),
        "seconds": round(end - start, 3),
        "p50_ms": round(1000 * _percentile(latencies, 0.50), 2),
        "p99_ms": round(1000 * _percentile(latencies, 0.99), 2),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        # CPU milliseconds per transaction, per component (workers: the client processes
        # from the start signal to their last transaction); cpu_busy: of the machine's CPUs
        "cpu_ms_per_tx": {k: round(1000 * v / args.count, 3) for k, v in cpu.items()},
        "cpu_busy": round(sum(cpu.values()) / wall / (os.cpu_count() or 1), 3),
    }
    if "cpu_system" in data[0]:  # --threads: how much of the workers' CPU was the kernel's
        out["workers_system_ms_per_tx"] = round(1000 * sum(d["cpu_system"] for d in data)
                                                / args.count, 3)
    if kind.startswith("xa"):
        counters: dict[str, int] = {}
        for d in data:
            for key, value in d["counters"].items():
                counters[key] = counters.get(key, 0) + value
        out["counters"] = counters
        spent: dict[str, float] = defaultdict(float)
        for d in data:
            for key, value in d["spent"].items():
                spent[key] += value
        # mean milliseconds one transaction spends in each phase (wall clock)
        out["ms_per_tx"] = {k: round(1000 * v / args.count, 3) for k, v in spent.items()}
        batches = sum(d["decision_batches"] for d in data)
        out["decisions_per_log_sync"] = round(sum(d["decisions"] for d in data)
                                              / max(1, batches), 2)
    return out


def prepare_rep(args: argparse.Namespace, url: str, dsn: str, rep: int = 0) -> None:
    """An empty table, no prepared transactions, ``--count`` messages in the queue (ids
    unique per rep: the broker drops a message id it saw recently as a duplicate)."""
    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id text PRIMARY KEY, body bytea)")
        pg.execute(f"TRUNCATE {TABLE}")
    with txbroker.connect(url) as conn:
        conn.declare_queue(args.queue)
        conn.purge_queue(args.queue)
        futures = [conn.send_nowait(args.queue, BODY, message_id=f"r{rep}-m{i}")
                   for i in range(args.count)]
        for future in futures:
            future.result(timeout=120)
        depth = conn.queue_info(args.queue)
        assert _depth(depth) == args.count, depth


def _depth(info: dict[str, Any]) -> int:
    for key in ("depth", "messages", "ready"):
        if key in info:
            return int(info[key])
    raise KeyError(f"no depth in {info}")


def verify(kind: str, args: argparse.Namespace, url: str, dsn: str) -> dict[str, Any]:
    """Exact counts after a phase; raises when anything is off."""
    with psycopg.connect(dsn, autocommit=True) as pg:
        rows = pg.execute(f"SELECT count(*) FROM {TABLE}").fetchone()
        prepared = pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()
    assert rows is not None and prepared is not None
    checked = {"rows": int(rows[0]), "pg_prepared": int(prepared[0])}
    if kind.startswith("xa"):
        with txbroker.connect(url) as conn:
            checked["queue_depth"] = _depth(conn.queue_info(args.queue))
            checked["broker_branches"] = len(conn.xa_branches())
        consumed = args.count - checked["queue_depth"]
        if consumed != checked["rows"] or checked["broker_branches"]:
            raise AssertionError(f"XA rep is inconsistent: {checked}")
    if checked["rows"] != args.count or checked["pg_prepared"]:
        raise AssertionError(f"{kind} rep is inconsistent: {checked}")
    return checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--inflight", type=int, default=8,
                        help="global transactions in flight per worker process")
    parser.add_argument("--count", type=int, default=10000, help="transactions per phase")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--queue", default="bench-xa")
    parser.add_argument("--url", help="a running broker (default: start one)")
    parser.add_argument("--dsn", help="a running PostgreSQL (default: start one)")
    parser.add_argument("--json", type=Path, help="result file (default bench/results/xa-<ts>)")
    parser.add_argument("--profile", type=Path,
                        help="py-spy the broker and one worker during rep 1 (raw stacks here)")
    parser.add_argument("--profile-seconds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0,
                        help="instead: ONE worker process with this many threads, each with a "
                             "sync txbroker and a sync psycopg connection (xa_sync_worker.py)")
    parser.add_argument("--sync-driver", choices=("tm", "tpc"), default="tm",
                        help="with --threads: the sync TransactionManager (default) or the "
                             "tpc_* calls by hand")
    args = parser.parse_args()
    if args.threads:
        args.workers, args.inflight = 1, args.threads
    xa_kind, pg_kind = ("xa_sync", "pg_sync") if args.threads else ("xa", "pg")
    if args.workers * args.inflight > 240:
        parser.error("workers × inflight must stay ≤ 240 (max_connections = 250)")

    work = Path(tempfile.mkdtemp(prefix="txb-xa-bench-"))
    stack: list[Any] = []
    try:
        url, dsn = args.url, args.dsn
        broker_pid = None
        postmaster = None
        if dsn is None:
            server = bench_postgres(PG_SETTINGS)
            stack.append(server.stop)
            dsn = server.dsn
            postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
            pg_settings = {**PG_SETTINGS, "others": "initdb defaults"}
        else:
            pg_settings = {"external": dsn}
        if url is None:
            from tests.support import BrokerProcess
            broker = BrokerProcess(work / "data", "--store", "journal", "--sync",
                                   "fdatasync").start()
            stack.append(broker.kill)
            url = broker.url
            broker_pid = broker.proc.pid if broker.proc else None
        with psycopg.connect(dsn, autocommit=True) as pg:
            version = pg.execute("SHOW server_version").fetchone()
            fsync = pg.execute("SHOW fsync").fetchone()
            sync_commit = pg.execute("SHOW synchronous_commit").fetchone()
        reps = []
        for rep in range(args.reps):
            log_dir = work / f"tm-{rep}"
            log_dir.mkdir()
            prepare_rep(args, url, dsn, rep)
            pids = {"broker": broker_pid, "postgres": postmaster}
            profile = args.profile if rep == 0 else None
            xa = run_phase(xa_kind, args, url, dsn, str(log_dir), pids, profile)
            xa["checked"] = verify(xa_kind, args, url, dsn)
            with psycopg.connect(dsn, autocommit=True) as pg:
                pg.execute(f"TRUNCATE {TABLE}")
            pg2pc = run_phase(pg_kind, args, url, dsn, str(log_dir), pids, profile)
            pg2pc["checked"] = verify(pg_kind, args, url, dsn)
            ratio = round(xa["tx_per_s"] / pg2pc["tx_per_s"], 3)
            reps.append({"xa": xa, "pg_2pc": pg2pc, "ratio": ratio})
            print(f"rep {rep + 1}: XA {xa['tx_per_s']} tx/s (p50 {xa['p50_ms']} ms, p99 "
                  f"{xa['p99_ms']} ms), PostgreSQL 2PC {pg2pc['tx_per_s']} tx/s (p50 "
                  f"{pg2pc['p50_ms']} ms, p99 {pg2pc['p99_ms']} ms), ratio {ratio}",
                  flush=True)
        summary = {
            "bench": "xa_dequeue_insert",
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "workers": args.workers, "inflight_per_worker": args.inflight,
            "threads": args.threads, "sync_driver": args.sync_driver if args.threads else None,
            "count": args.count, "reps": args.reps,
            "broker": {"store": "journal", "sync": "fdatasync", "pid": broker_pid,
                       "url": url if args.url else "started by the bench"},
            "postgres": {"version": version[0] if version else None,
                         "fsync": fsync[0] if fsync else None,
                         "synchronous_commit": sync_commit[0] if sync_commit else None,
                         "settings": pg_settings},
            "cpus": os.cpu_count(),
            "median": {
                "xa_tx_per_s": statistics.median(r["xa"]["tx_per_s"] for r in reps),
                "pg_2pc_tx_per_s": statistics.median(r["pg_2pc"]["tx_per_s"] for r in reps),
                "ratio": statistics.median(r["ratio"] for r in reps),
                "xa_p50_ms": statistics.median(r["xa"]["p50_ms"] for r in reps),
                "xa_p99_ms": statistics.median(r["xa"]["p99_ms"] for r in reps),
                "pg_2pc_p50_ms": statistics.median(r["pg_2pc"]["p50_ms"] for r in reps),
                "pg_2pc_p99_ms": statistics.median(r["pg_2pc"]["p99_ms"] for r in reps),
            },
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "reps_detail": reps,
        }
        text = json.dumps(summary, indent=2)
        print(json.dumps(summary["median"], indent=2))
        target = args.json or ROOT / "bench" / "results" / (
            "xa-" + time.strftime("%Y%m%d-%H%M%S") + ".json")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
        print(f"written {target}")
    finally:
        for stop in reversed(stack):
            try:
                stop()
            except Exception as exc:  # keep stopping the rest
                print(f"cleanup: {exc}", file=sys.stderr)


if __name__ == "__main__":
    main()
