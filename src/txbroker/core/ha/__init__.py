"""HA and replication as pure state machines (issue 26 §2): tables ``(state, input) ->
(next state, actions)``, a comment per rule, no sockets, threads, clocks or randomness.

* ``backup_link.py``: a backup's link as the primary sees it (joining, dumping,
  catching-up, ready, leaving, demoting, dropped);
* ``follower.py``: a backup's copy as the backup sees it (joining, copying, following);
* ``replicated_role.py``: a replicated broker's role (backup, promoting, primary,
  stopped);
* ``shared_store_role.py``: a shared-store broker's role (starting, standby,
  activating, active, stopped);
* ``transition.py``: :class:`IllegalTransition`, raised for a pair a table lacks.

The asyncio drivers in ``server/ha/`` feed inputs and carry out the actions; every
state change goes through a table (``tests/core/test_ha_tables.py`` checks each table
against an independent one).
"""

from txbroker.core.ha.transition import IllegalTransition

__all__ = ["IllegalTransition"]
