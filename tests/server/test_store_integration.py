"""The broker and its journal together: compaction, limits, shutdown."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import txbroker
from tests.support import BrokerProcess
from txbroker.errors import TooManyConnections


def _disk(conn: txbroker.Connection) -> tuple[int, int]:
    store = conn.stats()["store"]
    return int(store["segments"]), int(store["disk_bytes"])


def test_compaction_keeps_disk_proportional_to_live_data(tmp_path: Path) -> None:
    proc = BrokerProcess(tmp_path / "data", "--segment-size", str(64 * 1024)).start()
    try:
        body = b"p" * 1024
        with txbroker.connect(proc.url) as conn:
            for i in range(5):
                conn.send("pinned", b"pin-%d" % i)
            # one send, one entry: pipelined sends are coalesced into batches whose size
            # follows the timing, and a few large entries could fill only ten segments
            for _ in range(3000):
                conn.send("flow", body)
            segments_full, disk_full = _disk(conn)
            assert segments_full > 10
            sub = conn.subscribe("flow", prefetch=500)
            for _ in range(3000):
                msg = sub.get(timeout=10)
                assert msg is not None
                msg.ack()
            sub.close()
            conn.ping()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                segments, disk = _disk(conn)
                if segments <= 4:
                    break
                time.sleep(0.5)
            assert segments <= 4, f"still {segments} segments ({disk} bytes)"
            assert disk < disk_full / 10
        proc.stop()
        proc.start()
        with txbroker.connect(proc.url) as conn:
            pinned = []
            while (msg := conn.receive("pinned", timeout=0)) is not None:
                pinned.append(msg.body)
                msg.ack()
            assert pinned == [b"pin-%d" % i for i in range(5)]
            assert conn.queue_info("flow")["depth"] == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("store", ["journal", "dir"])
def test_body_cache_setting_and_its_size_in_stats(tmp_path: Path, store: str) -> None:
    """``--body-cache-bytes`` bounds the bodies a broker keeps in memory; ``stats()``
    reports what the cache holds (the default: every recent body; 0: none)."""
    for setting, expected in ((None, 10 * 1000), ("2500", 2 * 1000), ("0", 0)):
        args = ["--store", store] + (["--body-cache-bytes", setting] if setting else [])
        proc = BrokerProcess(tmp_path / f"data-{setting}", *args).start()
        try:
            with txbroker.connect(proc.url) as conn:
                for i in range(10):
                    conn.send("cached", bytes([65 + i]) * 1000)
                assert conn.stats()["store"]["body_cache_bytes"] == expected
                got = [conn.receive("cached", timeout=10) for _ in range(10)]
                assert [m.body[:1] for m in got if m is not None] == \
                    [bytes([65 + i]) for i in range(10)]  # read from disk past the cache
        finally:
            proc.kill()


def test_a_negative_body_cache_is_refused(tmp_path: Path) -> None:
    proc = BrokerProcess(tmp_path / "data", "--body-cache-bytes", "-1")
    with pytest.raises(RuntimeError, match="body_cache_bytes must be >= 0"):
        proc.start()


def test_max_connections(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text("[server]\nmax_connections = 2\n")
    with BrokerProcess(tmp_path / "data", "--config", str(config)) as proc:
        first = txbroker.connect(proc.url)
        second = txbroker.connect(proc.url)
        with pytest.raises((TooManyConnections, txbroker.ConnectionLost)):
            txbroker.connect(proc.url, reconnect=False)
        first.close()
        time.sleep(0.2)
        third = txbroker.connect(proc.url, reconnect=False)
        third.ping()
        third.close()
        second.close()


def test_sigterm_flushes_pending_writes(tmp_path: Path) -> None:
    proc = BrokerProcess(tmp_path / "data").start()
    try:
        with txbroker.connect(proc.url) as conn:
            futures = [conn.send_nowait("q", b"%d" % i) for i in range(2000)]
            for fut in futures:
                fut.result()
        assert proc.stop() == 0
        proc.start()
        with txbroker.connect(proc.url) as conn:
            assert conn.queue_info("q")["depth"] == 2000
    finally:
        proc.kill()


def test_corrupt_journal_refuses_to_start_then_repair(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = BrokerProcess(data, "--segment-size", str(64 * 1024)).start()
    with txbroker.connect(proc.url) as conn:
        for _ in range(200):  # one by one: many entries over several segments
            conn.send("q", b"m" * 1000)
    proc.stop()
    first = sorted((data / "journal").glob("*.seg"))[0]
    raw = bytearray(first.read_bytes())
    raw[5000] ^= 0x40  # one flipped bit inside an old segment
    first.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="corrupt"):
        proc.start()
    repaired = BrokerProcess(data, "--repair", port=proc.port).start()
    try:
        with txbroker.connect(repaired.url) as conn:
            depth = conn.queue_info("q")["depth"]
            assert 100 < depth < 200  # the damaged group entry is dropped, the rest kept
    finally:
        repaired.kill()


def test_dir_store_broker_keeps_xa_branches_as_the_seed_says(tmp_path: Path) -> None:
    """Through a real ``--store dir`` broker: a prepared branch is its command blocks
    in ``prepared/`` named ``<GTRID>-<n>``; it survives a kill -9 as PREPARED; its
    commit moves the message to ``committed/<id>`` and removes the consumed one."""
    data = tmp_path / "data"
    args = ("--store", "dir", "--dir-flags", "FDATASYNC,DSYNC")
    proc = BrokerProcess(data, *args).start()
    try:
        with txbroker.connect(proc.url) as conn:
            conn.send("orders", b"order-1")
            xid = conn.xid(7, b"\x0a\x0b", b"broker")
            conn.tpc_begin(xid)
            msg = conn.receive("orders", timeout=5)
            assert msg is not None and msg.body == b"order-1"
            msg.ack()
            conn.send("shipments", b"ship order-1")
            conn.tpc_prepare()
        names = sorted(p.name for p in (data / "prepared").iterdir())
        assert names == ["0A0B-000", "0A0B-001", "0A0B-002"]  # the Xid, the send, the ack
        assert sorted(p.name for p in (data / "active").iterdir()) == []
        proc.kill()
        proc = BrokerProcess(data, *args, port=proc.port).start()
        with txbroker.connect(proc.url) as conn:
            assert [str(x) for x in conn.tpc_recover()] == [str(xid)]
            assert conn.queue_info("shipments")["depth"] == 0
            conn.tpc_commit(xid)
            assert conn.tpc_recover() == []
            assert sorted(p.name for p in (data / "prepared").iterdir()) == []
            shipped = conn.receive("shipments", timeout=5)
            assert shipped is not None and shipped.body == b"ship order-1"
            assert conn.receive("orders", timeout=0.2) is None
            shipped.ack(wait=True)
        assert sorted(p.name for p in (data / "committed").iterdir()) == []
    finally:
        proc.kill()
