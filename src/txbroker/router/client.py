"""The router's client controller, async: start, send, accept or reject, receive the outcome.

Theory of operation
-------------------
A client controller runs one transaction at a time. Its tid is chosen here
(``uuid4().hex``); the first ``rtr_send`` of it starts it at the broker. Sends
are pipelined (no waiting for each reply); each key is checked first against
the partition map ``rtr_register`` returned, so a key outside every range
raises BadRequest at once. ``accept()`` waits for the sends' replies — a
broker error of one is raised there, before anything is accepted — then sends
``rtr_accept``; the outcome comes later as an ``rtr`` push, which ``receive()``
returns (and acknowledges with ``rtr_ack``, request id 0).

The states and the calls each allows are :data:`RULES` (one row per rule).

A lost connection (the failover of ``txbroker.client`` moves to the next broker
of the URL's list): the controller registers again and, for the transaction
it was in, asks ``rtr_outcome``. One that was still being sent is first
rejected (reason LOST) — its messages may be half gone; further sends and
accepts of it raise TransactionRolledBack. The outcome is delivered by
``receive()``: ACCEPTED, REJECTED, or REJECTED with reason UNKNOWN when the
router has no record of it (never durably accepted: applied nowhere; the router
keeps a tombstone so that the tid never begins again). While the answer is
PENDING (accepted, not decided yet) the library asks again.

**A transaction lives on one session.** Every call that awaits (``accept`` and
``set_accept`` wait for the earlier sends' replies) checks the state again after
the await: a session lost meanwhile made the transaction LOST, and nothing more
of it is ever sent — in particular never the accept, on the new session, of a
transaction whose first messages died with the old one (issue 25). Each message
carries its ``index`` in the transaction, so that a router never begins a
transaction from a message that is not its first.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from enum import Enum
from typing import Any, Final

from txbroker.client.aio import AsyncConnection
from txbroker.errors import (
    BrokerError,
    ConnectionLost,
    IllegalState,
    NotFound,
    TransactionRolledBack,
)
from txbroker.router._base import AsyncControllerBase
from txbroker.router.constants import (
    REASON_CLIENT,
    REASON_LOST,
    REASON_UNKNOWN,
    EventRanges,
    Key,
    MessageType,
    RouterMessage,
)

__all__ = ["RULES", "AsyncTransactionController", "ClientState"]

#: First pause (s) before asking again for the outcome of a PENDING transaction after a
#: failover, doubled up to :data:`OUTCOME_POLL_MAX`: a decision takes one vote round.
OUTCOME_POLL_FIRST: Final = 0.05
OUTCOME_POLL_MAX: Final = 1.0


class ClientState(Enum):
    """Where the controller's current transaction is."""

    IDLE = "IDLE"  # no transaction, or its outcome was received
    STARTED = "STARTED"  # start_transaction(); nothing sent yet
    SENDING = "SENDING"  # messages sent, neither accepted nor rejected
    ACCEPTED = "ACCEPTED"  # accepted: waiting for the outcome; can no longer reject
    REJECTED = "REJECTED"  # rejected: waiting for the REJECTED outcome
    LOST = "LOST"  # the session broke before the accept: the outcome is asked for


S = ClientState
#: (state, call) -> next state, or the IllegalState message. Calls not listed are refused.
RULES: Final[dict[tuple[ClientState, str], ClientState | str]] = {
    # Rule 1: a transaction starts only once the previous outcome was received.
    (S.IDLE, "start"): S.STARTED,
    # Rule 2: messages go out until the client accepts or rejects.
    (S.STARTED, "send"): S.SENDING,
    (S.SENDING, "send"): S.SENDING,
    # Rule 3: accept needs a message; set_accept carries its own.
    (S.STARTED, "accept"): "nothing was sent in this transaction: send first (or reject)",
    (S.SENDING, "accept"): S.ACCEPTED,
    (S.STARTED, "set_accept"): S.ACCEPTED,
    (S.SENDING, "set_accept"): S.ACCEPTED,
    # Rule 4: the client may reject until it accepted; never after (the seed's "Once the
    # client application has used the AcceptTransaction method, the result cannot be
    # changed").
    (S.STARTED, "reject"): S.REJECTED,
    (S.SENDING, "reject"): S.REJECTED,
    (S.REJECTED, "reject"): S.REJECTED,
    (S.LOST, "reject"): S.LOST,
    (S.ACCEPTED, "reject"): "the transaction was accepted: the client can no longer reject it",
    # Rule 5: an outcome ends the transaction in any state (a server may reject early).
    (S.STARTED, "outcome"): S.IDLE,
    (S.SENDING, "outcome"): S.IDLE,
    (S.ACCEPTED, "outcome"): S.IDLE,
    (S.REJECTED, "outcome"): S.IDLE,
    (S.LOST, "outcome"): S.IDLE,
}


class AsyncTransactionController(AsyncControllerBase):
    """A client of a facility (the seed's ``RTRClientTransactionController``), async.

    ``connection`` is an :class:`~txbroker.client.aio.AsyncConnection` or a URL
    (then ``options`` are those of ``txbroker.aio.connect``)."""

    _kind = "client"

    def __init__(self, connection: AsyncConnection | str, **options: Any) -> None:
        super().__init__(connection, **options)
        self._state = ClientState.IDLE
        self._tid: str | None = None
        self._sends: list[asyncio.Future[Any]] = []
        self._sent_count = 0  #: messages of the current transaction sent so far
        self._reason: str = REASON_CLIENT
        self._ask: str | None = None  # the tid to ask rtr_outcome for after a failover
        self._outcome_in: str | None = None  # tid whose outcome is in the inbox
        self._local: set[str] = set()  # outcomes made here (not acknowledged to the broker)
        self._poller: asyncio.Task[None] | None = None

    @property
    def tid(self) -> str | None:
        """The current transaction's id (None before the first start_transaction)."""
        return self._tid

    @property
    def state(self) -> ClientState:
        """Where the current transaction is (:class:`ClientState`)."""
        return self._state

    def _step(self, call: str) -> ClientState:
        rule = RULES.get((self._state, call))
        if rule is None:
            raise IllegalState(f"{call} is not allowed in state {self._state.value}"
                               + (" (start_transaction first)" if self._state is S.IDLE else
                                  " (receive the outcome first)" if call == "start" else ""))
        if isinstance(rule, str):
            if self._state is S.LOST:
                raise TransactionRolledBack(rule)
            raise IllegalState(rule)
        return rule

    def _check_not_lost(self, call: str) -> None:
        if self._state is S.LOST:
            raise TransactionRolledBack(
                f"{call}: the connection was lost before this transaction was accepted; it "
                "was rejected (reason LOST) and receive() gives its outcome")

    async def register_facility(self, facility: str, *, recipient: str | None = None,
                                events: EventRanges = ()) -> dict[str, Any]:
        """Register as a client of ``facility``; ``recipient`` names it for named
        events, ``events`` are the event numbers (or ``(low, high)`` ranges) to receive.
        Returns the broker's reply (key type, partitions). NotFound for an unknown
        facility."""
        return await self._register({"facility": facility, "kind": "client",
                                     "recipient": recipient,
                                     "events": self._events_arg(events)})

    async def start_transaction(self, *, tid: str | None = None) -> str:
        """Start a transaction; returns its tid. IllegalState while the previous one's
        outcome was not received. ``tid``: the transaction's id, when the caller draws
        it (it must be unique for ever — an id whose outcome was answered never begins
        again; the broker refuses one that is not a string of 1 to 64 characters, as
        any bad send: raised by accept); a random one (``uuid4().hex``) otherwise."""
        self._check_usable()
        self._state = self._step("start")
        self._tid = uuid.uuid4().hex if tid is None else tid
        self._sends, self._errors, self._reason = [], [], REASON_CLIENT
        self._sent_count = 0
        return self._tid

    async def send(self, body: bytes, *, key: Key, headers: dict[str, Any] | None = None) -> str:
        """Send a message of the transaction to the partition owning ``key``; returns
        that partition's name. Does not wait for the broker (errors are raised by
        accept/receive); a key outside every range raises BadRequest at once."""
        await self._port_ready()
        self._check_not_lost("send")
        next_state = self._step("send")
        partition = self._checked_partition(key)
        self._sends.append(self._pipeline("rtr_send", self._send_args(body, key, headers)))
        self._sent_count += 1
        self._state = next_state
        return partition

    def _checked_partition(self, key: Key) -> str:
        assert self._map is not None
        return self._map.partition_of(key)

    def _send_args(self, body: bytes, key: Key, headers: dict[str, Any] | None,
                   accept: bool = False) -> dict[str, Any]:
        return {"tid": self._tid, "key": key, "body": bytes(body), "accept": accept,
                "headers": headers, "index": self._sent_count}

    async def _sent(self) -> None:
        """Wait for the pipelined sends; raise the first broker error of them."""
        sends, self._sends = self._sends, []
        if sends:
            await asyncio.gather(*sends, return_exceptions=True)
        self._raise_pipelined()

    async def accept(self) -> None:
        """Accept the transaction (phase one starts); the outcome comes by receive().
        A broker error of an earlier send is raised here, before accepting."""
        await self._port_ready()
        self._check_not_lost("accept")
        next_state = self._step("accept")
        if self._outcome_in == self._tid:  # already decided (a server rejected): receive() it
            self._sends, self._errors = [], []
            self._state = next_state
            return
        await self._sent()
        # the session may have been lost while the sends were awaited: then the
        # transaction is LOST (its messages may be gone) and is never accepted
        self._check_not_lost("accept")
        self._state = next_state
        await self._lossy(self._call("rtr_accept", {"tid": self._tid}))

    async def set_accept(self, body: bytes | None = None, *, key: Key | None = None,
                         headers: dict[str, Any] | None = None) -> None:
        """Send the last message and the accept in one request (the seed's
        SetAcceptTransaction); with no ``body`` the same as :meth:`accept`."""
        if body is None:
            await self.accept()
            return
        if key is None:
            raise TypeError("set_accept with a body needs its key")
        await self._port_ready()
        self._check_not_lost("set_accept")
        next_state = self._step("set_accept")
        self._checked_partition(key)
        if self._outcome_in == self._tid:
            self._sends, self._errors = [], []
            self._state = next_state
            return
        await self._sent()
        self._check_not_lost("set_accept")  # as in accept(): lost meanwhile, never accepted
        self._state = next_state
        args = self._send_args(body, key, headers, True)
        self._sent_count += 1
        await self._lossy(self._call("rtr_send", args))

    async def _lossy(self, request: Any) -> None:
        """Await a request whose loss with the connection is not final: the outcome is
        asked for after the failover and delivered by receive()."""
        try:
            await request
        except ConnectionLost:
            if self._failed is not None or self._closed:
                raise

    async def reject(self, reason: str = REASON_CLIENT) -> None:
        """Reject the transaction (IllegalState once accepted); receive() then gives the
        REJECTED outcome."""
        self._check_usable()
        previous = self._state
        self._state = self._step("reject")
        self._reason = reason
        tid = self._tid
        assert tid is not None
        if previous is S.STARTED:  # the broker never heard of it
            self._local.add(tid)
            self._put(RouterMessage(MessageType.REJECTED, tid=tid, reason=reason))
            return
        if previous is not S.SENDING:
            return
        self._sends, self._errors = [], []
        assert self._port is not None
        if not self._port.ready.is_set():
            return  # the session is lost: the restore rejects it with this reason
        try:
            await self._call("rtr_reject", {"tid": tid, "reason": reason})
        except (IllegalState, NotFound, TransactionRolledBack):
            pass  # decided or gone meanwhile: its outcome comes anyway
        except ConnectionLost:
            if self._failed is not None or self._closed:
                raise

    async def receive(self, timeout: float | None = None) -> RouterMessage | None:
        """The next outcome (ACCEPTED, or REJECTED with its ``reason``) or event; None
        after ``timeout`` seconds (None: wait forever). Raises a broker error of a
        pipelined send first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._state is S.SENDING and self._errors:
                self._raise_pipelined()
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            item = await self._next_item(remaining)
            if item is None:
                return None
            if isinstance(item, BaseException):
                raise item
            if not item.is_outcome:
                return item
            tid = item.tid
            if tid is not None and tid not in self._local:
                self._notify("rtr_ack", {"tids": [tid]})
            self._local.discard(tid or "")
            if tid != self._tid or self._state is S.IDLE:
                continue  # a duplicate (asked for and pushed) or of an older transaction
            self._state = self._step("outcome")
            self._outcome_in, self._ask, self._sends, self._errors = None, None, [], []
            return item

    def _on_message(self, message: RouterMessage) -> None:
        if message.is_outcome and message.tid == self._tid:
            if self._outcome_in == message.tid:
                return  # asked for after a failover and pushed as well
            self._outcome_in = message.tid
        self._put(message)

    # -------------------------------------------------------------- failover

    def on_session_lost(self) -> None:
        """Remember which transaction to ask about once registered again."""
        super().on_session_lost()
        if self._state is S.SENDING:
            self._state = S.LOST
        if self._state in (S.ACCEPTED, S.REJECTED, S.LOST) and self._outcome_in != self._tid:
            self._ask = self._tid

    async def _restored(self, call: Any) -> None:
        tid = self._ask
        if tid is None or self._outcome_in == tid:
            return
        if self._state in (S.LOST, S.REJECTED):
            reason = REASON_LOST if self._state is S.LOST else self._reason
            # unknown (gone with a crash) or decided: the outcome says which
            with contextlib.suppress(BrokerError):
                await call("rtr_reject", {"controller": self._id, "tid": tid, "reason": reason})
        # with our (new) id: the router also pushes the outcome to us once decided
        reply = await call("rtr_outcome", {"tid": tid, "controller": self._id})
        if not self._take_outcome(tid, reply) and (self._poller is None or self._poller.done()):
            self._poller = asyncio.create_task(self._poll_outcome(tid))

    def _take_outcome(self, tid: str, reply: Any) -> bool:
        """Deliver the ``rtr_outcome`` answer for ``tid``; False while PENDING."""
        state = reply.get("state") if isinstance(reply, dict) else None
        if state == "PENDING" or self._tid != tid or self._outcome_in == tid:
            return state != "PENDING"
        if state == "ACCEPTED":
            message = RouterMessage(MessageType.ACCEPTED, tid=tid)
        else:
            reason = reply.get("reason") if state == "REJECTED" else REASON_UNKNOWN
            message = RouterMessage(MessageType.REJECTED, tid=tid, reason=reason or REASON_UNKNOWN)
        if state == "UNKNOWN" or state not in ("ACCEPTED", "REJECTED"):
            self._local.add(tid)  # nothing to acknowledge
        self._outcome_in = tid
        self._put(message)
        return True

    async def _poll_outcome(self, tid: str) -> None:
        delay = OUTCOME_POLL_FIRST
        while self._tid == tid and self._outcome_in != tid and not self._closed:
            await asyncio.sleep(delay)
            delay = min(delay * 2, OUTCOME_POLL_MAX)
            if self._outcome_in == tid or self._failed is not None:
                return
            try:
                reply = await self.connection.request("rtr_outcome", {"tid": tid})
            except (BrokerError, ConnectionLost, TimeoutError):
                return  # the next restore asks again
            if self._take_outcome(tid, reply):
                return

    async def close(self) -> None:
        """Unregister and close (see the base class)."""
        if self._poller is not None:
            self._poller.cancel()
        await super().close()
