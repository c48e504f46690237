"""The journal audit: the ``txbroker-journal`` source and ``txbroker audit``.

A real broker runs the workload of ``workload.py`` once per module; its
journal (after SIGTERM) is audited with the shared Spark session and every
table is checked against the workload's known counts. The CLI test starts
its own Spark once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib  # noqa: F401 - the report draws with it; missing, collection fails
import pytest

import txbroker
from tests.spark.workload import Workload, run_workload
from tests.support import ROOT, BrokerProcess
from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.errors import CorruptStore
from txbroker.spark.audit import run_audit
from txbroker.spark.journal_source import FORMAT_NAME, register_journal_source
from txbroker.storage.journal_format import (
    encode_entry,
    encode_segment_header,
    entry_size,
    segment_name,
)
from txbroker.storage.journal_reader import (
    SINK_COMMIT,
    JournalEntry,
    NoJournal,
    decode_record,
    journal_segments,
    read_records,
)
from txbroker.storage.journal_scan import (
    entry_spans,
)


@dataclass
class Journal:
    """A stopped broker's data directory and what was done to it."""

    data: Path
    workload: Workload


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Journal]:
    """The workload's journal, written by a real broker stopped with SIGTERM."""
    data = tmp_path_factory.mktemp("audit") / "data"
    proc = BrokerProcess(data).start()
    try:
        workload = run_workload(proc.url)
    finally:
        assert proc.stop() == 0
    yield Journal(data, workload)


def load(spark: Any, data: Path) -> Any:
    register_journal_source(spark)
    return spark.read.format(FORMAT_NAME).option("path", str(data)).load()


def kind_counts(frame: Any) -> Counter[str]:
    return Counter({row.kind_name: row["count"]
                    for row in frame.groupBy("kind_name").count().collect()})


# ---------------------------------------------------------------------- the source
def test_source_reads_one_row_per_record(spark: Any, journal: Journal) -> None:
    frame = load(spark, journal.data)
    rows = frame.orderBy("position").collect()
    assert rows == sorted(rows, key=lambda r: (r.segment_id, r.offset))
    assert len({r.position for r in rows}) == len(rows)
    kinds = Counter(r.kind_name for r in rows)
    assert kinds["ADD"] == 10  # orders 5, billing 2, work 1, scratch 2
    assert kinds["XA_PREPARE"] == 2 and kinds["XA_COMMIT"] == 1
    assert kinds["MOVE"] == 1 and kinds["DROP"] == 1
    assert all(r.meta_json is not None for r in rows)
    adds = [r for r in rows if r.kind == Kind.ADD]
    first = adds[0].messages[0]
    assert (first.queue, first.message_id, first.size) == ("orders", "o-0", len(b"order 0"))
    move = next(r for r in rows if r.kind == Kind.MOVE)
    assert (move.queue, move.reason) == ("work.dlq", "max_deliveries")
    prepares = {r.xid: r for r in rows if r.kind == Kind.XA_PREPARE}
    assert set(prepares) == {journal.workload.committed_xid, journal.workload.in_doubt_xid}
    assert len(prepares[journal.workload.committed_xid].consumed) == 1
    # the reader never writes: the files are exactly as the broker left them
    assert len(rows) == sum(1 for _ in read_records(journal.data))


def test_source_reads_a_live_broker(spark: Any, tmp_path: Path) -> None:
    proc = BrokerProcess(tmp_path / "data").start()
    try:
        with txbroker.connect(proc.url) as conn:
            for i in range(3):
                conn.send("live", f"m{i}".encode())
            xa = conn.xa_resource()
            xid = conn.xid(2, "live-branch", "b")
            xa.start(xid)
            conn.send("live", b"in-doubt")
            xa.end(xid)
            xa.prepare(xid)
            assert kind_counts(load(spark, proc.data)) >= Counter(ADD=3, XA_PREPARE=1)
            conn.send("live", b"after the read")  # the broker is unaffected
            assert kind_counts(load(spark, proc.data))["ADD"] == 4
            got = conn.receive("live", timeout=5)
            assert got is not None and got.body == b"m0"
    finally:
        proc.kill()


def test_torn_tail_ends_the_segment_and_damage_names_file_and_offset(
    spark: Any, journal: Journal, tmp_path: Path
) -> None:
    data = tmp_path / "copy"
    shutil.copytree(journal.data, data, ignore=shutil.ignore_patterns("lock"))
    last = data / "journal" / segment_name(journal_segments(data)[-1])
    whole = sum(1 for _ in read_records(data))
    spans = entry_spans(last.read_bytes())
    offset, length = spans[2]
    with open(last, "ab") as file:  # a record still being written
        file.write(last.read_bytes()[offset:offset + length // 2])
    assert sum(1 for _ in read_records(data)) == whole
    assert load(spark, data).count() == whole

    with open(last, "r+b") as file:  # one flipped byte in the middle of the log
        file.seek(offset + length - 6)
        byte = file.read(1)
        file.seek(offset + length - 6)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptStore) as info:
        list(read_records(data))
    assert info.value.path == str(last) and info.value.offset == offset
    with pytest.raises(Exception, match=rf"corrupt store: {last} at offset {offset}"):
        load(spark, data).count()
    with pytest.raises(CorruptStore) as failed:
        run_audit(data, tmp_path / "out", spark=spark)
    assert failed.value.path == str(last) and failed.value.offset == offset


def test_no_journal_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NoJournal, match=str(tmp_path / "missing")):
        run_audit(tmp_path / "missing", tmp_path / "out")


# ---------------------------------------------------------------------- old and new shapes
def entry(kind: int, meta: Any, bodies: int = 0) -> JournalEntry:
    packed = records.pack(meta)
    lengths = tuple(4 for _ in range(bodies))
    return JournalEntry(1, 24, entry_size(len(packed), list(lengths)), kind, packed, lengths)


OLD_MSG = [7, "q", "cid", {"h": "v"}, 4, 1000, 0, 0, 1]
NEW_MSG = [*OLD_MSG, 42]


def test_decoder_accepts_old_and_new_record_shapes() -> None:
    old = decode_record(entry(Kind.ADD, OLD_MSG, 1))["messages"][0]
    new = decode_record(entry(Kind.ADD, NEW_MSG, 1))["messages"][0]
    assert old["seq"] is None and new["seq"] == 42 and old["headers"] == [("h", "v")]
    assert decode_record(entry(Kind.TX, [[OLD_MSG], [3]], 1))["time_ms"] is None
    assert decode_record(entry(Kind.TX, [[NEW_MSG], [3], 5000], 1))["time_ms"] == 5000
    move = decode_record(entry(Kind.MOVE, [[7, 8], "dlq", "rejected", [1, 2]]))
    assert move["seqs"] == [{"id": 7, "seq": 1}, {"id": 8, "seq": 2}]
    assert decode_record(entry(Kind.MOVE, [[7], "dlq", "rejected"]))["seqs"] is None
    prepare = decode_record(entry(Kind.XA_PREPARE, ["x", [NEW_MSG], [[3, 1]], [], 10, 11], 1))
    assert (prepare["created_ms"], prepare["time_ms"]) == (10, 11)
    assert decode_record(entry(Kind.XA_PREPARE, ["x", [OLD_MSG], [], [], 10], 1))["time_ms"] \
        is None
    commit = decode_record(entry(Kind.XA_COMMIT, ["x", [9], [[7, 5]], 12]))
    assert (commit["discards"], commit["seqs"], commit["time_ms"]) == (
        [9], [{"id": 7, "seq": 5}], 12)
    assert decode_record(entry(Kind.XA_COMMIT, ["x", []]))["xid"] == "x"
    assert decode_record(entry(Kind.XA_ROLLBACK, "x"))["xid"] == "x"
    assert decode_record(entry(Kind.XA_ROLLBACK, ["x", 13]))["time_ms"] == 13
    heuristic = decode_record(entry(Kind.XA_HEURISTIC, ["x", "commit", [], [[7, 5]], 14]))
    assert (heuristic["outcome"], heuristic["time_ms"]) == ("commit", 14)
    assert decode_record(entry(Kind.XA_HEURISTIC, ["x", "rollback", []]))["seqs"] is None
    sink = decode_record(entry(SINK_COMMIT, ["s1", 3, [["x", [[7, 5]], [8]]], ["y"], 15]))
    assert sink["kind_name"] == "SINK_COMMIT" and sink["rolled_back"] == ["y"]
    assert sink["sink_branches"] == [{"xid": "x", "seqs": [{"id": 7, "seq": 5}],
                                      "discards": [8]}]
    short = decode_record(entry(SINK_COMMIT, ["s1", 3, [["x", [[7, 5]]]], [], 15]))
    assert short["sink_branches"][0]["discards"] == []
    snapshot = decode_record(entry(Kind.SNAPSHOT, {
        "next_id": 9, "queues": {"q": {"name": "q", "kind": "queue", "next_seq": 6}},
        "dups": {}, "sinks": {"s1": 3}, "xa": {"x": ["prepared", [], [], [], [], 10]}}))
    assert snapshot["branches"] == [{"xid": "x", "state": "prepared", "created_ms": 10}]
    relocated = decode_record(entry(Kind.RELOCATE_MANY, [OLD_MSG, NEW_MSG], 2))
    assert relocated["kind_name"] == "RELOCATE_MANY"
    assert [m["seq"] for m in relocated["messages"]] == [None, 42]
    unknown = decode_record(entry(99, [1, 2, 3]))
    assert unknown["kind"] == 99 and unknown["kind_name"] is None and unknown["meta_json"] is None
    with pytest.raises(CorruptStore, match="undecodable record of kind 4"):
        decode_record(entry(Kind.ADD, "not a message"), "seg-file")


def write_journal(data: Path, entries: list[tuple[int, Any, list[bytes]]]) -> None:
    """A one-segment journal holding ``entries`` (kind, meta, bodies)."""
    journal_dir = data / "journal"
    journal_dir.mkdir(parents=True)
    parts = [encode_segment_header(1)]
    for kind, meta, bodies in entries:
        packed = records.pack(meta)
        size = entry_size(len(packed), [len(b) for b in bodies])
        parts += encode_entry(kind, packed, bodies, size)
    (journal_dir / segment_name(1)).write_bytes(b"".join(parts))


def test_sink_commit_heuristics_and_unknown_kinds(spark: Any, tmp_path: Path) -> None:
    """A hand-written journal mixing old and new shapes: branches completed by a
    SINK_COMMIT, a heuristic one, an old-style rollback, a record of unknown kind."""
    def msg(message_id: int, queue: str = "out") -> list[Any]:
        return [message_id, queue, None, None, 4, 1000 + message_id, 0, 0, 0]

    write_journal(tmp_path / "data", [
        (Kind.XA_PREPARE, ["a", [msg(1), msg(5)], [], [], 100, 110], [b"one", b"five"]),
        (Kind.XA_PREPARE, ["b", [msg(2)], [], [], 100], [b"two"]),
        (Kind.XA_PREPARE, ["c", [msg(3)], [], [], 100], [b"three"]),
        (Kind.XA_PREPARE, ["d", [msg(4)], [], [], 100], [b"four"]),
        (SINK_COMMIT, ["sink-1", 7, [["a", [[1, 1]], [5]]], ["b"], 130], []),
        (Kind.XA_HEURISTIC, ["c", "commit", []], []),
        (Kind.XA_ROLLBACK, "d", []),
        (99, {"from": "the future"}, []),
    ])
    result = run_audit(tmp_path / "data", tmp_path / "out", spark=spark)
    assert result.counts["records"] == 8 and result.in_doubt == ["c"]
    branches = {r.xid: r for r in spark.read.parquet(str(tmp_path / "out/xa_branches"))
                .collect()}
    assert {x: b.state for x, b in branches.items()} == {
        "a": "committed", "b": "rolled_back", "c": "heuristic_committed", "d": "rolled_back"}
    assert [(h.state, h.time_ms) for h in branches["a"].history] == [
        ("prepared", 110), ("committed", 130)]
    fates = {r.id: (r.fate, r.seq) for r in spark.read.parquet(str(tmp_path / "out/messages"))
             .collect()}
    assert fates == {1: ("live", 1), 2: ("rolled_back", None), 3: ("live", None),
                     4: ("rolled_back", None), 5: ("dropped", None)}
    latency = spark.read.parquet(str(tmp_path / "out/transactions")).where("id = 'a'").first()
    assert (latency.outcome, latency.commit_latency_ms, latency.duration_ms) == (
        "committed", 20, 30)


# ---------------------------------------------------------------------- the audit tables
def test_audit_tables_match_the_workload(spark: Any, journal: Journal, tmp_path: Path) -> None:
    out = tmp_path / "out"
    workload = journal.workload
    result = run_audit(journal.data, out, spark=spark)
    assert result.in_doubt == [workload.in_doubt_xid]
    assert (out / "report.html").is_file()

    messages = {r.id: r for r in spark.read.parquet(str(out / "messages")).collect()}
    assert len(messages) == workload.plain_sends + workload.tx_sends + workload.xa_sends
    fates = Counter(r.fate for r in messages.values())
    assert fates == Counter(consumed=5, live=5, dropped=2, moved=1, in_doubt=1)
    by_client_id = {r.message_id: r for r in messages.values() if r.message_id}
    assert sorted(by_client_id) == [f"o-{i}" for i in range(5)]
    assert [by_client_id[f"o-{i}"].fate for i in range(5)] == ["consumed"] * 4 + ["live"]
    assert [by_client_id[f"o-{i}"].seq for i in range(5)] == [1, 2, 3, 4, 5]
    poison = next(r for r in messages.values() if r.queue == "work")
    assert (poison.fate, poison.moved_to, poison.move_reason) == (
        "moved", "work.dlq", "max_deliveries")
    shipped = {r.xid: r for r in messages.values() if r.queue == "shipments"}
    assert shipped[workload.committed_xid].fate == "live"
    assert shipped[workload.committed_xid].seq == 1
    assert shipped[workload.in_doubt_xid].fate == "in_doubt"
    assert all(r.sent_ms and r.size for r in messages.values())

    dead = spark.read.parquet(str(out / "dead_letters")).collect()
    assert sorted(r.reason for r in dead) == ["max_deliveries", "purged", "purged"]

    branches = {r.xid: r for r in spark.read.parquet(str(out / "xa_branches")).collect()}
    assert {x: b.state for x, b in branches.items()} == {
        workload.committed_xid: "committed", workload.in_doubt_xid: "prepared"}
    history = branches[workload.committed_xid].history
    assert [h.state for h in history] == ["prepared", "committed"]
    assert history[0].position < history[1].position
    in_doubt = spark.read.parquet(str(out / "in_doubt")).collect()
    assert [(r.xid, r.state, r.sends) for r in in_doubt] == [(workload.in_doubt_xid,
                                                              "prepared", 1)]

    transactions = spark.read.parquet(str(out / "transactions")).collect()
    xa = {r.xid: r for r in transactions if r.kind == "xa"}
    assert {x: (r.outcome, r.sends, r.acks) for x, r in xa.items()} == {
        workload.committed_xid: ("committed", 1, 1), workload.in_doubt_xid: ("prepared", 1, 0)}
    assert xa[workload.committed_xid].commit_latency_ms is not None
    local = [r for r in transactions if r.kind != "xa" and r.sends]
    assert [(r.sends, r.acks, r.outcome) for r in local] == [(2, 1, "committed")]
    acks_only = [r for r in transactions if r.kind != "xa" and not r.sends]
    assert sum(r.acks for r in acks_only) == workload.acked


def test_cli_audit_end_to_end(journal: Journal, tmp_path: Path, java: None) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "COLUMNS": "200", "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "audit", "--data", str(journal.data),
         "--out", str(out), "--master", "local[2]"],
        cwd=ROOT, env=env, text=True, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "audit: read journal" in done.stderr  # progress lines (not a terminal)
    assert journal.workload.in_doubt_xid in done.stdout
    report = (out / "report.html").read_text()
    assert journal.workload.in_doubt_xid in report
    assert report.count("data:image/png;base64,") == 4
    for table in ("messages", "transactions", "xa_branches", "in_doubt", "dead_letters"):
        assert any((out / table).glob("*.parquet")), table

    missing = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "audit", "--data", str(tmp_path / "nothing"),
         "--out", str(out)], cwd=ROOT, env=env, text=True, capture_output=True, timeout=60)
    assert missing.returncode != 0
    assert str(tmp_path / "nothing") in missing.stderr
