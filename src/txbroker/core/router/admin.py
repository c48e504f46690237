"""The router's user events and its administration: show, exception transactions.

Theory of operation
-------------------
**User events** (seed 000, "broadcast events") go from a client controller to
the server controllers of its facility, or from a server controller to the
client controllers — to create the other direction, an application registers
a second controller of the other kind. Each subscriber of the number gets one
push; a named event (recipient specifier) only reaches subscribers whose name
matches (``core/router/model.py``). Events are not journaled: a broadcast
reaches whoever is registered when it is sent, as RTR's do.

**Exception transactions**: a transaction that struck out (``SRVDIED``) stays in
the router's journal, flagged, until an operator resolves it. ``commit``
presents it again, decided, to a server of each partition (``UNCERTAIN``
first, then ``ACCEPTED``: the servers apply it unless their TID table says they
did); ``discard`` forgets it. Both are durable before the reply and both are
audited by the edge.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from txbroker.core.effects import Fail, Reply
from txbroker.core.queue_index import LATER
from txbroker.core.router.data import RouterData
from txbroker.core.router.model import USER_EVENT_MAX, Site, event_matches
from txbroker.core.router.presenting import enqueue
from txbroker.core.router.records import TxRecord
from txbroker.core.router.states import (
    PUBLIC,
    PUBLIC_NAMES,
    Participant,
    PartState,
    Transaction,
    TxEvent,
    TxState,
    tx_next,
)
from txbroker.core.router.voting import forget
from txbroker.errors import BadRequest, IllegalState, NotFound, StorageFailed


def user_event(router: RouterData, session_id: int, controller_id: Any, number: Any, body: Any,
               recipient: Any) -> dict[str, int]:
    """Broadcast a user event; replies how many controllers it reached."""
    sender = router.controller(session_id, controller_id)
    if type(number) is not int or not 0 <= number <= USER_EVENT_MAX:
        raise BadRequest(f"a user event number must be 0 to {USER_EVENT_MAX}")
    if not isinstance(body, bytes):
        raise BadRequest("argument 'body' must be bytes")
    if recipient is not None and not isinstance(recipient, str):
        raise BadRequest("argument 'recipient' must be a string or nil")
    delivered = 0
    for controller in list(router.controllers.values()):
        if controller.facility != sender.facility or controller.is_server == sender.is_server:
            continue
        if event_matches(number, recipient, controller.events, controller.recipient):
            router.push(controller, {"type": "USER_EVENT", "number": number, "body": body,
                                     "recipient": recipient, "facility": sender.facility})
            delivered += 1
    return {"delivered": delivered}


def show(router: RouterData, facility_name: Any = None) -> dict[str, Any]:
    """Facilities, partitions (shadowed or not), servers and their roles, transactions
    by state."""
    if facility_name is not None:
        names = [router.facility(facility_name).name]
    else:
        names = sorted(router.facilities)
    result = []
    for name in names:
        facility = router.facilities[name]
        partitions = []
        for partition in facility.partitions:
            servers = []
            for server in router.servers_of(name, partition.name):
                held = server.current
                servers.append({
                    "controller": server.id, "session": server.session,
                    "role": server.role.value if server.role else None,
                    "site": "secondary" if held is not None and held.site is Site.SECONDARY
                    else "primary",
                    "busy_tid": held.tx.tid if held is not None else None,
                    "explicit_prepare": server.explicit_prepare,
                    "recipient": server.recipient})
            waiting = router.waiting.get((name, partition.name), {})
            waiting_now = sum(1 for queue in waiting.values() for p in queue
                              if p.server is None and p.state is PartState.WAITING)
            partitions.append({**partition.to_dict(), "servers": servers,
                               "waiting": waiting_now,
                               # a secondary site's shadows registered (durable; its
                               # decided transactions are kept for them)
                               "shadowed": (name, partition.name) in router.shadowed})
        states: Counter[str] = Counter()
        exceptions = 0
        for tx in router.transactions.values():
            if tx.facility == name:
                states[PUBLIC[tx.state]] += 1
                exceptions += tx.exception
        result.append({
            "name": name, "key_type": facility.key_type, "partitions": partitions,
            "clients": sum(1 for c in router.controllers.values()
                           if c.facility == name and not c.is_server),
            "transactions": {name: states[name] for name in PUBLIC_NAMES},
            "exceptions": exceptions})
    return {"facilities": result, "counters": dict(router.counters)}


def stats(router: RouterData) -> dict[str, Any]:
    """The router's counts for ``txbroker stat`` and ``/metrics``."""
    states: Counter[str] = Counter(PUBLIC[tx.state] for tx in router.transactions.values())
    return {"facilities": len(router.facilities), "controllers": len(router.controllers),
            "transactions": {name: states[name] for name in PUBLIC_NAMES},
            "exceptions": sum(1 for tx in router.transactions.values() if tx.exception),
            **router.counters}


def holds(router: RouterData) -> list[str]:
    """One line per transaction the router holds, by tid: its state (the seed's name),
    its client and each participant's state and server (the simulator logs them at the
    end of a run, for reading a failing trace)."""
    lines = []
    for tid, tx in sorted(router.transactions.items()):
        parts = " ".join(f"{name}/{site.name}:{p.state.name}"
                         f"@{p.server.id if p.server else '-'}"
                         for (name, site), p in sorted(tx.participants.items()))
        holder = tx.client.id if tx.client is not None else "-"
        lines.append(f"{tid} {PUBLIC[tx.state]} client={holder} {parts}")
    return lines


def exceptions(router: RouterData, facility_name: Any = None) -> list[dict[str, Any]]:
    """The exception transactions (of one facility, or all)."""
    if facility_name is not None:
        router.facility(facility_name)
    found = []
    for tx in router.transactions.values():
        if not tx.exception or (facility_name is not None and tx.facility != facility_name):
            continue
        found.append({
            "tid": tx.tid, "facility": tx.facility, "reason": tx.reason,
            "partitions": sorted({name for name, _ in tx.participants}),
            "strikes": max((p.strikes for p in tx.participants.values()), default=0),
            "flagged_ms": tx.flagged_ms, "messages": len(tx.messages)})
    return sorted(found, key=lambda item: (item["flagged_ms"], item["tid"]))


def _exception(router: RouterData, tid: Any) -> Transaction:
    tx = router.transactions.get(tid) if isinstance(tid, str) else None
    if tx is None:
        raise NotFound(f"no router transaction {tid!r}")
    if not tx.exception:
        raise IllegalState(f"transaction {tid} is not an exception transaction")
    if tx.state is TxState.EXCEPTION_DECIDING:  # its strike-out is on its way to disk
        raise IllegalState(f"transaction {tid} is being written; try again")
    return tx


def commit_exception(router: RouterData, session_id: int, rid: int, tid: Any, now: int) -> Any:
    """An operator commits an exception transaction: it is replayed, decided."""
    tx = _exception(router, tid)
    tx.state = tx_next(tx.tid, tx.state, TxEvent.OPERATOR_COMMIT)  # Rule 10
    tx.reason = None
    tx.decided_ms = now
    for key, old in list(tx.participants.items()):
        tx.participants[key] = Participant(tx, old.partition, old.site, list(old.indexes),
                                           uncertain=True)

    def durable(error: BaseException | None) -> None:
        tx.state = tx_next(tx.tid, tx.state,  # Rule 11 or 12
                           TxEvent.DURABLE if error is None else TxEvent.WRITE_FAILED)
        if error is not None:
            router.outbox.storage_failed(error)
            router.outbox.emit(Fail(session_id, rid, StorageFailed(str(error))))
            return
        for participant in tx.participants.values():
            enqueue(router, participant)
        router.outbox.emit(Reply(session_id, rid, {"tid": tx.tid, "state": PUBLIC[tx.state]}))

    tx.record = router.log.write(TxRecord.of(tx), tx.record, now, durable)
    return LATER


def discard_exception(router: RouterData, session_id: int, rid: int, tid: Any, now: int) -> Any:
    """An operator discards an exception transaction: it is forgotten."""
    tx = _exception(router, tid)
    router.outbox.check_writable()
    forget(router, tx, now)
    result = {"tid": tx.tid, "state": "DISCARDED"}
    if not router.outbox.group:  # nothing to write (its record never reached the disk)
        return result
    router.outbox.reply_later(session_id, rid, result)
    return LATER


__all__ = ["commit_exception", "discard_exception", "exceptions", "holds", "show", "stats",
           "user_event"]
