"""Replicated HA (seed 001, issue 28 §3): prepared XA branches are recovered from a
*backup's* own disk after the loss of the whole group — the old primary's disk is
never read (``test_replicated.py`` covers promoting the old primary).

Kept in a file of its own so that it does not touch ``test_replicated.py``, which is
being changed on another branch; it borrows that module's helpers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import txbroker
from tests.replicated_support import BACKUP_PREFIX, wait_for
from tests.server.test_replicated import _connect, drain, group
from txbroker.errors import XA_OK, TxBrokerError
from txbroker.xid import Xid


def test_prepared_branches_are_recovered_from_a_backups_disk(tmp_path: Path) -> None:
    """kill -9 all three with two prepared branches (one that sent, one that
    consumed); restart the two backups only and promote one of them: it lists both
    branches, holds the consumed message, and completes them (commit and rollback)."""
    x_send, x_ack = Xid(6, b"send", b"b"), Xid(6, b"ack", b"b")
    with group(tmp_path) as g:
        a, b, c = g.nodes
        assert g.primary() is a
        with _connect(g.url) as conn:
            for i in range(5):
                conn.send("kept", f"k-{i}".encode(), message_id=f"k-{i}")
            conn.send("xin", b"in-1", message_id="in-1")
        g.wait_ready_backups(2, primary=a)
        direct = txbroker.connect(a.url, reconnect=False, timeout=5)
        try:
            xa = direct.xa_resource()
            xa.start(x_send)
            direct.send("xq", b"s-1", message_id="s-1")
            direct.send("xq", b"s-2", message_id="s-2")
            xa.end(x_send)
            assert xa.prepare(x_send) == XA_OK  # on every ready backup's disk too
            xa.start(x_ack)
            got = direct.receive("xin", timeout=5)
            assert got is not None and got.body == b"in-1"
            got.ack()
            xa.end(x_ack)
            assert xa.prepare(x_ack) == XA_OK
            for node in (a, b, c):  # the primary first
                g.kill9(node)
        finally:
            with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
                direct.close()
        for node in (b, c):  # the old primary's disk stays out of it
            g.spawn(node)
        for node in (b, c):
            node.wait_line(BACKUP_PREFIX)
            wait_for(lambda: (node.try_status() or {}).get("role") == "backup",  # noqa: B023
                     30, f"{node.name} to answer as a backup", g.describe)
        g.promote(b)
        g.wait_ready_backups(1, primary=b)
        with txbroker.connect(b.url, timeout=15) as conn:
            xa = conn.xa_resource()
            assert set(xa.recover()) == {x_send, x_ack}
            assert conn.receive("xin", timeout=0.2) is None  # held by the prepared branch
            assert conn.receive("xq", timeout=0.2) is None  # not committed yet
            xa.commit(x_send)
            xa.rollback(x_ack)
            assert xa.recover() == []
        assert drain(b.url, "kept") == [f"k-{i}" for i in range(5)]
        assert drain(b.url, "xq") == ["s-1", "s-2"]
        assert drain(b.url, "xin") == ["in-1"]  # the rolled-back branch gave it back
