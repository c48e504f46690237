"""The crash matrix's coordinator for the asyncio manager (``txbroker.tm.aio``).

Usage: python -m tests.tm.coordinator_aio URL DSN LOG STEP MODE BROKER_PID [PG_DATA]
Like ``tests.tm.coordinator``: dequeue one message and insert its row in one global
transaction of an :class:`~txbroker.tm.aio.AsyncTransactionManager`, crashing at
STEP (one of ``ASYNC_STEPS``). MODE ``coordinator``: kill -9 ourselves; ``broker``:
kill -9 the broker and carry on; ``postgres``: crash PostgreSQL and carry on.
Prints ``RESULT <outcome>``.
"""

from __future__ import annotations

import asyncio
import os
import sys

import psycopg

from tests.tm.coordinator import crash_hook
from txbroker.client.aio import open_connection
from txbroker.tm import RolledBack
from txbroker.tm.aio import (
    AsyncBrokerParticipant,
    AsyncPostgresParticipant,
    AsyncTransactionManager,
)


async def run(url: str, dsn: str, log_path: str, step: str, mode: str, broker_pid: str,
              pg_data: str) -> None:
    hook = crash_hook(step, mode, broker_pid, pg_data)
    tm = AsyncTransactionManager(log_path, hook=hook)
    conn = await open_connection(url, reconnect=False, timeout=5)
    pg = await psycopg.AsyncConnection.connect(dsn)
    try:
        gtx = await tm.begin([AsyncBrokerParticipant(conn), AsyncPostgresParticipant(pg)])
        message = await conn.receive("orders", timeout=5)
        assert message is not None
        await message.ack()
        await pg.execute("INSERT INTO orders (id, body) VALUES (%s, %s)",
                         (message.message_id, message.body))
        await gtx.commit()
        print(f"RESULT committed {message.message_id}", flush=True)
    except RolledBack as exc:
        print(f"RESULT rolled_back {exc}", flush=True)
    finally:
        tm.close()
        os._exit(0)  # do not wait for a dead broker in close()


if __name__ == "__main__":
    asyncio.run(run(*sys.argv[1:7], sys.argv[7] if len(sys.argv) > 7 else ""))
