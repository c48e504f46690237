"""The kill -9 total-queue workload through AMQP, shared by the single-broker test
(``test_durability.py``) and the failover tests (``test_ha_amqp.py``).

Publishers with confirms and with ``tx.commit``, and a mover that takes messages
from one queue and publishes them to another, acking the takes, in one transaction,
run against whatever broker a URL names until some more messages are confirmed; the
caller then kills that broker (and, in HA, lets another take over). Afterwards every
confirmed or committed message must be in exactly one place: 0 lost, 0 duplicated,
0 unexpected, and each transaction whole."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pika
from pika.exceptions import AMQPError

PERSISTENT = pika.BasicProperties(delivery_mode=2)
QUEUE, MOVED = "k9", "k9-moved"


def connect(url: str) -> pika.BlockingConnection:
    """A blocking pika connection (what the workers use)."""
    return pika.BlockingConnection(pika.URLParameters(url))


@dataclass
class Tally:
    """What the drain found against what the workers were told."""

    confirmed: int
    found: int
    moved: int
    lost: int
    duplicated: int
    unexpected: int
    broken_transactions: list[str]


class TotalQueue:
    """Confirmed and attempted message bodies, and the workers that make them."""

    def __init__(self) -> None:
        self.confirmed: set[str] = set()  # acknowledged by the broker: must not be lost
        self.attempted: set[str] = set()  # sent: may be there or not
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def declare(self, url: str) -> None:
        """The two durable queues."""
        conn = connect(url)
        conn.channel().queue_declare(QUEUE, durable=True)
        conn.channel().queue_declare(MOVED, durable=True)
        conn.close()

    def cycle(self, url: str, name: str, wanted: int, kill: Callable[[], object]) -> None:
        """Run the workers against ``url`` until ``wanted`` messages in all are
        confirmed (or 20 s passed), call ``kill``, and wait for the workers to end
        (their connection breaks)."""
        workers = [threading.Thread(target=self._confirming, args=(url, f"{name}a")),
                   threading.Thread(target=self._confirming, args=(url, f"{name}b")),
                   threading.Thread(target=self._transactional, args=(url, f"{name}t")),
                   threading.Thread(target=self._mover, args=(url,))]
        for worker in workers:
            worker.start()
        for _ in range(400):
            with self.lock:
                if len(self.confirmed) >= wanted:
                    break
            self.stop.wait(0.05)
        kill()
        self.stop.set()
        for worker in workers:
            worker.join(timeout=60)
            assert not worker.is_alive()
        self.stop.clear()

    def drain(self, url: str) -> Tally:
        """Take everything left in both queues and compare."""
        conn = connect(url)
        ch = conn.channel()
        found: list[str] = []
        moved = 0
        for queue in (QUEUE, MOVED):
            while True:
                method, _, body = ch.basic_get(queue, auto_ack=True)
                if method is None:
                    break
                found.append(body.decode())
                moved += queue == MOVED
        conn.close()
        present = set(found)
        broken = [prefix for prefix in {b.rsplit("-", 1)[0] for b in found if b[2] == "t"}
                  if not {f"{prefix}-{i}" for i in range(5)} <= present]
        return Tally(len(self.confirmed), len(found), moved, len(self.confirmed - present),
                     len(found) - len(present), len(present - self.attempted), broken)

    # ------------------------------------------------------------------ workers
    def _confirming(self, url: str, prefix: str) -> None:
        try:
            conn = connect(url)
            ch = conn.channel()
            ch.confirm_delivery()
            n = 0
            while not self.stop.is_set():
                body = f"{prefix}-{n}"
                with self.lock:
                    self.attempted.add(body)
                ch.basic_publish("", QUEUE, body.encode(), PERSISTENT)  # returns once acked
                with self.lock:
                    self.confirmed.add(body)
                n += 1
        except (AMQPError, OSError):
            return  # the broker is gone

    def _transactional(self, url: str, prefix: str) -> None:
        try:
            conn = connect(url)
            ch = conn.channel()
            ch.tx_select()
            n = 0
            while not self.stop.is_set():
                bodies = [f"{prefix}-{n}-{i}" for i in range(5)]
                with self.lock:
                    self.attempted.update(bodies)
                for body in bodies:
                    ch.basic_publish("", QUEUE, body.encode(), PERSISTENT)
                ch.tx_commit()
                with self.lock:
                    self.confirmed.update(bodies)
                n += 1
        except (AMQPError, OSError):
            return

    def _mover(self, url: str) -> None:
        """Take up to 3 messages from QUEUE and publish them to MOVED, acking the
        takes, all in one transaction: a message is in one queue or the other."""
        try:
            conn = connect(url)
            ch = conn.channel()
            ch.tx_select()
            while not self.stop.is_set():
                taken = []
                for _ in range(3):
                    method, _, body = ch.basic_get(QUEUE)
                    if method is None:
                        break
                    taken.append((method.delivery_tag, body))
                for _, body in taken:
                    ch.basic_publish("", MOVED, body, PERSISTENT)
                if taken:
                    ch.basic_ack(taken[-1][0], multiple=True)
                ch.tx_commit()
        except (AMQPError, OSError):
            return
