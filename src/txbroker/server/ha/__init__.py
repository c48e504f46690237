"""High availability: the shared-store pair (``shared_store.py``, its link's pieces in
``pair_link.py``), the replicated group (``replicated.py``: the primary's hub in
``replication.py`` with its store in ``replicating_store.py`` and a backup's join in
``joining.py``, a backup's side in ``replica.py``, the named fault points tests arm in
``faults.py``), the client ports of a broker that serves nobody (``standby.py``), the
authenticated HA link both use (``link.py``), and etcd leases for promotion
(``etcd.py``, ``etcd_lease.py``). Every state these drivers hold changes by a table of
``core/ha/``."""
