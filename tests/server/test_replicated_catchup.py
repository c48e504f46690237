"""Incremental catch-up (issue 29, item 2; docs/replication.md, "Catch-up"): a backup
whose link broke keeps its copy and, on rejoining the same primary, gets only the
entries it missed — counted by the primary (``ha status``: ``replication.catchup``)
— when the primary's catch-up buffer still holds them, and a full dump when it
does not. Either way the backup ends up a complete copy: promoted alone, it holds
every acknowledged send.

The backup reaches the primary through a proxy that cuts the link and then
swallows its attempts to rejoin while the test sends (``LinkProxy``); every wait
is on ``ha status`` or a log line, and bounded.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import txbroker
from tests.replicated_support import Group, LinkProxy, RNode, wait_for
from tests.support import ROOT

#: Stored before the cut: what a dump would have to copy again (3 x 100 x 1 KiB).
STORED = 300
#: Sent while the backup is cut off: what it missed.
MISSED = 20
#: Sent after a backup's checkpoint: the log its restart replays after it.
AFTER = 10
#: Sent without message ids, before a backup's checkpoint (which holds them as columns).
PLAIN = 200
BODY = b"x" * 1024


@contextlib.contextmanager
def pair_behind_a_proxy(tmp_path: Path, *args: str) -> Iterator[tuple[Group, LinkProxy]]:
    """a primary, b its ready backup, reaching a's HA port through a proxy."""
    g = Group(tmp_path / "group", 2, *args, backup_timeout=1.0)
    a, b = g.nodes
    proxy = LinkProxy(a.ha_port)
    b.peer_override = {"a": f"127.0.0.1:{proxy.port}"}
    try:
        g.start()
        yield g, proxy
    finally:
        g.stop()
        proxy.stop()


def replication(node: RNode) -> dict[str, Any]:
    return dict(node.status()["replication"])


def store_bulk(g: Group) -> int:
    """Store STORED messages (transactions of 100) and wait until b holds them durably;
    returns a's LSN then."""
    a = g.nodes[0]
    with txbroker.connect(a.url, timeout=15, reconnect=False) as conn:
        for k in range(STORED // 100):
            with conn.transaction() as tx:
                for i in range(100):
                    tx.send("bulk", BODY, message_id=f"bulk-{k}-{i}")
    return wait_durable_on_b(g)


def wait_durable_on_b(g: Group) -> int:
    a, b = g.nodes
    lsn = replication(a)["lsn"]
    wait_for(lambda: b.status()["following"]["durable_lsn"] == lsn, 15,
             "b to hold every entry durable", g.describe)
    return int(lsn)


def lose_b_and_send(g: Group, proxy: LinkProxy, *, kill: bool) -> int:
    """Cut b off (``kill``: kill -9 it too) and keep it from rejoining, wait until a
    dropped it, send MISSED more (acknowledged by a alone); returns a's LSN then."""
    a, b = g.nodes
    proxy.blocked.set()  # b's attempts to rejoin are swallowed …
    if kill:
        g.kill9(b)
    proxy.sever()  # … once its link is cut (or the proxy's side of a dead b's link)
    wait_for(lambda: not replication(a)["backups"], 15, "a to drop b", g.describe)
    with txbroker.connect(a.url, timeout=15, reconnect=False) as conn:
        for i in range(MISSED):
            conn.send("missed", BODY, message_id=f"missed-{i}")
    return int(replication(a)["lsn"])


def let_b_rejoin(g: Group, proxy: LinkProxy, *, start: bool) -> None:
    a, b = g.nodes
    if start:
        g.spawn(b)
    proxy.blocked.clear()
    g.wait_ready_backups(1, primary=a)


def store_then_cut_off_and_send(g: Group, proxy: LinkProxy) -> tuple[int, int]:
    """Store STORED messages (b has them), cut b's link and keep it cut, send MISSED
    more (acknowledged by a alone once it dropped b), let b rejoin; returns a's LSN
    at the cut and after the sends."""
    at_cut = store_bulk(g)
    after = lose_b_and_send(g, proxy, kill=False)
    assert after >= at_cut + MISSED
    let_b_rejoin(g, proxy, start=False)
    return at_cut, after


def b_alone_holds_everything(g: Group, after: int = 0, plain: int = 0) -> None:
    a, b = g.nodes
    g.kill9(a)
    g.promote(b)
    with txbroker.connect(b.url, timeout=15) as conn:
        for queue, count in (("bulk", STORED), ("missed", MISSED), ("after", after),
                             ("plain", plain)):
            if count:
                assert conn.queue_info(queue)["depth"] == count


def test_a_backup_that_lost_its_link_gets_only_the_suffix(tmp_path: Path) -> None:
    with pair_behind_a_proxy(tmp_path) as (g, proxy):
        a, b = g.nodes
        joined = replication(a)["catchup"]
        assert (joined["dumps"], joined["suffixes"]) == (1, 0)  # b's first join
        at_cut, after = store_then_cut_off_and_send(g, proxy)
        catchup = replication(a)["catchup"]
        assert catchup["dumps"] == 1  # no second dump
        assert catchup["suffixes"] == 1
        assert catchup["suffix_entries"] == after - at_cut  # exactly the entries missed
        # the bytes shipped follow the entries missed, not the state: 20 sends of 1 KiB
        # against a dump that held 300 (taken before they were stored, so a fresh dump
        # now would be larger still)
        assert MISSED * len(BODY) <= catchup["suffix_bytes"] < 2 * MISSED * len(BODY)
        assert catchup["held_bytes"] <= catchup["buffer_bytes"] == 64 * 1024 * 1024
        following = b.status()["following"]
        assert following["joined_by"] == "suffix" and following["resumes"] == 1
        assert following["applied_lsn"] == after
        [info] = replication(a)["backups"]
        assert info["joined_by"] == "suffix" and info["state"] == "ready"
        assert b.log_count("replication: following a from its dump") == 1
        assert b.log_has(f"resuming the copy of a from LSN {at_cut} (incremental catch-up")
        text = subprocess.run([sys.executable, "-m", "txbroker.cli", "ha", "status", "--url",
                               a.url], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert (f"joins: 1 dumps, 1 suffixes ({after - at_cut} entries, "
                f"{catchup['suffix_bytes']} bytes)") in text.stdout, text.stdout
        assert "link: unauthenticated, 0 refused" in text.stdout
        b_alone_holds_everything(g)


def test_a_backup_that_missed_more_than_the_buffer_gets_a_dump(tmp_path: Path) -> None:
    """A buffer of 4 KiB cannot hold 20 sends of 1 KiB: b's resume is answered with a
    dump, its kept copy is replaced, and it is whole again."""
    with pair_behind_a_proxy(tmp_path, "--ha-catchup-bytes", "4096") as (g, proxy):
        a, b = g.nodes
        store_then_cut_off_and_send(g, proxy)
        catchup = replication(a)["catchup"]
        assert (catchup["dumps"], catchup["suffixes"]) == (2, 0)
        assert catchup["held_bytes"] <= 4096 and catchup["buffer_bytes"] == 4096
        assert catchup["dump_entries"] > 0 and catchup["dump_bytes"] > STORED * len(BODY)
        assert b.status()["following"]["joined_by"] == "dump"
        assert b.log_count("replication: following a from its dump") == 2
        b_alone_holds_everything(g)


def test_a_restarted_backup_process_resumes_from_its_disk(tmp_path: Path) -> None:
    """The copy outlives the process: b, killed (-9) while a stores, and started again,
    recovers its own store, whose log says which LSN it holds (``REPLICA_AT``), and gets
    only the entries after it — those it held durable are not sent again, those a kill
    may have left unsynced are."""
    with pair_behind_a_proxy(tmp_path) as (g, proxy):
        a, b = g.nodes
        at_kill = store_bulk(g)
        after = lose_b_and_send(g, proxy, kill=True)
        let_b_rejoin(g, proxy, start=True)
        catchup = replication(a)["catchup"]
        assert (catchup["dumps"], catchup["suffixes"]) == (1, 1)  # b's first join only
        assert catchup["suffix_entries"] == after - at_kill  # exactly the entries missed
        assert MISSED * len(BODY) <= catchup["suffix_bytes"] < 2 * MISSED * len(BODY)
        following = b.status()["following"]
        assert following["joined_by"] == "suffix" and following["applied_lsn"] == after
        assert b.log_has(f"kept the copy on disk (epoch {following['epoch']}, LSN {at_kill})")
        assert b.log_count("replication: following a from its dump") == 1  # the first join
        b_alone_holds_everything(g)


def test_a_restarted_backup_whose_primary_moved_on_gets_a_dump(tmp_path: Path) -> None:
    """A buffer of 4 KiB cannot hold 20 sends of 1 KiB: b restarted on its copy asks to
    resume, and the answer is a dump that replaces the copy on its disk."""
    with pair_behind_a_proxy(tmp_path, "--ha-catchup-bytes", "4096") as (g, proxy):
        a, b = g.nodes
        with txbroker.connect(a.url, timeout=15, reconnect=False) as conn:
            conn.send("q", BODY)
        wait_durable_on_b(g)
        lose_b_and_send(g, proxy, kill=True)
        let_b_rejoin(g, proxy, start=True)
        catchup = replication(a)["catchup"]
        assert (catchup["dumps"], catchup["suffixes"]) == (2, 0)
        assert b.log_has("kept the copy on disk")
        assert b.status()["following"]["joined_by"] == "dump"
        with txbroker.connect(a.url, timeout=15, reconnect=False) as conn:
            conn.send("q", BODY)
        g.kill9(a)
        g.promote(b)
        with txbroker.connect(b.url, timeout=15) as conn:
            assert conn.queue_info("q")["depth"] == 2
            assert conn.queue_info("missed")["depth"] == MISSED


def _checkpoints_written(b: RNode) -> int:
    return int(b.status()["following"]["checkpoints"]["written"])


def test_a_restarted_backup_reads_its_checkpoint_then_only_the_log_after_it(
        tmp_path: Path) -> None:
    """With ``recovery_checkpoint``, a backup checkpoints its copy while it follows
    (``server/ha/replica_checkpoints.py``): killed (-9) and started again, it reads the
    checkpoint and replays only the entries logged after it, counts its primary's LSNs
    on from there, and gets exactly the suffix it missed; stopped cleanly, it closes
    with one (nothing after it). Promoted alone, it holds every acknowledged send."""
    config = tmp_path / "broker.toml"
    config.write_text("[server]\nrecovery_checkpoint = true\ncheckpoint_interval = 0.3\n")
    with pair_behind_a_proxy(tmp_path, "--config", str(config)) as (g, proxy):
        a, b = g.nodes
        with txbroker.connect(a.url, timeout=15, reconnect=False) as conn, \
                conn.transaction() as tx:
            for _ in range(PLAIN):  # settled: columns in the checkpoint, not lists
                tx.send("plain", BODY)
        store_bulk(g)
        written = _checkpoints_written(b)
        wait_for(lambda: _checkpoints_written(b) > written, 15, "b to checkpoint the bulk",
                 g.describe)
        with txbroker.connect(a.url, timeout=15, reconnect=False) as conn:
            for i in range(AFTER):  # logged after b's last checkpoint (its interval: 0.3 s)
                conn.send("after", BODY, message_id=f"after-{i}")
        at_kill = wait_durable_on_b(g)
        after = lose_b_and_send(g, proxy, kill=True)
        let_b_rejoin(g, proxy, start=True)
        replayed = re.findall(r"read a checkpoint, then the (\d+) entries logged after it",
                              b.log_path.read_text())
        assert len(replayed) == 1 and 0 < int(replayed[0]) < at_kill, replayed
        catchup = replication(a)["catchup"]
        assert (catchup["dumps"], catchup["suffixes"]) == (1, 1)
        assert catchup["suffix_entries"] == after - at_kill  # the count went on from it
        following = b.status()["following"]
        assert following["joined_by"] == "suffix" and following["applied_lsn"] == after
        assert b.log_has(f"kept the copy on disk (epoch {following['epoch']}, LSN {at_kill})")
        b.signal_and_wait(signal.SIGTERM)  # a clean stop: a checkpoint, nothing after it
        assert b.log_has("closing the copy with a checkpoint of its replay")
        let_b_rejoin(g, proxy, start=True)
        assert b.log_has("read a checkpoint, then the 0 entries logged after it")
        assert replication(a)["catchup"]["dumps"] == 1
        b_alone_holds_everything(g, after=AFTER, plain=PLAIN)
