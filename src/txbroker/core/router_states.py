"""The transaction router's two state tables (seed 000, tables 4-4 to 4-6).

Theory of operation
-------------------
A router transaction has one **router state** (:class:`TxState`) and, per
partition it touches (and per site, for shadowed partitions), one
**participant** whose state is the server's view (:class:`PartState`). The
engine (``core/router.py``) fires events on both; these tables are the whole
of what may happen, with a comment per rule, as ``core/xa.py`` does. A pair
missing from :data:`TX_RULES` is refused with :class:`~txbroker.errors.IllegalState`
(the message says what the transaction is); a missing pair in
:data:`PART_RULES` is a bug of the engine (AssertionError). Below the tables are
the objects that carry those states: :class:`Controller`, :class:`Transaction`
and its :class:`Participant` s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from txbroker.core.messages import Message
from txbroker.core.router_model import Key, Role, Site
from txbroker.errors import IllegalState


class TxState(Enum):
    """The router's states of a transaction (seed 000, table 4-6 and the commit phase)."""

    SENDING = "SENDING"  #: the client is still sending messages
    VREQ = "VREQ"  #: the client accepted; the router waits for every vote
    COMMITTING = "COMMITTING"  #: every vote was accept: the participants commit
    ABORTING = "ABORTING"  #: someone rejected (or the router did): the participants abort


class TxEvent(Enum):
    """What happens to a transaction."""

    SEND = "send a message"
    CLIENT_ACCEPT = "accept"
    CLIENT_REJECT = "reject"
    SERVER_REJECT = "server reject"
    ALL_VOTED = "all voted accept"
    STRIKE_OUT = "strike out"
    VOTE_TIMEOUT = "vote timeout"
    CLIENT_LOST = "client lost"
    OPERATOR_COMMIT = "operator commit"


#: (state, event) -> next state.
TX_RULES: dict[tuple[TxState, TxEvent], TxState] = {
    # Rule 1: a sending client may send any number of messages; each is routed by its key.
    (TxState.SENDING, TxEvent.SEND): TxState.SENDING,
    # Rule 2: the client accepts: the router asks every participant to vote (VREQ).
    (TxState.SENDING, TxEvent.CLIENT_ACCEPT): TxState.VREQ,
    # Rule 3: the client may reject until it accepted.
    (TxState.SENDING, TxEvent.CLIENT_REJECT): TxState.ABORTING,
    # Rule 4: a participant may reject until it voted accept, even before the client
    # accepted (seed: "A participant can reject the transaction up to the time ...").
    (TxState.SENDING, TxEvent.SERVER_REJECT): TxState.ABORTING,
    (TxState.VREQ, TxEvent.SERVER_REJECT): TxState.ABORTING,
    # Rule 5: a rejection that arrives after the decision changes nothing.
    (TxState.COMMITTING, TxEvent.SERVER_REJECT): TxState.COMMITTING,
    (TxState.ABORTING, TxEvent.SERVER_REJECT): TxState.ABORTING,
    # Rule 6: the client accepted and every participant voted accept: commit.
    (TxState.VREQ, TxEvent.ALL_VOTED): TxState.COMMITTING,
    # Rule 7: three strikes (presented and lost before a vote more often than the
    # partition's retry count): rejected with SRVDIED and flagged an exception.
    (TxState.SENDING, TxEvent.STRIKE_OUT): TxState.ABORTING,
    (TxState.VREQ, TxEvent.STRIKE_OUT): TxState.ABORTING,
    # Rule 8: the votes did not all come within the partition's vote timeout.
    (TxState.VREQ, TxEvent.VOTE_TIMEOUT): TxState.ABORTING,
    # Rule 9: a client that leaves before accepting takes its transaction with it...
    (TxState.SENDING, TxEvent.CLIENT_LOST): TxState.ABORTING,
    # ... but once it accepted, "the result cannot be changed": the router carries on
    # and keeps the outcome for the client to collect (rtr_outcome).
    (TxState.VREQ, TxEvent.CLIENT_LOST): TxState.VREQ,
    (TxState.COMMITTING, TxEvent.CLIENT_LOST): TxState.COMMITTING,
    (TxState.ABORTING, TxEvent.CLIENT_LOST): TxState.ABORTING,
    # Rule 10: an operator commits an exception transaction by hand: it is presented
    # again, decided (UNCERTAIN, then ACCEPTED), to a server of each partition.
    (TxState.ABORTING, TxEvent.OPERATOR_COMMIT): TxState.COMMITTING,
}

#: Why a client request is refused in a state (the message of the IllegalState).
_REFUSALS: dict[TxState, str] = {
    TxState.VREQ: "the client accepted it; the result can no longer be changed",
    TxState.COMMITTING: "it is already decided (accepted)",
    TxState.ABORTING: "it is already decided (rejected)",
    TxState.SENDING: "it is still sending",
}


def tx_next(tid: str, state: TxState, event: TxEvent) -> TxState:
    """The state after ``event`` (IllegalState if the table has no rule for it)."""
    try:
        return TX_RULES[(state, event)]
    except KeyError:
        raise IllegalState(f"transaction {tid}: cannot {event.value}: "
                           f"{_REFUSALS[state]}") from None


class PartState(Enum):
    """A participant's state: the server's view (seed 000, tables 4-4 and 4-5)."""

    WAITING = "WAITING"  #: no server holds it (none free, or its server died)
    RECEIVING = "RECEIVING"  #: presented; the server has not voted
    VOTING = "VOTING"  #: the client accepted and the server was asked to vote
    VOTED = "VOTED"  #: the server voted accept; waiting for the decision
    COMMIT = "COMMIT"  #: told ACCEPTED; not yet acknowledged
    ABORT = "ABORT"  #: told REJECTED; not yet acknowledged
    DONE = "DONE"  #: the server acknowledged the outcome (or never needs to)
    #: told REJECTED (reason PREEMPTED) to free its server for an older transaction in
    #: a wait cycle; back to WAITING once the server acknowledged (core/router_deadlock.py)
    YIELDING = "YIELDING"


class PartEvent(Enum):
    """What happens to a participant."""

    PRESENT = "present"  #: a server got the transaction (MSG1 or UNCERTAIN first)
    ASK = "ask"  #: the client accepted: vote now (PREPARE for explicit servers)
    VOTE = "vote accept"
    MORE = "more messages"  #: another message for this partition arrived
    COMMIT = "commit"  #: the decision is accept, and durable
    ABORT = "abort"  #: the decision is reject, and durable
    LOST = "lost"  #: its server died or unregistered
    ACK = "acknowledge"  #: the server acknowledged the outcome
    FORGET = "forget"  #: nothing to tell this participant (aborted before it voted)
    YIELD = "yield"  #: its server is taken back for an older transaction (deadlock)


#: (state, event) -> next state.
PART_RULES: dict[tuple[PartState, PartEvent], PartState] = {
    # Rule 1: a waiting participant is presented to a free server of its partition;
    # a decided one goes straight to its outcome (UNCERTAIN first, then the outcome).
    (PartState.WAITING, PartEvent.PRESENT): PartState.RECEIVING,
    # Rule 2: messages may arrive while waiting or receiving; an implicit server's accept
    # covers only the messages it had, so a new one voids it (it must vote again).
    (PartState.WAITING, PartEvent.MORE): PartState.WAITING,
    (PartState.RECEIVING, PartEvent.MORE): PartState.RECEIVING,
    (PartState.VOTED, PartEvent.MORE): PartState.RECEIVING,
    # Rule 3: the client accepted: a presented participant is asked to vote.
    (PartState.RECEIVING, PartEvent.ASK): PartState.VOTING,
    (PartState.WAITING, PartEvent.ASK): PartState.WAITING,
    (PartState.VOTED, PartEvent.ASK): PartState.VOTED,
    # Rule 4: an accept vote (implicit servers may vote while RECEIVING).
    (PartState.RECEIVING, PartEvent.VOTE): PartState.VOTED,
    (PartState.VOTING, PartEvent.VOTE): PartState.VOTED,
    # Rule 5: the outcome goes to every participant a server holds...
    (PartState.VOTED, PartEvent.COMMIT): PartState.COMMIT,
    (PartState.RECEIVING, PartEvent.ABORT): PartState.ABORT,
    (PartState.VOTING, PartEvent.ABORT): PartState.ABORT,
    (PartState.VOTED, PartEvent.ABORT): PartState.ABORT,
    # ... and a waiting one gets it when it is presented again.
    (PartState.WAITING, PartEvent.COMMIT): PartState.WAITING,
    (PartState.WAITING, PartEvent.ABORT): PartState.WAITING,
    (PartState.RECEIVING, PartEvent.COMMIT): PartState.COMMIT,  # a replay of a decided one
    # Rule 6: the server died. Before its vote: a strike, replay to another server (MSG1).
    # After its vote, or after the outcome went out unacknowledged: replay with UNCERTAIN
    # (seed: the router cannot tell whether the server committed).
    (PartState.RECEIVING, PartEvent.LOST): PartState.WAITING,
    (PartState.VOTING, PartEvent.LOST): PartState.WAITING,
    (PartState.VOTED, PartEvent.LOST): PartState.WAITING,
    (PartState.COMMIT, PartEvent.LOST): PartState.WAITING,
    # An aborted participant's server lost its uncommitted work with it: nothing to redo.
    (PartState.ABORT, PartEvent.LOST): PartState.DONE,
    # Rule 7: the server acknowledged the outcome (or asked for its next transaction):
    # the router forgets the participant; no replay after this (seed: "after step 6").
    (PartState.COMMIT, PartEvent.ACK): PartState.DONE,
    (PartState.ABORT, PartEvent.ACK): PartState.DONE,
    # Rule 8: an aborted transaction's waiting participants have nothing to learn.
    (PartState.WAITING, PartEvent.FORGET): PartState.DONE,
    # Rule 9: a wait cycle (core/router_deadlock.py): an undecided participant of the
    # youngest transaction in it gives its server back — told REJECTED PREEMPTED, its
    # vote void — and is presented again (MSG1) once the server acknowledged. Messages
    # and the client's accept meanwhile wait for that; the decision (an abort) takes it.
    (PartState.RECEIVING, PartEvent.YIELD): PartState.YIELDING,
    (PartState.VOTING, PartEvent.YIELD): PartState.YIELDING,
    (PartState.VOTED, PartEvent.YIELD): PartState.YIELDING,
    (PartState.YIELDING, PartEvent.MORE): PartState.YIELDING,
    (PartState.YIELDING, PartEvent.ASK): PartState.YIELDING,
    (PartState.YIELDING, PartEvent.ACK): PartState.WAITING,
    (PartState.YIELDING, PartEvent.LOST): PartState.WAITING,  # no strike: it was told
    (PartState.YIELDING, PartEvent.ABORT): PartState.ABORT,  # told REJECTED already
}


def part_next(state: PartState, event: PartEvent) -> PartState:
    """The participant's state after ``event`` (a missing rule is an engine bug)."""
    next_state = PART_RULES.get((state, event))
    assert next_state is not None, f"router participant: no rule for {state} + {event}"
    return next_state


# ---------------------------------------------------------------------- the objects
@dataclass(slots=True, eq=False)
class Controller:
    """One registration of a connection: a client of a facility or a server of a
    partition."""

    id: int
    session: int
    facility: str
    is_server: bool
    partition: str | None = None
    role: Role | None = None
    explicit_prepare: bool = False
    recipient: str | None = None
    events: tuple[tuple[int, int], ...] = ()
    #: (server) the participant it holds now
    current: Participant | None = None
    #: (client) its transactions whose outcome it has not collected
    tids: set[str] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class Participant:
    """A transaction's share of one partition at one site (the server's view)."""

    tx: Transaction
    partition: str
    site: Site
    indexes: list[int] = field(default_factory=list)  #: positions in ``tx.messages``
    state: PartState = PartState.WAITING
    server: Controller | None = None
    sent: int = 0  #: messages pushed to the current server
    uncertain: bool = False  #: the next presentation starts with UNCERTAIN
    strikes: int = 0  #: presentations lost before a vote
    presentations: int = 0


@dataclass(slots=True, eq=False)
class Transaction:
    """One router transaction."""

    tid: str
    facility: str
    client: Controller | None
    created_ms: int
    messages: list[tuple[str, Key, bytes, dict[str, str] | None]] = field(default_factory=list)
    participants: dict[tuple[str, Site], Participant] = field(default_factory=dict)
    state: TxState = TxState.SENDING
    reason: str | None = None
    exception: bool = False
    record: Message | None = None  #: its live journal record
    deciding: bool = False  #: the decision is on its way to disk
    client_acked: bool = False
    decided_ms: int = 0
    deadline_ms: int = 0  #: vote timeout (VREQ) or outcome retention (decided)
    flagged_ms: int = 0
    #: the transaction's age among those in flight (smaller: older; a wait cycle's
    #: youngest makes way, so the oldest always goes on: core/router_deadlock.py)
    seq: int = 0
    #: its outcome was asked for (``rtr_outcome``): forgotten, it leaves a tombstone
    inquired: bool = False


__all__ = ["PART_RULES", "TX_RULES", "Controller", "PartEvent", "PartState", "Participant",
           "Transaction", "TxEvent", "TxState", "part_next", "tx_next"]
