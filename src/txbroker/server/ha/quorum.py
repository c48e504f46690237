"""Promotion of a replicated group of three or more without etcd: a backup asks its
peers first (``core/ha/promotion.py`` decides; ``standings.py`` asks).

:class:`QuorumPromotion` is the node's part of it: the newest ready-set record the
node holds (as primary, as a follower, or in its data directory), what it says of
itself when a peer asks (:meth:`standing`), what the peers last said of themselves
(``heard``: a refused join carries it, and every check refreshes it), what ``ha
status`` shows as ``promotable``, and the check of ``ha promote`` itself, which
gives the term the new primary starts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from txbroker.core.ha.promotion import (
    ReadyRecord,
    Standing,
    majority,
    newest,
    next_term,
    promotion_refusal,
)
from txbroker.errors import IllegalState
from txbroker.server.ha.replica import read_record
from txbroker.server.ha.standings import gather_standings

if TYPE_CHECKING:
    from txbroker.server.ha.replicated import ReplicatedNode

log = logging.getLogger("txbroker.ha")

__all__ = ["QuorumPromotion"]


class QuorumPromotion:
    """A replicated node's promotion by a majority (module docstring)."""

    def __init__(self, node: ReplicatedNode) -> None:
        self.node = node
        self.group_size = len(node.peers) + 1
        #: what each peer last said of itself (a refused join, a standing request)
        self.heard: dict[str, Standing] = {}
        self.term = 0  #: the term the last check gave (the new primary's)
        #: promoted by force: the term's records are written but nobody waits for a
        #: majority to hold them (the operator said the others are gone)
        self.forced = False
        self._checking = False

    def backups_needed(self) -> int:
        """How many backups must hold each record of the term this node starts."""
        return 0 if self.forced else majority(self.group_size) - 1

    def record(self) -> ReadyRecord | None:
        """The newest ready-set record this node holds."""
        node = self.node
        if node.hub is not None and node.hub.records.record is not None:
            return node.hub.records.record
        if node.follower is not None:
            return node.follower.record
        return read_record(node.config.data)

    def standing(self) -> Standing:
        """What this node says of itself when a peer asks before a promotion."""
        node = self.node
        follower = node.follower
        following = follower.primary if follower is not None and follower.connected else ""
        return Standing(node.node, node.role.value, self.record(), following)

    def refusal_as_heard(self) -> str | None:
        """``promotable()``, and not excluded by a newer record a peer told us of: what
        ``ha status`` shows (``ha promote`` asks a majority afresh, :meth:`check`)."""
        node = self.node
        why = node.promotable()
        if why is not None:
            return why
        follower = node.follower
        if follower is not None and follower.connected:
            return None  # the primary's records reach us on the link
        record = newest([self.record(), *(s.record for s in self.heard.values())])
        if record is not None and not record.covers(node.node):
            return (f"the newest ready set a peer holds (term {record.term}, version "
                    f"{record.version}, primary {record.primary}) does not hold it")
        return None

    async def check(self, force: bool, promote: asyncio.Event) -> dict[str, Any]:
        """Ask every peer its standing; set ``promote`` if the rules allow (``force``:
        waive the majority and the record, never a live primary)."""
        node = self.node
        if self._checking or promote.is_set():
            raise IllegalState(f"{node.node} cannot be promoted: a promotion is under way")
        self._checking = True
        try:
            peers = await gather_standings(node.security, node.peers)
            for peer in peers:
                self.heard[peer.node] = peer
            own = self.standing()
            why = promotion_refusal(own, node.promotable(), self.group_size, peers,
                                    force=force)
            if why is not None:
                raise IllegalState(f"{node.node} cannot be promoted: {why}")
            if force and promotion_refusal(own, None, self.group_size, peers) is not None:
                log.warning("HA: %s promoted by force although %s", node.node,
                            promotion_refusal(own, None, self.group_size, peers))
            self.term = next_term([own, *peers])
            self.forced = force
            promote.set()
        finally:
            self._checking = False
        result: dict[str, Any] = {"node": node.node, "promoting": True, "term": self.term,
                                  "heard": sorted(peer.node for peer in peers)}
        if force:
            result["forced"] = True
        return result
