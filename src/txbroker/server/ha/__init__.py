"""High availability: the shared-store pair (``shared_store.py``), the replicated group
(``replicated.py``: the primary's hub in ``replication.py``, a backup's side in
``replica.py``), the authenticated HA link both use (``link.py``), and etcd leases for
promotion (``etcd.py``, ``etcd_lease.py``)."""
