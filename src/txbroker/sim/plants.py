"""Planted bugs: switches that break the simulated edge on purpose, to prove that the
checkers can fail. All are off unless a run names them (``--plant``); none is
reachable from production code, which never imports ``txbroker.sim``.

Each perturbs what the real code sees or what its edge does — never the core:
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: The scenario that runs ``router-bank-sites-live``'s bank over ``replicated-live``'s
#: trio: the plants of both apply to it.
BANK_REPLICATED: Final = ("router-bank-replicated-live",)


@dataclass(frozen=True, slots=True)
class Plant:
    """One planted bug: its name, the scenario it applies to, what it does, and the
    other scenarios it applies to as well (which run the same parts)."""

    name: str
    scenario: str
    description: str
    also: tuple[str, ...] = ()

    def applies_to(self, scenario: str) -> bool:
        """The plant applies to ``scenario``."""
        return scenario == self.scenario or scenario in self.also


PLANTS: Final = {plant.name: plant for plant in (
    Plant("reply-before-fsync", "queue",
          "the edge answers a persistent send and a transaction commit before their "
          "record is synced"),
    Plant("ack-before-fsync", "queue",
          "the edge answers an ack before its record is synced"),
    Plant("deliver-without-redelivered", "queue",
          "the edge delivers every message without its redelivered flag"),
    Plant("accept-before-durable", "router-bank",
          "the edge answers a router accept before the accepted transaction's journal "
          "record is synced"),
    Plant("server-no-tid-check", "router-bank",
          "a partition server applies an UNCERTAIN replay without checking its TID "
          "table"),
    Plant("server-commit-on-vote", "router-bank",
          "a partition server commits its leg when it votes, before the outcome"),
    Plant("live-fsync-lies", "queue-live",
          "the broker's disk reports a sync done that a crash then loses: a kill drops "
          "the last synced entry too"),
    Plant("live-server-no-tid-check", "router-bank-live",
          "a partition server (over the production router server library) applies an "
          "UNCERTAIN replay without checking its TID table"),
    Plant("forget-prepared-at-restart", "xa-live",
          "the broker's restart forgets every prepared XA branch not yet finished (its "
          "XA_PREPARE records are dropped from the journal)"),
    Plant("tm-commit-without-log", "xa-live",
          "the transaction manager starts phase two without writing its commit decision"),
    Plant("pg-loses-prepared", "xa-live",
          "the PostgreSQL model's crash loses its prepared transactions too"),
    Plant("recovery-in-flight", "xa-live",
          "the transaction manager runs its periodic recovery without telling it the "
          "transactions in flight: it rolls back branches that are prepared but not "
          "yet decided"),
    Plant("reply-before-backups", "replicated-live",
          "the primary answers once an entry is on its own disk, without waiting for "
          "the ready backups' acknowledgements",
          also=BANK_REPLICATED),
    Plant("promote-outside-ready-set", "replicated-live",
          "the operator promotes the first live node it reaches, every node says it "
          "is promotable and none asks its peers (no ready set recorded on a "
          "majority): a backup that is not ready, or was dropped, is promoted",
          also=BANK_REPLICATED),
    Plant("primary-ignores-lost-lease", "replicated-etcd-live",
          "a primary whose etcd lease renewal fails (or whose lease expired) does not "
          "fence itself: it goes on answering clients"),
    Plant("standby-ignores-lock", "shared-store-live",
          "a shared-store standby that heard no heartbeat for the activation interval "
          "activates without the lock (taking it from its live holder)"),
    Plant("router-presents-to-both-sites", "router-bank-sites-live",
          "the primary site's copy of a transaction also goes to the shadow site (each "
          "shadow process also serves as a concurrent server into its site's ledger): "
          "the secondary site applies it twice, the primary site misses it",
          also=BANK_REPLICATED),
    Plant("shadow-no-tid-check", "router-bank-sites-live",
          "a shadow server applies an UNCERTAIN replay without checking its TID table",
          also=BANK_REPLICATED),
    Plant("standby-serves-beside-concurrents", "router-bank-sites-live",
          "a standby server is given work while its partition's concurrent servers are "
          "registered (it registers as one of them): the standby check must see it",
          also=BANK_REPLICATED),
    Plant("fsync-lies", "router-bank",
          "the disk reports an fsync done that a crash then loses: a crash drops the "
          "last synced entry too"),
)}
