"""The native-protocol load of the kill -9 tests (``tests/server/test_kill9.py``, a
restarted broker, and ``tests/server/test_ha.py``, a shared-store pair).

Producers send plain messages or transactions of several sends, feeders fill
``txin``, consumers receive and ack from ``plain``, movers consume from
``txin`` and send to ``txout`` in one local transaction; everything is written
to a :class:`~tests.ledger.Ledger`. ``connect(url)`` opens the connection (with
or without failover). An exception of ``retry`` (the failover errors) makes a
worker go on with its next step; any other error ends it (the single-broker
test stops its workers by killing the broker).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tests.ledger import Ledger

Connect = Callable[[str], Any]
Retry = tuple[type[BaseException], ...]


def producer(connect: Connect, url: str, name: str, ledger: Ledger, stop: threading.Event,
             tx_size: int, retry: Retry = ()) -> None:
    """Plain sends (``tx_size`` 0) or transactions of ``tx_size`` sends to ``plain``."""
    n = 0
    with connect(url) as conn:
        while not stop.is_set():
            ids = [f"{name}-{n + i}" for i in range(max(tx_size, 1))]
            n += len(ids)
            ledger.add("attempted", *ids)
            try:
                if tx_size:
                    with conn.transaction() as tx:
                        for mid in ids:
                            tx.send("plain", mid.encode(), message_id=mid)
                else:
                    conn.send("plain", ids[0].encode(), message_id=ids[0])
            except retry:
                continue  # lost in a failover: not acknowledged, maybe stored
            ledger.add("acknowledged", *ids)


def feeder(connect: Connect, url: str, name: str, ledger: Ledger, stop: threading.Event,
           retry: Retry = ()) -> None:
    """Plain sends to ``txin`` (the movers' input)."""
    n = 0
    with connect(url) as conn:
        while not stop.is_set():
            mid = f"{name}-{n}"
            n += 1
            ledger.add("attempted", mid)
            try:
                conn.send("txin", mid.encode(), message_id=mid)
            except retry:
                continue
            ledger.add("acknowledged", mid)


def consumer(connect: Connect, url: str, ledger: Ledger, stop: threading.Event,
             retry: Retry = (), flags: dict[str, list[bool]] | None = None) -> None:
    """Receive from ``plain`` and ack (waiting for the ack's reply); ``flags`` collects
    each delivery's ``redelivered`` by message."""
    with connect(url) as conn:
        while not stop.is_set():
            try:
                msg = conn.receive("plain", timeout=0.2)
            except retry:
                continue
            if msg is None:
                continue
            mid = msg.body.decode()
            ledger.delivered(mid)
            if flags is not None:
                with ledger.lock:
                    flags.setdefault(mid, []).append(bool(msg.redelivered))
            try:
                msg.ack(wait=True)
            except retry:
                continue  # delivered before a failover: it comes back, flagged
            ledger.add("ack_confirmed", mid)


def mover(connect: Connect, url: str, ledger: Ledger, stop: threading.Event,
          retry: Retry = ()) -> None:
    """Move ``txin`` → ``txout`` one message per local transaction."""
    with connect(url) as conn:
        while not stop.is_set():
            try:
                with conn.transaction() as tx:
                    msg = tx.receive("txin", timeout=0.2)
                    if msg is None:
                        continue
                    mid = msg.body.decode()
                    tx.send("txout", msg.body, message_id=mid)
            except retry:
                continue
            ledger.add("moved", mid)


def drain(connect: Connect, url: str, queue: str) -> list[str]:
    """Every message left in ``queue`` (acked), as message ids."""
    found: list[str] = []
    with connect(url) as conn:
        while (msg := conn.receive(queue, timeout=0.5)) is not None:
            found.append(msg.body.decode())
            msg.ack()
        conn.ping()
    return found
