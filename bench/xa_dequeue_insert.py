"""Benchmark: global transactions per second for dequeue + insert (broker + PostgreSQL).

Each of ``--workers`` threads has its own txbroker connection and psycopg connection and
runs ``txbroker.tm.example.dequeue_and_insert`` in a loop; all share one
TransactionManager (one decision log: group commit). Prints tx/s and where the time of
one transaction goes (mean ms per phase, per worker).

    python bench/xa_dequeue_insert.py --url txb://127.0.0.1:5445 \\
        --dsn "host=127.0.0.1 port=5432 user=postgres dbname=postgres" --count 4000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

import txbroker
from txbroker.tm import BrokerParticipant, PostgresParticipant, TransactionManager
from txbroker.xid import Xid


class Timed:
    """Wrap a participant and add the seconds spent in each call to ``spent``."""

    def __init__(self, inner: Any, spent: dict[str, float]) -> None:
        self.inner, self.spent = inner, spent
        self.sort_key = inner.sort_key

    def _timed(self, name: str, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return getattr(self.inner, name)(*args)
        finally:
            self.spent[f"{self.sort_key}.{name}"] += time.perf_counter() - start

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


def worker(tm: TransactionManager, url: str, dsn: str, queue: str, todo: list[int],
           lock: threading.Lock, spent: dict[str, float]) -> None:
    with txbroker.connect(url) as conn, psycopg.connect(dsn) as pg:
        broker = Timed(BrokerParticipant(conn), spent)
        db = Timed(PostgresParticipant(pg), spent)
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            start = time.perf_counter()
            gtx = tm.begin([broker, db])
            t0 = time.perf_counter()
            message = conn.receive(queue, timeout=5)
            assert message is not None
            message.ack()
            t1 = time.perf_counter()
            pg.execute("INSERT INTO bench_orders (id, body) VALUES (%s, %s)",
                       (message.message_id, message.body))
            t2 = time.perf_counter()
            gtx.commit()
            t3 = time.perf_counter()
            spent["begin"] += t0 - start
            spent["receive+ack"] += t1 - t0
            spent["insert"] += t2 - t1
            spent["commit"] += t3 - t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--queue", default="bench-xa")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with psycopg.connect(args.dsn, autocommit=True) as pg:
        pg.execute("CREATE TABLE IF NOT EXISTS bench_orders (id text PRIMARY KEY, body bytea)")
        pg.execute("TRUNCATE bench_orders")
    with txbroker.connect(args.url) as conn:
        conn.declare_queue(args.queue)
        conn.purge_queue(args.queue)
        for i in range(args.count):
            conn.send(args.queue, b"x" * 100, message_id=f"m{i}")
    log_dir = Path(tempfile.mkdtemp(prefix="txb-tm-"))
    tm = TransactionManager(log_dir / "tm.log")
    spent: dict[str, float] = defaultdict(float)
    todo = list(range(args.count))
    lock = threading.Lock()
    decide = tm.log.decide

    def timed_decide(gtrid: bytes) -> None:
        start = time.perf_counter()
        decide(gtrid)
        spent["log.decide"] += time.perf_counter() - start

    tm.log.decide = timed_decide  # type: ignore[method-assign]
    threads = [threading.Thread(target=worker, args=(tm, args.url, args.dsn, args.queue, todo,
                                                     lock, spent))
               for _ in range(args.workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    with psycopg.connect(args.dsn, autocommit=True) as pg:
        rows = pg.execute("SELECT count(*) FROM bench_orders").fetchone()[0]
    summary = {
        "workers": args.workers, "transactions": args.count, "rows": rows,
        "seconds": round(elapsed, 2), "global_tx_per_s": round(args.count / elapsed, 1),
        "log_syncs": tm.log.syncs,
        # mean milliseconds one transaction spends in each phase (commit = the votes +
        # log.decide + the finishes)
        "ms_per_tx": {k: round(1000 * v / args.count, 3) for k, v in sorted(spent.items())},
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    tm.close()


if __name__ == "__main__":
    main()
