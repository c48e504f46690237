"""The ``ha status`` of a replicated broker (``server/ha/replicated.py``): its role,
its copy or its backups, etcd's part, the ready-set record (docs/replication.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txbroker.core.ha.replicated_role import NodeRole

if TYPE_CHECKING:
    from txbroker.server.ha.replicated import ReplicatedNode

__all__ = ["node_status"]


def node_status(node: ReplicatedNode) -> dict[str, Any]:
    """What ``txbroker ha status`` prints for a replicated broker."""
    result: dict[str, Any] = {
        "mode": "replicated", "role": node.role.value, "since": round(node.since, 3),
        "node": node.node, "peers": node.config.ha_peers,
        "promotable": (node.promotable() if node.quorum is None
                       else node.quorum.refusal_as_heard()) is None,
        "backup_timeout": node.config.backup_timeout,
        "link": node.security.status()}
    if node.hub is not None:
        result["replication"] = node.hub.status()
    if node.follower is not None:
        result["following"] = node.follower.status()
    elif node.role is NodeRole.BACKUP:  # what this copy had when it last followed a primary
        result["copy"] = {"lsn": node.copy_position, "ready": node.copy_ready}
    if node.last_problem:
        result["problem"] = node.last_problem
    if node.config.ha_etcd:
        holder = node.candidate.holder if node.candidate is not None else None
        result["etcd"] = {
            "endpoints": node.config.ha_etcd, "cluster": node.config.ha_cluster,
            "primary_key_holder": node.etcd_primary, "ready_set": node.etcd_ready,
            "lease_ttl": holder.granted_ttl if holder is not None and holder.held
            else node.config.ha_lease_ttl,
            "holding": bool(holder is not None and holder.held)}
    if node.fenced:
        result["fenced"] = node.fenced
    if node.quorum is not None:
        record = node.quorum.record()
        result["ready_record"] = None if record is None else record.to_wire()
    return result
