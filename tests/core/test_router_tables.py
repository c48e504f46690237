"""The router's two state tables against an independent reading of seed 000
(issue 26): written from the seed's tables 4-4 to 4-6 and docs/router.md, not
copied from core/router/states.py. A row added to, removed from or changed in the
engine's tables fails here until the expected table says why.

A decision that must be durable before anybody hears it (every commit, every
rejection of an accepted — journaled — transaction, every strike-out) passes
through a *deciding* state; a struck-out transaction is an EXCEPTION until an
operator resolves it (issue 26 §3: no hidden states)."""

from __future__ import annotations

import pytest

from txbroker.core.router.states import (
    DECIDED,
    PART_RULES,
    PUBLIC,
    REJECTED,
    TX_RULES,
    WRITING,
    PartEvent,
    PartState,
    TxEvent,
    TxState,
    part_answer,
    part_next,
    tx_next,
    vote_is_stale,
)
from txbroker.errors import IllegalState

#: (router state, event) -> next state. Absent pairs are refused (IllegalState).
EXPECTED_TX: dict[tuple[str, str], str] = {
    ("SENDING", "send a message"): "SENDING",  # messages until accept or reject
    ("SENDING", "accept"): "VREQ",  # the client accepts: journaled, ask for the votes
    # before the accept nothing is journaled: a rejection is told at once
    ("SENDING", "reject"): "ABORTING",  # the client may reject before it accepted
    ("SENDING", "server reject"): "ABORTING",  # a server may reject before voting
    ("VREQ", "server reject"): "ABORT_DECIDING",  # journaled: durable before it is told
    # too late: after the decision a rejection changes nothing
    ("COMMIT_DECIDING", "server reject"): "COMMIT_DECIDING",
    ("COMMITTING", "server reject"): "COMMITTING",
    ("ABORT_DECIDING", "server reject"): "ABORT_DECIDING",
    ("ABORTING", "server reject"): "ABORTING",
    ("EXCEPTION_DECIDING", "server reject"): "EXCEPTION_DECIDING",
    ("EXCEPTION", "server reject"): "EXCEPTION",
    ("VREQ", "all voted accept"): "COMMIT_DECIDING",  # every commit is durable first
    # three strikes: SRVDIED, an exception, kept (so journaled) even before the accept
    ("SENDING", "strike out"): "EXCEPTION_DECIDING",
    ("VREQ", "strike out"): "EXCEPTION_DECIDING",
    ("VREQ", "vote timeout"): "ABORT_DECIDING",
    ("SENDING", "client lost"): "ABORTING",  # a client that leaves before accepting
    ("VREQ", "client lost"): "VREQ",  # accepted: "the result cannot be changed"
    ("COMMIT_DECIDING", "client lost"): "COMMIT_DECIDING",
    ("COMMITTING", "client lost"): "COMMITTING",
    ("ABORT_DECIDING", "client lost"): "ABORT_DECIDING",
    ("ABORTING", "client lost"): "ABORTING",
    ("EXCEPTION_DECIDING", "client lost"): "EXCEPTION_DECIDING",
    ("EXCEPTION", "client lost"): "EXCEPTION",
    # an exception committed by hand: durable, then replayed decided
    ("EXCEPTION", "operator commit"): "COMMIT_DECIDING",
    # the decision reached the disk: now it is told
    ("COMMIT_DECIDING", "decision durable"): "COMMITTING",
    ("ABORT_DECIDING", "decision durable"): "ABORTING",
    ("EXCEPTION_DECIDING", "decision durable"): "EXCEPTION",
    # the store failed under it: not durable, so still deciding — told nobody, and
    # asked, it is PENDING (a restart reads the journal)
    ("COMMIT_DECIDING", "decision write failed"): "COMMIT_DECIDING",
    ("ABORT_DECIDING", "decision write failed"): "ABORT_DECIDING",
    ("EXCEPTION_DECIDING", "decision write failed"): "EXCEPTION_DECIDING",
}

#: The seed's four states, as the journal, ``show`` and ``stats`` name them.
EXPECTED_PUBLIC: dict[str, str] = {
    "SENDING": "SENDING", "VREQ": "VREQ",
    "COMMIT_DECIDING": "COMMITTING", "COMMITTING": "COMMITTING",
    "ABORT_DECIDING": "ABORTING", "ABORTING": "ABORTING",
    "EXCEPTION_DECIDING": "ABORTING", "EXCEPTION": "ABORTING",  # rejected, flagged
}

#: (participant state, event) -> next state. Absent pairs are engine bugs.
EXPECTED_PART: dict[tuple[str, str], str] = {
    ("WAITING", "present"): "RECEIVING",
    ("WAITING", "more messages"): "WAITING",
    ("RECEIVING", "more messages"): "RECEIVING",
    ("VOTED", "more messages"): "RECEIVING",  # a new message voids an implicit vote
    ("RECEIVING", "ask"): "VOTING",
    ("WAITING", "ask"): "WAITING",
    ("VOTED", "ask"): "VOTED",
    ("RECEIVING", "vote accept"): "VOTED",  # implicit prepare
    ("VOTING", "vote accept"): "VOTED",
    ("VOTED", "vote accept"): "VOTED",  # said again: nothing changes
    ("VOTING", "vote accept after prepare"): "VOTED",  # explicit: only after PREPARE
    ("RECEIVING", "reject"): "RECEIVING",  # may reject until it voted accept; the
    ("VOTING", "reject"): "VOTING",  # outcome (REJECTED) reaches it as everyone
    ("VOTED", "commit"): "COMMIT",
    ("RECEIVING", "abort"): "ABORT",
    ("VOTING", "abort"): "ABORT",
    ("VOTED", "abort"): "ABORT",
    ("WAITING", "commit"): "WAITING",  # told when presented again (UNCERTAIN first)
    ("WAITING", "abort"): "WAITING",
    ("RECEIVING", "commit"): "COMMIT",  # the replay of a decided transaction
    ("RECEIVING", "lost"): "WAITING",  # before the vote: a strike, MSG1 again
    ("VOTING", "lost"): "WAITING",
    ("VOTED", "lost"): "WAITING",  # after it: UNCERTAIN
    ("COMMIT", "lost"): "WAITING",
    ("ABORT", "lost"): "DONE",  # its uncommitted work died with it
    ("COMMIT", "acknowledge"): "DONE",
    ("ABORT", "acknowledge"): "DONE",
    ("WAITING", "forget"): "DONE",  # aborted before it was presented
    # a wait cycle's youngest transaction makes way (issue 28 §2)
    ("RECEIVING", "yield"): "YIELDING",
    ("VOTING", "yield"): "YIELDING",
    ("VOTED", "yield"): "YIELDING",  # its vote is void
    ("YIELDING", "more messages"): "YIELDING",
    ("YIELDING", "ask"): "YIELDING",
    ("YIELDING", "acknowledge"): "WAITING",  # rolled back: presented again (MSG1)
    ("YIELDING", "lost"): "WAITING",  # no strike: it was making way
    ("YIELDING", "abort"): "ABORT",  # told REJECTED already
    ("YIELDING", "vote accept"): "YIELDING",  # ignored: it votes again when presented
    ("YIELDING", "vote accept after prepare"): "YIELDING",
    ("YIELDING", "reject"): "YIELDING",
}

#: A server's inputs: what a missing pair answers (IllegalState, not an engine bug).
SERVER_EVENTS = ("vote accept", "vote accept after prepare", "reject", "acknowledge")


def test_the_transaction_table_is_the_expected_one() -> None:
    assert {(s.value, e.value): n.value for (s, e), n in TX_RULES.items()} == EXPECTED_TX


def test_the_participant_table_is_the_expected_one() -> None:
    assert {(s.value, e.value): n.value for (s, e), n in PART_RULES.items()} == EXPECTED_PART


@pytest.mark.parametrize("state", list(TxState))
@pytest.mark.parametrize("event", list(TxEvent))
def test_every_transaction_pair(state: TxState, event: TxEvent) -> None:
    expected = EXPECTED_TX.get((state.value, event.value))
    if expected is None:
        with pytest.raises(IllegalState, match=f"cannot {event.value}"):
            tx_next("t", state, event)
    else:
        assert tx_next("t", state, event).value == expected


@pytest.mark.parametrize("state", list(PartState))
@pytest.mark.parametrize("event", list(PartEvent))
def test_every_participant_pair(state: PartState, event: PartEvent) -> None:
    expected = EXPECTED_PART.get((state.value, event.value))
    if expected is None:
        with pytest.raises(AssertionError, match="no rule"):
            part_next(state, event)
        if event.value in SERVER_EVENTS:  # the server's mistake, refused
            with pytest.raises(IllegalState, match=r"^transaction t[: ]"):
                part_answer("t", state, event)
    else:
        assert part_next(state, event).value == expected
        if event.value in SERVER_EVENTS:
            assert part_answer("t", state, event).value == expected


def test_what_a_server_is_told_when_its_vote_is_refused() -> None:
    with pytest.raises(IllegalState, match="voted accept; it can no longer reject"):
        part_answer("t", PartState.VOTED, PartEvent.REJECT)
    for state in (PartState.RECEIVING, PartState.VOTED):
        with pytest.raises(IllegalState, match="explicit prepare votes accept after PREPARE"):
            part_answer("t", state, PartEvent.VOTE_AFTER_PREPARE)
    for state in (PartState.RECEIVING, PartState.VOTING, PartState.VOTED):
        with pytest.raises(IllegalState, match=r"^transaction t has no outcome to acknowledge"):
            part_answer("t", state, PartEvent.ACK)


def test_the_seeds_names_of_the_states() -> None:
    assert {state.value: name for state, name in PUBLIC.items()} == EXPECTED_PUBLIC


def test_the_named_guards() -> None:
    decided = {"COMMIT_DECIDING", "COMMITTING", "ABORT_DECIDING", "ABORTING",
               "EXCEPTION_DECIDING", "EXCEPTION"}
    assert {s.value for s in DECIDED} == decided
    assert {s.value for s in REJECTED} == {"ABORT_DECIDING", "ABORTING",
                                           "EXCEPTION_DECIDING", "EXCEPTION"}
    assert {s.value for s in WRITING} == {"COMMIT_DECIDING", "ABORT_DECIDING",
                                          "EXCEPTION_DECIDING"}
    # an accept is stale when it saw fewer messages than were pushed to its server
    assert vote_is_stale(1, 2) and not vote_is_stale(2, 2) and not vote_is_stale(None, 2)
