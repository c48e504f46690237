"""Votes and decisions: a server's vote, the decision, telling everyone, and
forgetting a finished transaction.

Theory of operation
-------------------
A server votes accept (``rtr_vote``) or rejects; the participant table
(``states.py``, Rules 4 and 4b, with the stale-vote guard) says whether it may.
A rejection decides the transaction at once; the last accept the router needs
decides it once the client accepted (:func:`all_voted`). A decision goes
through its *deciding* state while its record is on its way to disk (every
commit, every rejection of a journaled transaction, every strike-out), and only
once it is durable is anybody told (:func:`announce`); a rejection of a
transaction nobody journaled is told at once. A transaction is forgotten (its
record consumed, or replaced by a tombstone if its outcome was asked for) once
every server acknowledged the outcome and the client collected it or its
retention ran out.
"""

from __future__ import annotations

import contextlib
from typing import Any

from txbroker.core.router.data import RouterData
from txbroker.core.router.model import OUTCOME_RETENTION_MS, TIMEOUT, check_tid
from txbroker.core.router.presenting import enqueue, free_aborted, pump, tell
from txbroker.core.router.records import TxRecord
from txbroker.core.router.states import (
    DECIDED,
    WRITING,
    PartEvent,
    Participant,
    PartState,
    Transaction,
    TxEvent,
    TxState,
    part_answer,
    tx_next,
    vote_is_stale,
)
from txbroker.errors import NotFound, StorageFailed


def held(router: RouterData, session_id: int, controller_id: Any, tid: Any
         ) -> Participant | None:
    """The participant of ``tid`` the session's server controller holds (None: the
    router knows the transaction but the server no longer holds it)."""
    server = router.controller(session_id, controller_id, server=True)
    tid = check_tid(tid)
    participant = server.current
    if participant is None or participant.tx.tid != tid:
        if tid in router.transactions:
            return None  # e.g. a vote for a transaction the server no longer holds
        raise NotFound(f"transaction {tid} is not presented to controller {server.id}")
    return participant


def vote(router: RouterData, session_id: int, controller_id: Any, tid: Any, accept: bool,
         reason: Any, now: int, seen: int | None = None) -> dict[str, Any]:
    """A server's vote: accept, or reject with a reason (``states.py`` Rules 4, 4b)."""
    participant = held(router, session_id, controller_id, tid)
    if participant is None:
        return {"ignored": True}
    tx = participant.tx
    if tx.state in DECIDED:
        return {"ignored": True}  # decided already (Rule 5 of the tx table)
    server = participant.server
    assert server is not None
    event = (PartEvent.REJECT if not accept else PartEvent.VOTE_AFTER_PREPARE
             if server.explicit_prepare else PartEvent.VOTE)
    after = part_answer(tx.tid, participant.state, event)  # refuses what may not be
    if after is PartState.YIELDING:
        return {"ignored": True}  # preempted: it votes again when presented again
    if not accept:
        decide(router, tx, TxEvent.SERVER_REJECT,
               reason if isinstance(reason, str) and reason else "SERVER", now)
        return {}
    if after is participant.state:
        return {}  # a repeated accept
    if vote_is_stale(seen, participant.sent):
        return {"stale": True}
    participant.state = after
    if tx.state is TxState.VREQ and all_voted(router, tx):
        decide(router, tx, TxEvent.ALL_VOTED, None, now)
    return {}


def done(router: RouterData, session_id: int, controller_id: Any, tid: Any, now: int
         ) -> dict[str, Any]:
    """A server acknowledges the outcome: it is free for its next transaction. (Sent
    without a request id: a tid the router already forgot is ignored.)"""
    if isinstance(tid, str) and tid not in router.transactions:
        return {"ignored": True}
    participant = held(router, session_id, controller_id, tid)
    if participant is None:
        return {"ignored": True}
    before = participant.state
    # Rule 7 (and Rule 9's YIELDING): a participant with no outcome yet is refused
    participant.state = part_answer(participant.tx.tid, before, PartEvent.ACK)
    server = participant.server
    assert server is not None
    participant.server, server.current = None, None
    if before is PartState.YIELDING:  # the server rolled back: presented again
        enqueue(router, participant)
    else:
        maybe_forget(router, participant.tx, now)
    pump(router, server.facility, participant.partition)
    return {}


def all_voted(router: RouterData, tx: Transaction) -> bool:
    """Every participant whose site is up voted accept, and each partition has at
    least one such vote. A site with no server (down) does not hold the decision:
    its participant waits, in the journal, to be replayed when the site returns
    (RTR's shadow recovery); while no site of a partition is up, nothing is decided
    but by the vote timeout."""
    voted: dict[str, bool] = {}
    for (name, site), participant in tx.participants.items():
        if not router.candidates(tx.facility, name, site):
            voted.setdefault(name, False)
            continue  # the site is down
        if participant.state is not PartState.VOTED:
            return False
        voted[name] = True
    return all(voted.values())


def decide(router: RouterData, tx: Transaction, event: TxEvent, reason: str | None,
           now: int) -> None:
    """Decide; make the decision durable when the table says so (a *deciding* state);
    then tell everyone."""
    tx.state = tx_next(tx.tid, tx.state, event)
    tx.reason = reason
    tx.decided_ms = now
    tx.deadline_ms = 0
    commit = tx.state in (TxState.COMMIT_DECIDING, TxState.COMMITTING)
    router.counters["committed" if commit else "rejected"] += 1
    if tx.state not in WRITING:
        announce(router, tx, now)  # never journaled: nobody can remember it
        return

    def durable(error: BaseException | None) -> None:
        tx.state = tx_next(tx.tid, tx.state,
                           TxEvent.DURABLE if error is None else TxEvent.WRITE_FAILED)
        if error is not None:
            router.outbox.storage_failed(error)
            return  # nothing more is written or told: the broker stops taking writes
        announce(router, tx, max(now, router.outbox.now))

    try:
        tx.record = router.log.write(TxRecord.of(tx), tx.record, now, durable)
    except StorageFailed:
        tx.state = tx_next(tx.tid, tx.state, TxEvent.WRITE_FAILED)


def announce(router: RouterData, tx: Transaction, now: int) -> None:
    """Tell every participant and the client the (durable) decision."""
    commit = tx.state is TxState.COMMITTING
    for participant in tx.participants.values():
        if participant.state in (PartState.DONE, PartState.COMMIT, PartState.ABORT):
            continue
        tell(router, participant, commit=commit)
    if not commit:
        free_aborted(tx)
    client = tx.client
    if client is not None and client.id in router.controllers:
        body: dict[str, Any] = {"type": "ACCEPTED" if commit else "REJECTED",
                                "tid": tx.tid}
        if not commit:
            body["reason"] = tx.reason
        router.push(client, body)
    elif not tx.client_acked:
        tx.deadline_ms = now + OUTCOME_RETENTION_MS
        router.arm(tx)
    for name in {name for name, _ in tx.participants}:
        pump(router, tx.facility, name)
    maybe_forget(router, tx, now)


def maybe_forget(router: RouterData, tx: Transaction, now: int) -> None:
    """Forget a durably decided transaction once nobody needs it (an exception is kept
    until an operator commits or discards it)."""
    if tx.state not in (TxState.COMMITTING, TxState.ABORTING):
        return
    if any(p.state is not PartState.DONE for p in tx.participants.values()):
        return
    client_gone = tx.client is None or tx.client.id not in router.controllers
    if not tx.client_acked and not (client_gone and tx.deadline_ms
                                    and tx.deadline_ms <= now):
        return
    forget(router, tx, now)


def forget(router: RouterData, tx: Transaction, now: int) -> None:
    """Drop a finished transaction and its journal record; one whose outcome was
    asked for leaves its tombstone in the record's place."""
    router.transactions.pop(tx.tid, None)
    if tx.client is not None:
        tx.client.tids.discard(tx.tid)
    if tx.inquired:
        state = "ACCEPTED" if tx.state is TxState.COMMITTING else "REJECTED"
        with contextlib.suppress(StorageFailed):  # failed: nothing more is written
            router.tombstones.lay(tx.tid, tx.facility, state, tx.reason, now, tx.record)
    else:
        router.log.remove(tx.record)
    tx.record = None


def expire(router: RouterData, tx: Transaction, now: int) -> None:
    """The transaction's deadline passed: its vote timeout (VREQ), or the end of its
    kept outcome."""
    if tx.state is TxState.VREQ:
        decide(router, tx, TxEvent.VOTE_TIMEOUT, TIMEOUT, now)
    else:
        maybe_forget(router, tx, now)


__all__ = ["all_voted", "announce", "decide", "done", "expire", "forget", "held",
           "maybe_forget", "vote"]
