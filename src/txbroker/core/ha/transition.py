"""The one error of the HA tables: a pair a table has no rule for.

Theory of operation
-------------------
Each HA machine (``backup_link``, ``follower``, ``replicated_role``,
``shared_store_role``) is a table ``(state, input) -> (next state, actions)``. A pair
missing from a table is not silently ignored: its ``*_next`` function raises
:class:`IllegalTransition`, naming the machine, the state and the input. An
operator's request that the state does not allow (``ha promote`` of a primary) reaches
the client as this error (an :class:`~txbroker.errors.IllegalState`).
"""

from __future__ import annotations

from txbroker.errors import IllegalState

__all__ = ["IllegalTransition"]


class IllegalTransition(IllegalState):
    """``machine`` in ``state`` has no rule for ``event``."""

    def __init__(self, machine: str, state: str, event: str) -> None:
        super().__init__(f"{machine}: no rule for {event!r} in state {state!r}")
        self.machine = machine
        self.state = state
        self.event = event
