"""The broker's whole durable state as store entries: what a joining backup gets
first (``--ha replicated``, ``server/ha/replication.py``), and the follower's side.

Theory of operation
-------------------
Replication ships the primary's store entries (``core/records/__init__.py``) to every
backup, which writes them to its own store and replays them into its own core
(:meth:`Broker.replay <txbroker.core.broker.Broker.replay>`), never finishing
recovery until it is promoted. A backup that joins — new, or back after any
absence — gets a **dump** first: :func:`state_entries` describes the state the
primary's entries up to one LSN add up to, as entries replay understands:

1. one ``SNAPSHOT`` (queues, topics, duplicate windows, the next id, sinks, the
   XA branches no body keeps — ``Broker.snapshot``);
2. ``RELOCATE_MANY`` entries with every live stored message (ready, delivered,
   or held by an open transaction: its consumption is not committed), in each
   queue's commit order (seq), :data:`DUMP_SLICE` messages each;
3. one ``XA_PREPARE`` per prepared branch the snapshot leaves out (its sends'
   bodies are in that entry).

The dump must be taken when the in-memory state is exactly the durable log:
every appended entry durable and applied, no open record group. The edge makes
that so (it stops reading clients until its in-flight entries are complete,
``server/ha/replication.py``); :func:`check_quiet` refuses otherwise. Bodies are
not in the dump's description: the edge reads them from the store (by the
messages' refs) as it streams the dump.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from txbroker.core.messages import Message, State
from txbroker.core.records import RelocateMany, Snapshot, XaPrepare
from txbroker.core.xa import BranchState

if TYPE_CHECKING:
    from txbroker.core.broker import Broker

#: Messages per ``RELOCATE_MANY`` entry of a dump (a few MiB of 1 KiB bodies).
DUMP_SLICE: Final = 2_000

#: Branch states whose XA_PREPARE record is durable (a dump is taken when nothing is
#: on its way to disk, so PREPARING and COMMITTING do not occur then).
_PREPARED: Final = (BranchState.PREPARED,)


@dataclass(slots=True)
class DumpEntry:
    """One entry of a dump: ``kind``, its packed ``meta`` and the messages whose
    bodies are its bodies, in order."""

    kind: int
    meta: bytes
    messages: list[Message] = field(default_factory=list)


def check_quiet(broker: Broker) -> str | None:
    """Why the state is not the durable log right now (None: it is)."""
    if broker.outbox.group:
        return "a record group is open"
    for branch in broker.xa.branches.values():
        if branch.state in (BranchState.PREPARING, BranchState.COMMITTING,
                            BranchState.ROLLING_BACK):
            return f"XA branch {branch.xid} is on its way to disk"
    for message in broker.index.messages.objects.values():  # (pending ones are objects)
        if message.persistent and message.state is State.PENDING:
            return f"message {message.id} is on its way to disk"
    return None


def state_entries(broker: Broker) -> list[DumpEntry]:
    """The dump of the broker's state (see the module docstring)."""
    kind, meta = broker.snapshot()
    entries = [DumpEntry(kind, meta)]
    covered = set(Snapshot.decode(meta).xa or {})
    found = {m.id: m for m in broker.index.messages.values()}
    for branch in broker.xa.branches.values():  # consumed by a prepared branch: held there
        if branch.state in _PREPARED:
            found.update((m.id, m) for m in branch.work.acks.values())
    live = [m for m in found.values()
            if m.persistent and m.ref is not None
            and m.state not in (State.PENDING, State.GONE)]
    live.sort(key=lambda m: (m.queue, m.seq, m.id))
    for start in range(0, len(live), DUMP_SLICE):
        chunk = live[start:start + DUMP_SLICE]
        relocate = RelocateMany([m.to_record() for m in chunk])
        entries.append(DumpEntry(relocate.kind, relocate.encode(), chunk))
    for branch in broker.xa.branches.values():
        if branch.state not in _PREPARED or str(branch.xid) in covered:
            continue
        sends = [m for m in branch.work.sends if m.persistent]
        consumed = [[m.id, m.delivery_count] for m in branch.work.acks.values()
                    if m.persistent] + branch.ref_ids
        prepare = XaPrepare(str(branch.xid), [m.to_record() for m in sends], consumed,
                            sorted(branch.discards), branch.created_ms,
                            branch.prepared_ms or branch.created_ms)
        entries.append(DumpEntry(prepare.kind, prepare.encode(), sends))
    return entries


__all__ = ["DUMP_SLICE", "DumpEntry", "check_quiet", "state_entries"]
