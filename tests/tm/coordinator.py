"""A coordinator process for the crash matrix: dequeue one message and insert its row.

Usage: python -m tests.tm.coordinator URL DSN LOG STEP MODE BROKER_PID [PG_DATA]
MODE ``coordinator``: kill -9 ourselves at STEP; ``broker``: kill -9 the broker at STEP
and carry on; ``postgres``: stop PostgreSQL at once (``pg_ctl -m immediate``, a crash
without checkpoint) at STEP and carry on. Prints ``RESULT <outcome>`` at the end.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg

import txbroker
from tests.tm.pg import PostgresServer, pg_bindir
from txbroker.tm import RolledBack, TransactionManager
from txbroker.tm.example import dequeue_and_insert


def crash_hook(step: str, mode: str, broker_pid: str, pg_data: str) -> Callable[[str], None]:
    """The TM hook that, at ``step``, kills what ``mode`` names (see the module's doc);
    shared with the asyncio coordinator (tests/tm/coordinator_aio.py)."""

    def hook(at: str) -> None:
        if at != step:
            return
        if mode == "coordinator":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "broker":
            os.kill(int(broker_pid), signal.SIGKILL)
        elif mode == "postgres":
            server = PostgresServer.__new__(PostgresServer)
            server.data, server.bindir = Path(pg_data), pg_bindir() or Path()
            server.as_root = os.geteuid() == 0
            server.kill()

    return hook


def main() -> None:
    url, dsn, log_path, step, mode, broker_pid = sys.argv[1:7]
    pg_data = sys.argv[7] if len(sys.argv) > 7 else ""
    hook = crash_hook(step, mode, broker_pid, pg_data)
    tm = TransactionManager(log_path, hook=hook)
    conn = txbroker.connect(url, reconnect=False, timeout=5)
    pg = psycopg.connect(dsn)
    try:
        row = dequeue_and_insert(tm, conn, pg, "orders", hook=hook)
        print(f"RESULT committed {row}", flush=True)
    except RolledBack as exc:
        print(f"RESULT rolled_back {exc}", flush=True)
    finally:
        tm.close()
        os._exit(0)  # do not wait for a dead broker in close()


if __name__ == "__main__":
    main()
