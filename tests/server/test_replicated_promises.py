"""Promises before a promotion without etcd (``core/ha/promotion.py``, "Promises"),
with real processes: a backup promoted while the old primary is alive behind a
partial partition must not lose what the old primary answers afterwards.

Before promises, ``ha promote b`` checked the peers' standings and acted on them
later: c (following a, b's ready set recorded) allowed it; a, alive, dropped the
silent b once c held the smaller ready set, and answered five sends with c alone;
when a died, c joined b, b's dump replaced c's copy, and the five answered sends
were gone. Now c promises b's term before b is promoted and leaves a at once: a's
answers wait for c, and c takes none of a's records again.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import txbroker
from tests import native_workload as load
from tests.replicated_support import READY_PREFIX, ROOT, Group, LinkProxy, wait_for
from txbroker.errors import TxBrokerError


def _drain(url: str, queue: str) -> list[str]:
    return load.drain(lambda u: txbroker.connect(u, timeout=15, failover_timeout=60), url,
                      queue)


def test_a_promotion_beside_a_live_primary_loses_no_answered_send(tmp_path: Path) -> None:
    g = Group(tmp_path / "group", 3)  # backup_timeout 5 s: a waits that long for b
    a, b, c = g.nodes
    proxy = LinkProxy(a.ha_port)
    b.peer_override = {"a": f"127.0.0.1:{proxy.port}"}  # b reaches a through the proxy
    try:
        g.start()
        assert g.wait_ready_backups(2, primary=a) == {"b": "ready", "c": "ready"}
        before = [f"before-{i}" for i in range(3)]
        with txbroker.connect(a.url, reconnect=False, timeout=15) as conn:
            for mid in before:
                conn.send("q", mid.encode(), message_id=mid)
        proxy.blocked.set()  # b and a no longer hear each other; c hears both
        run = subprocess.run([sys.executable, "-m", "txbroker.cli", "ha", "promote",
                              "--url", b.url], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr + g.describe()
        assert "promoting b to primary" in run.stdout, run.stdout
        # c promised b's term (and so left a): the answer names who promised
        assert "promised by c" in run.stdout, run.stdout
        wait_for(lambda: c.log_has("promised term"), 10, "c to log its promise", g.describe)
        # a is alive and still thinks itself the primary: whatever it answers now must
        # survive it (before promises, it answered these once it dropped b, 5 s on)
        # (now: it has no backup to wait for, or it already fenced itself when c
        # refused its record — its client port is then closed)
        answered: list[str] = []
        with contextlib.suppress(TxBrokerError, OSError, TimeoutError), \
                txbroker.connect(a.url, reconnect=False, timeout=10) as conn:
            for mid in (f"after-{i}" for i in range(5)):
                conn.send("q", mid.encode(), message_id=mid)
                answered.append(mid)
        if a.alive():  # else it fenced itself and stopped (c refused its record)
            g.kill9(a)
        b.wait_line(READY_PREFIX, timeout=30)
        assert g.wait_ready_backups(1, primary=b, timeout=30) == {"c": "ready"}
        assert _drain(b.url, "q") == before + answered
        assert answered == []  # a could answer nothing without c
    finally:
        g.stop()
        proxy.stop()
