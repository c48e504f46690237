"""The etcd side of a replicated primary (``server/ha/replicated.py``, docs/etcd.md):
the ready set recorded under the primary's lease, and the guard that fences before
any reply when the lease ran out while the process was stopped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from txbroker.server.ha.etcd_lease import put_ready_set

if TYPE_CHECKING:
    from txbroker.server.ha.replicated import ReplicatedNode

__all__ = ["lease_guard", "record_ready"]


async def record_ready(node: ReplicatedNode, names: list[str]) -> None:
    """Record the ready set in etcd (before the primary stops waiting for a backup that
    left it): after a whole-group loss only these may be promoted. Written only while
    the node's lease still holds the primary key (EtcdError otherwise)."""
    assert node.etcd is not None and node.candidate is not None
    await put_ready_set(node.etcd, node.config.ha_cluster, node.node, names,
                        node.candidate.holder.lease_id or 0)
    node.etcd_ready_primary, node.etcd_ready = node.node, names


def lease_guard(node: ReplicatedNode) -> None:
    """Before replies are written (``Operations.answer_guard``): a lease past its
    deadline fences now. A process stopped (SIGSTOP) past its lease runs the store's
    completions before the watchdog's timer when it continues: without this check
    they would answer after another broker may have taken the key."""
    holder = node.candidate.holder if node.candidate is not None else None
    if node.fenced or (holder is not None and holder.held
                       and holder.clock() >= holder.deadline):
        node.fence("the lease's deadline passed while the process was not running")
