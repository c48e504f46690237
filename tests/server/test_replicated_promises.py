"""Promises before a promotion without etcd (``core/ha/promotion.py``, "Promises"),
with real processes: a promotion beside an old primary that is still alive must not
lose what that primary answers.

Before promises, ``ha promote b`` checked the peers' standings and acted on them
later. With b cut off from a and c reaching both, c (following a, b still in the
recorded ready set) allowed it; a, alive, dropped the silent b 5 s later once c held
the smaller ready set and answered five sends with c alone; when a died, c joined b,
b's dump replaced c's copy, and the five answered sends were gone (run against the
code before promises, the first test below failed exactly so). Now:

- a peer that still hears its primary promises nobody else a term, so b is refused
  while a is alive and heard by c (first test);
- a primary that falls silent (frozen) is not heard: c promises b the term, syncs the
  promise and leaves a at once, so a, resumed, can get nothing acknowledged by a
  majority again (second test).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import txbroker
from tests import native_workload as load
from tests.replicated_support import READY_PREFIX, ROOT, Group, LinkProxy, wait_for
from txbroker.errors import TxBrokerError


def _drain(url: str, queue: str) -> list[str]:
    return load.drain(lambda u: txbroker.connect(u, timeout=15, failover_timeout=60), url,
                      queue)


def _promote(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "txbroker.cli", "ha", "promote", "--url",
                           url], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _send(url: str, ids: list[str], timeout: float) -> list[str]:
    """Send ``ids`` one by one to ``url`` alone; the ones answered (stops at the first
    failure: a broker that cannot answer, or that fenced itself and closed its port)."""
    answered: list[str] = []
    with contextlib.suppress(TxBrokerError, OSError, TimeoutError), \
            txbroker.connect(url, reconnect=False, timeout=timeout) as conn:
        for mid in ids:
            conn.send("q", mid.encode(), message_id=mid)
            answered.append(mid)
    return answered


def _trio_with_b_cut_off_from_a(tmp_path: Path) -> tuple[Group, LinkProxy, list[str]]:
    """a primary, b and c ready; three sends; then b and a stop hearing each other (b
    reaches a through a proxy, now blocked); c hears both."""
    g = Group(tmp_path / "group", 3)  # backup_timeout 5 s: a waits that long for b
    a, b, _ = g.nodes
    proxy = LinkProxy(a.ha_port)
    b.peer_override = {"a": f"127.0.0.1:{proxy.port}"}
    try:
        g.start()
        assert g.wait_ready_backups(2, primary=a) == {"b": "ready", "c": "ready"}
        before = [f"before-{i}" for i in range(3)]
        assert _send(a.url, before, 15) == before
        proxy.blocked.set()
    except BaseException:
        g.stop()
        proxy.stop()
        raise
    return g, proxy, before


def test_a_backup_is_not_promoted_while_a_peer_hears_the_live_primary(tmp_path: Path) -> None:
    g, proxy, before = _trio_with_b_cut_off_from_a(tmp_path)
    a, b, c = g.nodes
    try:
        run = _promote(b.url)
        assert run.returncode != 0, run.stdout + g.describe()
        assert "cannot be promoted" in run.stdout + run.stderr
        assert "c (it hears its primary a)" in run.stdout + run.stderr, run.stdout + run.stderr
        # a goes on: it drops the silent b after backup_timeout and answers with c
        after = [f"after-{i}" for i in range(5)]
        assert _send(a.url, after, 15) == after
        g.kill9(a)
        run = _promote(b.url)  # the newest ready set (c's) leaves b out
        assert run.returncode != 0 and "does not hold it" in run.stdout + run.stderr
        g.promote(c)
        assert _drain(c.url, "q") == before + after
    finally:
        g.stop()
        proxy.stop()


def test_a_peer_that_promised_leaves_the_frozen_primary(tmp_path: Path) -> None:
    g, proxy, before = _trio_with_b_cut_off_from_a(tmp_path)
    a, b, c = g.nodes
    try:
        a.send_signal(signal.SIGSTOP)  # frozen: c's link falls silent, not closed
        time.sleep(1.0)  # longer than HEARS_WITHIN (0.5 s)
        run = _promote(b.url)
        assert run.returncode == 0, run.stdout + run.stderr + g.describe()
        assert "promoting b to primary" in run.stdout and "promised by c" in run.stdout, \
            run.stdout
        wait_for(lambda: c.log_has("promised term"), 10, "c to log its promise", g.describe)
        b.wait_line(READY_PREFIX, timeout=30)
        assert g.wait_ready_backups(1, primary=b, timeout=30) == {"c": "ready"}
        a.send_signal(signal.SIGCONT)  # a wakes up still a primary in its own eyes
        # whatever a answers now must survive it: it cannot get c's acknowledgement
        # (c promised a newer term) nor record a smaller ready set, so it answers none
        answered = _send(a.url, [f"after-{i}" for i in range(5)], 10)
        assert answered == []
        if a.alive():  # else it fenced itself (c refused its record) and stopped
            g.kill9(a)
        assert _drain(b.url, "q") == before
    finally:
        g.stop()
        proxy.stop()
