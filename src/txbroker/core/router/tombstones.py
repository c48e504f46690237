"""Tombstones: the tids whose outcome the router answered and that never begin again.

Theory of operation
-------------------
The router presumes abort: a tid it has no record of was never durably accepted,
so ``rtr_outcome`` answers it UNKNOWN — "applied nowhere". That answer is a
promise, and it holds only if the tid can never *begin* afterwards: a request
that was still on its way (a client library that sends "last message + accept"
on the session after a failover, a stale retry) would otherwise start a new
transaction under the same tid and commit it, after the client was told it was
never applied (issue 25: one leg of a transfer applied, the client told
"never applied").

So the router writes a **tombstone** before it gives such an answer:

- an UNKNOWN answer is given only once its tombstone is durable (a crash between
  the answer and the record would forget the promise);
- a transaction whose outcome was asked for (a reconnected client) leaves a
  tombstone with that outcome when it is forgotten, in the same journal entry
  that consumes its record.

A tombstoned tid refuses every client request that would begin or change it:
``TransactionRolledBack`` when it was presumed aborted or rejected,
``IllegalState`` when it was accepted. ``rtr_outcome`` keeps answering what the
tombstone says. Tombstones are router records of the ``$router`` queue
(``core/router/log.py``): they survive restarts, replicate and are compacted as
the rest of the router's journal. They are kept :data:`TOMBSTONE_RETENTION_MS`
and at most :data:`MAX_TOMBSTONES` of them (the oldest goes first): both bound
what a client could make the broker keep by asking about made-up tids.

Tombstones are written only where an outcome was *asked*; the everyday path
(outcome pushed, acknowledged, forgotten) writes none. A tid that was never
asked about is not reusable either in practice — every message after the first
carries its index, and a non-first message of an unknown tid never begins a
transaction (:meth:`Router.send <txbroker.core.router.engine.Router.send>`) — but the
first message of a forgotten, never-asked tid would begin a new one: client
libraries draw tids at random (``uuid4``) and never reuse them.

Journal record: :class:`~txbroker.core.router.records.TombRecord` (``{"r": "tomb",
…}``, its bytes described in ``records.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from txbroker.core.messages import Message
from txbroker.core.outbox import OnDurable, Outbox
from txbroker.core.queue_index import LATER
from txbroker.core.router.log import RouterLog
from txbroker.core.router.records import TombRecord
from txbroker.errors import BrokerError, IllegalState, TransactionRolledBack

#: How long a tombstone is kept (7 days): far beyond any request still in flight.
TOMBSTONE_RETENTION_MS: Final = 7 * 24 * 3600 * 1000
#: The most tombstones kept; beyond, the oldest is dropped.
MAX_TOMBSTONES: Final = 100_000
#: The answers a tombstone may hold.
STATES: Final = ("UNKNOWN", "ACCEPTED", "REJECTED")


@dataclass(slots=True)
class Tombstone:
    """One tid that never begins again, and what the router answered for it."""

    tid: str
    facility: str | None
    state: str  #: one of :data:`STATES`
    reason: str | None
    until_ms: int
    record: Message | None = None
    durable: bool = False
    #: answers waiting for the record to be durable
    waiters: list[OnDurable] = field(default_factory=list)

    def answer(self) -> dict[str, Any]:
        """The ``rtr_outcome`` answer."""
        return {"tid": self.tid, "state": self.state, "reason": self.reason}

    def refusal(self) -> BrokerError:
        """The error of a request that would begin or change this tid again."""
        said = self.state if self.reason in (None, self.state) else f"{self.state} {self.reason}"
        if self.state == "ACCEPTED":
            return IllegalState(f"transaction {self.tid} was ACCEPTED and is finished: a "
                                "transaction id never begins again")
        return TransactionRolledBack(
            f"transaction {self.tid} was answered {said} (applied nowhere): a transaction "
            "id never begins again; start a new transaction")

    def to_record(self) -> TombRecord:
        """The journal record."""
        return TombRecord(self.tid, self.facility, self.state, self.reason, self.until_ms)


class Tombstones:
    """The router's tombstones, oldest first (see the module docstring)."""

    def __init__(self, log: RouterLog, outbox: Outbox, limit: int = MAX_TOMBSTONES) -> None:
        self.log, self.outbox = log, outbox
        self.by_tid: dict[str, Tombstone] = {}  #: in order of expiry
        self.limit = limit  #: the most kept (the oldest goes first beyond)

    def __len__(self) -> int:
        return len(self.by_tid)

    def get(self, tid: str) -> Tombstone | None:
        """The tombstone of ``tid``, if any."""
        return self.by_tid.get(tid)

    def check(self, tid: str) -> None:
        """Raise the refusal of a tombstoned ``tid``."""
        tomb = self.by_tid.get(tid)
        if tomb is not None:
            raise tomb.refusal()

    def lay(self, tid: str, facility: str | None, state: str, reason: str | None, now: int,
            replaces: Message | None = None) -> Tombstone:
        """Write the tombstone of ``tid`` (replacing the record ``replaces``, atomically)."""
        assert state in STATES, state
        tomb = Tombstone(tid, facility, state, reason, now + TOMBSTONE_RETENTION_MS)

        def durable(error: BaseException | None) -> None:
            tomb.durable = error is None
            if error is not None:
                self.outbox.storage_failed(error)
            waiters, tomb.waiters = tomb.waiters, []
            for waiter in waiters:
                waiter(error)

        tomb.record = self.log.write(tomb.to_record(), replaces, now, durable)
        old = self.by_tid.pop(tid, None)
        if old is not None:
            self.log.remove(old.record)
        self.by_tid[tid] = tomb
        while len(self.by_tid) > self.limit:
            self._drop(next(iter(self.by_tid.values())))
        return tomb

    def answer(self, tomb: Tombstone, session_id: int, rid: int) -> Any:
        """The ``rtr_outcome`` answer of ``tomb``: now if it is durable, else once it is."""
        if tomb.durable:
            return tomb.answer()
        tomb.waiters.append(self.outbox.reply_when_durable(session_id, rid, tomb.answer()))
        return LATER

    def restore(self, record: TombRecord, message: Message) -> None:
        """A tombstone read back from the journal at start."""
        if record.state not in STATES:
            raise ValueError(f"tombstone of {record.tid!r} with state {record.state!r}")
        tomb = Tombstone(record.tid, record.facility, record.state, record.reason,
                         record.until_ms, message, durable=True)
        self.by_tid.pop(tomb.tid, None)
        self.by_tid[tomb.tid] = tomb

    def expire(self, now: int) -> None:
        """Drop the tombstones whose time is over."""
        while self.by_tid:
            oldest = next(iter(self.by_tid.values()))
            if oldest.until_ms > now:
                return
            self._drop(oldest)

    def next_wakeup(self) -> int | None:
        """When :meth:`expire` has something to do."""
        if not self.by_tid:
            return None
        return next(iter(self.by_tid.values())).until_ms

    def _drop(self, tomb: Tombstone) -> None:
        self.by_tid.pop(tomb.tid, None)
        self.log.remove(tomb.record)
        tomb.record = None


__all__ = ["MAX_TOMBSTONES", "STATES", "TOMBSTONE_RETENTION_MS", "Tombstone", "Tombstones"]
