"""Presenting participants to servers: the queues of waiting participants, the
messages a server is pushed, the request to vote and the outcome.

Theory of operation
-------------------
A server holds one transaction at a time. A participant waits in its
partition's queue (per site) until one of the site's servers is free; then it
is *presented*: its messages are pushed, the first as ``MSG1`` (``UNCERTAIN``
on a replay after its server may have voted), the rest as ``MSG``. If the
client already accepted, the server is asked to vote (``PREPARE`` for a server
with explicit prepare); if the transaction is already decided accept (a
replay), the outcome follows at once. A presentation round that leaves a
participant waiting looks for a wait cycle (``deadlock.py``): the youngest
transaction of one makes way.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from txbroker.core.router.data import RouterData
from txbroker.core.router.deadlock import victims
from txbroker.core.router.model import PREEMPTED
from txbroker.core.router.states import (
    Controller,
    PartEvent,
    Participant,
    PartState,
    Transaction,
    TxState,
    part_next,
)


def pump(router: RouterData, facility: str, partition: str) -> None:
    """Present waiting participants of a partition to its free servers."""
    queues = router.waiting.get((facility, partition))
    if not queues:
        return
    blocked = False
    for site, waiting in queues.items():
        while waiting:
            participant = waiting[0]
            if participant.state is not PartState.WAITING or participant.server is not None:
                waiting.popleft()  # stale: done, or presented meanwhile
                continue
            free = [s for s in router.candidates(facility, partition, site)
                    if s.current is None]
            if not free:
                blocked = True
                break
            router.round_robin += 1
            waiting.popleft()
            _present(router, participant, free[router.round_robin % len(free)])
    if blocked:
        _break_wait_cycle(router)


def _break_wait_cycle(router: RouterData) -> None:
    """A participant waits for busy servers: if that closes a wait cycle, the
    youngest transaction of the cycle makes way (``deadlock.py``)."""
    waiting = [p for queues in router.waiting.values() for queue in queues.values()
               for p in queue]
    for participant in victims(waiting, lambda p: router.candidates(
            p.tx.facility, p.partition, p.site)):
        server = participant.server
        assert server is not None
        participant.state = part_next(participant.state, PartEvent.YIELD)
        router.counters["preempted"] += 1
        router.push(server, {"type": "REJECTED", "tid": participant.tx.tid,
                             "partition": participant.partition, "reason": PREEMPTED})


def enqueue(router: RouterData, participant: Participant, *, front: bool = False) -> None:
    """Queue a participant for its partition's next free server (``front``: a replay)."""
    tx = participant.tx
    queues = router.waiting.setdefault((tx.facility, participant.partition), {})
    waiting = queues.setdefault(participant.site, deque())
    if front:
        waiting.appendleft(participant)
    else:
        waiting.append(participant)
    pump(router, tx.facility, participant.partition)


def message_body(participant: Participant, position: int, kind: str) -> dict[str, Any]:
    """The push of the participant's message ``position`` (``MSG1``, ``UNCERTAIN`` or
    ``MSG``)."""
    tx = participant.tx
    _, key, body, headers = tx.messages[participant.indexes[position]]
    body_: dict[str, Any] = {
        "type": kind, "tid": tx.tid, "key": key, "body": body, "headers": headers,
        "index": position, "partition": participant.partition,
        "replay": participant.presentations - 1}
    if tx.state in (TxState.COMMIT_DECIDING, TxState.COMMITTING):
        # the replay of a transaction decided ACCEPTED (its ACCEPTED follows): the
        # server applies it whatever its checks say now — a refusal cannot change
        # the outcome, and the other partitions commit (found by the simulator:
        # router-bank seed 1177). Also while the decision is on its way to disk: a
        # site that returns then (a down site does not hold the decision) is told
        # the same (router-bank-sites-live seed 95: a standby's balance check refused,
        # the vote was ignored, ACCEPTED followed with nothing to commit)
        body_["decided"] = True
    return body_


def _present(router: RouterData, participant: Participant, server: Controller) -> None:
    tx = participant.tx
    participant.server = server
    server.current = participant
    participant.presentations += 1
    if participant.presentations > 1:
        router.counters["replays"] += 1
    participant.state = part_next(participant.state, PartEvent.PRESENT)
    first = "UNCERTAIN" if participant.uncertain else "MSG1"
    for position in range(len(participant.indexes)):
        router.push(server, message_body(participant, position,
                                         first if position == 0 else "MSG"))
    participant.sent = len(participant.indexes)
    if tx.state is TxState.COMMITTING:
        tell(router, participant, commit=True)
    elif tx.state is TxState.VREQ:
        ask(router, participant)


def ask(router: RouterData, participant: Participant) -> None:
    """The client accepted: the participant is asked to vote (``PREPARE`` to a server
    with explicit prepare that holds it)."""
    participant.state = part_next(participant.state, PartEvent.ASK)
    server = participant.server
    if (participant.state is PartState.VOTING and server is not None
            and server.explicit_prepare):
        router.push(server, {"type": "PREPARE", "tid": participant.tx.tid,
                             "partition": participant.partition})


def tell(router: RouterData, participant: Participant, *, commit: bool) -> None:
    """Give a participant the outcome (now if a server holds it)."""
    tx = participant.tx
    server = participant.server
    if server is None:
        if not commit:
            participant.state = part_next(participant.state, PartEvent.FORGET)
        return  # a commit waits in WAITING: presented with UNCERTAIN, then ACCEPTED
    if participant.state is PartState.YIELDING:  # told REJECTED (PREEMPTED) already
        participant.state = part_next(participant.state, PartEvent.ABORT)
        return
    participant.state = part_next(participant.state,
                                  PartEvent.COMMIT if commit else PartEvent.ABORT)
    body: dict[str, Any] = {"type": "ACCEPTED" if commit else "REJECTED", "tid": tx.tid,
                            "partition": participant.partition}
    if not commit:
        body["reason"] = tx.reason
    router.push(server, body)


def free_aborted(tx: Transaction) -> None:
    """Waiting participants of an aborted transaction leave their queues' head."""
    for participant in tx.participants.values():
        if participant.state is PartState.WAITING:
            participant.state = part_next(participant.state, PartEvent.FORGET)


__all__ = ["ask", "enqueue", "free_aborted", "message_body", "pump", "tell"]
