"""The router's two state tables against an independent reading of seed 000
(issue 26): written from the seed's tables 4-4 to 4-6 and docs/router.md, not
copied from core/router_states.py. A row added to, removed from or changed in the
engine's tables fails here until the expected table says why."""

from __future__ import annotations

import pytest

from txbroker.core.router_states import (
    PART_RULES,
    TX_RULES,
    PartEvent,
    PartState,
    TxEvent,
    TxState,
    part_next,
    tx_next,
)
from txbroker.errors import IllegalState

#: (router state, event) -> next state. Absent pairs are refused (IllegalState).
EXPECTED_TX: dict[tuple[str, str], str] = {
    ("SENDING", "send a message"): "SENDING",  # messages until accept or reject
    ("SENDING", "accept"): "VREQ",  # the client accepts: ask for the votes
    ("SENDING", "reject"): "ABORTING",  # the client may reject before it accepted
    ("SENDING", "server reject"): "ABORTING",  # a server may reject before voting
    ("VREQ", "server reject"): "ABORTING",
    ("COMMITTING", "server reject"): "COMMITTING",  # too late: nothing changes
    ("ABORTING", "server reject"): "ABORTING",
    ("VREQ", "all voted accept"): "COMMITTING",
    ("SENDING", "strike out"): "ABORTING",  # three strikes: SRVDIED, exception
    ("VREQ", "strike out"): "ABORTING",
    ("VREQ", "vote timeout"): "ABORTING",
    ("SENDING", "client lost"): "ABORTING",  # a client that leaves before accepting
    ("VREQ", "client lost"): "VREQ",  # accepted: "the result cannot be changed"
    ("COMMITTING", "client lost"): "COMMITTING",
    ("ABORTING", "client lost"): "ABORTING",
    ("ABORTING", "operator commit"): "COMMITTING",  # an exception committed by hand
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
}


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
    else:
        assert part_next(state, event).value == expected
