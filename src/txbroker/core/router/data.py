"""What the transaction router holds, and the lookups every part of it uses.

Theory of operation
-------------------
:class:`RouterData` is the router's state — facilities, controllers,
transactions, the participants waiting for a server, the timers, the counters —
with the journal (``log.py``) and tombstones (``tombstones.py``) it writes
through. The router's behaviour is free functions over it, one module per
concern (``presenting.py``, ``voting.py``, ``failover.py``, ``clients.py``,
``facilities.py``, ``journal.py``, ``admin.py``), layered so that none imports
a later one; :class:`~txbroker.core.router.engine.Router` is their front, and
the broker core's front (``core/broker.py``) is the router's only door.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Final

from txbroker.core.effects import Notify
from txbroker.core.messages import Message
from txbroker.core.outbox import OnDurable, Outbox
from txbroker.core.router.log import RouterLog
from txbroker.core.router.model import Facility, Role, RouterEvent, Site, event_matches
from txbroker.core.router.states import Controller, Participant, Transaction
from txbroker.core.router.tombstones import Tombstones
from txbroker.errors import IllegalState, NotFound

#: The push event name of every router message (``docs/router.md``).
PUSH: Final = "rtr"

#: Roles that make up a partition's primary site.
_ACTIVE_ROLES: Final = (Role.PRIMARY, Role.CONCURRENT)


class RouterData:
    """The router's state (see the module docstring)."""

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
        #: tids whose outcome was answered: they never begin again (tombstones.py)
        self.tombstones = Tombstones(log, outbox)
        #: (facility, partition) -> {site: participants waiting for a server}
        self.waiting: dict[tuple[str, str], dict[Site, deque[Participant]]] = {}
        self.next_controller = 1
        self.round_robin = 0
        self.timers: list[tuple[int, str]] = []  #: (deadline, tid), lazily stale
        #: (facility, partition) a shadow server ever registered for (durable in the
        #: facility record): its transactions get a secondary-site participant even
        #: while the shadows are down, and across restarts
        self.shadowed: set[tuple[str, str]] = set()
        self.counters = {"committed": 0, "rejected": 0, "replays": 0, "exceptions": 0,
                         "preempted": 0}
        self._next_seq = 1

    def next_seq(self) -> int:
        """The age of a transaction coming into flight (``deadlock.py``)."""
        self._next_seq += 1
        return self._next_seq - 1

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

    def candidates(self, facility: str, partition: str, site: Site) -> list[Controller]:
        """The servers a participant of ``site`` may go to: the primary site's (primary
        and concurrent servers, else standbys) or the shadows. Never the other site's:
        each site applies a transaction once (seed 000, shadowing)."""
        servers = self.servers_of(facility, partition)
        if site is Site.SECONDARY:
            return [s for s in servers if s.role is Role.SHADOW]
        active = [s for s in servers if s.role in _ACTIVE_ROLES]
        return active or [s for s in servers if s.role is Role.STANDBY]

    def arm(self, tx: Transaction) -> None:
        """Wake the router's ``tick`` at the transaction's deadline."""
        if tx.deadline_ms:
            heapq.heappush(self.timers, (tx.deadline_ms, tx.tid))

    def journaled(self, reply: OnDurable | None) -> OnDurable:
        """The completion of a transaction's record: the reply (if any) once durable; a
        failed store takes no more writes."""
        def durable(error: BaseException | None) -> None:
            if reply is not None:
                reply(error)
            elif error is not None:  # the store failed: the broker takes no more writes
                self.outbox.storage_failed(error)
        return durable

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


__all__ = ["PUSH", "RouterData"]
