"""The etcd side of a replicated node (``server/ha/replicated.py``, docs/etcd.md): the
ready set recorded under the primary's lease, the guard that fences before any reply
when the lease ran out while the process was stopped, and what admits an operator's
``ha promote`` of a backup — when it is asked, and again when the key is taken."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final

from txbroker.errors import EtcdError, EtcdUnavailable
from txbroker.server.ha.etcd_lease import put_ready_set

if TYPE_CHECKING:
    from txbroker.server.ha.replicated import ReplicatedNode

__all__ = ["etcd_refusal", "lease_guard", "manual_request_stands", "record_first_ready_set",
           "record_ready"]

log = logging.getLogger("txbroker.ha")

#: Pause between two tries of the first ready set while etcd does not answer (s).
RETRY_PAUSE: Final = 0.3


async def record_ready(node: ReplicatedNode, names: list[str]) -> None:
    """Record the ready set in etcd (before the primary stops waiting for a backup that
    left it): after a whole-group loss only these may be promoted. Written only while
    the node's lease still holds the primary key (EtcdError otherwise)."""
    assert node.etcd is not None and node.candidate is not None
    await put_ready_set(node.etcd, node.config.ha_cluster, node.node, names,
                        node.candidate.holder.lease_id or 0)
    node.etcd_ready_primary, node.etcd_ready = node.node, names


async def record_first_ready_set(node: ReplicatedNode) -> None:
    """A new primary, before it serves: record an empty ready set (until a backup is
    ready, none may succeed it), retried while etcd does not answer — until written,
    or the key is lost (then fenced). (The process crashed on the first timeout:
    ``replicated-etcd-live`` seed 50355.)"""
    stopping = node.stopping
    while not stopping.is_set():
        try:
            await record_ready(node, [])
            return
        except EtcdUnavailable as exc:
            node.last_problem = f"etcd: {exc}"
            log.warning("etcd: cannot record the ready set yet (%s): retrying", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), RETRY_PAUSE)
        except EtcdError as exc:  # it no longer holds the key
            node.fence(str(exc))
            return


def lease_guard(node: ReplicatedNode) -> None:
    """Before replies are written (``Operations.answer_guard``): a lease past its
    deadline fences now. A process stopped (SIGSTOP) past its lease runs the store's
    completions before the watchdog's timer when it continues: without this check
    they would answer after another broker may have taken the key."""
    holder = node.candidate.holder if node.candidate is not None else None
    if node.fenced or (holder is not None and holder.held
                       and holder.clock() >= holder.deadline):
        node.fence("the lease's deadline passed while the process was not running")


def etcd_refusal(node: ReplicatedNode) -> str | None:
    """Why etcd's records, as the node last read them, refuse its promotion now (None:
    they admit it): another node holds the key, or the last primary's recorded ready set
    names this node neither among its ready backups nor as the primary that recorded it."""
    if node.etcd_primary not in (None, node.node):
        return f"the etcd key is held by {node.etcd_primary}"
    if node.etcd_ready is not None and node.node not in node.etcd_ready and \
            node.node != node.etcd_ready_primary:
        return f"the last primary's ready set in etcd is {node.etcd_ready or 'empty'}"
    return None


def manual_request_stands(node: ReplicatedNode) -> bool:
    """Whether an operator's earlier ``ha promote`` (admitted when asked) still holds,
    checked again against what the campaign just read before the key is taken: a
    request that waited while the node was stopped, cut off from etcd, or while another
    node served a whole term is void once the records moved on (replicated-etcd-live
    seed 52677: a request of 0.1 s took the key at 6.97 s, after another node's term,
    with a copy that had none of it — every send that term answered was lost)."""
    why = node.promotable() or etcd_refusal(node)
    if why is not None:
        log.warning("etcd: %s drops the operator's promotion request: %s", node.node, why)
    return why is None
