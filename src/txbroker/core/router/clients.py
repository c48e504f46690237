"""The client side: a client controller's transactions — messages, accept,
reject, collecting outcomes, and asking what became of a transaction.

Theory of operation
-------------------
Applications register **controllers** on a facility (``model.py``): a client
controller starts transactions and sends messages, each routed by its key to
the partition that owns it. A transaction gets one **participant** per
partition it touches (and a second one per shadowed partition, for the
secondary site), queued for a server of its partition (``presenting.py``).
When the client accepts, the router writes the transaction to its journal
(``log.py``) and asks for the votes (``voting.py``); the outcome is pushed to
the client and kept until the client collected it (``rtr_ack``). A client that
reconnected asks for outcomes with ``rtr_outcome``; an answer about a tid the
router has no record of is a promise kept by a tombstone (``tombstones.py``).
"""

from __future__ import annotations

from typing import Any

from txbroker.core.queue_index import LATER
from txbroker.core.router.data import RouterData
from txbroker.core.router.model import CLIENT, LOST, Site, check_tid
from txbroker.core.router.presenting import ask, enqueue, message_body
from txbroker.core.router.records import TxRecord
from txbroker.core.router.states import (
    DECIDED,
    REJECTED,
    Controller,
    PartEvent,
    Participant,
    PartState,
    Transaction,
    TxEvent,
    TxState,
    part_next,
    tx_next,
)
from txbroker.core.router.voting import all_voted, decide, maybe_forget
from txbroker.errors import (
    AlreadyExists,
    BadRequest,
    IllegalState,
    NotFound,
    TransactionRolledBack,
)


def _client_tx(router: RouterData, session_id: int, controller_id: Any, tid: Any, *,
               create: bool, now: int) -> tuple[Controller, Transaction]:
    controller = router.controller(session_id, controller_id, server=False)
    tid = check_tid(tid)
    tx = router.transactions.get(tid)
    if tx is None:
        router.tombstones.check(tid)  # answered already: it never begins again
        if not create:
            raise NotFound(f"no router transaction {tid!r}")
        tx = Transaction(tid, controller.facility, controller, now)
        tx.seq = router.next_seq()
        router.transactions[tid] = tx
        controller.tids.add(tid)
    elif tx.client is not controller:
        raise AlreadyExists(f"transaction {tid!r} belongs to another controller")
    return controller, tx


def send(router: RouterData, session_id: int, controller_id: Any, tid: Any, key: Any,
         body: bytes, headers: dict[str, str] | None, now: int, index: int | None = None
         ) -> dict[str, Any]:
    """A client's message: routed by ``key``; the first one starts the transaction.

    ``index`` (the message's position in its transaction, as the client counts) keeps
    a transaction whole: a message after the first never begins one (its earlier
    messages were lost, e.g. with a broker restart) and a message out of its place
    is refused."""
    controller = router.controller(session_id, controller_id, server=False)
    partition = router.facility(controller.facility).route(key)  # before anything changes
    if index and isinstance(tid, str) and tid not in router.transactions:
        router.tombstones.check(tid)
        raise TransactionRolledBack(
            f"transaction {tid}: message {index} came with no transaction: the earlier "
            "ones were lost (a broker restart or a lost connection); it is applied "
            "nowhere")
    _, tx = _client_tx(router, session_id, controller_id, tid, create=True, now=now)
    if tx.state in REJECTED:
        # a server rejected while the client was still sending (the seed's "a
        # participant can reject ..."): the message goes nowhere, the REJECTED outcome
        # is on its way to the client
        return {"partition": partition.name, "rejected": tx.reason}
    if index is not None and index != len(tx.messages):
        raise IllegalState(f"transaction {tx.tid}: message {index} arrived where message "
                           f"{len(tx.messages)} was due")
    tx.state = tx_next(tx.tid, tx.state, TxEvent.SEND)
    tx.messages.append((partition.name, key, body, headers))
    position = len(tx.messages) - 1
    sites = [Site.PRIMARY]
    first = (partition.name, Site.PRIMARY) not in tx.participants
    # transactions of a partition go to both sites once shadows registered for it (now,
    # or earlier in this run: a down site replays what it missed)
    if (first and (controller.facility, partition.name) in router.shadowed) or (
            partition.name, Site.SECONDARY) in tx.participants:
        sites.append(Site.SECONDARY)
    for site in sites:
        participant = tx.participants.get((partition.name, site))
        if participant is None:
            participant = Participant(tx, partition.name, site)
            tx.participants[(partition.name, site)] = participant
            participant.indexes.append(position)
            enqueue(router, participant)
            continue
        participant.indexes.append(position)
        participant.state = part_next(participant.state, PartEvent.MORE)
        if participant.server is not None and participant.state is not PartState.YIELDING:
            kind = "MSG1" if participant.sent == 0 else "MSG"
            router.push(participant.server, message_body(
                participant, len(participant.indexes) - 1, kind))
            participant.sent += 1
    return {"partition": partition.name}


def accept(router: RouterData, session_id: int, controller_id: Any, tid: Any, now: int,
           rid: int | None = None, result: dict[str, Any] | None = None) -> Any:
    """The client accepts: journal the transaction and ask for the votes. With
    ``rid``, the answer (``result``, or ``{}``) goes once the accepted transaction
    is on disk (LATER): an accept that returned survives a broker crash."""
    _, tx = _client_tx(router, session_id, controller_id, tid, create=False, now=now)
    if tx.state in REJECTED:
        return {"rejected": tx.reason}  # a server rejected first: the outcome is pushed
    if not tx.messages:
        raise IllegalState(f"transaction {tx.tid} has no message to accept")
    router.outbox.check_writable()
    tx.state = tx_next(tx.tid, tx.state, TxEvent.CLIENT_ACCEPT)
    timeouts = [router.facility(tx.facility).partition(name).vote_timeout_ms
                for name, _ in tx.participants]
    limit = min((t for t in timeouts if t), default=0)
    if limit:
        tx.deadline_ms = now + limit
        router.arm(tx)
    answer = {} if result is None else result
    if all_voted(router, tx):  # decided at once: its decision is made durable first
        decide(router, tx, TxEvent.ALL_VOTED, None, now)
        return answer
    reply = None if rid is None else router.outbox.reply_when_durable(session_id, rid, answer)
    tx.record = router.log.write(TxRecord.of(tx), tx.record, now, router.journaled(reply))
    for participant in tx.participants.values():
        ask(router, participant)
    return answer if reply is None else LATER


def reject(router: RouterData, session_id: int, controller_id: Any, tid: Any, reason: Any,
           now: int) -> dict[str, Any]:
    """The client rejects its transaction (only before it accepted). A controller of
    the same facility may reject a transaction of another one (the client that
    reconnected before the broker noticed its old session end: the tid is its own)."""
    controller = router.controller(session_id, controller_id, server=False)
    current = router.transactions.get(tid) if isinstance(tid, str) else None
    if (current is not None and current.client is not controller
            and current.facility == controller.facility):
        _take_over(current, controller)
    _, tx = _client_tx(router, session_id, controller_id, tid, create=False, now=now)
    if tx.state in REJECTED:
        return {"rejected": tx.reason}  # rejected already: nothing changes
    tx_next(tx.tid, tx.state, TxEvent.CLIENT_REJECT)  # refuses after accept
    decide(router, tx, TxEvent.CLIENT_REJECT, reason if isinstance(reason, str) else CLIENT,
           now)
    return {}


def collected(router: RouterData, session_id: int, controller_id: Any, tids: Any, now: int
              ) -> None:
    """The client collected these outcomes (``rtr_ack``, sent without a request id:
    tids the router already forgot, or a controller of an earlier connection, are
    ignored rather than answered with an error nobody waits for)."""
    if not isinstance(tids, list):
        raise BadRequest("argument 'tids' must be a list of transaction ids")
    controller = router.controllers.get(controller_id) if type(controller_id) is int else None
    if controller is None or controller.session != session_id or controller.is_server:
        return
    for tid in tids:
        tx = router.transactions.get(tid) if isinstance(tid, str) else None
        controller.tids.discard(tid)
        if tx is not None and tx.state in DECIDED:
            tx.client_acked = True
            maybe_forget(router, tx, now)


def outcome(router: RouterData, session_id: int, rid: int, tid: Any, controller_id: Any,
            now: int) -> Any:
    """What became of ``tid``; a client controller given here gets the outcome
    pushed when it is decided (a client that reconnected). An UNKNOWN answer (no
    record: never durably accepted, presumed aborted) is given once its tombstone
    is durable, so that the tid can never begin afterwards; a transaction asked
    about leaves a tombstone when it is forgotten (``tombstones.py``)."""
    tid = check_tid(tid)
    controller = (None if controller_id is None
                  else router.controller(session_id, controller_id, server=False))
    tx = router.transactions.get(tid)
    if tx is None:
        tomb = router.tombstones.get(tid)
        if tomb is None:
            router.outbox.check_writable()
            tomb = router.tombstones.lay(tid, controller.facility if controller else None,
                                         "UNKNOWN", "UNKNOWN", now)
        return router.tombstones.answer(tomb, session_id, rid)
    tx.inquired = True
    if controller is not None:
        if tx.facility != controller.facility:
            raise BadRequest(f"transaction {tid} is not of facility {controller.facility!r}")
        _take_over(tx, controller)
    if tx.state is TxState.SENDING:
        # asked about while still being sent: its client lost the session that sent
        # it (a library never sends more of it), maybe before this broker noticed —
        # waiting for that would hold its servers; presumed abort, now (found by the
        # simulator: router-bank-resets, seed 2)
        decide(router, tx, TxEvent.CLIENT_LOST, LOST, now)
    if tx.state is TxState.COMMITTING:
        return {"tid": tid, "state": "ACCEPTED", "reason": None}
    if tx.state in (TxState.ABORTING, TxState.EXCEPTION):
        return {"tid": tid, "state": "REJECTED", "reason": tx.reason}
    return {"tid": tid, "state": "PENDING", "reason": None}


def _take_over(tx: Transaction, controller: Controller) -> None:
    """``controller`` (a reconnected client) is now the transaction's client."""
    if tx.client is not None and tx.client is not controller:
        tx.client.tids.discard(tx.tid)
    tx.client = controller
    controller.tids.add(tx.tid)


__all__ = ["accept", "collected", "outcome", "reject", "send"]
