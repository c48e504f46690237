"""Registrations, and the failover of servers: a server that comes, a server
that leaves or dies, and what becomes of the transaction it held.

Theory of operation
-------------------
A server controller registers on a partition in a role; the router tells the
facility's controllers (router events: server up, partition up, primary or
secondary site) and presents waiting participants to it. When a server dies
(its connection, or ``unregister``) the router replays its transaction (seed
000, "RTR transaction recovery"): before its vote to another (or the
restarted) server as ``MSG1``, counting a **strike**; after its vote, or after
an outcome it did not acknowledge, as ``UNCERTAIN`` (the server checks its TID
table). A vote is void once its server died: the replay votes again, so a
commit never counts on work that died with a server. A participant lost before
a vote more often than its partition's retry count strikes the transaction out
(``SRVDIED``, an exception: ``states.py`` Rule 7). A client controller that
leaves takes its unaccepted transactions with it; an accepted one goes on and
its outcome is kept for the client to collect. A partition's first shadow
registration is journaled (the facility record): from then on, across restarts,
its transactions keep a participant for the secondary site — until an operator
retires the secondary site (``rtr_retire_shadow``, :func:`retire_shadow`): then the
participants kept for it go, and so do the decided transactions that only waited for it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from txbroker.core.queue_index import LATER
from txbroker.core.router.data import RouterData
from txbroker.core.router.facilities import add_key_range, store
from txbroker.core.router.model import (
    CLIENT,
    OUTCOME_RETENTION_MS,
    SRVDIED,
    Partition,
    Role,
    RouterEvent,
    Site,
)
from txbroker.core.router.presenting import enqueue, pump
from txbroker.core.router.records import TxRecord
from txbroker.core.router.states import (
    WRITING,
    Controller,
    PartEvent,
    Participant,
    PartState,
    Transaction,
    TxEvent,
    TxState,
    part_next,
)
from txbroker.core.router.voting import all_voted, decide, maybe_forget
from txbroker.errors import BadRequest, IllegalState, NotFound, StorageFailed


def register(router: RouterData, session_id: int, facility_name: Any, *, server: bool,
             partition: Any = None, role: Role = Role.PRIMARY,
             explicit_prepare: bool = False, recipient: str | None = None,
             events: tuple[tuple[int, int], ...] = (), now: int = 0,
             rid: int | None = None) -> Any:
    """Register a client or server controller; replies its id and the partition map.

    The first shadow server of a partition makes the partition shadowed for good: the
    facility record says so (a restart keeps the partition's new transactions for a
    secondary site that is down), and the reply to request ``rid`` waits until that
    record is durable (LATER; without ``rid`` the reply is returned at once)."""
    facility = router.facility(facility_name)
    found: Partition | None = None
    if server:
        try:
            found = facility.find(partition)
        except NotFound:
            if not (isinstance(partition, list | tuple) and len(partition) == 2):
                raise
            facility = add_key_range(router, facility, partition, now)
            found = facility.find(partition)
    newly_shadowed = (found is not None and role is Role.SHADOW
                      and (facility.name, found.name) not in router.shadowed)
    if newly_shadowed:
        router.outbox.check_writable()  # before anything changes
    controller = Controller(router.next_controller, session_id, facility.name, server,
                            found.name if found else None, role if server else None,
                            explicit_prepare, recipient, events)
    router.next_controller += 1
    router.controllers[controller.id] = controller
    router.by_session.setdefault(session_id, []).append(controller)
    reply: dict[str, Any] = {
        "controller": controller.id, "facility": facility.name,
        "key_type": facility.key_type,
        "partitions": [{"name": p.name, "low": p.low, "high": p.high}
                       for p in facility.partitions]}
    answer: Any = reply
    if found is not None:
        reply["partition"] = found.name
        router.partition_servers.setdefault((facility.name, found.name), []).append(controller)
        if newly_shadowed:
            router.shadowed.add((facility.name, found.name))
            if rid is None:
                store(router, facility, now, router.outbox.ignore_durable)
            else:
                store(router, facility, now,
                      router.outbox.reply_when_durable(session_id, rid, reply))
                answer = LATER
        _server_up(router, controller, found)
    return answer


def _server_up(router: RouterData, controller: Controller, partition: Partition) -> None:
    servers = router.servers_of(controller.facility, partition.name)
    router.router_event(controller.facility, RouterEvent.SERVER_UP, partition.name,
                        {"server": controller.id, "role": controller.role.value
                         if controller.role else None})
    if len(servers) == 1:
        router.router_event(controller.facility, RouterEvent.PARTITION_UP, partition.name, {})
    shadows = [s for s in servers if s.role is Role.SHADOW]
    primary_site = [s for s in servers if s.role is not Role.SHADOW]
    if controller.role is Role.SHADOW:
        event = RouterEvent.SECONDARY if primary_site else RouterEvent.PRIMARY
        router.router_event(controller.facility, event, partition.name, {}, only=[controller])
    elif len(primary_site) == 1 and shadows:
        router.router_event(controller.facility, RouterEvent.SECONDARY, partition.name, {},
                            only=shadows)
    pump(router, controller.facility, partition.name)


def unregister(router: RouterData, session_id: int, controller_id: Any, now: int
               ) -> dict[str, Any]:
    """End a registration (a server's transaction is replayed as if it died)."""
    controller = router.controller(session_id, controller_id)
    drop(router, controller, now)
    return {}


def session_closed(router: RouterData, session_id: int, now: int) -> None:
    """A connection ended: each of its controllers leaves."""
    for controller in list(router.by_session.get(session_id, ())):
        drop(router, controller, now)
    router.by_session.pop(session_id, None)


def drop(router: RouterData, controller: Controller, now: int) -> None:
    """A controller leaves (unregistered, or its connection ended)."""
    router.controllers.pop(controller.id, None)
    owned = router.by_session.get(controller.session)
    if owned is not None and controller in owned:
        owned.remove(controller)
    if not controller.is_server:
        for tid in list(controller.tids):
            tx = router.transactions.get(tid)
            if tx is None or tx.client is not controller:
                continue
            tx.client = None
            if tx.state is TxState.SENDING:
                decide(router, tx, TxEvent.CLIENT_LOST, CLIENT, now)
            elif tx.state is not TxState.VREQ:
                tx.deadline_ms = now + OUTCOME_RETENTION_MS
                router.arm(tx)
        return
    partition = controller.partition
    assert partition is not None
    servers = router.partition_servers.get((controller.facility, partition), [])
    if controller in servers:
        servers.remove(controller)
    held = controller.current
    controller.current = None
    if held is not None:
        lost(router, held, now)
    servers = router.servers_of(controller.facility, partition)
    router.router_event(controller.facility, RouterEvent.SERVER_DOWN, partition,
                        {"server": controller.id})
    if not servers:
        router.router_event(controller.facility, RouterEvent.PARTITION_DOWN, partition, {})
    shadows = [s for s in servers if s.role is Role.SHADOW]
    if controller.role is not Role.SHADOW and shadows and len(shadows) == len(servers):
        router.router_event(controller.facility, RouterEvent.PRIMARY, partition, {},
                            only=shadows)
    pump(router, controller.facility, partition)
    _site_down_decisions(router, controller.facility, partition, now)


def _site_down_decisions(router: RouterData, facility: str, partition: str, now: int) -> None:
    """A server left: a transaction waiting for votes may now have every vote it
    needs (the left site's participant waits for the site's return instead)."""
    for tx in list(router.transactions.values()):
        if (tx.facility == facility and tx.state is TxState.VREQ
                and (partition, Site.PRIMARY) in tx.participants
                and all_voted(router, tx)):
            decide(router, tx, TxEvent.ALL_VOTED, None, now)


def lost(router: RouterData, participant: Participant, now: int) -> None:
    """The participant's server died (or left): replay, strike, or forget."""
    tx = participant.tx
    participant.server = None
    before = participant.state
    participant.state = part_next(before, PartEvent.LOST)
    if participant.state is PartState.DONE:
        maybe_forget(router, tx, now)
        return
    if before is PartState.YIELDING:  # it was making way: no strike, not uncertain
        enqueue(router, participant, front=True)
        return
    if before in (PartState.RECEIVING, PartState.VOTING):
        participant.strikes += 1
        retry = router.facility(tx.facility).partition(participant.partition).retry_count
        if participant.strikes > retry and tx.state in (TxState.SENDING, TxState.VREQ):
            _strike_out(router, tx, now)
            return
        if tx.record is not None and tx.state not in WRITING:
            # journaled: so is the strike, or a restart would give the transaction
            # more presentations than its partition's retry count (a failed store
            # takes no more writes: a session's end must not raise for it — found
            # by the simulator, router-bank-failing-fsync seed 126)
            with contextlib.suppress(StorageFailed):
                tx.record = router.log.write(TxRecord.of(tx), tx.record, now,
                                             router.journaled(None))
    else:  # it voted, or had the outcome: it may have committed
        participant.uncertain = True
    enqueue(router, participant, front=True)


def _strike_out(router: RouterData, tx: Transaction, now: int) -> None:
    tx.flagged_ms = now
    router.counters["exceptions"] += 1
    decide(router, tx, TxEvent.STRIKE_OUT, SRVDIED, now)
    partitions = sorted({name for name, _ in tx.participants})
    for name in partitions:
        router.router_event(tx.facility, RouterEvent.EXCEPTION, name, {"tid": tx.tid})



def retire_shadow(router: RouterData, session_id: int, rid: int, facility_name: Any,
                  partition: Any, now: int) -> Any:
    """An operator retires a partition's secondary site: the partition is no longer
    shadowed (its facility record says so, durably before the reply), and every
    transaction drops the participant it kept for that site — a decided one that only
    waited for it is forgotten. Refused while a shadow server of the partition is
    registered (it would get nothing more) or while a transaction with such a
    participant is being written (try again). Replies how many participants still
    waited for the site (``released``); a partition that is not shadowed replies 0 at
    once."""
    facility = router.facility(facility_name)
    if not isinstance(partition, str):
        raise BadRequest("argument 'partition' must be a partition name")
    key = (facility.name, facility.partition(partition).name)
    result: dict[str, Any] = {"facility": key[0], "partition": key[1], "released": 0}
    if key not in router.shadowed:
        return result
    shadows = [s.id for s in router.servers_of(*key) if s.role is Role.SHADOW]
    if shadows:
        raise IllegalState(f"partition {key[1]!r} of facility {key[0]!r} has shadow servers "
                           f"registered ({', '.join(map(str, shadows))}): unregister the "
                           "secondary site first")
    kept = [tx for tx in router.transactions.values()
            if tx.facility == key[0] and (key[1], Site.SECONDARY) in tx.participants]
    busy = [tx.tid for tx in kept if tx.state in WRITING]
    if busy:
        raise IllegalState(f"transaction {busy[0]} is being written; try again")
    router.outbox.check_writable()  # before anything changes
    router.shadowed.discard(key)
    router.waiting.get(key, {}).pop(Site.SECONDARY, None)
    released = 0
    for tx in kept:
        released += tx.participants.pop((key[1], Site.SECONDARY)).state is not PartState.DONE
        maybe_forget(router, tx, now)
        if tx.tid in router.transactions and tx.record is not None:  # still kept: so is
            # the retirement (a restart must not bring the participant back)
            tx.record = router.log.write(TxRecord.of(tx), tx.record, now,
                                         router.journaled(None))
    result["released"] = released
    store(router, facility, now, router.outbox.reply_when_durable(session_id, rid, result))
    return LATER

__all__ = ["drop", "lost", "register", "retire_shadow", "session_closed", "unregister"]
