"""The role of one broker of a shared-store pair (``server/ha/shared_store.py``).

Theory of operation
-------------------
Both brokers of a pair start **starting** and try the store's lock, which *is* the
HA lock. The lock held by the other broker: **standby** (its native port refuses
clients with ``Standby``; it follows the active's heartbeats and tries the lock again
on detection). The lock taken: **activating** (the refuser closes, the store
recovers), then **active** once its listeners are open. Only an activating or active
broker takes a standby's hello on its HA port; the others refuse it for now (the
peer retries). A node that closes is **stopped**. The heartbeats never move a role:
only the lock does.

:data:`STORE_ROLE_RULES` is the whole machine, :func:`store_role_next` looks a pair
up and refuses a missing one (:class:`~txbroker.core.ha.IllegalTransition`).
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from txbroker.core.ha.transition import IllegalTransition

__all__ = ["STORE_ROLE_RULES", "StoreRole", "StoreRoleAction", "StoreRoleInput",
           "store_role_next"]


class StoreRole(Enum):
    """The roles of a shared-store broker (``stats()["ha"]["role"]``)."""

    STARTING = "starting"  #: has not tried the lock yet
    STANDBY = "standby"  #: the other broker holds the lock: follow it, serve nobody
    ACTIVATING = "activating"  #: holds the lock, recovering the store
    ACTIVE = "active"  #: holds the lock, serves clients, heartbeats to the standby
    STOPPED = "stopped"  #: closed


class StoreRoleInput(Enum):
    """What happens to a shared-store broker."""

    LOCK_BUSY = "the store's lock is held by the other broker"
    LOCK_TAKEN = "the store's lock is ours"
    SERVING = "recovered, listeners open"
    STANDBY_HELLO = "a standby's hello on the HA port"
    CLOSED = "everything closed"


class StoreRoleAction(Enum):
    """What the node's driver does for a transition."""

    OPEN_REFUSER = "the native port answers Standby"
    FOLLOW = "follow the active's heartbeats until detection"
    CLOSE_REFUSER = "the native port stops refusing (the listeners take it)"
    ACTIVATE = "re-read the configuration, recover the store, open the listeners"
    ANNOUNCE = "tell the caller the role (the standby line, the ready line)"
    CHECK_STANDBY = "take the hello's sender as standby unless another is attached or the "\
                    "lock files differ"
    REFUSE_FOR_NOW = "refuse the hello; the peer retries"


R, E, A = StoreRole, StoreRoleInput, StoreRoleAction

#: (role, input) -> (next role, actions). A missing pair is refused.
STORE_ROLE_RULES: Final[dict[tuple[StoreRole, StoreRoleInput],
                             tuple[StoreRole, tuple[StoreRoleAction, ...]]]] = {
    # Rule 1: the lock is held by the other broker: standby, its port refusing clients.
    (R.STARTING, E.LOCK_BUSY): (R.STANDBY, (A.OPEN_REFUSER, A.ANNOUNCE, A.FOLLOW)),
    # Rule 2: still held after a detection or a failed follow: follow again.
    (R.STANDBY, E.LOCK_BUSY): (R.STANDBY, (A.FOLLOW,)),
    # Rule 3: the lock decides: whoever holds it activates (at start, or a takeover).
    (R.STARTING, E.LOCK_TAKEN): (R.ACTIVATING, (A.ANNOUNCE, A.ACTIVATE)),
    (R.STANDBY, E.LOCK_TAKEN): (R.ACTIVATING, (A.CLOSE_REFUSER, A.ANNOUNCE, A.ACTIVATE)),
    # Rule 4: recovered and listening: active, announced.
    (R.ACTIVATING, E.SERVING): (R.ACTIVE, (A.ANNOUNCE,)),
    # Rule 5: a holder of the lock takes a standby (checked: one standby, one directory).
    (R.ACTIVATING, E.STANDBY_HELLO): (R.ACTIVATING, (A.CHECK_STANDBY,)),
    (R.ACTIVE, E.STANDBY_HELLO): (R.ACTIVE, (A.CHECK_STANDBY,)),
    # Rule 6: a node without the lock refuses a standby for now (retry: roles may change).
    (R.STARTING, E.STANDBY_HELLO): (R.STARTING, (A.REFUSE_FOR_NOW,)),
    (R.STANDBY, E.STANDBY_HELLO): (R.STANDBY, (A.REFUSE_FOR_NOW,)),
    (R.STOPPED, E.STANDBY_HELLO): (R.STOPPED, (A.REFUSE_FOR_NOW,)),
    # Rule 7: closed, from any role.
    (R.STARTING, E.CLOSED): (R.STOPPED, (A.ANNOUNCE,)),
    (R.STANDBY, E.CLOSED): (R.STOPPED, (A.ANNOUNCE,)),
    (R.ACTIVATING, E.CLOSED): (R.STOPPED, (A.ANNOUNCE,)),
    (R.ACTIVE, E.CLOSED): (R.STOPPED, (A.ANNOUNCE,)),
    (R.STOPPED, E.CLOSED): (R.STOPPED, ()),
}


def store_role_next(role: StoreRole, event: StoreRoleInput
                    ) -> tuple[StoreRole, tuple[StoreRoleAction, ...]]:
    """The next role and actions for ``event`` in ``role`` (IllegalTransition when the
    table has no such rule)."""
    try:
        return STORE_ROLE_RULES[(role, event)]
    except KeyError:
        raise IllegalTransition("shared-store node", role.value, event.value) from None
