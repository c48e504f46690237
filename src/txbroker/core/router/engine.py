"""The transaction router (seed 000): partitioned servers that vote, replay, three
strikes — the front of the router's parts.

Theory of operation
-------------------
Applications register **controllers** on a facility (``model.py``): a client
controller starts transactions and sends messages, each routed by its key to
the partition that owns it; a server controller serves one partition in a role.
A transaction gets one **participant** per partition it touches (and a second
one per shadowed partition, for the secondary site). The router:

1. presents each participant to a free server of its partition — the first
   message as ``MSG1`` (``UNCERTAIN`` on a replay after the server may have
   voted), then ``MSG`` — and queues it while every server is busy (a server
   holds one transaction at a time, until it acknowledges the outcome):
   ``presenting.py``, with wait cycles broken in ``deadlock.py``;
2. when the client accepts, writes the transaction to its journal (``log.py``)
   and asks for the votes (``PREPARE`` to servers that registered with explicit
   prepare; implicit servers vote on their own, and may do so before the client
   accepted): ``clients.py``;
3. decides: commit when every participant voted accept, abort when anyone
   rejected, the votes timed out, or a participant struck out; a decision that
   must survive a crash (every commit, and every abort of a journaled
   transaction) is durable before anybody hears it: ``voting.py``;
4. tells every participant and the client, and forgets the transaction once
   every server acknowledged and the client collected the outcome.

When a server dies (its connection, or ``unregister``) the router replays its
transaction, counting strikes (``failover.py``). When the broker itself
restarts, :meth:`Router.restore` reads the journal (``journal.py``). Every rule
of a transaction's and a participant's life is a row of the tables in
``states.py``; facilities are ``facilities.py``, operators' requests and user
events ``admin.py``, tombstones ``tombstones.py``.

:class:`Router` owns the router's state (:class:`~txbroker.core.router.data.RouterData`)
and takes every router command; the broker core's front (``core/broker.py``) is
the only caller outside this package.
"""

from __future__ import annotations

import heapq
from typing import Any

from txbroker.core.limits import Limits
from txbroker.core.messages import Message
from txbroker.core.outbox import Outbox
from txbroker.core.router import admin, clients, facilities, failover, journal, voting
from txbroker.core.router.commands import (
    Accept,
    Collected,
    CommitException,
    Define,
    DiscardException,
    Done,
    Exceptions,
    FacilityOf,
    Outcome,
    Register,
    Reject,
    RetireShadow,
    RouterCommand,
    Send,
    SetPartition,
    Show,
    Unregister,
    UserEvent,
    Vote,
)
from txbroker.core.router.data import RouterData
from txbroker.core.router.log import RouterLog
from txbroker.core.router.model import Role, check_size
from txbroker.errors import BadRequest, NotFound


class Router:
    """The router part of the broker core (see the module docstring)."""

    def __init__(self, log: RouterLog, outbox: Outbox, limits: Limits | None = None) -> None:
        #: everything the router holds (its parts are functions over it)
        self.data = RouterData(log, outbox)
        self.limits = limits or Limits()

    def execute(self, session_id: int, rid: int, command: RouterCommand, now: int) -> Any:
        """Carry out one command of a session (``commands.py``): its answer, LATER (the
        answer comes once durable), or a BrokerError."""
        if isinstance(command, Send):
            return self.send(session_id, command.controller, command.tid, command.key,
                             command.body, command.headers, now, command.index,
                             accept=command.accept, rid=rid)
        if isinstance(command, Vote):
            return self.vote(session_id, command.controller, command.tid, command.accept,
                             command.reason, now, command.seen)
        if isinstance(command, Done):
            return self.done(session_id, command.controller, command.tid, now)
        if isinstance(command, Accept):
            return self.accept(session_id, command.controller, command.tid, now, rid)
        if isinstance(command, Reject):
            return self.reject(session_id, command.controller, command.tid, command.reason,
                               now)
        if isinstance(command, Collected):
            self.collected(session_id, command.controller, command.tids, now)
            return {}
        if isinstance(command, Outcome):
            return self.outcome(session_id, rid, command.tid, command.controller, now)
        if isinstance(command, Register):
            return self.register(session_id, command.facility, server=command.server,
                                 partition=command.partition, role=command.role,
                                 explicit_prepare=command.explicit_prepare,
                                 recipient=command.recipient, events=command.events, now=now,
                                 rid=rid)
        if isinstance(command, Unregister):
            return self.unregister(session_id, command.controller, now)
        if isinstance(command, UserEvent):
            return self.user_event(session_id, command.controller, command.number,
                                   command.body, command.recipient)
        return self._execute_admin(session_id, rid, command, now)

    def _execute_admin(self, session_id: int, rid: int, command: RouterCommand, now: int
                       ) -> Any:
        if isinstance(command, Define):
            return self.define(session_id, rid, command.facility, command.partitions, now)
        if isinstance(command, SetPartition):
            return self.set_partition(session_id, rid, command.facility, command.partition,
                                      command.retry_count, command.vote_timeout_ms, now)
        if isinstance(command, Show):
            return self.show(command.facility)
        if isinstance(command, Exceptions):
            return self.exceptions(command.facility)
        if isinstance(command, FacilityOf):
            return self.facility_of(command.tid)
        if isinstance(command, CommitException):
            return self.commit_exception(session_id, rid, command.tid, now)
        if isinstance(command, DiscardException):
            return self.discard_exception(session_id, rid, command.tid, now)
        if isinstance(command, RetireShadow):
            return self.retire_shadow(session_id, rid, command.facility, command.partition,
                                      now)
        raise BadRequest(f"not a router command: {type(command).__name__}")

    # ------------------------------------------------------------------ facilities
    def define(self, session_id: int, rid: int, name: Any, partitions: Any, now: int) -> Any:
        """Define (or redefine) a facility; answered once its record is durable."""
        return facilities.define(self.data, session_id, rid, name, partitions, now)

    def define_from_config(self, name: str, partitions: Any, now: int) -> None:
        """A facility of the configuration file (``facilities.py``)."""
        facilities.define_from_config(self.data, name, partitions, now)

    def set_partition(self, session_id: int, rid: int, facility_name: Any, partition: Any,
                      retry_count: Any, vote_timeout_ms: Any, now: int) -> Any:
        """Change a partition's retry count or vote timeout (durable before the reply)."""
        return facilities.set_partition(self.data, session_id, rid, facility_name,
                                        partition, retry_count, vote_timeout_ms, now)

    # ------------------------------------------------------------------ registrations
    def register(self, session_id: int, facility_name: Any, *, server: bool,
                 partition: Any = None, role: Role = Role.PRIMARY,
                 explicit_prepare: bool = False, recipient: str | None = None,
                 events: tuple[tuple[int, int], ...] = (), now: int = 0,
                 rid: int | None = None) -> Any:
        """Register a client or server controller; replies its id and the partition map
        (LATER when the partition's first shadow registers: answered once that is
        durable, ``failover.register``)."""
        return failover.register(self.data, session_id, facility_name, server=server,
                                 partition=partition, role=role,
                                 explicit_prepare=explicit_prepare, recipient=recipient,
                                 events=events, now=now, rid=rid)

    def unregister(self, session_id: int, controller_id: Any, now: int) -> dict[str, Any]:
        """End a registration (a server's transaction is replayed as if it died)."""
        return failover.unregister(self.data, session_id, controller_id, now)

    def session_closed(self, session_id: int, now: int) -> None:
        """A connection ended: each of its controllers leaves."""
        failover.session_closed(self.data, session_id, now)

    # ------------------------------------------------------------------ client side
    def send(self, session_id: int, controller_id: Any, tid: Any, key: Any, body: bytes,
             headers: dict[str, str] | None, now: int, index: int | None = None,
             *, accept: bool = False, rid: int | None = None) -> Any:
        """A client's message (``clients.py``); with ``accept``, the client's accept goes
        with it and the answer comes once the accepted transaction is durable. A body
        above ``max_message_size`` is refused before anything else (BadRequest)."""
        check_size(body, self.limits.max_message_size)
        result = clients.send(self.data, session_id, controller_id, tid, key, body, headers,
                              now, index)
        if accept and "rejected" not in result:
            return clients.accept(self.data, session_id, controller_id, tid, now, rid, result)
        return result

    def accept(self, session_id: int, controller_id: Any, tid: Any, now: int,
               rid: int | None = None, result: dict[str, Any] | None = None) -> Any:
        """The client accepts: journal the transaction and ask for the votes."""
        return clients.accept(self.data, session_id, controller_id, tid, now, rid, result)

    def reject(self, session_id: int, controller_id: Any, tid: Any, reason: Any,
               now: int) -> dict[str, Any]:
        """The client rejects its transaction (only before it accepted)."""
        return clients.reject(self.data, session_id, controller_id, tid, reason, now)

    def collected(self, session_id: int, controller_id: Any, tids: Any, now: int) -> None:
        """The client collected these outcomes (``rtr_ack``)."""
        clients.collected(self.data, session_id, controller_id, tids, now)

    def outcome(self, session_id: int, rid: int, tid: Any, controller_id: Any, now: int
                ) -> Any:
        """What became of ``tid`` (``rtr_outcome``)."""
        return clients.outcome(self.data, session_id, rid, tid, controller_id, now)

    # ------------------------------------------------------------------ server side
    def vote(self, session_id: int, controller_id: Any, tid: Any, accept: bool, reason: Any,
             now: int, seen: int | None = None) -> dict[str, Any]:
        """A server's vote: accept, or reject with a reason. ``seen``: how many of the
        transaction's messages the server had received when it voted; an accept that
        did not see every message already pushed to it is stale (the server votes
        again after the next one), so a vote never covers a message it never saw."""
        return voting.vote(self.data, session_id, controller_id, tid, accept, reason, now,
                           seen)

    def done(self, session_id: int, controller_id: Any, tid: Any, now: int) -> dict[str, Any]:
        """A server acknowledges the outcome: it is free for its next transaction."""
        return voting.done(self.data, session_id, controller_id, tid, now)

    # ------------------------------------------------------------------ events, operators
    def user_event(self, session_id: int, controller_id: Any, number: Any, body: Any,
                   recipient: Any) -> dict[str, int]:
        """Broadcast a user event; replies how many controllers it reached."""
        return admin.user_event(self.data, session_id, controller_id, number, body,
                                recipient)

    def show(self, facility_name: Any = None) -> dict[str, Any]:
        """Facilities, partitions, servers and their roles, transactions by state."""
        return admin.show(self.data, facility_name)

    def stats(self) -> dict[str, Any]:
        """The router's counts for ``txbroker stat`` and ``/metrics``."""
        return admin.stats(self.data)

    def exceptions(self, facility_name: Any = None) -> list[dict[str, Any]]:
        """The exception transactions (of one facility, or all)."""
        return admin.exceptions(self.data, facility_name)

    def holds(self) -> list[str]:
        """What the router holds, one line per transaction (``admin.holds``)."""
        return admin.holds(self.data)

    def facility_of(self, tid: str) -> str:
        """The facility of a transaction the router holds (NotFound otherwise)."""
        tx = self.data.transactions.get(tid)
        if tx is None:
            raise NotFound(f"no router transaction {tid!r}")
        return tx.facility

    def commit_exception(self, session_id: int, rid: int, tid: Any, now: int) -> Any:
        """An operator commits an exception transaction: it is replayed, decided."""
        return admin.commit_exception(self.data, session_id, rid, tid, now)

    def discard_exception(self, session_id: int, rid: int, tid: Any, now: int) -> Any:
        """An operator discards an exception transaction: it is forgotten."""
        return admin.discard_exception(self.data, session_id, rid, tid, now)

    def retire_shadow(self, session_id: int, rid: int, facility: Any, partition: Any,
                      now: int) -> Any:
        """Retire a partition's secondary site (``failover.retire_shadow``)."""
        return failover.retire_shadow(self.data, session_id, rid, facility, partition, now)

    # ------------------------------------------------------------------ timers
    def tick(self, now: int) -> None:
        """Vote timeouts and the end of kept outcomes."""
        data = self.data
        timers = data.timers
        while timers and timers[0][0] <= now:
            deadline, tid = heapq.heappop(timers)
            tx = data.transactions.get(tid)
            if tx is None or tx.deadline_ms != deadline:
                continue
            voting.expire(data, tx, now)
        data.tombstones.expire(now)

    def next_wakeup(self) -> int | None:
        """When :meth:`tick` has something to do."""
        data = self.data
        wakeups = [w for w in (data.timers[0][0] if data.timers else None,
                               data.tombstones.next_wakeup()) if w is not None]
        return min(wakeups, default=None)

    # ------------------------------------------------------------------ restart
    def records(self) -> list[Message]:
        """The router's live journal records, in log order (their bodies are the
        edge's to read, for :meth:`restore`)."""
        return self.data.log.records()

    def restore(self, records: list[tuple[Message, bytes]], now: int) -> list[str]:
        """Rebuild from the journal (bodies read by the edge); returns the problems
        found (a record that is not the router's is reported, never loaded)."""
        return journal.restore(self.data, records, now)


__all__ = ["Router"]
