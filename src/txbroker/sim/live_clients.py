"""The clients of the queue scenarios on the deterministic event loop (``queue-live``,
``shared-store-live``, ``replicated-live``, ``replicated-etcd-live``), in one place:
what differs between those scenarios is the broker's address (one node, a pair, a
trio: the failover list), which each passes as ``url``.

- **Producers** (:func:`producer`) send persistent messages with message ids (so a
  send carried over a failover is not stored twice: the duplicate window), one unit
  in four as a local transaction of two sends.
- **Consumers** (:func:`consumer`) receive and acknowledge (waiting for the ack's
  answer), until a given virtual time.
- :func:`left_in_queue` counts what is left in the queue at the end.
- :func:`check_queue` judges what the clients were told and saw (:class:`Record`): no
  answered send lost, no second delivery without the redelivered flag, no answered
  ack undone, local transactions all-or-nothing, an empty queue at the end.

Every client connects with :func:`~txbroker.sim.live.connect_retrying` (a supervisor
restarts a program whose first connect failed) and fails over for
:data:`FAILOVER_TIMEOUT_S`; its trace lines are stamped with virtual time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Final

from txbroker.client.aio import AsyncConnection
from txbroker.errors import NotFound, TxBrokerError
from txbroker.sim.live import connect_retrying
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World

__all__ = ["FAILOVER_TIMEOUT_S", "QUEUE", "SEND_GAP_S", "Record", "check_queue", "consumer",
           "left_in_queue", "producer"]

#: The queue every producer sends to and every consumer receives from.
QUEUE: Final = "orders"
#: Pause between a producer's sends (s, uniform).
SEND_GAP_S: Final = (0.0, 0.01)
#: How long a failing-over client keeps trying (s): longer than any outage here.
FAILOVER_TIMEOUT_S: Final = 30.0
#: A client's request timeout (s).
REQUEST_TIMEOUT_S: Final = 5.0


@dataclass
class Record:
    """What the clients were told, and what they saw."""

    #: message id -> "ok" (the send or its commit was answered) or "unknown"
    sent: dict[str, str] = field(default_factory=dict)
    #: transaction number -> its two message ids, and whether its commit was answered
    transactions: dict[int, tuple[list[str], bool]] = field(default_factory=dict)
    #: deliveries: (virtual time, message id, redelivered)
    delivered: list[tuple[float, str, bool]] = field(default_factory=list)
    #: message id -> virtual time its ack was answered
    acked: dict[str, float] = field(default_factory=dict)
    #: what went wrong outside the checkers' view (a client that raised)
    failures: list[str] = field(default_factory=list)
    #: how many sends and commits were answered
    answered: int = 0


async def _connect(loop: SimLoop, url: str) -> AsyncConnection:
    return await connect_retrying(loop, url, failover_timeout=FAILOVER_TIMEOUT_S,
                                  timeout=REQUEST_TIMEOUT_S)


async def producer(loop: SimLoop, world: World, number: int, record: Record,
                   until: float, *, url: str, or_first_answer_by: float | None = None,
                   plain: bool = False) -> None:
    """Producer ``number``: persistent sends with message ids until ``until`` (virtual
    time), every fourth a local transaction of two sends; what it was told goes to
    ``record``. With ``or_first_answer_by``: past ``until`` too, while no producer's
    send has been answered, until that time (a schedule that left no primary for the
    whole sending time still tests something). ``plain``: the id is in the body only
    (no message id: the broker keeps such messages as compact slots; a send is never
    resent by the client, so none is stored twice)."""
    conn = await _connect(loop, url)
    count = 0
    while loop.time() < until or (or_first_answer_by is not None and not record.answered
                                  and loop.time() < or_first_answer_by):
        count += 1
        if count % 4 == 0:
            tx_number = number * 1_000_000 + count
            ids = [f"p{number}-{count}-a", f"p{number}-{count}-b"]
            for message_id in ids:
                record.sent[message_id] = "unknown"
            record.transactions[tx_number] = (ids, False)
            try:
                tx = conn.transaction()
                for message_id in ids:
                    await tx.send(QUEUE, message_id.encode(),
                                  message_id=None if plain else message_id)
                await tx.commit()
            except (TxBrokerError, TimeoutError):  # the outcome is unknown
                continue
            record.transactions[tx_number] = (ids, True)
            record.answered += 1
            for message_id in ids:
                record.sent[message_id] = "ok"
            world.log(f"{loop.time():.6f} commit {ids}")
        else:
            message_id = f"p{number}-{count}"
            record.sent[message_id] = "unknown"
            try:
                await conn.send(QUEUE, message_id.encode(),
                                message_id=None if plain else message_id)
            except (TxBrokerError, TimeoutError):  # the outcome is unknown
                continue
            record.sent[message_id] = "ok"
            record.answered += 1
            world.log(f"{loop.time():.6f} sent {message_id}")
        await asyncio.sleep(loop.random.uniform(*SEND_GAP_S))
    await conn.close()


async def consumer(loop: SimLoop, world: World, record: Record, until: float, *,
                   url: str) -> None:
    """A consumer: receive and acknowledge (waiting for the ack's answer) until
    ``until`` (virtual time); what it saw goes to ``record``."""
    conn = await _connect(loop, url)
    while loop.time() < until:
        try:
            message = await conn.receive(QUEUE, timeout=0.1)
        except (TxBrokerError, TimeoutError):
            continue
        if message is None:
            continue
        message_id = message.body.decode()
        record.delivered.append((loop.time(), message_id, message.redelivered))
        world.log(f"{loop.time():.6f} delivered {message_id} {message.redelivered}")
        try:
            await message.ack(wait=True)
        except (TxBrokerError, TimeoutError):
            continue
        record.acked[message_id] = loop.time()
    await conn.close()


async def left_in_queue(loop: SimLoop, *, url: str) -> int:
    """How many messages are left in :data:`QUEUE` (0 if it was never made)."""
    conn = await _connect(loop, url)
    try:
        info = await conn.queue_info(QUEUE)
    except NotFound:  # never made (nothing was sent): nothing left
        return 0
    finally:
        await conn.close()
    return int(info["messages"])


def check_queue(record: Record, left: int) -> list[str]:
    """The queue scenarios' checkers over ``record`` and the count ``left`` at the end
    (-1: it could not be counted); returns the violations."""
    violations: list[str] = list(record.failures)
    if not any(outcome == "ok" for outcome in record.sent.values()):
        violations.append("no send was answered: the run tested nothing")
    first: dict[str, float] = {}
    for at, message_id, redelivered in record.delivered:
        if message_id in first and not redelivered:
            violations.append(f"{message_id} delivered again at {at:.6f} without the "
                              "redelivered flag (a duplicate, or a lost delivery mark)")
        first.setdefault(message_id, at)
        acked_at = record.acked.get(message_id)
        if acked_at is not None and at > acked_at:
            violations.append(f"{message_id} delivered at {at:.6f} after its ack was "
                              f"answered at {acked_at:.6f}")
    for message_id, outcome in record.sent.items():
        if outcome == "ok" and message_id not in first:
            violations.append(f"{message_id}: its send was answered but it was never "
                              "delivered (lost)")
    violations.extend(f"{message_id} delivered but never sent"
                      for message_id in first if message_id not in record.sent)
    for number, (ids, committed) in record.transactions.items():
        seen = [message_id in first for message_id in ids]
        if any(seen) and not all(seen):
            violations.append(f"transaction {number}: only part of it was delivered: "
                              f"{dict(zip(ids, seen, strict=True))}")
        if committed and not all(seen):
            violations.append(f"transaction {number}: committed but not delivered")
    if left:
        violations.append(f"{left} messages left in the queue after the healed phase")
    return violations
