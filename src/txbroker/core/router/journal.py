"""Restart: the router rebuilt from its journal records (``records.py``: their classes
and byte format; :func:`~txbroker.core.router.records.decode` reads them).

On restart every transaction the client accepted comes back with each of its
participants WAITING and *uncertain* (the router cannot tell which server voted
or committed before the crash): presented again, it starts with ``UNCERTAIN``.
A decided one is presented with its outcome; an aborted one has nothing left to
tell its servers and only waits for its client (or the end of the outcome
retention); an exception (an ``ABORTING`` record flagged ``exception``) stays an
exception. A facility record restores which partitions have a shadow site (their
new transactions keep a participant for it even while every shadow is down).
"""

from __future__ import annotations

from txbroker.core.messages import Message
from txbroker.core.router.data import RouterData
from txbroker.core.router.model import OUTCOME_RETENTION_MS, Site
from txbroker.core.router.presenting import enqueue, free_aborted
from txbroker.core.router.records import FacilityRecord, TombRecord, TxRecord, decode
from txbroker.core.router.states import Participant, Transaction, TxState
from txbroker.errors import BadRequest

#: The state a journaled transaction comes back in: by its record's state and flag.
_RESTORED: dict[tuple[str, bool], TxState] = {
    ("VREQ", False): TxState.VREQ,
    ("COMMITTING", False): TxState.COMMITTING,
    ("ABORTING", False): TxState.ABORTING,
    ("ABORTING", True): TxState.EXCEPTION,
}


def restore(router: RouterData, records: list[tuple[Message, bytes]], now: int) -> list[str]:
    """Rebuild ``router`` from the journal (bodies read by the edge); returns the problems
    found (a record that is not the router's is reported, never loaded)."""
    problems: list[str] = []
    for message, body in records:
        try:
            record = decode(body)
            if isinstance(record, FacilityRecord):
                facility = record.facility
                router.facilities[facility.name] = facility
                router.facility_records[facility.name] = message
                router.shadowed.update((facility.name, name) for name in record.shadowed)
            elif isinstance(record, TombRecord):
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


def _restore_tx(router: RouterData, record: TxRecord, message: Message, now: int) -> None:
    key = (record.state, record.exception)
    state = _RESTORED.get(key)
    if state is None:
        raise ValueError(f"a transaction record in state {key[0]!r}"
                         f"{' (exception)' if key[1] else ''}")
    tx = Transaction(record.tid, record.facility, None, record.created_ms)
    tx.seq = router.next_seq()
    tx.state, tx.reason, tx.record = state, record.reason, message
    tx.decided_ms, tx.flagged_ms = record.decided_ms, record.flagged_ms
    tx.messages = record.messages
    shadowed = set(record.shadowed)
    for position, (name, _, _, _) in enumerate(tx.messages):
        sites = [Site.PRIMARY, Site.SECONDARY] if name in shadowed else [Site.PRIMARY]
        for site in sites:
            participant = tx.participants.get((name, site))
            if participant is None:
                participant = Participant(tx, name, site, uncertain=True,
                                          strikes=record.strikes.get(name, 0))
                tx.participants[(name, site)] = participant
            participant.indexes.append(position)
    router.transactions[tx.tid] = tx
    if state in (TxState.ABORTING, TxState.EXCEPTION):
        free_aborted(tx)
        if state is TxState.ABORTING:
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
        enqueue(router, participant)


__all__ = ["restore"]
