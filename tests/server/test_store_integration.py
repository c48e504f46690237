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
            futures = [conn.send_nowait("flow", body) for _ in range(3000)]
            for fut in futures:
                fut.result()
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
        futures = [conn.send_nowait("q", b"m" * 1000) for _ in range(200)]
        for fut in futures:
            fut.result()
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


def test_dir_store_broker_serves_and_refuses_xa_clearly(tmp_path: Path) -> None:
    from txbroker.errors import XAError

    with BrokerProcess(tmp_path / "data", "--store", "dir", "--dir-flags", "FDATASYNC") as proc:
        with txbroker.connect(proc.url) as conn:
            conn.send("q", b"on disk as files")
            with pytest.raises(XAError, match="does not support XA"):
                conn.tpc_begin(conn.xid(1, b"gtrid", b"bqual"))
            msg = conn.receive("q", timeout=5)
            assert msg is not None and msg.body == b"on disk as files"
            msg.ack(wait=True)
        committed = list((tmp_path / "data" / "committed").iterdir())
        assert committed == []
