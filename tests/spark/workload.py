"""A known workload run through a real broker, for the audit tests.

Every count the audit tables must show follows from :func:`run_workload`:

=====================  ==============================================================
orders                 5 plain sends (``o-0``..``o-4``); 3 received and acked; one
                       consumed by the committed XA branch; 2 sent by the committed
                       local transaction; 1 sent by the rolled-back one (never logged)
billing                2 plain sends; 1 consumed by the committed local transaction
shipments              1 sent by the committed XA branch, 1 by the in-doubt branch
work → work.dlq        1 send, rejected twice with ``max_deliveries=2``: moved to
                       ``work.dlq`` with reason ``max_deliveries``
scratch                2 sends, then purged (DROP ``purged``)
=====================  ==============================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import txbroker


@dataclass
class Workload:
    """What the workload did (the audit's expected answers)."""

    committed_xid: str
    in_doubt_xid: str
    plain_sends: int = 5 + 2 + 1 + 2
    tx_sends: int = 2
    xa_sends: int = 2  # one committed, one in doubt
    acked: int = 3


def run_workload(url: str) -> Workload:
    """Drive the broker at ``url`` through the workload of the module doc."""
    with txbroker.connect(url) as conn:
        for i in range(5):
            conn.send("orders", f"order {i}".encode(), message_id=f"o-{i}")
        for i in range(2):
            conn.send("billing", f"bill {i}".encode())
        for _ in range(3):
            msg = conn.receive("orders", timeout=5)
            assert msg is not None
            msg.ack(wait=True)

        with conn.transaction() as tx:
            tx.send("orders", b"tx-1")
            tx.send("orders", b"tx-2")
            got = tx.receive("billing", timeout=5)
            assert got is not None
        rolled_back = conn.transaction()
        rolled_back.send("orders", b"never")
        rolled_back.rollback()

        xa = conn.xa_resource()
        committed = conn.xid(1, "audit-commit", "b1")
        xa.start(committed)
        conn.send("shipments", b"ship-1")
        consumed = conn.receive("orders", timeout=5)
        assert consumed is not None
        consumed.ack()
        xa.end(committed)
        xa.prepare(committed)
        xa.commit(committed)
        in_doubt = conn.xid(1, "audit-doubt", "b1")
        xa.start(in_doubt)
        conn.send("shipments", b"ship-2")
        xa.end(in_doubt)
        xa.prepare(in_doubt)

        conn.declare_queue("work", max_deliveries=2, dead_letter_queue="work.dlq")
        conn.send("work", b"poison")
        for _ in range(2):
            bad = conn.receive("work", timeout=5)
            assert bad is not None
            bad.nack(requeue=True, wait=True)
        for i in range(2):
            conn.send("scratch", f"tmp {i}".encode())
        assert conn.purge_queue("scratch") == 2
        conn.ping()
    return Workload(committed_xid=str(committed), in_doubt_xid=str(in_doubt))
