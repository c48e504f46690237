"""A backup's copy of its primary, as the backup sees it (``server/ha/replica.py``).

Theory of operation
-------------------
A backup's :class:`~txbroker.server.ha.replica.Follower` is **joining** until the
primary welcomes it. A ``welcome`` with a dump replaces whatever copy it had (the
data directory is marked incomplete and emptied, a fresh store opens): it is
**copying** until every dump entry is durable and the primary said ``dumped``, then
the copy is whole (the marker goes) and it is **following**: it acknowledges every
entry durable here. A kept whole copy that joins again may be resumed (an
``incremental`` welcome): it stays following and acknowledges at once. The link
breaking ends the follower's run, not its state: a following copy is kept to resume.
A node restarted on a whole copy whose log says where it stands (``REPLICA_AT``) is
following too, from its own disk, and joins to resume it.

:data:`COPY_RULES` is the whole machine, :func:`copy_next` looks a pair up and
refuses a missing one (:class:`~txbroker.core.ha.IllegalTransition`).
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from txbroker.core.ha.transition import IllegalTransition

__all__ = ["COPY_RULES", "CopyAction", "CopyInput", "CopyState", "copy_next"]


class CopyState(Enum):
    """The states of a backup's copy (``ha status``: ``following.state``)."""

    JOINING = "joining"  #: no welcome yet
    COPYING = "copying"  #: a dump is arriving; the directory is marked incomplete
    FOLLOWING = "following"  #: the copy is whole; every durable entry is acknowledged


class CopyInput(Enum):
    """What happens to a backup's copy."""

    WELCOME_DUMP = "welcome with a dump"
    WELCOME_SUFFIX = "welcome resuming the kept copy (incremental)"
    COPY_WHOLE = "dumped, and every dump entry durable"
    ENTRY_DURABLE = "a streamed entry is durable here"
    COPY_ON_DISK = "a whole copy recovered from this node's disk, its position known"


class CopyAction(Enum):
    """What the backup's driver does for a transition."""

    REPLACE_COPY = "mark the directory incomplete, empty it, open a fresh store"
    KEEP_COPY = "go on from the kept copy (count the resume)"
    MARK_WHOLE = "remove the incomplete marker"
    ACK = "acknowledge the highest durable LSN"


S, E, A = CopyState, CopyInput, CopyAction

#: (state, input) -> (next state, actions). A missing pair is refused.
COPY_RULES: Final[dict[tuple[CopyState, CopyInput], tuple[CopyState, tuple[CopyAction, ...]]]] = {
    # Rule 1: a dump replaces any copy: a fresh one, or one this primary cannot resume, or
    # a second welcome on one link (the copy so far is not trusted).
    (S.JOINING, E.WELCOME_DUMP): (S.COPYING, (A.REPLACE_COPY,)),
    (S.COPYING, E.WELCOME_DUMP): (S.COPYING, (A.REPLACE_COPY,)),
    (S.FOLLOWING, E.WELCOME_DUMP): (S.COPYING, (A.REPLACE_COPY,)),
    # Rule 2: only a whole copy can be resumed; it acknowledges what it holds at once.
    # (Resuming a joining or copying one is the primary's protocol error.)
    (S.FOLLOWING, E.WELCOME_SUFFIX): (S.FOLLOWING, (A.KEEP_COPY, A.ACK)),
    # Rule 3: the dump is whole and durable: the marker goes, the dump's LSN is acked.
    (S.COPYING, E.COPY_WHOLE): (S.FOLLOWING, (A.MARK_WHOLE, A.ACK)),
    # Rule 4: "dumped" before any welcome, or again on a whole copy: nothing to do.
    (S.JOINING, E.COPY_WHOLE): (S.JOINING, ()),
    (S.FOLLOWING, E.COPY_WHOLE): (S.FOLLOWING, ()),
    # Rule 5: a whole copy acknowledges each durable entry; a partial one acknowledges
    # nothing (the primary must not count an incomplete copy).
    (S.FOLLOWING, E.ENTRY_DURABLE): (S.FOLLOWING, (A.ACK,)),
    (S.COPYING, E.ENTRY_DURABLE): (S.COPYING, ()),
    # Rule 6: a restarted node keeps the whole copy on its disk when its log says which
    # LSN it holds: following, to be resumed (nothing to acknowledge before a link).
    (S.JOINING, E.COPY_ON_DISK): (S.FOLLOWING, ()),
}


def copy_next(state: CopyState, event: CopyInput) -> tuple[CopyState, tuple[CopyAction, ...]]:
    """The next state and actions for ``event`` in ``state`` (IllegalTransition when the
    table has no such rule)."""
    try:
        return COPY_RULES[(state, event)]
    except KeyError:
        raise IllegalTransition("backup copy", state.value, event.value) from None
