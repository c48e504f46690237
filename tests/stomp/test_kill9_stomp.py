"""Kill -9 under load, through STOMP with receipts: nothing acknowledged by a
RECEIPT is lost, nothing appears from nowhere, no confirmed ACK comes back, no
STOMP transaction is partly visible.

The same shape as ``tests/server/test_kill9.py`` (native protocol): producers
(persistent SENDs with receipts, and BEGIN / 5 SENDs / COMMIT with a receipt),
consumers (client-individual ACKs with receipts) and movers (BEGIN, SEND to
``txout`` + ACK from ``txin``, COMMIT with a receipt) run against a broker
that is killed with SIGKILL at a random moment, restarted on the same ports,
and loaded again. At the end every queue is drained and each id checked.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.ledger import Ledger, check, join_or_explain, verdict
from tests.stomp.support import StompBroker, StompClient
from txbroker.protocol.stomp import StompProtocolError

PLAIN, TXIN, TXOUT = "/queue/k9-plain", "/queue/k9-txin", "/queue/k9-txout"


def _guard(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        # the broker is killed under us: errors are expected
        with contextlib.suppress(OSError, TimeoutError, AssertionError, StompProtocolError):
            fn()

    return run


def _client(port: int) -> StompClient:
    client = StompClient(port, timeout=5)
    client.connect()
    return client


def _producer(port: int, name: str, ledger: Ledger, stop: threading.Event, tx_size: int) -> None:
    n = 0
    with _client(port) as client:
        while not stop.is_set():
            if tx_size:
                ids = [f"{name}-{n + i}" for i in range(tx_size)]
                n += tx_size
                ledger.add("attempted", *ids)
                tx = f"tx-{n}"
                client.send("BEGIN", {"transaction": tx})
                for mid in ids:
                    client.send("SEND", {"destination": PLAIN, "persistent": "true",
                                         "transaction": tx}, mid.encode())
                client.call("COMMIT", {"transaction": tx}, timeout=5)
                ledger.add("acknowledged", *ids)
            else:
                mid = f"{name}-{n}"
                n += 1
                ledger.add("attempted", mid)
                client.call("SEND", {"destination": PLAIN if name.endswith("p") else TXIN,
                                     "persistent": "true"}, mid.encode(), timeout=5)
                ledger.add("acknowledged", mid)


def _consumer(port: int, ledger: Ledger, stop: threading.Event) -> None:
    with _client(port) as client:
        client.call("SUBSCRIBE", {"destination": PLAIN, "id": "c", "ack": "client-individual",
                                  "prefetch-count": "10"})
        while not stop.is_set():
            try:
                message = client.messages(1, timeout=0.2)[0]
            except TimeoutError:
                continue
            mid = message.body.decode()
            ledger.delivered(mid)
            client.call("ACK", {"id": message.headers["ack"]}, timeout=5)
            ledger.add("ack_confirmed", mid)


def _mover(port: int, ledger: Ledger, stop: threading.Event) -> None:
    with _client(port) as client:
        client.call("SUBSCRIBE", {"destination": TXIN, "id": "m", "ack": "client-individual",
                                  "prefetch-count": "1"})
        n = 0
        while not stop.is_set():
            try:
                message = client.messages(1, timeout=0.2)[0]
            except TimeoutError:
                continue
            n += 1
            tx = f"move-{n}"
            client.send("BEGIN", {"transaction": tx})
            client.send("SEND", {"destination": TXOUT, "persistent": "true", "transaction": tx},
                        message.body)
            client.send("ACK", {"id": message.headers["ack"], "transaction": tx})
            client.call("COMMIT", {"transaction": tx}, timeout=5)
            ledger.add("moved", message.body.decode())


def _drain(port: int, queue: str) -> list[str]:
    found: list[str] = []
    with _client(port) as client:
        client.call("SUBSCRIBE", {"destination": queue, "id": "d", "ack": "client-individual",
                                  "prefetch-count": "500"})
        while True:
            try:
                message = client.messages(1, timeout=0.7)[0]
            except TimeoutError:
                break
            found.append(message.body.decode())
            client.send("ACK", {"id": message.headers["ack"]})
        client.disconnect()
    return found


def run_cycles(tmp_path: Path, cycles: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ledger = Ledger()
    broker = StompBroker(tmp_path / "data").start()
    port = broker.stomp_port
    try:
        for cycle in range(cycles):
            stop = threading.Event()
            workers: list[Callable[[], None]] = [
                partial(_producer, port, f"c{cycle}a-p", ledger, stop, 0),
                partial(_producer, port, f"c{cycle}b-p", ledger, stop, 0),
                partial(_producer, port, f"c{cycle}t", ledger, stop, 5),
                partial(_producer, port, f"c{cycle}f-f", ledger, stop, 0),  # feeds txin
                partial(_consumer, port, ledger, stop),
                partial(_consumer, port, ledger, stop),
                partial(_mover, port, ledger, stop),
            ]
            threads = [threading.Thread(target=_guard(w), daemon=True) for w in workers]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.3, 1.2))
            broker.kill(signal.SIGKILL)
            stop.set()
            for thread in threads:
                join_or_explain(thread, timeout=60)
            broker.start()
        plain = _drain(port, PLAIN)
        txin = _drain(port, TXIN)
        txout = _drain(port, TXOUT)
    finally:
        broker.kill()

    report = verdict(ledger, plain, txin, txout, cycles=cycles)
    print("kill -9 through STOMP:", report)
    return report


@pytest.mark.timeout(120)
def test_kill9_through_stomp(tmp_path: Path) -> None:
    check(run_cycles(tmp_path, cycles=6, seed=20261122))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill9_through_stomp_soak(tmp_path: Path) -> None:
    check(run_cycles(tmp_path, cycles=40, seed=5))
