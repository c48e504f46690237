"""A backup's disk follows the live data, not the history (issue 29): it drops dead
segments as its primary does (``Follower._maintain``), so a backup of a busy primary
no longer fills its disk with every message ever sent — and a restart of it reads what
is live. (Before, a backup never dropped a segment: after 90,000 messages of 1 KiB
sent and consumed, the primary's directory held 8.7 MB and its backup's 103 MB.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import txbroker
from tests.replicated_support import Group, RNode, wait_for
from tests.support import ROOT

SEGMENT = 64 * 1024
#: sent and consumed: 3 MiB of history (14 segments: entries carry a batch each)
CHURN = 3000


def segments(node: RNode) -> list[str]:
    """The journal's segment files (the head's size includes its zeros allocated
    ahead, up to 8 MiB: ``journal_writer.py``, so files are counted, not bytes)."""
    return sorted(p.name for p in (node.data / "journal").glob("*.seg"))


def churn(a: RNode) -> None:
    """CHURN messages of 1 KiB sent to and consumed from ``a`` (``txbroker bench``)."""
    bench = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "bench", "--url", a.url, "--count",
         str(CHURN), "--size", "1024", "--producers", "1", "--consumers", "1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bench.returncode == 0, bench.stderr


def test_a_backup_drops_dead_segments(tmp_path: Path) -> None:
    with Group(tmp_path / "group", 2, "--segment-size", str(SEGMENT)) as g:
        a, b = g.nodes
        g.wait_ready_backups(1, primary=a)
        churn(a)
        lsn = a.status()["replication"]["lsn"]
        wait_for(lambda: b.status()["following"]["durable_lsn"] == lsn, 30,
                 "b to hold every entry", g.describe)
        assert int(segments(a)[-1][:20]) >= 10  # the history filled ten segments or more
        # nothing is live: a segment or two remain on each (the head, and one the last
        # maintenance had not yet seen dead), not every segment of the history
        wait_for(lambda: len(segments(b)) <= 2, 30, "b to drop its dead segments",
                 lambda: f"{segments(b)}")
        wait_for(lambda: len(segments(a)) <= 2, 30, "a to drop its dead segments",
                 lambda: f"{segments(a)}")
        g.kill9(a)
        g.promote(b)  # the copy that dropped its dead segments holds the state: empty
        with txbroker.connect(b.url, timeout=15) as conn:
            assert conn.queue_info("bench")["depth"] == 0


def test_a_backup_that_dropped_segments_resumes_from_a_snapshot_after_a_restart(
        tmp_path: Path) -> None:
    """The count of LSNs survives dropping the segment that held the ``REPLICA_AT``
    record: each segment's snapshot carries it. b, after rolling through many small
    segments and dropping the dead ones, is killed, misses sends, and on its restart
    gets only those (a suffix, no second dump); promoted alone it holds them all."""
    with Group(tmp_path / "group", 2, "--segment-size", str(SEGMENT)) as g:
        a, b = g.nodes
        g.wait_ready_backups(1, primary=a)
        churn(a)
        with txbroker.connect(a.url, timeout=15, reconnect=False) as conn:
            for i in range(400):  # 400 KiB after the churn: seven segments that stay
                conn.send("kept", b"k" * 1024, message_id=f"kept-{i}")
        lsn = a.status()["replication"]["lsn"]
        wait_for(lambda: b.status()["following"]["durable_lsn"] == lsn, 30,
                 "b to hold every entry", g.describe)
        # the segment with the dump's REPLICA_AT record is gone: the count comes from
        # a snapshot at the start of a later one
        wait_for(lambda: int(segments(b)[0][:20]) > 1, 30, "b to drop its first segments",
                 lambda: f"{segments(b)}")
        g.kill9(b)
        with txbroker.connect(a.url, timeout=15, reconnect=False) as conn:
            for i in range(20):
                conn.send("missed", b"m" * 1024, message_id=f"missed-{i}")
        after = a.status()["replication"]["lsn"]
        g.restart(b)
        g.wait_ready_backups(1, primary=a)
        catchup = a.status()["replication"]["catchup"]
        assert (catchup["dumps"], catchup["suffixes"]) == (1, 1)
        assert catchup["suffix_entries"] == after - lsn  # the entries it missed, no more
        assert b.status()["following"]["applied_lsn"] == after
        g.kill9(a)
        g.promote(b)
        with txbroker.connect(b.url, timeout=15) as conn:
            assert conn.queue_info("kept")["depth"] == 400
            assert conn.queue_info("missed")["depth"] == 20
            assert conn.queue_info("bench")["depth"] == 0
