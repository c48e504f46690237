"""The role of one broker of a replicated group (``server/ha/replicated.py``).

Theory of operation
-------------------
Every broker of a replicated group starts as a **backup**: it follows whichever
peer is the primary and refuses joins. Told to (``txbroker ha promote``, or it took
the etcd primary key) and with a whole copy, it is **promoting**: it finishes
recovery from the state it replayed, starts the replication hub and opens its client
listeners; then it is the **primary** and welcomes the other brokers' joins. A node
that closes is **stopped**. A primary that loses its etcd lease is *fenced*: it cuts
every client at once and stops (its role stays until it is stopped; ``ha status``
shows ``fenced``). Whether a backup's copy is whole enough to promote is the
driver's check (``ReplicatedNode.promotable``); whether its *role* allows it is this
table's.

:data:`ROLE_RULES` is the whole machine, :func:`role_next` looks a pair up and
refuses a missing one (:class:`~txbroker.core.ha.IllegalTransition`).
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from txbroker.core.ha.transition import IllegalTransition

__all__ = ["ROLE_RULES", "NodeRole", "RoleAction", "RoleInput", "role_next"]


class NodeRole(Enum):
    """The roles of a replicated broker (``ha status``: ``role``)."""

    BACKUP = "backup"  #: follows the primary, refuses clients (Standby) and joins
    PROMOTING = "promoting"  #: finishing recovery, starting the hub and the listeners
    PRIMARY = "primary"  #: serves clients, replicates every entry to its backups
    STOPPED = "stopped"  #: closed


class RoleInput(Enum):
    """What happens to a replicated broker."""

    PROMOTE = "promotion (ha promote, or the etcd key taken)"
    SERVING = "hub started and listeners open"
    JOIN = "a backup's join on the HA port"
    LEASE_LOST = "the etcd primary key's lease is lost"
    SUPERSEDED = "a backup holds a newer term: another primary was promoted"
    STOP = "stop requested (SIGTERM, SIGINT)"
    CLOSED = "everything closed"


class RoleAction(Enum):
    """What the node's driver does for a transition."""

    PROMOTE = "finish recovery from the copy (or the own store), start the hub, listen"
    ANNOUNCE = "tell the caller the role (the ready line)"
    SERVE_BACKUP = "welcome the join: the hub serves the backup's link"
    REFUSE_JOIN = "refuse the join: this broker is not the primary"
    FENCE = "cut every client connection at once and stop"
    STOP = "stop serving (a primary shuts down, a backup stops following)"


R, E, A = NodeRole, RoleInput, RoleAction

#: (role, input) -> (next role, actions). A missing pair is refused.
ROLE_RULES: Final[dict[tuple[NodeRole, RoleInput], tuple[NodeRole, tuple[RoleAction, ...]]]] = {
    # Rule 1: only a backup is promoted (ha promote of anything else is refused); every
    # role change is announced (the caller's on_role).
    (R.BACKUP, E.PROMOTE): (R.PROMOTING, (A.ANNOUNCE, A.PROMOTE)),
    # Rule 2: listeners open and the hub running: the primary, announced.
    (R.PROMOTING, E.SERVING): (R.PRIMARY, (A.ANNOUNCE,)),
    # Rule 3: the primary takes joins, and so does a node being promoted (once its hub
    # runs: a new primary's first ready-set record reaches a majority through its
    # backups' joins before it opens its client ports, core/ha/promotion.py); a backup
    # or a stopped node refuses them (the backup looks for the primary elsewhere).
    (R.PRIMARY, E.JOIN): (R.PRIMARY, (A.SERVE_BACKUP,)),
    (R.BACKUP, E.JOIN): (R.BACKUP, (A.REFUSE_JOIN,)),
    (R.PROMOTING, E.JOIN): (R.PROMOTING, (A.SERVE_BACKUP,)),
    (R.STOPPED, E.JOIN): (R.STOPPED, (A.REFUSE_JOIN,)),
    # Rule 4: the lease is lost: no more replies to anybody, then stop (before another
    # broker can take the key). The role stays until the node is stopped.
    (R.BACKUP, E.LEASE_LOST): (R.BACKUP, (A.FENCE,)),
    (R.PROMOTING, E.LEASE_LOST): (R.PROMOTING, (A.FENCE,)),
    (R.PRIMARY, E.LEASE_LOST): (R.PRIMARY, (A.FENCE,)),
    (R.STOPPED, E.LEASE_LOST): (R.STOPPED, ()),
    # Rule 4b: superseded (a backup refused our ready-set record: it holds a newer
    # term, core/ha/promotion.py): only a primary hears it; the same fencing.
    (R.PRIMARY, E.SUPERSEDED): (R.PRIMARY, (A.FENCE,)),
    (R.PROMOTING, E.SUPERSEDED): (R.PROMOTING, (A.FENCE,)),
    (R.BACKUP, E.SUPERSEDED): (R.BACKUP, ()),
    (R.STOPPED, E.SUPERSEDED): (R.STOPPED, ()),
    # Rule 5: a stop request stops every role (the role changes once closed, rule 6).
    (R.BACKUP, E.STOP): (R.BACKUP, (A.STOP,)),
    (R.PROMOTING, E.STOP): (R.PROMOTING, (A.STOP,)),
    (R.PRIMARY, E.STOP): (R.PRIMARY, (A.STOP,)),
    (R.STOPPED, E.STOP): (R.STOPPED, ()),
    # Rule 6: closed, from any role.
    (R.BACKUP, E.CLOSED): (R.STOPPED, (A.ANNOUNCE,)),
    (R.PROMOTING, E.CLOSED): (R.STOPPED, (A.ANNOUNCE,)),
    (R.PRIMARY, E.CLOSED): (R.STOPPED, (A.ANNOUNCE,)),
    (R.STOPPED, E.CLOSED): (R.STOPPED, ()),
}


def role_next(role: NodeRole, event: RoleInput) -> tuple[NodeRole, tuple[RoleAction, ...]]:
    """The next role and actions for ``event`` in ``role`` (IllegalTransition when the
    table has no such rule)."""
    try:
        return ROLE_RULES[(role, event)]
    except KeyError:
        raise IllegalTransition("replicated node", role.value, event.value) from None
