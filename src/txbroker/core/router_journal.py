"""The router's journal records: what :meth:`Router.journal_record` writes and
:meth:`Router.restore` reads back after a restart (the byte format is in
``core/router_log.py``).

On restart every transaction the client accepted comes back with each of its
participants WAITING and *uncertain* (the router cannot tell which server voted
or committed before the crash): presented again, it starts with ``UNCERTAIN``.
A decided one is presented with its outcome; an aborted one has nothing left to
tell its servers and only waits for its client (or the end of the outcome
retention); an exception stays an exception.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txbroker.core.messages import Message
from txbroker.core.router_log import decode
from txbroker.core.router_model import OUTCOME_RETENTION_MS, Site, parse_facility
from txbroker.core.router_states import Participant, Transaction, TxState
from txbroker.errors import BadRequest

if TYPE_CHECKING:
    from txbroker.core.router import Router


def journal_record(tx: Transaction) -> dict[str, Any]:
    """The transaction as its journal record (``core/router_log.py``)."""
    strikes: dict[str, int] = {}
    for (name, _), participant in tx.participants.items():
        strikes[name] = max(strikes.get(name, 0), participant.strikes)
    return {"r": "tx", "tid": tx.tid, "facility": tx.facility, "state": tx.state.value,
            "reason": tx.reason, "exception": tx.exception, "strikes": strikes,
            "messages": [list(m) for m in tx.messages], "created_ms": tx.created_ms,
            "decided_ms": tx.decided_ms, "flagged_ms": tx.flagged_ms,
            "shadowed": sorted(name for name, site in tx.participants
                               if site is Site.SECONDARY)}


def restore(router: Router, records: list[tuple[Message, bytes]], now: int) -> list[str]:
    """Rebuild ``router`` from the journal (bodies read by the edge); returns the problems
    found (a record that is not the router's is reported, never loaded)."""
    problems: list[str] = []
    for message, body in records:
        try:
            record = decode(body)
            if record["r"] == "facility":
                facility = parse_facility(record["name"], record["partitions"])
                router.facilities[facility.name] = facility
                router.facility_records[facility.name] = message
            elif record["r"] == "tomb":
                router.tombstones.restore(record, message)
            else:
                _restore_tx(router, record, message, now)
        except (KeyError, TypeError, ValueError, BadRequest) as exc:
            problems.append(f"router record {message.id}: {exc}")
    for tx in list(router.transactions.values()):
        if tx.facility not in router.facilities:
            problems.append(f"transaction {tx.tid}: no facility {tx.facility!r}")
    router.tombstones.expire(now)
    return problems


def _restore_tx(router: Router, record: dict[str, Any], message: Message, now: int) -> None:
    state = TxState(record["state"])
    tx = Transaction(record["tid"], record["facility"], None, record["created_ms"])
    tx.seq = router.next_seq()
    tx.state, tx.reason, tx.record = state, record["reason"], message
    tx.exception = bool(record["exception"])
    tx.decided_ms, tx.flagged_ms = record["decided_ms"], record.get("flagged_ms", 0)
    tx.messages = [(m[0], m[1], m[2], m[3]) for m in record["messages"]]
    shadowed = set(record.get("shadowed", ()))
    for position, (name, _, _, _) in enumerate(tx.messages):
        sites = [Site.PRIMARY, Site.SECONDARY] if name in shadowed else [Site.PRIMARY]
        for site in sites:
            participant = tx.participants.get((name, site))
            if participant is None:
                participant = Participant(tx, name, site, uncertain=True,
                                          strikes=record["strikes"].get(name, 0))
                tx.participants[(name, site)] = participant
            participant.indexes.append(position)
    router.transactions[tx.tid] = tx
    if state is TxState.ABORTING:
        router.free_aborted(tx)
        if not tx.exception:
            tx.deadline_ms = now + OUTCOME_RETENTION_MS
            router.arm(tx)
        return
    if state is TxState.COMMITTING:
        tx.deadline_ms = now + OUTCOME_RETENTION_MS
        router.arm(tx)
    if state is TxState.VREQ:
        facility = router.facilities.get(tx.facility)
        timeouts = [facility.partition(name).vote_timeout_ms for name, _ in tx.participants
                    ] if facility else []
        limit = min((t for t in timeouts if t), default=0)
        if limit:
            tx.deadline_ms = now + limit
            router.arm(tx)
    for participant in tx.participants.values():
        router.enqueue(participant)


__all__ = ["journal_record", "restore"]
