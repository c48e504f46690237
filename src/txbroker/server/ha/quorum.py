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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from txbroker.core.ha.promotion import (
    HEARS_WITHIN,
    PROMISE_HOLD,
    Promise,
    ReadyRecord,
    Standing,
    majority,
    newest,
    next_term,
    promise_refusal,
    promotion_refusal,
)
from txbroker.errors import IllegalState
from txbroker.server.ha.clock import monotonic
from txbroker.server.ha.promises import read_promise, withdraw_promise, write_promise
from txbroker.server.ha.replica_files import read_record
from txbroker.server.ha.standings import gather_promises, gather_standings

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
        #: when this node last promised a term to a peer, and to whom
        self._granted: tuple[float, str, int] = (float("-inf"), "", 0)

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
        promise = read_promise(node.config.data)
        hears = following if follower is not None and following and \
            monotonic() - follower.heard_at < HEARS_WITHIN else ""
        return Standing(node.node, node.role.value, self.record(), following,
                        0 if promise is None else promise.term, hears=hears)

    def grant(self, promise: Promise) -> Standing:
        """A peer being promoted asks this node to promise it a term: promise it (synced
        first, ``promises.py``) unless :func:`promise_refusal` says no, and leave the
        primary this node follows (its entries must not be acknowledged here any more:
        ``core/ha/promotion.py``, "Promises"). The answer is the standing, ``granted``
        saying which. While this node's own promotion is being checked it is being
        promoted (P1): it promises nobody else — a candidate that promised a newer term
        went on to promote itself with the older one, and stayed promoting for ever
        (``replicated-live`` seeds 50067, 50905)."""
        node = self.node
        own = self.standing()
        if self._checking:  # its own promotion is being checked: it is being promoted (P1)
            own = replace(own, role="promoting")
        why = promise_refusal(own, read_promise(node.config.data), promise.term,
                              promise.candidate, recently=self._recently())
        if why is not None:
            log.info("HA: %s does not promise term %d to %s: %s", node.node, promise.term,
                     promise.candidate, why)
            return own
        write_promise(node.config.data, promise)
        self._granted = (monotonic(), promise.candidate, promise.term)
        log.warning("HA: %s promised term %d to %s", node.node, promise.term,
                    promise.candidate)
        follower = node.follower
        if follower is not None and follower.connected and follower.primary != promise.candidate:
            follower.leave()
        return replace(own, following="", promised=promise.term, granted=True)

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
            self._refuse_unless_allowed(force, peers, warn=False)
            # then the promises: the term to ourselves first (synced), then the peers'
            # (``core/ha/promotion.py``, "Promises"), and the rules again over those
            # that promised it: between the two asks the group may have moved on
            own = self.standing()
            term = next_term([own, *peers])
            promise, previous = Promise(term, node.node), read_promise(node.config.data)
            why = promise_refusal(own, previous, term, node.node, recently=self._recently())
            if why is not None:
                raise IllegalState(f"{node.node} cannot be promoted: {why}")
            write_promise(node.config.data, promise)
            try:
                answers = await gather_promises(node.security, node.peers, promise)
                granted = [a for a in answers
                           if a.granted or a.role in ("primary", "promoting")]
                refused = sorted(
                    f"{a.node} (it hears its primary {a.hears})" if a.hears else
                    f"{a.node} (promised term {a.promised})"
                    for a in answers if all(a is not g for g in granted))
                try:
                    self._refuse_unless_allowed(force, granted, warn=True)
                except IllegalState as exc:
                    if refused:
                        raise IllegalState(f"{exc}; not promised by {', '.join(refused)}") \
                            from None
                    raise
            except BaseException:
                withdraw_promise(node.config.data, previous)
                raise
            self.term = term
            self.forced = force
            promote.set()
        finally:
            self._checking = False
        result: dict[str, Any] = {"node": node.node, "promoting": True, "term": self.term,
                                  "heard": sorted(peer.node for peer in peers),
                                  "promised": sorted(a.node for a in answers if a.granted)}
        if force:
            result["forced"] = True
        return result

    def _recently(self) -> str:
        """The node this one promised a term to less than ``PROMISE_HOLD`` ago and has
        not seen become the primary of it yet (""): once this node holds a record of
        that term, the term's records protect it."""
        at, candidate, term = self._granted
        record = self.record()
        if monotonic() - at >= PROMISE_HOLD or (record is not None and record.term >= term):
            return ""
        return candidate

    def _refuse_unless_allowed(self, force: bool, peers: list[Standing], *, warn: bool
                               ) -> None:
        """Raise IllegalState unless the rules let this node be promoted having heard
        ``peers`` (remembered as heard); ``warn``: log what ``force`` waived."""
        node = self.node
        for peer in peers:
            self.heard[peer.node] = peer
        own = self.standing()
        why = promotion_refusal(own, node.promotable(), self.group_size, peers, force=force)
        if why is not None:
            raise IllegalState(f"{node.node} cannot be promoted: {why}")
        if force and warn:
            unforced = promotion_refusal(own, None, self.group_size, peers)
            if unforced is not None:
                log.warning("HA: %s promoted by force although %s", node.node, unforced)
