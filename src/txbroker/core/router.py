"""The transaction router (seed 000): partitioned servers that vote, replay, three
strikes.

Theory of operation
-------------------
Applications register **controllers** on a facility (``core/router_model.py``):
a client controller starts transactions and sends messages, each routed by its
key to the partition that owns it; a server controller serves one partition
in a role. A transaction gets one **participant** per partition it touches
(and a second one per shadowed partition, for the secondary site). The router:

1. presents each participant to a free server of its partition — the first
   message as ``MSG1`` (``UNCERTAIN`` on a replay after the server may have
   voted), then ``MSG`` — and queues it while every server is busy (a server
   holds one transaction at a time, until it acknowledges the outcome);
2. when the client accepts, writes the transaction to its journal
   (``core/router_log.py``) and asks for the votes (``PREPARE`` to servers that
   registered with explicit prepare; implicit servers vote on their own, and
   may do so before the client accepted);
3. decides: commit when every participant voted accept, abort when anyone
   rejected, the votes timed out, or a participant struck out; a decision that
   must survive a crash (every commit, and every abort of a journaled
   transaction) is durable before anybody hears it;
4. tells every participant and the client, and forgets the transaction once
   every server acknowledged and the client collected the outcome.

When a server dies (its connection, or ``unregister``) the router replays its
transaction (seed 000, "RTR transaction recovery"): before its vote to another
(or the restarted) server as ``MSG1``, counting a **strike**; after its vote,
or after an outcome it did not acknowledge, as ``UNCERTAIN`` (the server checks
its TID table). A vote is void once its server died: the replay votes again,
so a commit never counts on work that died with a server. A participant lost
before a vote more often than its partition's retry count is rejected with
``SRVDIED`` and the transaction is flagged an **exception**, kept until an
operator commits or discards it (``core/router_states.py`` holds both state
tables; events and administration are ``core/router_admin.py``).

When the broker itself restarts, :meth:`Router.restore` reads the journal
(``core/router_journal.py``): a transaction the client accepted is presented
again to every partition as ``UNCERTAIN``; a decided one is replayed with its
outcome.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import deque
from typing import Any, Final

from txbroker.core.effects import Notify
from txbroker.core.messages import Message
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import LATER
from txbroker.core.router_deadlock import victims
from txbroker.core.router_journal import journal_record, restore
from txbroker.core.router_log import RouterLog
from txbroker.core.router_model import (
    CLIENT,
    LOST,
    OUTCOME_RETENTION_MS,
    PREEMPTED,
    SRVDIED,
    TIMEOUT,
    Facility,
    Partition,
    Role,
    RouterEvent,
    Site,
    check_tid,
    event_matches,
    parse_facility,
)
from txbroker.core.router_states import (
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
from txbroker.core.router_tombstones import Tombstones
from txbroker.errors import (
    AlreadyExists,
    BadRequest,
    IllegalState,
    NotFound,
    StorageFailed,
    TransactionRolledBack,
)

#: The push event name of every router message (``docs/router.md``).
PUSH: Final = "rtr"

#: Roles that make up a partition's primary site.
_ACTIVE_ROLES: Final = (Role.PRIMARY, Role.CONCURRENT)


class Router:
    """The router part of the broker core (see the module docstring)."""

    def __init__(self, log: RouterLog, outbox: Outbox) -> None:
        self.log = log
        self.outbox = outbox
        self.facilities: dict[str, Facility] = {}
        self.facility_records: dict[str, Message] = {}
        self.controllers: dict[int, Controller] = {}
        self.by_session: dict[int, list[Controller]] = {}
        #: (facility, partition) -> its server controllers, in registration order
        self.partition_servers: dict[tuple[str, str], list[Controller]] = {}
        self.transactions: dict[str, Transaction] = {}
        #: tids whose outcome was answered: they never begin again (router_tombstones.py)
        self.tombstones = Tombstones(log, outbox)
        #: (facility, partition) -> {site: participants waiting for a server}
        self.waiting: dict[tuple[str, str], dict[Site, deque[Participant]]] = {}
        self._next_controller = 1
        self._round_robin = 0
        self._timers: list[tuple[int, str]] = []  #: (deadline, tid), lazily stale
        #: (facility, partition) a shadow server ever registered for (this run): its
        #: transactions get a secondary-site participant even while the shadows are down
        self.shadowed: set[tuple[str, str]] = set()
        self.counters = {"committed": 0, "rejected": 0, "replays": 0, "exceptions": 0,
                         "preempted": 0}
        self._next_seq = 1

    def next_seq(self) -> int:
        """The age of a transaction coming into flight (core/router_deadlock.py)."""
        self._next_seq += 1
        return self._next_seq - 1

    # ------------------------------------------------------------------ helpers
    def facility(self, name: Any) -> Facility:
        """A defined facility (NotFound otherwise)."""
        facility = self.facilities.get(name) if isinstance(name, str) else None
        if facility is None:
            raise NotFound(f"no facility {name!r}")
        return facility

    def controller(self, session_id: int, controller_id: Any, *, server: bool | None = None
                   ) -> Controller:
        """The session's controller ``controller_id`` (NotFound otherwise)."""
        found = self.controllers.get(controller_id) if type(controller_id) is int else None
        if found is None or found.session != session_id:
            raise NotFound(f"no router controller {controller_id!r} on this connection")
        if server is not None and found.is_server != server:
            kind = "server" if server else "client"
            raise IllegalState(f"controller {controller_id} is not a {kind} controller")
        return found

    def push(self, controller: Controller, body: dict[str, Any]) -> None:
        """Push one router message to a controller."""
        body["controller"] = controller.id
        self.outbox.emit(Notify(controller.session, PUSH, body))

    def servers_of(self, facility: str, partition: str) -> list[Controller]:
        """The server controllers registered on a partition, in registration order."""
        return self.partition_servers.get((facility, partition), [])

    # ------------------------------------------------------------------ definitions
    def define(self, session_id: int, rid: int, name: Any, partitions: Any, now: int) -> Any:
        """Define (or redefine) a facility; answered once its record is durable."""
        facility = parse_facility(name, partitions)
        current = self.facilities.get(facility.name)
        if current is not None and current.to_dict() == facility.to_dict():
            return facility.to_dict()
        if current is not None and any(t.facility == facility.name
                                       for t in self.transactions.values()):
            raise IllegalState(f"facility {facility.name!r} has transactions in flight: "
                               "it cannot be redefined now")
        if current is not None and any(c.facility == facility.name
                                       for c in self.controllers.values()):
            raise IllegalState(f"facility {facility.name!r} has registered controllers: "
                               "it cannot be redefined now")
        self._store_facility(facility, now, self.outbox.reply_when_durable(
            session_id, rid, facility.to_dict()))
        return LATER

    def _store_facility(self, facility: Facility, now: int, on_durable: Any) -> None:
        record = {"r": "facility", **facility.to_dict()}
        self.facilities[facility.name] = facility
        self.facility_records[facility.name] = self.log.write(
            record, self.facility_records.get(facility.name), now, on_durable)

    def define_from_config(self, name: str, partitions: Any, now: int) -> None:
        """A facility of the configuration file: defined unless the journal already
        has the same one (a different one is redefined when nothing uses it)."""
        facility = parse_facility(name, partitions)
        current = self.facilities.get(facility.name)
        if current is not None and current.to_dict() == facility.to_dict():
            return
        if current is not None and any(t.facility == name for t in self.transactions.values()):
            raise IllegalState(f"facility {name!r} of the configuration differs from the "
                               "journal's and has transactions in flight")
        self._store_facility(facility, now, self.outbox.ignore_durable)

    def set_partition(self, session_id: int, rid: int, facility_name: Any, partition: Any,
                      retry_count: Any, vote_timeout_ms: Any, now: int) -> Any:
        """Change a partition's retry count or vote timeout (durable before the reply)."""
        facility = self.facility(facility_name)
        if not isinstance(partition, str):
            raise BadRequest("argument 'partition' must be a partition name")
        old = facility.partition(partition)
        new = old.with_settings(retry_count, vote_timeout_ms)
        updated = Facility(facility.name, [new if p is old else p for p in facility.partitions])
        self._store_facility(updated, now, self.outbox.reply_when_durable(
            session_id, rid, new.to_dict()))
        return LATER

    # ------------------------------------------------------------------ registration
    def register(self, session_id: int, facility_name: Any, *, server: bool,
                 partition: Any = None, role: Role = Role.PRIMARY,
                 explicit_prepare: bool = False, recipient: str | None = None,
                 events: tuple[tuple[int, int], ...] = (), now: int = 0) -> dict[str, Any]:
        """Register a client or server controller; replies its id and the partition map."""
        facility = self.facility(facility_name)
        found: Partition | None = None
        if server:
            try:
                found = facility.find(partition)
            except NotFound:
                if not (isinstance(partition, list | tuple) and len(partition) == 2):
                    raise
                facility = self._partition_by_key_range(facility, partition, now)
                found = facility.find(partition)
        controller = Controller(self._next_controller, session_id, facility.name, server,
                                found.name if found else None, role if server else None,
                                explicit_prepare, recipient, events)
        self._next_controller += 1
        self.controllers[controller.id] = controller
        self.by_session.setdefault(session_id, []).append(controller)
        reply: dict[str, Any] = {
            "controller": controller.id, "facility": facility.name,
            "key_type": facility.key_type,
            "partitions": [{"name": p.name, "low": p.low, "high": p.high}
                           for p in facility.partitions]}
        if found is not None:
            reply["partition"] = found.name
            self.partition_servers.setdefault((facility.name, found.name), []).append(controller)
            self._server_up(controller, found)
        return reply

    def _partition_by_key_range(self, facility: Facility, key_range: Any, now: int
                                ) -> Facility:
        """A server registers a key range no partition has (the seed's servers define
        partitions by their key range): the facility gets a partition of that range,
        named ``low-high``, durably (BadRequest if it overlaps another partition or
        its keys are of another type)."""
        low, high = key_range
        parts = [p.to_dict() for p in facility.partitions]
        parts.append({"name": f"{low}-{high}", "low": low, "high": high})
        updated = parse_facility(facility.name, parts)
        self.outbox.check_writable()
        self._store_facility(updated, now, self.outbox.ignore_durable)
        return updated

    def _server_up(self, controller: Controller, partition: Partition) -> None:
        servers = self.servers_of(controller.facility, partition.name)
        if controller.role is Role.SHADOW:
            self.shadowed.add((controller.facility, partition.name))
        self.router_event(controller.facility, RouterEvent.SERVER_UP, partition.name,
                          {"server": controller.id, "role": controller.role.value
                           if controller.role else None})
        if len(servers) == 1:
            self.router_event(controller.facility, RouterEvent.PARTITION_UP, partition.name, {})
        shadows = [s for s in servers if s.role is Role.SHADOW]
        primary_site = [s for s in servers if s.role is not Role.SHADOW]
        if controller.role is Role.SHADOW:
            event = RouterEvent.SECONDARY if primary_site else RouterEvent.PRIMARY
            self.router_event(controller.facility, event, partition.name, {}, only=[controller])
        elif len(primary_site) == 1 and shadows:
            self.router_event(controller.facility, RouterEvent.SECONDARY, partition.name, {},
                              only=shadows)
        self.pump(controller.facility, partition.name)

    def unregister(self, session_id: int, controller_id: Any, now: int) -> dict[str, Any]:
        """End a registration (a server's transaction is replayed as if it died)."""
        controller = self.controller(session_id, controller_id)
        self._drop(controller, now)
        return {}

    def session_closed(self, session_id: int, now: int) -> None:
        """A connection ended: each of its controllers leaves."""
        for controller in list(self.by_session.get(session_id, ())):
            self._drop(controller, now)
        self.by_session.pop(session_id, None)

    def _drop(self, controller: Controller, now: int) -> None:
        self.controllers.pop(controller.id, None)
        owned = self.by_session.get(controller.session)
        if owned is not None and controller in owned:
            owned.remove(controller)
        if not controller.is_server:
            for tid in list(controller.tids):
                tx = self.transactions.get(tid)
                if tx is None or tx.client is not controller:
                    continue
                tx.client = None
                if tx.state is TxState.SENDING:
                    self._abort(tx, TxEvent.CLIENT_LOST, CLIENT, now)
                elif tx.state is not TxState.VREQ:
                    tx.deadline_ms = now + OUTCOME_RETENTION_MS
                    self.arm(tx)
            return
        partition = controller.partition
        assert partition is not None
        servers = self.partition_servers.get((controller.facility, partition), [])
        if controller in servers:
            servers.remove(controller)
        held = controller.current
        controller.current = None
        if held is not None:
            self._lost(held, now)
        servers = self.servers_of(controller.facility, partition)
        self.router_event(controller.facility, RouterEvent.SERVER_DOWN, partition,
                          {"server": controller.id})
        if not servers:
            self.router_event(controller.facility, RouterEvent.PARTITION_DOWN, partition, {})
        shadows = [s for s in servers if s.role is Role.SHADOW]
        if controller.role is not Role.SHADOW and shadows and len(shadows) == len(servers):
            self.router_event(controller.facility, RouterEvent.PRIMARY, partition, {},
                              only=shadows)
        self.pump(controller.facility, partition)
        self._site_down_decisions(controller.facility, partition, now)

    def _site_down_decisions(self, facility: str, partition: str, now: int) -> None:
        """A server left: a transaction waiting for votes may now have every vote it
        needs (the left site's participant waits for the site's return instead)."""
        for tx in list(self.transactions.values()):
            if (tx.facility == facility and tx.state is TxState.VREQ and not tx.deciding
                    and (partition, Site.PRIMARY) in tx.participants
                    and self._all_voted(tx)):
                self._decide(tx, TxEvent.ALL_VOTED, None, now)

    # ------------------------------------------------------------------ presenting
    def _candidates(self, facility: str, partition: str, site: Site) -> list[Controller]:
        """The servers a participant of ``site`` may go to: the primary site's (primary
        and concurrent servers, else standbys) or the shadows. Never the other site's:
        each site applies a transaction once (seed 000, shadowing)."""
        servers = self.servers_of(facility, partition)
        if site is Site.SECONDARY:
            return [s for s in servers if s.role is Role.SHADOW]
        active = [s for s in servers if s.role in _ACTIVE_ROLES]
        return active or [s for s in servers if s.role is Role.STANDBY]

    def pump(self, facility: str, partition: str) -> None:
        """Present waiting participants of a partition to its free servers."""
        queues = self.waiting.get((facility, partition))
        if not queues:
            return
        blocked = False
        for site, waiting in queues.items():
            while waiting:
                participant = waiting[0]
                if participant.state is not PartState.WAITING or participant.server is not None:
                    waiting.popleft()  # stale: done, or presented meanwhile
                    continue
                free = [s for s in self._candidates(facility, partition, site)
                        if s.current is None]
                if not free:
                    blocked = True
                    break
                self._round_robin += 1
                waiting.popleft()
                self._present(participant, free[self._round_robin % len(free)])
        if blocked:
            self._break_wait_cycle()

    def _break_wait_cycle(self) -> None:
        """A participant waits for busy servers: if that closes a wait cycle, the
        youngest transaction of the cycle makes way (core/router_deadlock.py)."""
        waiting = [p for queues in self.waiting.values() for queue in queues.values()
                   for p in queue]
        for participant in victims(waiting, lambda p: self._candidates(
                p.tx.facility, p.partition, p.site)):
            server = participant.server
            assert server is not None
            participant.state = part_next(participant.state, PartEvent.YIELD)
            self.counters["preempted"] += 1
            self.push(server, {"type": "REJECTED", "tid": participant.tx.tid,
                               "partition": participant.partition, "reason": PREEMPTED})

    def enqueue(self, participant: Participant, *, front: bool = False) -> None:
        """Queue a participant for its partition's next free server (``front``: a replay)."""
        tx = participant.tx
        queues = self.waiting.setdefault((tx.facility, participant.partition), {})
        waiting = queues.setdefault(participant.site, deque())
        if front:
            waiting.appendleft(participant)
        else:
            waiting.append(participant)
        self.pump(tx.facility, participant.partition)

    def _message_body(self, participant: Participant, position: int, kind: str
                      ) -> dict[str, Any]:
        tx = participant.tx
        _, key, body, headers = tx.messages[participant.indexes[position]]
        body_: dict[str, Any] = {
            "type": kind, "tid": tx.tid, "key": key, "body": body, "headers": headers,
            "index": position, "partition": participant.partition,
            "replay": participant.presentations - 1}
        if tx.state is TxState.COMMITTING and not tx.deciding:
            # the replay of a transaction decided ACCEPTED (its ACCEPTED follows): the
            # server applies it whatever its checks say now — a refusal cannot change
            # the outcome, and the other partitions commit (found by the simulator:
            # router-bank seed 1177)
            body_["decided"] = True
        return body_

    def _present(self, participant: Participant, server: Controller) -> None:
        tx = participant.tx
        participant.server = server
        server.current = participant
        participant.presentations += 1
        if participant.presentations > 1:
            self.counters["replays"] += 1
        participant.state = part_next(participant.state, PartEvent.PRESENT)
        first = "UNCERTAIN" if participant.uncertain else "MSG1"
        for position in range(len(participant.indexes)):
            self.push(server, self._message_body(participant, position,
                                                 first if position == 0 else "MSG"))
        participant.sent = len(participant.indexes)
        if tx.state is TxState.COMMITTING and not tx.deciding:
            self._tell(participant, commit=True)
        elif tx.state is TxState.VREQ:
            self._ask(participant)

    def _ask(self, participant: Participant) -> None:
        participant.state = part_next(participant.state, PartEvent.ASK)
        server = participant.server
        if (participant.state is PartState.VOTING and server is not None
                and server.explicit_prepare):
            self.push(server, {"type": "PREPARE", "tid": participant.tx.tid,
                               "partition": participant.partition})

    def _tell(self, participant: Participant, *, commit: bool) -> None:
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
        self.push(server, body)

    # ------------------------------------------------------------------ client side
    def _client_tx(self, session_id: int, controller_id: Any, tid: Any, *,
                   create: bool, now: int) -> tuple[Controller, Transaction]:
        controller = self.controller(session_id, controller_id, server=False)
        tid = check_tid(tid)
        tx = self.transactions.get(tid)
        if tx is None:
            self.tombstones.check(tid)  # answered already: it never begins again
            if not create:
                raise NotFound(f"no router transaction {tid!r}")
            tx = Transaction(tid, controller.facility, controller, now)
            tx.seq = self.next_seq()
            self.transactions[tid] = tx
            controller.tids.add(tid)
        elif tx.client is not controller:
            raise AlreadyExists(f"transaction {tid!r} belongs to another controller")
        return controller, tx

    def send(self, session_id: int, controller_id: Any, tid: Any, key: Any, body: bytes,
             headers: dict[str, str] | None, now: int, index: int | None = None
             ) -> dict[str, Any]:
        """A client's message: routed by ``key``; the first one starts the transaction.

        ``index`` (the message's position in its transaction, as the client counts) keeps
        a transaction whole: a message after the first never begins one (its earlier
        messages were lost, e.g. with a broker restart) and a message out of its place
        is refused."""
        controller = self.controller(session_id, controller_id, server=False)
        partition = self.facility(controller.facility).route(key)  # before anything changes
        if index and isinstance(tid, str) and tid not in self.transactions:
            self.tombstones.check(tid)
            raise TransactionRolledBack(
                f"transaction {tid}: message {index} came with no transaction: the earlier "
                "ones were lost (a broker restart or a lost connection); it is applied "
                "nowhere")
        _, tx = self._client_tx(session_id, controller_id, tid, create=True, now=now)
        if tx.state is TxState.ABORTING:
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
        if (first and self._shadowed(controller.facility, partition.name)) or (
                partition.name, Site.SECONDARY) in tx.participants:
            sites.append(Site.SECONDARY)
        for site in sites:
            participant = tx.participants.get((partition.name, site))
            if participant is None:
                participant = Participant(tx, partition.name, site)
                tx.participants[(partition.name, site)] = participant
                participant.indexes.append(position)
                self.enqueue(participant)
                continue
            participant.indexes.append(position)
            participant.state = part_next(participant.state, PartEvent.MORE)
            if participant.server is not None and participant.state is not PartState.YIELDING:
                kind = "MSG1" if participant.sent == 0 else "MSG"
                self.push(participant.server, self._message_body(
                    participant, len(participant.indexes) - 1, kind))
                participant.sent += 1
        return {"partition": partition.name}

    def _shadowed(self, facility: str, partition: str) -> bool:
        """Transactions of the partition go to both sites: shadows registered for it
        (now, or earlier in this run: a down site replays what it missed)."""
        return (facility, partition) in self.shadowed

    def accept(self, session_id: int, controller_id: Any, tid: Any, now: int,
               rid: int | None = None, result: dict[str, Any] | None = None) -> Any:
        """The client accepts: journal the transaction and ask for the votes. With
        ``rid``, the answer (``result``, or ``{}``) goes once the accepted transaction
        is on disk (LATER): an accept that returned survives a broker crash."""
        _, tx = self._client_tx(session_id, controller_id, tid, create=False, now=now)
        if tx.state is TxState.ABORTING:
            return {"rejected": tx.reason}  # a server rejected first: the outcome is pushed
        if not tx.messages:
            raise IllegalState(f"transaction {tx.tid} has no message to accept")
        self.outbox.check_writable()
        tx.state = tx_next(tx.tid, tx.state, TxEvent.CLIENT_ACCEPT)
        timeouts = [self.facility(tx.facility).partition(name).vote_timeout_ms
                    for name, _ in tx.participants]
        limit = min((t for t in timeouts if t), default=0)
        if limit:
            tx.deadline_ms = now + limit
            self.arm(tx)
        answer = {} if result is None else result
        if self._all_voted(tx):  # decided at once: its decision is made durable first
            self._decide(tx, TxEvent.ALL_VOTED, None, now)
            return answer
        reply = None if rid is None else self.outbox.reply_when_durable(session_id, rid, answer)
        tx.record = self.log.write(self.journal_record(tx), tx.record, now,
                                   self._journaled(reply))
        for participant in tx.participants.values():
            self._ask(participant)
        return answer if reply is None else LATER

    def _journaled(self, reply: Any) -> Any:
        def durable(error: BaseException | None) -> None:
            if reply is not None:
                reply(error)
            elif error is not None:  # the store failed: the broker takes no more writes
                self.outbox.storage_failed(error)
        return durable

    def reject(self, session_id: int, controller_id: Any, tid: Any, reason: Any,
               now: int) -> dict[str, Any]:
        """The client rejects its transaction (only before it accepted). A controller of
        the same facility may reject a transaction of another one (the client that
        reconnected before the broker noticed its old session end: the tid is its own)."""
        controller = self.controller(session_id, controller_id, server=False)
        current = self.transactions.get(tid) if isinstance(tid, str) else None
        if (current is not None and current.client is not controller
                and current.facility == controller.facility):
            self._take_over(current, controller)
        _, tx = self._client_tx(session_id, controller_id, tid, create=False, now=now)
        if tx.state is TxState.ABORTING:
            return {"rejected": tx.reason}  # rejected already: nothing changes
        tx_next(tx.tid, tx.state, TxEvent.CLIENT_REJECT)  # refuses after accept
        self._abort(tx, TxEvent.CLIENT_REJECT, reason if isinstance(reason, str) else CLIENT,
                    now)
        return {}

    def collected(self, session_id: int, controller_id: Any, tids: Any, now: int) -> None:
        """The client collected these outcomes (``rtr_ack``, sent without a request id:
        tids the router already forgot, or a controller of an earlier connection, are
        ignored rather than answered with an error nobody waits for)."""
        if not isinstance(tids, list):
            raise BadRequest("argument 'tids' must be a list of transaction ids")
        controller = self.controllers.get(controller_id) if type(controller_id) is int else None
        if controller is None or controller.session != session_id or controller.is_server:
            return
        for tid in tids:
            tx = self.transactions.get(tid) if isinstance(tid, str) else None
            controller.tids.discard(tid)
            if tx is not None and tx.state in (TxState.COMMITTING, TxState.ABORTING):
                tx.client_acked = True
                self._maybe_forget(tx, now)

    def outcome(self, session_id: int, rid: int, tid: Any, controller_id: Any, now: int
                ) -> Any:
        """What became of ``tid``; a client controller given here gets the outcome
        pushed when it is decided (a client that reconnected). An UNKNOWN answer (no
        record: never durably accepted, presumed aborted) is given once its tombstone
        is durable, so that the tid can never begin afterwards; a transaction asked
        about leaves a tombstone when it is forgotten (``core/router_tombstones.py``)."""
        tid = check_tid(tid)
        controller = (None if controller_id is None
                      else self.controller(session_id, controller_id, server=False))
        tx = self.transactions.get(tid)
        if tx is None:
            tomb = self.tombstones.get(tid)
            if tomb is None:
                self.outbox.check_writable()
                tomb = self.tombstones.lay(tid, controller.facility if controller else None,
                                           "UNKNOWN", "UNKNOWN", now)
            return self.tombstones.answer(tomb, session_id, rid)
        tx.inquired = True
        if controller is not None:
            if tx.facility != controller.facility:
                raise BadRequest(f"transaction {tid} is not of facility {controller.facility!r}")
            self._take_over(tx, controller)
        if tx.state is TxState.SENDING:
            # asked about while still being sent: its client lost the session that sent
            # it (a library never sends more of it), maybe before this broker noticed —
            # waiting for that would hold its servers; presumed abort, now (found by the
            # simulator: router-bank-resets, seed 2)
            self._abort(tx, TxEvent.CLIENT_LOST, LOST, now)
        if tx.state is TxState.COMMITTING and not tx.deciding:
            return {"tid": tid, "state": "ACCEPTED", "reason": None}
        if tx.state is TxState.ABORTING and not tx.deciding:
            return {"tid": tid, "state": "REJECTED", "reason": tx.reason}
        return {"tid": tid, "state": "PENDING", "reason": None}

    def _take_over(self, tx: Transaction, controller: Controller) -> None:
        """``controller`` (a reconnected client) is now the transaction's client."""
        if tx.client is not None and tx.client is not controller:
            tx.client.tids.discard(tx.tid)
        tx.client = controller
        controller.tids.add(tx.tid)

    # ------------------------------------------------------------------ server side
    def _held(self, session_id: int, controller_id: Any, tid: Any) -> Participant | None:
        server = self.controller(session_id, controller_id, server=True)
        tid = check_tid(tid)
        participant = server.current
        if participant is None or participant.tx.tid != tid:
            if tid in self.transactions:
                return None  # e.g. a vote for a transaction the server no longer holds
            raise NotFound(f"transaction {tid} is not presented to controller {server.id}")
        return participant

    def vote(self, session_id: int, controller_id: Any, tid: Any, accept: bool, reason: Any,
             now: int, seen: int | None = None) -> dict[str, Any]:
        """A server's vote: accept, or reject with a reason. ``seen``: how many of the
        transaction's messages the server had received when it voted; an accept that
        did not see every message already pushed to it is stale (the server votes
        again after the next one), so a vote never covers a message it never saw."""
        participant = self._held(session_id, controller_id, tid)
        if participant is None:
            return {"ignored": True}
        tx = participant.tx
        if tx.state in (TxState.COMMITTING, TxState.ABORTING):
            return {"ignored": True}  # decided already (Rule 5 of the tx table)
        if participant.state is PartState.YIELDING:
            return {"ignored": True}  # preempted: it votes again when presented again
        if not accept:
            if participant.state is PartState.VOTED:
                raise IllegalState(f"transaction {tx.tid}: this server voted accept; it can "
                                   "no longer reject")
            self._abort(tx, TxEvent.SERVER_REJECT,
                        reason if isinstance(reason, str) and reason else "SERVER", now)
            return {}
        server = participant.server
        assert server is not None
        if server.explicit_prepare and participant.state is not PartState.VOTING:
            raise IllegalState(f"transaction {tx.tid}: a server with explicit prepare votes "
                               "accept after PREPARE")
        if participant.state is PartState.VOTED:
            return {}
        if seen is not None and seen < participant.sent:
            return {"stale": True}
        participant.state = part_next(participant.state, PartEvent.VOTE)
        if tx.state is TxState.VREQ and self._all_voted(tx):
            self._decide(tx, TxEvent.ALL_VOTED, None, now)
        return {}

    def done(self, session_id: int, controller_id: Any, tid: Any, now: int) -> dict[str, Any]:
        """A server acknowledges the outcome: it is free for its next transaction. (Sent
        without a request id: a tid the router already forgot is ignored.)"""
        if isinstance(tid, str) and tid not in self.transactions:
            return {"ignored": True}
        participant = self._held(session_id, controller_id, tid)
        if participant is None:
            return {"ignored": True}
        if participant.state is PartState.YIELDING:  # the server rolled back: requeue
            participant.state = part_next(participant.state, PartEvent.ACK)
            server = participant.server
            assert server is not None
            participant.server, server.current = None, None
            self.enqueue(participant)
            self.pump(server.facility, participant.partition)
            return {}
        if participant.state not in (PartState.COMMIT, PartState.ABORT):
            raise IllegalState(f"transaction {participant.tx.tid} has no outcome to "
                               "acknowledge yet")
        participant.state = part_next(participant.state, PartEvent.ACK)
        server = participant.server
        assert server is not None
        participant.server = None
        server.current = None
        self._maybe_forget(participant.tx, now)
        self.pump(server.facility, participant.partition)
        return {}

    def _lost(self, participant: Participant, now: int) -> None:
        """The participant's server died (or left): replay, strike, or forget."""
        tx = participant.tx
        participant.server = None
        before = participant.state
        participant.state = part_next(before, PartEvent.LOST)
        if participant.state is PartState.DONE:
            self._maybe_forget(tx, now)
            return
        if before is PartState.YIELDING:  # it was making way: no strike, not uncertain
            self.enqueue(participant, front=True)
            return
        if before in (PartState.RECEIVING, PartState.VOTING):
            participant.strikes += 1
            retry = self.facility(tx.facility).partition(participant.partition).retry_count
            if participant.strikes > retry and tx.state in (TxState.SENDING, TxState.VREQ):
                self._strike_out(tx, now)
                return
            if tx.record is not None and not tx.deciding:
                # journaled: so is the strike, or a restart would give the transaction
                # more presentations than its partition's retry count (a failed store
                # takes no more writes: a session's end must not raise for it — found
                # by the simulator, router-bank-failing-fsync seed 126)
                with contextlib.suppress(StorageFailed):
                    tx.record = self.log.write(self.journal_record(tx), tx.record, now,
                                               self._journaled(None))
        else:  # it voted, or had the outcome: it may have committed
            participant.uncertain = True
        self.enqueue(participant, front=True)

    def _strike_out(self, tx: Transaction, now: int) -> None:
        tx.exception = True
        tx.flagged_ms = now
        self.counters["exceptions"] += 1
        self._abort(tx, TxEvent.STRIKE_OUT, SRVDIED, now)
        partitions = sorted({name for name, _ in tx.participants})
        for name in partitions:
            self.router_event(tx.facility, RouterEvent.EXCEPTION, name, {"tid": tx.tid})

    # ------------------------------------------------------------------ deciding
    def _all_voted(self, tx: Transaction) -> bool:
        """Every participant whose site is up voted accept, and each partition has at
        least one such vote. A site with no server (down) does not hold the decision:
        its participant waits, in the journal, to be replayed when the site returns
        (RTR's shadow recovery); while no site of a partition is up, nothing is decided
        but by the vote timeout."""
        voted: dict[str, bool] = {}
        for (name, site), participant in tx.participants.items():
            if not self._candidates(tx.facility, name, site):
                voted.setdefault(name, False)
                continue  # the site is down
            if participant.state is not PartState.VOTED:
                return False
            voted[name] = True
        return all(voted.values())

    def _abort(self, tx: Transaction, event: TxEvent, reason: str, now: int) -> None:
        self._decide(tx, event, reason, now)

    def _decide(self, tx: Transaction, event: TxEvent, reason: str | None, now: int) -> None:
        """Decide; make the decision durable when it must be; then tell everyone."""
        tx.state = tx_next(tx.tid, tx.state, event)
        tx.reason = reason
        tx.decided_ms = now
        tx.deadline_ms = 0
        commit = tx.state is TxState.COMMITTING
        self.counters["committed" if commit else "rejected"] += 1
        if not (commit or tx.exception or tx.record is not None):
            self._announce(tx, now)  # never journaled: nobody can remember it
            return
        tx.deciding = True

        def durable(error: BaseException | None) -> None:
            tx.deciding = False
            if error is not None:
                self.outbox.storage_failed(error)
                return  # nothing more is written or told: the broker stops taking writes
            self._announce(tx, max(now, self.outbox.now))

        try:
            tx.record = self.log.write(self.journal_record(tx), tx.record, now, durable)
        except StorageFailed:
            tx.deciding = False

    def _announce(self, tx: Transaction, now: int) -> None:
        commit = tx.state is TxState.COMMITTING
        for participant in tx.participants.values():
            if participant.state in (PartState.DONE, PartState.COMMIT, PartState.ABORT):
                continue
            self._tell(participant, commit=commit)
        if not commit:
            self.free_aborted(tx)
        client = tx.client
        if client is not None and client.id in self.controllers:
            body: dict[str, Any] = {"type": "ACCEPTED" if commit else "REJECTED",
                                    "tid": tx.tid}
            if not commit:
                body["reason"] = tx.reason
            self.push(client, body)
        elif not tx.client_acked:
            tx.deadline_ms = now + OUTCOME_RETENTION_MS
            self.arm(tx)
        for name in {name for name, _ in tx.participants}:
            self.pump(tx.facility, name)
        self._maybe_forget(tx, now)

    def free_aborted(self, tx: Transaction) -> None:
        """Waiting participants of an aborted transaction leave their queues' head."""
        for participant in tx.participants.values():
            if participant.state is PartState.WAITING:
                participant.state = part_next(participant.state, PartEvent.FORGET)

    def _maybe_forget(self, tx: Transaction, now: int) -> None:
        if tx.state not in (TxState.COMMITTING, TxState.ABORTING) or tx.deciding:
            return
        if tx.exception:
            return  # kept until an operator commits or discards it
        if any(p.state is not PartState.DONE for p in tx.participants.values()):
            return
        client_gone = tx.client is None or tx.client.id not in self.controllers
        if not tx.client_acked and not (client_gone and tx.deadline_ms
                                        and tx.deadline_ms <= now):
            return
        self.forget(tx, now)

    def forget(self, tx: Transaction, now: int) -> None:
        """Drop a finished transaction and its journal record; one whose outcome was
        asked for leaves its tombstone in the record's place."""
        self.transactions.pop(tx.tid, None)
        if tx.client is not None:
            tx.client.tids.discard(tx.tid)
        if tx.inquired:
            state = "ACCEPTED" if tx.state is TxState.COMMITTING else "REJECTED"
            with contextlib.suppress(StorageFailed):  # failed: nothing more is written
                self.tombstones.lay(tx.tid, tx.facility, state, tx.reason, now, tx.record)
        else:
            self.log.remove(tx.record)
        tx.record = None

    def journal_record(self, tx: Transaction) -> dict[str, Any]:
        """The transaction as its journal record (``core/router_log.py``)."""
        return journal_record(tx)

    # ------------------------------------------------------------------ timers
    def arm(self, tx: Transaction) -> None:
        """Wake :meth:`tick` at the transaction's deadline."""
        if tx.deadline_ms:
            heapq.heappush(self._timers, (tx.deadline_ms, tx.tid))

    def tick(self, now: int) -> None:
        """Vote timeouts and the end of kept outcomes."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            deadline, tid = heapq.heappop(timers)
            tx = self.transactions.get(tid)
            if tx is None or tx.deadline_ms != deadline:
                continue
            if tx.state is TxState.VREQ:
                self._abort(tx, TxEvent.VOTE_TIMEOUT, TIMEOUT, now)
            else:
                self._maybe_forget(tx, now)
        self.tombstones.expire(now)

    def next_wakeup(self) -> int | None:
        """When :meth:`tick` has something to do."""
        wakeups = [w for w in (self._timers[0][0] if self._timers else None,
                               self.tombstones.next_wakeup()) if w is not None]
        return min(wakeups, default=None)

    # ------------------------------------------------------------------ events
    def router_event(self, facility: str, number: RouterEvent, partition: str,
                     detail: dict[str, Any], *, only: list[Controller] | None = None) -> int:
        """Tell the subscribers of a router event (or only some controllers)."""
        targets = only if only is not None else [
            c for c in self.controllers.values() if c.facility == facility]
        count = 0
        found = self.facilities.get(facility)
        part = next((p for p in found.partitions if p.name == partition), None
                    ) if found is not None else None
        key_range = None if part is None else [part.low, part.high]
        for controller in targets:
            if event_matches(int(number), None, controller.events, controller.recipient):
                self.push(controller, {"type": "ROUTER_EVENT", "number": int(number),
                                       "name": number.name, "facility": facility,
                                       "partition": partition, "key_range": key_range,
                                       "detail": detail})
                count += 1
        return count

    # ------------------------------------------------------------------ restart
    def restore(self, records: list[tuple[Message, bytes]], now: int) -> list[str]:
        """Rebuild from the journal (bodies read by the edge); returns the problems
        found (a record that is not the router's is reported, never loaded)."""
        return restore(self, records, now)


__all__ = ["PUSH", "Controller", "Participant", "Router", "Transaction"]

