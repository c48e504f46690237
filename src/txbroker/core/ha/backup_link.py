"""A backup's link as its primary sees it (replicated HA, ``server/ha/replication.py``).

Theory of operation
-------------------
A backup that connects to the primary's HA port is **joining**. It either
resumes from the copy it kept (``join`` names this primary's epoch and an LSN the
catch-up buffer still covers: the primary sends the missing suffix and the link is
**catching-up** at once), or gets a dump: once the broker is quiet the primary
describes its state at one LSN (**dumping**: entries appended meanwhile queue behind
the dump) and streams it; after the dump the queued entries follow and the link is
**catching-up**. An acknowledgement within :data:`READY_LAG` entries of the newest
makes it **ready**: from then on every entry waits for its acknowledgement.

A ready backup leaves the ready set in two ways, both through a recorded smaller
ready set (etcd, ``on_ready_change``: a whole-group restart must never promote a
copy that missed acknowledged entries) during which entries still wait for it:
dropped (its link closed, broke, was too slow to drain, or it voted fail) it is
**leaving** and then **dropped**; late (an entry unacknowledged for
``backup_timeout``) it is **demoting** and then catching-up again, not waited for.
Without a recorder the driver feeds :attr:`LinkInput.READY_SET_RECORDED` at once.

The table :data:`LINK_RULES` is the whole machine: ``(state, input) -> (next state,
actions)``; :func:`link_next` looks a pair up and refuses a missing one
(:class:`~txbroker.core.ha.IllegalTransition`). The driver does the I/O each action
names and nothing else decides a link's state. Which states entries wait for, and
when an acknowledgement is within the lag, are the two named rules below the table.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from txbroker.core.ha.transition import IllegalTransition

__all__ = ["LINK_RULES", "READY_LAG", "WAITED_FOR", "LinkAction", "LinkInput", "LinkState",
           "ack_input", "link_next"]

#: A catching-up backup within this many entries of the newest is ready (seed 001 waits
#: for "ready" backups only; 64 entries is a few group commits at full load).
READY_LAG: Final = 64


class LinkState(Enum):
    """The states of one backup's link on the primary (``ha status``: ``state``)."""

    JOINING = "joining"  #: connected; neither resumed nor dumped yet
    DUMPING = "dumping"  #: its dump streams; new entries queue behind it
    CATCHING_UP = "catching-up"  #: it has a whole copy; entries do not wait for it
    READY = "ready"  #: within the lag: every entry waits for its acknowledgement
    LEAVING = "leaving"  #: dropped while ready: waited for until the smaller set is recorded
    DEMOTING = "demoting"  #: late while ready: waited for until the smaller set is recorded
    DROPPED = "dropped"  #: gone (it joins again with a fresh link)

    #: Members are singletons: hash by identity, in C (Enum's own hashes the name in
    #: Python, and the hub looks a state up for every backup on every entry).
    __hash__ = object.__hash__


class LinkInput(Enum):
    """What happens to a backup's link (the driver feeds these)."""

    RESUME = "resume from the catch-up buffer"
    DUMP_TAKEN = "dump described at a quiet moment"
    DUMP_SENT = "every dump frame written"
    ENTRY = "a new entry is appended"
    HEARTBEAT = "heartbeat period"
    ACK_WITHIN_LAG = "acknowledgement within READY_LAG of the newest"
    ACK_BEHIND = "acknowledgement further behind"
    LATE = "an entry unacknowledged for backup_timeout"
    DROP = "link closed, broken, over its queue bound, or a fail vote"
    READY_SET_RECORDED = "the smaller ready set is recorded"

    #: Hash by identity (see :class:`LinkState`).
    __hash__ = object.__hash__


class LinkAction(Enum):
    """What the driver does for a transition."""

    SEND_SUFFIX = "send the welcome and the buffered entries after its LSN"
    SEND_DUMP = "stream the dump"
    SEND_BACKLOG = "send the entries queued behind the dump, acks count from zero"
    SEND_ENTRY = "write the entry's frame"
    QUEUE_ENTRY = "queue the entry's frame behind the dump"
    SEND_HEARTBEAT = "write a heartbeat"
    SEND_READY = "tell the backup it is ready (state frame)"
    SEND_NOT_READY = "tell the backup it is no longer ready (state frame)"
    RECORD_GROWN_SET = "record the bigger ready set (best effort)"
    RECORD_SHRUNK_SET = "record the smaller ready set; READY_SET_RECORDED when done"
    CLOSE_LINK = "log the drop and close the link"
    FORGET = "remove the backup from the hub"
    COMPLETE = "complete the entries nobody waits for any more"


S, E, A = LinkState, LinkInput, LinkAction
#: Transitions with no action.
_NONE: Final[tuple[LinkAction, ...]] = ()

#: (state, input) -> (next state, actions). A missing pair is refused.
LINK_RULES: Final[dict[tuple[LinkState, LinkInput], tuple[LinkState, tuple[LinkAction, ...]]]] = {
    # Rule 1: a joining backup whose copy this primary can resume gets the suffix, no dump.
    (S.JOINING, E.RESUME): (S.CATCHING_UP, (A.SEND_SUFFIX,)),
    # Rule 2: otherwise the state is described at a quiet moment and streamed.
    (S.JOINING, E.DUMP_TAKEN): (S.DUMPING, (A.SEND_DUMP,)),
    # Rule 3: dropped while the broker became quiet: no dump for a gone link.
    (S.DROPPED, E.DUMP_TAKEN): (S.DROPPED, _NONE),
    # Rule 4: the dump is written: the entries queued behind it follow; acks from now on.
    (S.DUMPING, E.DUMP_SENT): (S.CATCHING_UP, (A.SEND_BACKLOG,)),
    # Rule 5: dropped while its dump streamed: nothing more is sent.
    (S.DROPPED, E.DUMP_SENT): (S.DROPPED, _NONE),
    # Rule 6: an entry appended while joining is in the dump (described after it) or in
    # the catch-up buffer (a resume): not sent on its own.
    (S.JOINING, E.ENTRY): (S.JOINING, _NONE),
    # Rule 7: an entry appended while the dump streams waits behind it.
    (S.DUMPING, E.ENTRY): (S.DUMPING, (A.QUEUE_ENTRY,)),
    # Rule 8: a whole copy gets every new entry as it is appended.
    (S.CATCHING_UP, E.ENTRY): (S.CATCHING_UP, (A.SEND_ENTRY,)),
    (S.READY, E.ENTRY): (S.READY, (A.SEND_ENTRY,)),
    (S.DEMOTING, E.ENTRY): (S.DEMOTING, (A.SEND_ENTRY,)),
    # Rule 9: a closed link gets nothing.
    (S.LEAVING, E.ENTRY): (S.LEAVING, _NONE),
    (S.DROPPED, E.ENTRY): (S.DROPPED, _NONE),
    # Rule 10: every open link hears the heartbeat, a joining one too (a peer that says
    # nothing is not a primary).
    (S.JOINING, E.HEARTBEAT): (S.JOINING, (A.SEND_HEARTBEAT,)),
    (S.DUMPING, E.HEARTBEAT): (S.DUMPING, (A.SEND_HEARTBEAT,)),
    (S.CATCHING_UP, E.HEARTBEAT): (S.CATCHING_UP, (A.SEND_HEARTBEAT,)),
    (S.READY, E.HEARTBEAT): (S.READY, (A.SEND_HEARTBEAT,)),
    (S.DEMOTING, E.HEARTBEAT): (S.DEMOTING, (A.SEND_HEARTBEAT,)),
    (S.LEAVING, E.HEARTBEAT): (S.LEAVING, _NONE),
    (S.DROPPED, E.HEARTBEAT): (S.DROPPED, _NONE),
    # Rule 11: a catching-up backup within the lag is ready: told so, the bigger ready set
    # recorded, and the entries it acknowledged may complete.
    (S.CATCHING_UP, E.ACK_WITHIN_LAG): (
        S.READY, (A.SEND_READY, A.RECORD_GROWN_SET, A.COMPLETE)),
    # Rule 12: any other acknowledgement only moves its position: entries it was the last
    # to acknowledge complete (a backup on its way out still counts until recorded).
    (S.JOINING, E.ACK_WITHIN_LAG): (S.JOINING, (A.COMPLETE,)),
    (S.DUMPING, E.ACK_WITHIN_LAG): (S.DUMPING, (A.COMPLETE,)),
    (S.READY, E.ACK_WITHIN_LAG): (S.READY, (A.COMPLETE,)),
    (S.LEAVING, E.ACK_WITHIN_LAG): (S.LEAVING, (A.COMPLETE,)),
    (S.DEMOTING, E.ACK_WITHIN_LAG): (S.DEMOTING, (A.COMPLETE,)),
    (S.DROPPED, E.ACK_WITHIN_LAG): (S.DROPPED, (A.COMPLETE,)),
    (S.JOINING, E.ACK_BEHIND): (S.JOINING, (A.COMPLETE,)),
    (S.DUMPING, E.ACK_BEHIND): (S.DUMPING, (A.COMPLETE,)),
    (S.CATCHING_UP, E.ACK_BEHIND): (S.CATCHING_UP, (A.COMPLETE,)),
    (S.READY, E.ACK_BEHIND): (S.READY, (A.COMPLETE,)),
    (S.LEAVING, E.ACK_BEHIND): (S.LEAVING, (A.COMPLETE,)),
    (S.DEMOTING, E.ACK_BEHIND): (S.DEMOTING, (A.COMPLETE,)),
    (S.DROPPED, E.ACK_BEHIND): (S.DROPPED, (A.COMPLETE,)),
    # Rule 13: a ready backup that left an entry unacknowledged for backup_timeout leaves
    # the ready set; entries wait for it until the smaller set is recorded.
    (S.READY, E.LATE): (S.DEMOTING, (A.RECORD_SHRUNK_SET,)),
    # Rule 14: lateness of a backup already on its way out changes nothing.
    (S.LEAVING, E.LATE): (S.LEAVING, _NONE),
    (S.DEMOTING, E.LATE): (S.DEMOTING, _NONE),
    # Rule 15: the smaller set is recorded: a late backup catches up without being waited
    # for (told so); a dropped one is gone. Either way waiting entries may complete.
    (S.DEMOTING, E.READY_SET_RECORDED): (S.CATCHING_UP, (A.SEND_NOT_READY, A.COMPLETE)),
    (S.LEAVING, E.READY_SET_RECORDED): (S.DROPPED, (A.FORGET, A.COMPLETE)),
    # Rule 16: a backup nobody waits for is dropped at once: its link closed, forgotten,
    # and entries that waited for nothing else complete.
    (S.JOINING, E.DROP): (S.DROPPED, (A.CLOSE_LINK, A.FORGET, A.COMPLETE)),
    (S.DUMPING, E.DROP): (S.DROPPED, (A.CLOSE_LINK, A.FORGET, A.COMPLETE)),
    (S.CATCHING_UP, E.DROP): (S.DROPPED, (A.CLOSE_LINK, A.FORGET, A.COMPLETE)),
    # Rule 17: a ready backup is dropped through the recorded smaller set (rule 15).
    (S.READY, E.DROP): (S.LEAVING, (A.CLOSE_LINK, A.RECORD_SHRUNK_SET)),
    # Rule 18: a demoting backup whose link ends is dropped once its recording is done
    # (the recording under way already leaves it out).
    (S.DEMOTING, E.DROP): (S.LEAVING, (A.CLOSE_LINK,)),
    # Rule 19: dropping a backup on its way out, or gone, changes nothing.
    (S.LEAVING, E.DROP): (S.LEAVING, _NONE),
    (S.DROPPED, E.DROP): (S.DROPPED, _NONE),
}

#: The states whose acknowledgements entries wait for: ready, and on the way out of the
#: ready set until the smaller set is recorded (rules 13, 15, 17).
WAITED_FOR: Final = frozenset({S.READY, S.LEAVING, S.DEMOTING})


def link_next(state: LinkState, event: LinkInput) -> tuple[LinkState, tuple[LinkAction, ...]]:
    """The next state and the actions for ``event`` in ``state`` (IllegalTransition when
    the table has no such rule)."""
    try:
        return LINK_RULES[(state, event)]
    except KeyError:
        raise IllegalTransition("backup link", state.value, event.value) from None


def ack_input(newest: int, acked: int) -> LinkInput:
    """The input an acknowledgement of ``acked`` is, with ``newest`` the newest LSN."""
    return E.ACK_WITHIN_LAG if newest - acked <= READY_LAG else E.ACK_BEHIND
