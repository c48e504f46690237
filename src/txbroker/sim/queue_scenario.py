"""Scenario ``queue``: producers and consumers on one durable queue, the broker
crashing at random points.

Producers send persistent messages, some in local transactions of one to three
sends; consumers receive and acknowledge. During the fault phase the broker
crashes at random times and restarts after a pause; then a healed phase (no more
faults, no more sends) lets the consumers drain the queue. The checkers then
judge what every actor was told against what the broker did:

- no acknowledged send lost: every send (or committed transaction's send) whose
  reply came was delivered at some point, or is still in the queue;
- no acknowledged consume comes back: a message whose ack was answered is never
  delivered after that answer, nor left in the queue;
- local transactions are all-or-nothing: of a transaction's messages, either all
  were ever seen or none (and all, when its commit was answered); a rolled-back
  transaction's messages are never seen (consumers ack one message in four in a
  local transaction);
- no second delivery of a message without the redelivered flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from txbroker.core import Broker
from txbroker.errors import AlreadyExists
from txbroker.sim.actors import Actor
from txbroker.sim.node import BrokerNode, Delivered
from txbroker.sim.world import World

QUEUE = "q"
#: Virtual length of the fault phase and of the healed phase (ms).
FAULT_MS = 1_500
HEAL_MS = 2_000
#: Mean time between broker crashes in the fault phase (ms), and the restart pause.
MEAN_CRASH_GAP_MS = 400
RESTART_MS = (1, 60)
PRODUCERS = 2
CONSUMERS = 2
#: How long a consumer's ``receive`` waits for a message (ms).
RECEIVE_WAIT_MS = 20


@dataclass
class QueueLedger:
    """What the actors were told and saw."""

    acked_sends: set[bytes] = field(default_factory=set)
    #: transaction name -> (its bodies, whether its commit was answered)
    txs: dict[str, tuple[list[bytes], bool]] = field(default_factory=dict)
    #: bodies of transactions the producer rolled back
    rolled_back: set[bytes] = field(default_factory=set)
    #: (arrival time, body, redelivered flag) of every delivery
    deliveries: list[tuple[int, bytes, bool]] = field(default_factory=list)
    #: body -> when the first answer to an ack of it arrived
    acked_consumes: dict[bytes, int] = field(default_factory=dict)


class Producer(Actor):
    """Sends persistent messages; one unit in three is a local transaction."""

    def __init__(self, world: World, node: BrokerNode, name: str, ledger: QueueLedger) -> None:
        super().__init__(world, node, name)
        self.ledger = ledger
        self.count = 0

    def _body(self) -> bytes:
        self.count += 1
        return f"{self.name}-{self.count}".encode()

    def on_connected(self) -> None:
        """Start producing."""
        self._next()

    def _next(self) -> None:
        if self.stopped or self.conn is None:
            return
        if self.world.chance(0.3):
            self.call("tx_begin", lambda b, s, r, now: b.tx_begin(s), self._in_tx)
            return
        body = self._body()

        def sent(ok: bool, result: Any) -> None:
            if ok:
                self.ledger.acked_sends.add(body)
                self.world.log(f"{self.name} sent {body.decode()}")
            self._later()

        self.call("send", lambda b, s, r, now: b.send(s, r, QUEUE, body, now), sent)

    def _in_tx(self, ok: bool, result: Any) -> None:
        if not ok:
            self._later()
            return
        tx_id = int(result["tx"])
        name = f"{self.name}-tx{self.count}"
        bodies = [self._body() for _ in range(self.world.delay(1, 3))]
        self.ledger.txs[name] = (bodies, False)
        for body in bodies:
            self.call("send", lambda b, s, r, now, body=body: b.send(  # type: ignore[misc]
                s, r, QUEUE, body, now, tx=tx_id), lambda ok, result: None)
        if self.world.chance(0.15):
            del self.ledger.txs[name]
            self.ledger.rolled_back.update(bodies)
            self.call("tx_rollback", lambda b, s, r, now: b.tx_rollback(s, tx_id, now),
                      lambda ok, result: self._later())
            return

        def committed(ok: bool, result: Any) -> None:
            if ok:
                self.ledger.txs[name] = (bodies, True)
                self.world.log(f"{self.name} committed {name}")
            self._later()

        self.call("tx_commit", lambda b, s, r, now: b.tx_commit(s, r, tx_id, now), committed)

    def _later(self) -> None:
        self.world.schedule(self.world.delay(0, 20), self._next)


class Consumer(Actor):
    """Receives and acknowledges, one message at a time."""

    def __init__(self, world: World, node: BrokerNode, name: str, ledger: QueueLedger) -> None:
        super().__init__(world, node, name)
        self.ledger = ledger

    def on_connected(self) -> None:
        """Start consuming."""
        self._next()

    def _next(self) -> None:
        if self.stopped or self.conn is None:
            return
        self.call("receive", lambda b, s, r, now: b.receive(s, r, QUEUE, now, RECEIVE_WAIT_MS),
                  self._received)

    def _received(self, ok: bool, result: Any) -> None:
        if not ok or not isinstance(result, Delivered):
            self.world.schedule(self.world.delay(0, 10), self._next)
            return
        body = result.body
        self.ledger.deliveries.append((self.world.now, body, result.redelivered))
        self.world.log(f"{self.name} got {body.decode()} redelivered={result.redelivered}")
        tag = result.tag

        def acked(ok: bool, answer: Any) -> None:
            if ok:
                self.ledger.acked_consumes.setdefault(body, self.world.now)
                self.world.log(f"{self.name} acked {body.decode()}")
            self._next()

        if not self.world.chance(0.25):
            self.call("ack", lambda b, s, r, now: b.ack(s, r, [tag], now), acked)
            return

        def in_tx(ok: bool, answer: Any) -> None:  # the ack in a local transaction
            if not ok:
                self._next()
                return
            tx_id = int(answer["tx"])
            self.call("ack", lambda b, s, r, now: b.ack(s, r, [tag], now, tx=tx_id),
                      lambda ok, answer: None)
            self.call("tx_commit", lambda b, s, r, now: b.tx_commit(s, r, tx_id, now), acked)

        self.call("tx_begin", lambda b, s, r, now: b.tx_begin(s), in_tx)


class Setup(Actor):
    """Declares the queue, then starts the workload."""

    def __init__(self, world: World, node: BrokerNode, start: Any) -> None:
        super().__init__(world, node, "setup")
        self.start = start

    def on_connected(self) -> None:
        """Declare the durable queue (once: a retry after a failed declare and a
        reconnection can both be under way; the workload starts once — seed 105467
        of queue-failing-fsync started it twice, two producers of one name)."""
        if self.stopped:
            return

        def declared(ok: bool, result: Any) -> None:
            if self.stopped:
                return
            # e.g. its record failed to sync: again, on this connection
            if not ok and not isinstance(result, AlreadyExists):
                self.world.schedule(20, self.on_connected)
                return
            self.stopped = True
            self.start()

        self.call("declare", lambda b, s, r, now: b.queue_declare(s, r, QUEUE, now), declared)


def _final_bodies(broker: Broker, bodies: dict[int, bytes]) -> list[bytes]:
    found = []
    for message in broker.messages.values():
        if message.queue == QUEUE:
            found.append(message.body if message.body is not None
                         else bodies[message.ref])  # type: ignore[index]
    return found


def run_queue(world: World, plants: frozenset[str]) -> list[str]:
    """Run the scenario on ``world``; the checkers' violations (empty: all good)."""
    return _run_queue(world, plants, failing_fsync=False)


def run_queue_failing_fsync(world: World, plants: frozenset[str]) -> list[str]:
    """Scenario ``queue-failing-fsync``: ``queue`` with fsyncs that fail now and then
    (the broker then takes no writes until a supervisor restarts it)."""
    return _run_queue(world, plants, failing_fsync=True)


def _run_queue(world: World, plants: frozenset[str], *, failing_fsync: bool) -> list[str]:
    early = set()
    if "reply-before-fsync" in plants:
        early |= {"send", "tx_commit"}
    if "ack-before-fsync" in plants:
        early.add("ack")
    node = BrokerNode(world, early_ops=frozenset(early),
                      strip_redelivered="deliver-without-redelivered" in plants)
    node.start()
    node.faults = failing_fsync
    ledger = QueueLedger()
    workers: list[Actor] = []
    fault_end = world.now + FAULT_MS

    def start() -> None:
        workers.extend(Producer(world, node, f"p{n}", ledger) for n in range(PRODUCERS))
        workers.extend(Consumer(world, node, f"c{n}", ledger) for n in range(CONSUMERS))
        for worker in workers:
            worker.connect_soon()
        node.crash_now_and_then(MEAN_CRASH_GAP_MS, RESTART_MS, fault_end)

    Setup(world, node, start).connect_soon()
    world.run_until(fault_end)
    world.log("heal")
    node.faults = False
    for worker in workers:
        if isinstance(worker, Producer):
            worker.stopped = True
    world.run_until(fault_end + HEAL_MS)
    for worker in workers:
        worker.stopped = True
    world.run_until(world.now + 200)
    if not node.up:
        node.start()
    # a command that must not fail (a session's end) raised: a defect, whatever else holds
    return ([f"core error: {e}" for e in node.core_errors]
            + check_queue(ledger, _final_bodies(node.broker, node.disk.bodies)))


def check_queue(ledger: QueueLedger, final: list[bytes]) -> list[str]:
    """The queue scenario's checkers (see the module docstring)."""
    violations = []
    seen = {body for _, body, _ in ledger.deliveries} | set(final)
    for body in sorted(ledger.acked_sends):
        if body not in seen:
            violations.append(f"acknowledged send lost: {body.decode()}")
    final_set = set(final)
    for body, when in sorted(ledger.acked_consumes.items()):
        again = [t for t, b, _ in ledger.deliveries if b == body and t > when]
        if again or body in final_set:
            violations.append(f"acknowledged consume came back: {body.decode()}")
    for name, (bodies, committed) in sorted(ledger.txs.items()):
        present = [b in seen for b in bodies]
        if committed and not all(present):
            violations.append(f"committed transaction {name} lost messages")
        elif any(present) and not all(present):
            violations.append(f"transaction {name} applied in part")
    for body in sorted(ledger.rolled_back & seen):
        violations.append(f"rolled-back send delivered: {body.decode()}")
    first_seen: set[bytes] = set()
    for _, body, redelivered in ledger.deliveries:
        if body in first_seen and not redelivered:
            violations.append(f"second delivery without the redelivered flag: {body.decode()}")
        first_seen.add(body)
    return violations
