"""The transaction router's two state tables (seed 000, tables 4-4 to 4-6).

Theory of operation
-------------------
A router transaction has one **router state** (:class:`TxState`) and, per
partition it touches (and per site, for shadowed partitions), one
**participant** whose state is the server's view (:class:`PartState`). The
engine (``core/router/``) fires events on both; these tables are the whole
of what may happen, with a comment per rule, as ``core/xa.py`` does. A pair
missing from :data:`TX_RULES` is refused with :class:`~txbroker.errors.IllegalState`
(the message says what the transaction is); a missing pair in
:data:`PART_RULES` is a bug of the engine (AssertionError), except for the
events a server sends (a vote, a rejection, an acknowledgement:
:func:`part_answer`), which are refused with IllegalState. The few checks that
are not a pair of a table are named guards defined here (:data:`DECIDED`,
:data:`REJECTED`, :data:`WRITING`, :func:`vote_is_stale`), and the rules that use
them say so. Below the tables
are the objects that carry those states: :class:`Controller`,
:class:`Transaction` and its :class:`Participant` s.

A decision passes through a *deciding* state while its record is on its way to
disk (nobody hears it before it is durable), and a transaction that struck out
is an ``EXCEPTION`` until an operator commits or discards it. The journal, the
``show`` and ``stats`` answers keep the seed's four names (:data:`PUBLIC`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from txbroker.core.messages import Message
from txbroker.core.router.model import Key, Role, Site
from txbroker.errors import IllegalState


class TxState(Enum):
    """The router's states of a transaction (seed 000, table 4-6 and the commit phase)."""

    SENDING = "SENDING"  #: the client is still sending messages
    VREQ = "VREQ"  #: the client accepted; the router waits for every vote
    #: decided accept; the decision is on its way to disk (nobody is told yet)
    COMMIT_DECIDING = "COMMIT_DECIDING"
    COMMITTING = "COMMITTING"  #: every vote was accept: the participants commit
    #: decided reject; the decision is on its way to disk (nobody is told yet)
    ABORT_DECIDING = "ABORT_DECIDING"
    ABORTING = "ABORTING"  #: someone rejected (or the router did): the participants abort
    #: struck out (rejected SRVDIED); the decision is on its way to disk
    EXCEPTION_DECIDING = "EXCEPTION_DECIDING"
    #: struck out and rejected SRVDIED: kept, flagged, until an operator resolves it
    EXCEPTION = "EXCEPTION"


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
    DURABLE = "decision durable"  #: the decision's journal record is on disk
    WRITE_FAILED = "decision write failed"  #: the store failed: no more writes


#: (state, event) -> next state.
TX_RULES: dict[tuple[TxState, TxEvent], TxState] = {
    # Rule 1: a sending client may send any number of messages; each is routed by its key.
    (TxState.SENDING, TxEvent.SEND): TxState.SENDING,
    # Rule 2: the client accepts: the router journals the transaction and asks every
    # participant to vote (VREQ). From here on the transaction has a journal record; a
    # SENDING one never has one.
    (TxState.SENDING, TxEvent.CLIENT_ACCEPT): TxState.VREQ,
    # Rule 3: the client may reject until it accepted. Nothing was journaled: the
    # rejection is told at once (presumed abort: nobody has to remember it).
    (TxState.SENDING, TxEvent.CLIENT_REJECT): TxState.ABORTING,
    # Rule 4: a participant may reject until it voted accept, even before the client
    # accepted (seed: "A participant can reject the transaction up to the time ...");
    # whether it still may is the participant table's REJECT rule. Before the accept,
    # told at once (Rule 3); after it, the journaled transaction's rejection is made
    # durable first.
    (TxState.SENDING, TxEvent.SERVER_REJECT): TxState.ABORTING,
    (TxState.VREQ, TxEvent.SERVER_REJECT): TxState.ABORT_DECIDING,
    # Rule 5: a rejection that arrives after the decision changes nothing (the engine
    # ignores every vote of a DECIDED transaction).
    (TxState.COMMIT_DECIDING, TxEvent.SERVER_REJECT): TxState.COMMIT_DECIDING,
    (TxState.COMMITTING, TxEvent.SERVER_REJECT): TxState.COMMITTING,
    (TxState.ABORT_DECIDING, TxEvent.SERVER_REJECT): TxState.ABORT_DECIDING,
    (TxState.ABORTING, TxEvent.SERVER_REJECT): TxState.ABORTING,
    (TxState.EXCEPTION_DECIDING, TxEvent.SERVER_REJECT): TxState.EXCEPTION_DECIDING,
    (TxState.EXCEPTION, TxEvent.SERVER_REJECT): TxState.EXCEPTION,
    # Rule 6: the client accepted and every participant voted accept: commit, once the
    # decision is durable (every commit is).
    (TxState.VREQ, TxEvent.ALL_VOTED): TxState.COMMIT_DECIDING,
    # Rule 7: three strikes (presented and lost before a vote more often than the
    # partition's retry count): rejected with SRVDIED and flagged an exception, durably
    # (also before the accept: an exception is kept for the operator).
    (TxState.SENDING, TxEvent.STRIKE_OUT): TxState.EXCEPTION_DECIDING,
    (TxState.VREQ, TxEvent.STRIKE_OUT): TxState.EXCEPTION_DECIDING,
    # Rule 8: the votes did not all come within the partition's vote timeout.
    (TxState.VREQ, TxEvent.VOTE_TIMEOUT): TxState.ABORT_DECIDING,
    # Rule 9: a client that leaves before accepting takes its transaction with it (told
    # at once, as Rule 3)...
    (TxState.SENDING, TxEvent.CLIENT_LOST): TxState.ABORTING,
    # ... but once it accepted, "the result cannot be changed": the router carries on
    # and keeps the outcome for the client to collect (rtr_outcome).
    (TxState.VREQ, TxEvent.CLIENT_LOST): TxState.VREQ,
    (TxState.COMMIT_DECIDING, TxEvent.CLIENT_LOST): TxState.COMMIT_DECIDING,
    (TxState.COMMITTING, TxEvent.CLIENT_LOST): TxState.COMMITTING,
    (TxState.ABORT_DECIDING, TxEvent.CLIENT_LOST): TxState.ABORT_DECIDING,
    (TxState.ABORTING, TxEvent.CLIENT_LOST): TxState.ABORTING,
    (TxState.EXCEPTION_DECIDING, TxEvent.CLIENT_LOST): TxState.EXCEPTION_DECIDING,
    (TxState.EXCEPTION, TxEvent.CLIENT_LOST): TxState.EXCEPTION,
    # Rule 10: an operator commits an exception transaction by hand: once that decision
    # is durable it is presented again, decided (UNCERTAIN, then ACCEPTED), to a server
    # of each partition. (While its strike-out is being written it cannot be resolved:
    # "try again".)
    (TxState.EXCEPTION, TxEvent.OPERATOR_COMMIT): TxState.COMMIT_DECIDING,
    # Rule 11: the decision is durable: now everybody is told (a commit, a rejection, an
    # exception's rejection; an operator's commit is presented again).
    (TxState.COMMIT_DECIDING, TxEvent.DURABLE): TxState.COMMITTING,
    (TxState.ABORT_DECIDING, TxEvent.DURABLE): TxState.ABORTING,
    (TxState.EXCEPTION_DECIDING, TxEvent.DURABLE): TxState.EXCEPTION,
    # Rule 12: the store failed while the decision was written: the decision is NOT
    # durable, so it stays a deciding state — nobody is told, and an rtr_outcome asked
    # now answers PENDING (the broker takes no more writes; a restart reads the journal,
    # which may decide otherwise: a lost commit decision is aborted, a lost rejection
    # may be voted through). Moving on to COMMITTING here answered ACCEPTED for a
    # transaction the restart then aborted (router-bank-failing-fsync, seed 28115).
    (TxState.COMMIT_DECIDING, TxEvent.WRITE_FAILED): TxState.COMMIT_DECIDING,
    (TxState.ABORT_DECIDING, TxEvent.WRITE_FAILED): TxState.ABORT_DECIDING,
    (TxState.EXCEPTION_DECIDING, TxEvent.WRITE_FAILED): TxState.EXCEPTION_DECIDING,
}

#: The guards are tuples: ``in`` compares enum members by identity first, where a set
#: would call ``Enum.__hash__`` (Python code) on every check.
#: Guard (Rule 5 and every "decided" check): the transaction is decided — accepted or
#: rejected, durably or not yet; votes are ignored, the client has an outcome to collect.
DECIDED: Final = (TxState.COMMIT_DECIDING, TxState.COMMITTING, TxState.ABORT_DECIDING,
                  TxState.ABORTING, TxState.EXCEPTION_DECIDING, TxState.EXCEPTION)
#: Guard: decided *reject* (a client's send, accept or reject answers "rejected").
REJECTED: Final = (TxState.ABORT_DECIDING, TxState.ABORTING, TxState.EXCEPTION_DECIDING,
                   TxState.EXCEPTION)
#: Guard: the decision's record is on its way to disk (Rule 11 or 12 comes next);
#: nothing else is written for the transaction meanwhile.
WRITING: Final = (TxState.COMMIT_DECIDING, TxState.ABORT_DECIDING,
                  TxState.EXCEPTION_DECIDING)
#: Guard: an exception transaction (struck out, kept for the operator).
EXCEPTIONS: Final = (TxState.EXCEPTION_DECIDING, TxState.EXCEPTION)
#: The seed's name of each state: what the journal records, ``show`` and ``stats``
#: count and ``/metrics`` exports (an exception is a rejected transaction, flagged).
PUBLIC: Final = {
    TxState.SENDING: "SENDING", TxState.VREQ: "VREQ",
    TxState.COMMIT_DECIDING: "COMMITTING", TxState.COMMITTING: "COMMITTING",
    TxState.ABORT_DECIDING: "ABORTING", TxState.ABORTING: "ABORTING",
    TxState.EXCEPTION_DECIDING: "ABORTING", TxState.EXCEPTION: "ABORTING"}
#: The public names, in the order ``show`` and ``stats`` list them.
PUBLIC_NAMES: Final = ("SENDING", "VREQ", "COMMITTING", "ABORTING")

#: Why a client request is refused in a state (the message of the IllegalState).
_REFUSALS: dict[TxState, str] = {
    TxState.VREQ: "the client accepted it; the result can no longer be changed",
    TxState.COMMIT_DECIDING: "it is already decided (accepted)",
    TxState.COMMITTING: "it is already decided (accepted)",
    TxState.ABORT_DECIDING: "it is already decided (rejected)",
    TxState.ABORTING: "it is already decided (rejected)",
    TxState.EXCEPTION_DECIDING: "it is already decided (rejected)",
    TxState.EXCEPTION: "it is already decided (rejected)",
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
    #: a wait cycle; back to WAITING once the server acknowledged (core/router/deadlock.py)
    YIELDING = "YIELDING"


class PartEvent(Enum):
    """What happens to a participant."""

    PRESENT = "present"  #: a server got the transaction (MSG1 or UNCERTAIN first)
    ASK = "ask"  #: the client accepted: vote now (PREPARE for explicit servers)
    VOTE = "vote accept"  #: a server with implicit prepare votes accept
    #: a server with explicit prepare votes accept (only after PREPARE)
    VOTE_AFTER_PREPARE = "vote accept after prepare"
    REJECT = "reject"  #: the server rejects (the transaction's SERVER_REJECT follows)
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
    # Rule 4: an accept vote. A server with implicit prepare may vote while RECEIVING, and
    # a repeated accept changes nothing; one with explicit prepare votes only after
    # PREPARE (VOTING), once (a missing pair is refused: :func:`part_answer`). An accept
    # that did not see every message pushed to the server is stale and changes nothing
    # (guard :func:`vote_is_stale`): the server votes again after the next message.
    (PartState.RECEIVING, PartEvent.VOTE): PartState.VOTED,
    (PartState.VOTING, PartEvent.VOTE): PartState.VOTED,
    (PartState.VOTED, PartEvent.VOTE): PartState.VOTED,
    (PartState.VOTING, PartEvent.VOTE_AFTER_PREPARE): PartState.VOTED,
    # Rule 4b: a server may reject until it voted accept; a server that voted accept can
    # no longer reject (refused). The participant stays as it is: the transaction's
    # rejection (its Rule 4) tells it REJECTED, as every other participant.
    (PartState.RECEIVING, PartEvent.REJECT): PartState.RECEIVING,
    (PartState.VOTING, PartEvent.REJECT): PartState.VOTING,
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
    # An acknowledgement before the outcome is refused (:func:`part_answer`).
    (PartState.COMMIT, PartEvent.ACK): PartState.DONE,
    (PartState.ABORT, PartEvent.ACK): PartState.DONE,
    # Rule 8: an aborted transaction's waiting participants have nothing to learn.
    (PartState.WAITING, PartEvent.FORGET): PartState.DONE,
    # Rule 9: a wait cycle (core/router/deadlock.py): an undecided participant of the
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
    # ... and a vote of a yielding participant is ignored: it votes again when presented
    # again.
    (PartState.YIELDING, PartEvent.VOTE): PartState.YIELDING,
    (PartState.YIELDING, PartEvent.VOTE_AFTER_PREPARE): PartState.YIELDING,
    (PartState.YIELDING, PartEvent.REJECT): PartState.YIELDING,
}

#: What a server is told when :data:`PART_RULES` has no pair for its vote, rejection
#: or acknowledgement (``{tid}``: the transaction).
_SERVER_REFUSALS: dict[PartEvent, str] = {
    PartEvent.VOTE: "transaction {tid}: this server cannot vote now",
    PartEvent.VOTE_AFTER_PREPARE: "transaction {tid}: a server with explicit prepare "
                                  "votes accept after PREPARE",
    PartEvent.REJECT: "transaction {tid}: this server voted accept; it can no longer "
                      "reject",
    PartEvent.ACK: "transaction {tid} has no outcome to acknowledge yet",
}


def part_next(state: PartState, event: PartEvent) -> PartState:
    """The participant's state after ``event`` (a missing rule is an engine bug)."""
    next_state = PART_RULES.get((state, event))
    assert next_state is not None, f"router participant: no rule for {state} + {event}"
    return next_state


def part_answer(tid: str, state: PartState, event: PartEvent) -> PartState:
    """The participant's state after a server's vote, rejection or acknowledgement
    (``event``); a pair the table does not have is the server's mistake: IllegalState."""
    next_state = PART_RULES.get((state, event))
    if next_state is None:
        raise IllegalState(_SERVER_REFUSALS[event].format(tid=tid))
    return next_state


def vote_is_stale(seen: int | None, sent: int) -> bool:
    """Guard of Rule 4: an accept that saw ``seen`` of the ``sent`` messages pushed to its
    server does not cover them all (a server that does not say counts as seeing all)."""
    return seen is not None and seen < sent


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
    record: Message | None = None  #: its live journal record
    client_acked: bool = False
    decided_ms: int = 0
    deadline_ms: int = 0  #: vote timeout (VREQ) or outcome retention (decided)
    flagged_ms: int = 0
    #: the transaction's age among those in flight (smaller: older; a wait cycle's
    #: youngest makes way, so the oldest always goes on: core/router/deadlock.py)
    seq: int = 0
    #: its outcome was asked for (``rtr_outcome``): forgotten, it leaves a tombstone
    inquired: bool = False

    @property
    def exception(self) -> bool:
        """Struck out and kept for an operator (an ``EXCEPTION`` state)."""
        return self.state in EXCEPTIONS

    @property
    def deciding(self) -> bool:
        """The decision is on its way to disk (a *deciding* state)."""
        return self.state in WRITING


__all__ = ["DECIDED", "EXCEPTIONS", "PART_RULES", "PUBLIC", "PUBLIC_NAMES", "REJECTED",
           "TX_RULES", "WRITING", "Controller", "PartEvent", "PartState", "Participant",
           "Transaction", "TxEvent", "TxState", "part_answer", "part_next", "tx_next",
           "vote_is_stale"]
