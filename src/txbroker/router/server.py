"""The router's server controller, async: receive a transaction's messages, vote, get
the outcome, acknowledge it.

Theory of operation
-------------------
A server controller is registered for one partition of a facility and holds one
transaction at a time: MSG1 (or UNCERTAIN on a replay) starts it, MSG adds to
it, PREPARE asks for the vote (explicit prepare only), ACCEPTED / REJECTED end
it. The next MSG1 comes only after the outcome was acknowledged (``rtr_done``):
by :meth:`acknowledge_outcome`, or by the next :meth:`receive` if the
application did not call it — the seed's rule that "a Receive to begin a new
transaction" tells the router the last one was committed.

What each received type and each call does to the controller's state is
:data:`RECEIVED` and :data:`CALLS` (one row per rule).

The **inactivity timeout** (the seed's SERVER_INACTIVITY_TIMEOUT,
``inactivity_timeout_ms``): once a transaction's first message arrived, a
``receive`` that waits longer than that rejects the partly received
transaction (reason TIMEOUT) and goes on waiting for its outcome; there is no
such timeout once PREPARE arrived or the server voted, nor while waiting for a
new transaction or an outcome.

A lost connection: the transaction in progress (its outcome not yet given to
the application) ends — ``receive()`` returns a REJECTED with reason LOST for
it (roll back the database work) and drops what the old session had pushed;
the library registers again on the next broker of the URL's list, and the
router replays the transaction (MSG1, or UNCERTAIN if this server may have
voted). An outcome given to the application but not acknowledged is not
acknowledged on the new session (the replay repeats it: check the TID table).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from enum import Enum
from typing import Any, Final

from txbroker.client.aio import AsyncConnection
from txbroker.errors import ConnectionLost, IllegalState
from txbroker.router._base import AsyncControllerBase
from txbroker.router.constants import (
    REASON_LOST,
    REASON_TIMEOUT,
    EventRanges,
    Key,
    MessageType,
    Role,
    RouterMessage,
    key_range_arg,
)

__all__ = ["CALLS", "RECEIVED", "AsyncServerTransactionController", "ServerState"]

#: The reason of a server's reject when the application gives none.
DEFAULT_SERVER_REASON: Final = "SERVER"


class ServerState(Enum):
    """Where the server's current transaction is (the seed's Table 4-4 and 4-5)."""

    IDLE = "IDLE"  # no transaction (waiting for a MSG1)
    RECEIVING = "RECEIVING"  # messages received, not voted
    PREPARED = "PREPARED"  # explicit prepare: PREPARE received, the vote is due
    VOTED = "VOTED"  # voted accept: waiting for the outcome
    VOTED_REJECT = "VOTED_REJECT"  # voted reject: waiting for the REJECTED outcome
    OUTCOME = "OUTCOME"  # outcome given to the application, not acknowledged yet


S = ServerState
M = MessageType
_VOTING = (S.RECEIVING, S.PREPARED, S.VOTED, S.VOTED_REJECT)

#: (state, received type) -> state after it. A pair not listed keeps the state.
RECEIVED: Final[dict[tuple[ServerState, MessageType], ServerState]] = {
    # Rule 1: MSG1 starts a transaction; UNCERTAIN starts a replay after this partition's
    # server may have voted (the application checks its TID table).
    (S.IDLE, M.MSG1): S.RECEIVING,
    (S.IDLE, M.UNCERTAIN): S.RECEIVING,
    # Rule 2: further messages; a later message voids an implicit accept vote.
    (S.RECEIVING, M.MSG): S.RECEIVING,
    (S.VOTED, M.MSG): S.RECEIVING,
    # Rule 3: explicit prepare: the client accepted, the vote is due.
    (S.RECEIVING, M.PREPARE): S.PREPARED,
    # Rule 4: an outcome ends the transaction in every state of it.
    **{(state, kind): S.OUTCOME for state in _VOTING for kind in (M.ACCEPTED, M.REJECTED)},
}

#: (state, call) -> state after it, or the IllegalState message. Calls not listed are refused.
CALLS: Final[dict[tuple[ServerState, str], ServerState | str]] = {
    # Rule 5: accept: implicit servers any time after a message, explicit ones after PREPARE.
    (S.RECEIVING, "accept"): S.VOTED,
    (S.PREPARED, "accept"): S.VOTED,
    (S.VOTED, "accept"): S.VOTED,
    # Rule 6: reject: any time before voting accept.
    (S.RECEIVING, "reject"): S.VOTED_REJECT,
    (S.PREPARED, "reject"): S.VOTED_REJECT,
    (S.VOTED_REJECT, "reject"): S.VOTED_REJECT,
    (S.VOTED, "reject"): "this server voted to accept: it can no longer reject",
    # Rule 7: the outcome is acknowledged once (rtr_done); the next MSG1 can come.
    (S.OUTCOME, "acknowledge"): S.IDLE,
}


class AsyncServerTransactionController(AsyncControllerBase):
    """A server of one partition (the seed's ``RTRServerTransactionController``), async.

    ``connection`` is an :class:`~txbroker.client.aio.AsyncConnection` or a URL (then
    ``options`` are those of ``txbroker.aio.connect``); ``inactivity_timeout_ms``: see
    the module docstring (None: none)."""

    _kind = "server"

    def __init__(self, connection: AsyncConnection | str, *,
                 inactivity_timeout_ms: int | None = None, **options: Any) -> None:
        super().__init__(connection, **options)
        if inactivity_timeout_ms is not None and inactivity_timeout_ms <= 0:
            raise ValueError("inactivity_timeout_ms must be positive (or None)")
        self.inactivity_timeout_ms = inactivity_timeout_ms
        self._state = ServerState.IDLE
        self._tid: str | None = None
        #: messages of the current transaction handed to the application (votes say it)
        self._seen = 0
        self._explicit = False
        self._partition: str | None = None
        #: a tid whose outcome the new session does not hold (LOST): no rtr_done for it
        self._no_done_for: str | None = None

    @property
    def tid(self) -> str | None:
        """The current transaction's id (None while waiting for a new one)."""
        return None if self._state is S.IDLE else self._tid

    @property
    def state(self) -> ServerState:
        """Where the current transaction is (:class:`ServerState`)."""
        return self._state

    @property
    def partition(self) -> str | None:
        """The name of the partition this server registered for."""
        return self._partition

    async def register_partition(
        self, facility: str, key_range: str | Sequence[Key], role: Role = Role.PRIMARY, *,
        explicit_prepare: bool = False, recipient: str | None = None,
        events: EventRanges = (),
    ) -> dict[str, Any]:
        """Register as a server of the partition ``key_range`` (its name, or its
        ``(low, high)``) of ``facility`` in ``role``. ``explicit_prepare``: receive
        PREPARE and vote then. Returns the broker's reply (partition, key type …)."""
        reply = await self._register({
            "facility": facility, "kind": "server", "partition": key_range_arg(key_range),
            "role": Role(role).value, "explicit_prepare": bool(explicit_prepare),
            "recipient": recipient, "events": self._events_arg(events)})
        self._explicit = bool(explicit_prepare)
        self._partition = reply.get("partition")
        return reply

    async def set_recovery_retry_count(self, count: int) -> dict[str, Any]:
        """Set how many presentations lost before a vote (server deaths) a transaction
        of this server's partition survives before it is rejected with SRVDIED and
        flagged an exception (the seed's SetRecoveryRetryCount; default 3). Durable and
        for every server of the partition; needs the admin permission on the facility.
        Returns the partition's settings."""
        if type(count) is not int or count < 0:
            raise ValueError(f"a recovery retry count is an integer >= 0, not {count!r}")
        self._check_usable()
        if self._partition is None:
            raise IllegalState("register_partition first")
        assert self._register_args is not None
        reply: dict[str, Any] = await self._call("rtr_set_partition", {
            "facility": self._register_args["facility"], "partition": self._partition,
            "retry_count": count})
        return reply

    def _call_step(self, call: str) -> ServerState:
        rule = CALLS.get((self._state, call))
        if rule is None:
            raise IllegalState(f"{call} is not allowed in state {self._state.value}")
        if isinstance(rule, str):
            raise IllegalState(rule)
        return rule

    # ---------------------------------------------------------------- receive

    def _inactivity(self) -> float | None:
        """Seconds a receive may wait now before the transaction is rejected."""
        if self.inactivity_timeout_ms is None or self._state is not S.RECEIVING:
            return None
        return self.inactivity_timeout_ms / 1000

    async def receive(self, timeout: float | None = None) -> RouterMessage | None:
        """The next message, outcome or event; None after ``timeout`` seconds (None:
        wait forever). Acknowledges the previous outcome first if the application did
        not. Raises a broker error of a pipelined vote (``set_accept``) first."""
        if self._state is S.OUTCOME:
            await self.acknowledge_outcome()
        self._raise_pipelined()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            idle_limit = self._inactivity()
            wait = remaining if idle_limit is None else (
                idle_limit if remaining is None else min(idle_limit, remaining))
            item = await self._next_item(wait)
            if item is None:
                if idle_limit is not None and (remaining is None or idle_limit < remaining) \
                        and self._state is S.RECEIVING:
                    await self.reject_transaction(REASON_TIMEOUT)  # the seed's rule
                    continue
                return None
            if isinstance(item, BaseException):
                raise item
            if item.is_event:
                return item
            self._tid = item.tid
            self._state = RECEIVED.get((self._state, item.type), self._state)
            if item.type in (M.MSG1, M.UNCERTAIN):
                self._state = S.RECEIVING  # a new transaction, whatever came before
                self._no_done_for = None
                self._seen = 0
            if item.type in (M.MSG1, M.UNCERTAIN, M.MSG):
                self._seen = max(self._seen, (item.index or 0) + 1)
            return item

    def _on_message(self, message: RouterMessage) -> None:
        if not message.is_event and message.partition is None:
            message.partition = self._partition
        self._put(message)

    # ------------------------------------------------------------------ votes

    async def accept_transaction(self) -> None:
        """Vote to accept (after PREPARE for an explicit-prepare server; an implicit one
        may vote after any message — a later message voids the vote)."""
        self._check_explicit()
        next_state = self._call_step("accept")
        self._state = next_state
        await self._vote(True, "")

    def _check_explicit(self) -> None:
        if self._explicit and self._state is S.RECEIVING:
            raise IllegalState("an explicit-prepare server votes accept after PREPARE")

    async def set_accept(self) -> None:
        """Vote to accept without waiting for the broker (the server side of the
        seed's SetAcceptTransaction); an error is raised by the next receive."""
        await self._port_ready()
        self._check_explicit()
        self._state = self._call_step("accept")
        if self._presented_on_lost_session():
            return
        self._pipeline("rtr_vote", {"tid": self._tid, "accept": True, "reason": "",
                                    "seen": self._seen})

    async def reject_transaction(self, reason: str = DEFAULT_SERVER_REASON) -> None:
        """Vote to reject (any time before voting accept); every participant gets
        REJECTED with ``reason``."""
        self._state = self._call_step("reject")
        await self._vote(False, reason)

    def _presented_on_lost_session(self) -> bool:
        """The current transaction came on a session that broke: a vote for it is void
        (receive() gives its REJECTED reason LOST, and the router presents it again,
        maybe to this server, where the application votes on the replay). Sent on the
        new session, the old vote would count for the replay (issue 25's audit)."""
        return self._tid is not None and self._no_done_for == self._tid

    async def _vote(self, accept: bool, reason: str) -> None:
        tid = self._tid
        await self._port_ready()  # a session lost meanwhile: the checks below see it
        if self._presented_on_lost_session() or self._tid != tid:
            return
        try:
            await self._call("rtr_vote", {"tid": tid, "accept": accept, "reason": reason,
                                          "seen": self._seen})
        except ConnectionLost:
            if self._failed is not None or self._closed:
                raise
            # failing over: receive() gives REJECTED reason LOST for this transaction

    async def acknowledge_outcome(self) -> None:
        """The outcome is applied (the database committed or rolled back): the router
        may forget the transaction; the next MSG1 can come."""
        self._state = self._call_step("acknowledge")
        tid, skip = self._tid, self._no_done_for
        self._no_done_for = None
        if tid is not None and tid != skip:
            self._notify("rtr_done", {"tid": tid})

    # -------------------------------------------------------------- failover

    def on_session_lost(self) -> None:
        """End the transaction in progress with REJECTED reason LOST (see module)."""
        super().on_session_lost()
        kept = [item for item in self._inbox
                if isinstance(item, RouterMessage) and item.is_event]
        self._inbox.clear()
        self._inbox.extend(kept)
        if self._state in _VOTING:
            self._put(RouterMessage(M.REJECTED, tid=self._tid, reason=REASON_LOST,
                                    partition=self._partition))
        if self._state in _VOTING or self._state is S.OUTCOME:
            self._no_done_for = self._tid
