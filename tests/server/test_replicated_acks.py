"""Replicated HA: an ack after a promotion follows seed 004's rule as after a
shared-store takeover (issue 28 §5): with one receiver the ack of a message
delivered before the failover succeeds, by the message's id (ids are replicated).

A file of its own so as not to touch ``test_replicated.py`` (changed on another
branch); it borrows that module's helpers.
"""

from __future__ import annotations

from pathlib import Path

from tests.server.test_replicated import _connect, group


def test_one_receiver_acks_a_message_delivered_before_a_promotion(tmp_path: Path) -> None:
    with group(tmp_path) as g:
        a, b, _ = g.nodes
        g.wait_ready_backups(2, primary=a)
        with _connect(g.url) as conn:
            conn.send("acks", b"r1")
            conn.send("acks", b"r2")
            taken = conn.receive("acks", timeout=5)
            assert taken is not None and taken.body == b"r1"
            g.kill9(a)
            g.promote(b)
            taken.ack(wait=True)  # before issue 28: IllegalState
            second = conn.receive("acks", timeout=10)
            assert second is not None and second.body == b"r2"  # r1 is not redelivered
            second.ack(wait=True)
            assert conn.receive("acks", timeout=0.2) is None
            assert conn.queue_info("acks")["messages"] == 0
