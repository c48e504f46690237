"""The threads + sync client worker of bench/xa_dequeue_insert.py (``--threads N``).

One worker process runs N threads; each has its own sync txbroker connection
(``txbroker.connect``) and its own sync psycopg connection, as a threaded
application would. Kinds:

``xa_sync`` (``--sync-driver tm``, the default): the sync
    :class:`~txbroker.tm.TransactionManager` (one per process, its decision log
    group-committed across the threads) with :class:`~txbroker.tm.BrokerParticipant`
    and :class:`~txbroker.tm.PostgresParticipant`, docs/tm.md's classic case::

        with tm.begin([BrokerParticipant(conn), PostgresParticipant(pg)]):
            msg = conn.receive(queue, timeout=10)
            pg.execute(INSERT, (msg.message_id, msg.body))
            msg.ack()

``xa_sync`` (``--sync-driver tpc``): the DB-API TPC calls on both connections
    by hand, without a decision log (what issue 30's independent run did)::

        conn.tpc_begin(xid); pg.tpc_begin(xid)
        msg = conn.receive(...); pg.execute(INSERT, ...); msg.ack()
        pg.tpc_prepare(); conn.tpc_prepare(); pg.tpc_commit(); conn.tpc_commit()

``pg_sync``: PostgreSQL's own 2PC on the same threads and psycopg connections
    (``tpc_begin`` / INSERT / ``tpc_prepare`` / ``tpc_commit``).

The wall time of each step (and, with the TM, of each participant call) is summed
per step name, for the report's ``ms_per_tx``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

import txbroker
from txbroker.tm import BrokerParticipant, PostgresParticipant, TransactionManager
from txbroker.xid import Xid

TABLE = "bench_orders"
INSERT = f"INSERT INTO {TABLE} (id, body) VALUES (%s, %s)"
BODY = b"x" * 100


class Timed:
    """A participant that sums the wall time of each call of the one it wraps."""

    def __init__(self, inner: Any, spent: dict[str, float]) -> None:
        self.inner = inner
        self.spent = spent
        self.sort_key = inner.sort_key

    def _timed(self, name: str, *args: Any) -> Any:
        start = time.monotonic()
        try:
            return getattr(self.inner, name)(*args)
        finally:
            self.spent[f"{self.sort_key}.{name}"] += time.monotonic() - start

    def begin(self, xid: Xid) -> None:
        self._timed("begin", xid)

    def vote(self, xid: Xid) -> bool:
        return bool(self._timed("vote", xid))

    def commit_one_phase(self, xid: Xid) -> None:
        self._timed("commit_one_phase", xid)

    def finish(self, xid: Xid, commit: bool) -> bool:
        return bool(self._timed("finish", xid, commit))

    def abort(self, xid: Xid) -> None:
        self._timed("abort", xid)


def _xa_tm(tm: TransactionManager, conn: Any, pg: Any, queue: str, todo: int,
           latencies: list[float], spent: dict[str, float]) -> None:
    parts = [Timed(BrokerParticipant(conn), spent), Timed(PostgresParticipant(pg), spent)]
    for _ in range(todo):
        start = time.monotonic()
        gtx = tm.begin(parts)
        t1 = time.monotonic()
        message = conn.receive(queue, timeout=10)
        t2 = time.monotonic()
        if message is None:
            raise RuntimeError("the queue ran dry before the count was reached")
        pg.execute(INSERT, (message.message_id, message.body))
        t3 = time.monotonic()
        message.ack()
        t4 = time.monotonic()
        gtx.commit()
        end = time.monotonic()
        latencies.append(end - start)
        for step, seconds in (("begin", t1 - start), ("receive", t2 - t1),
                              ("insert", t3 - t2), ("ack", t4 - t3), ("commit", end - t4)):
            spent[step] += seconds


def _xa_tpc(conn: Any, pg: Any, queue: str, name: str, todo: int, latencies: list[float],
            spent: dict[str, float]) -> None:
    for n in range(todo):
        start = time.monotonic()
        gtrid = f"tpc-{name}-{n}"
        conn.tpc_begin(conn.xid(1, gtrid, "txbroker"))
        pg.tpc_begin(pg.xid(1, gtrid, "postgres"))
        t1 = time.monotonic()
        message = conn.receive(queue, timeout=10)
        t2 = time.monotonic()
        if message is None:
            raise RuntimeError("the queue ran dry before the count was reached")
        pg.execute(INSERT, (message.message_id, message.body))
        t3 = time.monotonic()
        message.ack()
        t4 = time.monotonic()
        pg.tpc_prepare()
        t5 = time.monotonic()
        conn.tpc_prepare()
        t6 = time.monotonic()
        pg.tpc_commit()
        t7 = time.monotonic()
        conn.tpc_commit()
        end = time.monotonic()
        latencies.append(end - start)
        for step, seconds in (("begin", t1 - start), ("receive", t2 - t1),
                              ("insert", t3 - t2), ("ack", t4 - t3),
                              ("postgres.prepare", t5 - t4), ("txbroker.prepare", t6 - t5),
                              ("postgres.commit", t7 - t6), ("txbroker.commit", end - t7)):
            spent[step] += seconds


def _pg(pg: Any, name: str, todo: int, latencies: list[float]) -> None:
    for n in range(todo):
        start = time.monotonic()
        row = f"pg-{name}-{n}"
        pg.tpc_begin(pg.xid(1, row, "postgres"))
        pg.execute(INSERT, (row, BODY))
        pg.tpc_prepare()
        pg.tpc_commit()
        latencies.append(time.monotonic() - start)


def sync_worker_main(kind: str, driver: str, worker: int, url: str, dsn: str, queue: str,
                     slots: list[int], log_dir: str, ready_q: Any,
                     go_ev: Any) -> dict[str, Any]:
    """Run one thread per slot (``slots[i]`` transactions each) once ``go_ev`` is set."""
    latencies: list[float] = []
    spent: dict[str, float] = defaultdict(float)
    tm = TransactionManager(Path(log_dir) / f"tm-sync-{worker}.log")
    ready = threading.Barrier(len(slots) + 1)
    go = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def thread_main(index: int, todo: int) -> None:
        conn = txbroker.connect(url, timeout=30) if kind == "xa_sync" else None
        pg = psycopg.connect(dsn)
        mine: list[float] = []
        my_spent: dict[str, float] = defaultdict(float)
        try:
            ready.wait()
            go.wait()
            name = f"{worker}-{index}"
            if kind == "pg_sync":
                _pg(pg, name, todo, mine)
            elif driver == "tm":
                _xa_tm(tm, conn, pg, queue, todo, mine, my_spent)
            else:
                _xa_tpc(conn, pg, queue, name, todo, mine, my_spent)
        except BaseException as exc:
            errors.append(exc)
            if ready.n_waiting:
                ready.abort()
        finally:
            with lock:
                latencies.extend(mine)
                for key, value in my_spent.items():
                    spent[key] += value
            pg.close()
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=thread_main, args=(i, n), name=f"xa-{i}")
               for i, n in enumerate(slots)]
    for thread in threads:
        thread.start()
    ready.wait(timeout=120)
    ready_q.put(worker)
    go_ev.wait()
    start, cpu, times = time.monotonic(), time.process_time(), os.times()
    go.set()
    for thread in threads:
        thread.join()
    end, cpu, times_after = time.monotonic(), time.process_time() - cpu, os.times()
    tm.close()
    if errors:
        raise errors[0]
    return {"start": start, "end": end, "latencies": latencies, "cpu": cpu,
            "counters": dict(tm.counters), "decision_batches": tm.log.syncs,
            "decisions": tm.counters["committed"] if driver == "tm" else 0,
            "spent": dict(spent),
            # of ``cpu``: in the kernel (thread wake-ups, socket calls, fsyncs), and user
            "cpu_system": times_after.system - times.system,
            "cpu_user": times_after.user - times.user}
