"""The HA tables (``core/ha/``) against independent expected tables (issue 26 §2).

Written out by hand from what the drivers did before the tables existed
(``server/ha/replication.py``, ``replica.py``, ``replicated.py``, ``shared_store.py``)
and from docs/replication.md and docs/ha.md, not copied from the tables: a row added
to, removed from or changed in a table fails here until the expected table says why.
Every (state, input) pair is checked: an expected one gives exactly its next state
and actions, any other is refused with IllegalTransition.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import pytest

from txbroker.core.ha.backup_link import (
    LINK_RULES,
    READY_LAG,
    WAITED_FOR,
    LinkInput,
    LinkState,
    ack_input,
    link_next,
)
from txbroker.core.ha.follower import COPY_RULES, CopyInput, CopyState, copy_next
from txbroker.core.ha.replicated_role import ROLE_RULES, NodeRole, RoleInput, role_next
from txbroker.core.ha.shared_store_role import (
    STORE_ROLE_RULES,
    StoreRole,
    StoreRoleInput,
    store_role_next,
)
from txbroker.core.ha.transition import IllegalTransition
from txbroker.errors import IllegalState

Expected = dict[tuple[str, str], tuple[str, tuple[str, ...]]]

_DROP_NOW = ("CLOSE_LINK", "FORGET", "COMPLETE")

#: The primary's view of a backup's link: (state, input) -> (state after, actions).
EXPECTED_LINK: Expected = {
    ("joining", "RESUME"): ("catching-up", ("SEND_SUFFIX",)),
    ("joining", "DUMP_TAKEN"): ("dumping", ("SEND_DUMP",)),
    ("dropped", "DUMP_TAKEN"): ("dropped", ()),  # dropped while waiting for quiet
    ("dumping", "DUMP_SENT"): ("catching-up", ("SEND_BACKLOG",)),
    ("dropped", "DUMP_SENT"): ("dropped", ()),
    ("joining", "ENTRY"): ("joining", ()),  # the dump (or the suffix) carries it
    ("dumping", "ENTRY"): ("dumping", ("QUEUE_ENTRY",)),
    ("catching-up", "ENTRY"): ("catching-up", ("SEND_ENTRY",)),
    ("ready", "ENTRY"): ("ready", ("SEND_ENTRY",)),
    ("demoting", "ENTRY"): ("demoting", ("SEND_ENTRY",)),  # its link is still open
    ("leaving", "ENTRY"): ("leaving", ()),  # its link is closed
    ("dropped", "ENTRY"): ("dropped", ()),
    ("joining", "HEARTBEAT"): ("joining", ("SEND_HEARTBEAT",)),
    ("dumping", "HEARTBEAT"): ("dumping", ("SEND_HEARTBEAT",)),
    ("catching-up", "HEARTBEAT"): ("catching-up", ("SEND_HEARTBEAT",)),
    ("ready", "HEARTBEAT"): ("ready", ("SEND_HEARTBEAT",)),
    ("demoting", "HEARTBEAT"): ("demoting", ("SEND_HEARTBEAT",)),
    ("leaving", "HEARTBEAT"): ("leaving", ()),
    ("dropped", "HEARTBEAT"): ("dropped", ()),
    ("catching-up", "ACK_WITHIN_LAG"): ("ready", ("SEND_READY", "RECORD_GROWN_SET",
                                                  "COMPLETE")),
    ("joining", "ACK_WITHIN_LAG"): ("joining", ("COMPLETE",)),
    ("dumping", "ACK_WITHIN_LAG"): ("dumping", ("COMPLETE",)),
    ("ready", "ACK_WITHIN_LAG"): ("ready", ("COMPLETE",)),
    ("leaving", "ACK_WITHIN_LAG"): ("leaving", ("COMPLETE",)),
    ("demoting", "ACK_WITHIN_LAG"): ("demoting", ("COMPLETE",)),  # no way back but catching up
    ("dropped", "ACK_WITHIN_LAG"): ("dropped", ("COMPLETE",)),
    ("joining", "ACK_BEHIND"): ("joining", ("COMPLETE",)),
    ("dumping", "ACK_BEHIND"): ("dumping", ("COMPLETE",)),
    ("catching-up", "ACK_BEHIND"): ("catching-up", ("COMPLETE",)),
    ("ready", "ACK_BEHIND"): ("ready", ("COMPLETE",)),
    ("leaving", "ACK_BEHIND"): ("leaving", ("COMPLETE",)),
    ("demoting", "ACK_BEHIND"): ("demoting", ("COMPLETE",)),
    ("dropped", "ACK_BEHIND"): ("dropped", ("COMPLETE",)),
    ("ready", "LATE"): ("demoting", ("RECORD_SHRUNK_SET",)),
    ("leaving", "LATE"): ("leaving", ()),
    ("demoting", "LATE"): ("demoting", ()),
    ("demoting", "READY_SET_RECORDED"): ("catching-up", ("SEND_NOT_READY", "COMPLETE")),
    ("leaving", "READY_SET_RECORDED"): ("dropped", ("FORGET", "COMPLETE")),
    ("joining", "DROP"): ("dropped", _DROP_NOW),
    ("dumping", "DROP"): ("dropped", _DROP_NOW),
    ("catching-up", "DROP"): ("dropped", _DROP_NOW),
    ("ready", "DROP"): ("leaving", ("CLOSE_LINK", "RECORD_SHRUNK_SET")),
    ("demoting", "DROP"): ("leaving", ("CLOSE_LINK",)),  # its recording is under way
    ("leaving", "DROP"): ("leaving", ()),
    ("dropped", "DROP"): ("dropped", ()),
}

#: A backup's copy: (state, input) -> (state after, actions).
EXPECTED_COPY: Expected = {
    ("joining", "WELCOME_DUMP"): ("copying", ("REPLACE_COPY",)),
    ("copying", "WELCOME_DUMP"): ("copying", ("REPLACE_COPY",)),
    ("following", "WELCOME_DUMP"): ("copying", ("REPLACE_COPY",)),  # not resumable
    ("following", "WELCOME_SUFFIX"): ("following", ("KEEP_COPY", "ACK")),
    ("copying", "COPY_WHOLE"): ("following", ("MARK_WHOLE", "ACK")),
    ("joining", "COPY_WHOLE"): ("joining", ()),
    ("following", "COPY_WHOLE"): ("following", ()),
    ("following", "ENTRY_DURABLE"): ("following", ("ACK",)),
    ("copying", "ENTRY_DURABLE"): ("copying", ()),  # an incomplete copy acks nothing
    ("joining", "COPY_ON_DISK"): ("following", ()),  # a restart on a whole, positioned copy
}

#: A replicated broker's role: (role, input) -> (role after, actions).
EXPECTED_ROLE: Expected = {
    ("backup", "PROMOTE"): ("promoting", ("ANNOUNCE", "PROMOTE")),
    ("promoting", "SERVING"): ("primary", ("ANNOUNCE",)),
    ("primary", "JOIN"): ("primary", ("SERVE_BACKUP",)),
    ("backup", "JOIN"): ("backup", ("REFUSE_JOIN",)),
    ("promoting", "JOIN"): ("promoting", ("SERVE_BACKUP",)),  # its first record
    ("stopped", "JOIN"): ("stopped", ("REFUSE_JOIN",)),
    ("backup", "LEASE_LOST"): ("backup", ("FENCE",)),
    ("promoting", "LEASE_LOST"): ("promoting", ("FENCE",)),
    ("primary", "LEASE_LOST"): ("primary", ("FENCE",)),
    ("stopped", "LEASE_LOST"): ("stopped", ()),
    # superseded (a backup holds a newer term): a primary, or one on its way, fences
    ("backup", "SUPERSEDED"): ("backup", ()),
    ("promoting", "SUPERSEDED"): ("promoting", ("FENCE",)),
    ("primary", "SUPERSEDED"): ("primary", ("FENCE",)),
    ("stopped", "SUPERSEDED"): ("stopped", ()),
    ("backup", "STOP"): ("backup", ("STOP",)),
    ("promoting", "STOP"): ("promoting", ("STOP",)),
    ("primary", "STOP"): ("primary", ("STOP",)),
    ("stopped", "STOP"): ("stopped", ()),
    ("backup", "CLOSED"): ("stopped", ("ANNOUNCE",)),
    ("promoting", "CLOSED"): ("stopped", ("ANNOUNCE",)),
    ("primary", "CLOSED"): ("stopped", ("ANNOUNCE",)),
    ("stopped", "CLOSED"): ("stopped", ()),
}

#: A shared-store broker's role: (role, input) -> (role after, actions).
EXPECTED_STORE_ROLE: Expected = {
    ("starting", "LOCK_BUSY"): ("standby", ("OPEN_REFUSER", "ANNOUNCE", "FOLLOW")),
    ("standby", "LOCK_BUSY"): ("standby", ("FOLLOW",)),
    ("starting", "LOCK_TAKEN"): ("activating", ("ANNOUNCE", "ACTIVATE")),
    ("standby", "LOCK_TAKEN"): ("activating", ("CLOSE_REFUSER", "ANNOUNCE",
                                                    "ACTIVATE")),
    ("activating", "SERVING"): ("active", ("ANNOUNCE",)),
    ("activating", "STANDBY_HELLO"): ("activating", ("CHECK_STANDBY",)),
    ("active", "STANDBY_HELLO"): ("active", ("CHECK_STANDBY",)),
    ("starting", "STANDBY_HELLO"): ("starting", ("REFUSE_FOR_NOW",)),
    ("standby", "STANDBY_HELLO"): ("standby", ("REFUSE_FOR_NOW",)),
    ("stopped", "STANDBY_HELLO"): ("stopped", ("REFUSE_FOR_NOW",)),
    ("starting", "CLOSED"): ("stopped", ("ANNOUNCE",)),
    ("standby", "CLOSED"): ("stopped", ("ANNOUNCE",)),
    ("activating", "CLOSED"): ("stopped", ("ANNOUNCE",)),
    ("active", "CLOSED"): ("stopped", ("ANNOUNCE",)),
    ("stopped", "CLOSED"): ("stopped", ()),
}

Step = Callable[[Any, Any], tuple[Enum, tuple[Enum, ...]]]
MACHINES: list[tuple[str, type[Enum], type[Enum], Step, dict[Any, Any], Expected]] = [
    ("link", LinkState, LinkInput, link_next, LINK_RULES, EXPECTED_LINK),
    ("copy", CopyState, CopyInput, copy_next, COPY_RULES, EXPECTED_COPY),
    ("role", NodeRole, RoleInput, role_next, ROLE_RULES, EXPECTED_ROLE),
    ("store-role", StoreRole, StoreRoleInput, store_role_next, STORE_ROLE_RULES,
     EXPECTED_STORE_ROLE),
]
PAIRS = [(machine, state, event) for machine in MACHINES for state in machine[1]
         for event in machine[2]]


@pytest.mark.parametrize("machine", MACHINES, ids=[m[0] for m in MACHINES])
def test_expected_table_names_real_states_inputs_and_actions(machine: Any) -> None:
    _, states, inputs, _, rules, expected = machine
    names = {(s.value, i.name) for s in states for i in inputs}
    assert set(expected) <= names
    assert {after for after, _ in expected.values()} <= {s.value for s in states}
    actions = {a.name for _, acts in rules.values() for a in acts}
    assert {a for _, acts in expected.values() for a in acts} <= actions


@pytest.mark.parametrize(("machine", "state", "event"), PAIRS,
                         ids=[f"{m[0]}-{s.value}-{e.name}" for m, s, e in PAIRS])
def test_table_answers_every_state_and_input(machine: Any, state: Enum, event: Enum) -> None:
    _, _, _, step, _, expected = machine
    want = expected.get((state.value, event.name))
    if want is not None:
        after, actions = step(state, event)
        assert (after.value, tuple(a.name for a in actions)) == want
    else:
        with pytest.raises(IllegalTransition) as info:
            step(state, event)
        assert info.value.state == state.value and info.value.event == event.value
        assert isinstance(info.value, IllegalState)  # an operator sees IllegalState
        assert repr(state.value) in str(info.value) and repr(event.value) in str(info.value)


@pytest.mark.parametrize("machine", MACHINES, ids=[m[0] for m in MACHINES])
def test_table_has_no_rule_the_expected_table_lacks(machine: Any) -> None:
    """A row added to a table in core/ha/ must be added here too (with a reason)."""
    _, _, _, _, rules, expected = machine
    assert {(s.value, i.name) for s, i in rules} == set(expected)


def test_entries_wait_for_ready_backups_and_those_on_their_way_out() -> None:
    assert {s.value for s in WAITED_FOR} == {"ready", "leaving", "demoting"}


def test_an_ack_within_the_lag_is_one_input_and_further_behind_another() -> None:
    assert READY_LAG == 64
    assert ack_input(1000, 1000 - 64) is LinkInput.ACK_WITHIN_LAG
    assert ack_input(1000, 1000 - 65) is LinkInput.ACK_BEHIND
    assert ack_input(5, 5) is LinkInput.ACK_WITHIN_LAG


def test_a_backup_dropped_while_demoting_is_dropped_once_recorded() -> None:
    """Walk: ready -> late -> (link breaks) -> recorded -> dropped, never catching-up."""
    state = LinkState.READY
    for event, want in [(LinkInput.LATE, "demoting"), (LinkInput.DROP, "leaving"),
                        (LinkInput.READY_SET_RECORDED, "dropped")]:
        state, _ = link_next(state, event)
        assert state.value == want
