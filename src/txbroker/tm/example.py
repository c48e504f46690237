"""The worked example: move work between a queue and a PostgreSQL table atomically.

:func:`dequeue_and_insert` takes one message from a queue and inserts a row
for it in one global transaction: afterwards the message is consumed exactly
when the row exists. :func:`insert_and_send` is the reverse: a row and a
message, both or neither. Both take a :class:`~txbroker.tm.TransactionManager`,
a txbroker sync connection and a psycopg connection (not autocommit)::

    import psycopg, txbroker
    from txbroker.tm import TransactionManager
    from txbroker.tm.example import dequeue_and_insert

    tm = TransactionManager("tm.log")
    with txbroker.connect("txb://127.0.0.1:5445") as conn, psycopg.connect(dsn) as pg:
        pg.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, body bytea)")
        pg.commit()
        while dequeue_and_insert(tm, conn, pg, "orders", timeout=1.0):
            pass

The table needs ``(id text PRIMARY KEY, body bytea)``; the row id is the
message's ``message_id`` (or the body as text when it has none).
"""

from __future__ import annotations

from typing import Any

from txbroker.tm.manager import TransactionManager
from txbroker.tm.participants import BrokerParticipant, PostgresParticipant


def dequeue_and_insert(tm: TransactionManager, conn: Any, pg: Any, queue: str,
                       table: str = "orders", timeout: float = 1.0,
                       hook: Any = None) -> str | None:
    """Consume one message of ``queue`` and insert its row, atomically. Returns the row
    id, or None when the queue stayed empty for ``timeout`` seconds (nothing is done)."""
    broker, db = BrokerParticipant(conn), PostgresParticipant(pg)
    gtx = tm.begin([broker, db])
    try:
        message = conn.receive(queue, timeout=timeout)
        if message is None:
            gtx.rollback()
            return None
        row_id = message.message_id or message.body.decode()
        message.ack()
        pg.execute(f"INSERT INTO {table} (id, body) VALUES (%s, %s)",
                   (row_id, message.body))
        if hook is not None:
            hook("work_done")
    except BaseException:
        gtx.rollback()
        raise
    gtx.commit()
    return str(row_id)


def insert_and_send(tm: TransactionManager, conn: Any, pg: Any, queue: str, row_id: str,
                    body: bytes, table: str = "orders") -> None:
    """Insert a row and send a message about it, atomically."""
    with tm.begin([BrokerParticipant(conn), PostgresParticipant(pg)]):
        pg.execute(f"INSERT INTO {table} (id, body) VALUES (%s, %s)",
                   (row_id, body))
        conn.send(queue, body, message_id=row_id)
