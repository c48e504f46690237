"""The record vocabulary (``core/records``): exact bytes, every historical shape, one
clear error for a malformed record, and encode → decode round trips.

The golden bytes below were written out from the encoder as it was before the
record classes (``msgpack.packb(meta_list, use_bin_type=True)`` of the positional
lists): the journal's format and the replication wire must not change.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txbroker.core import records
from txbroker.core.records import (
    RECORD_CLASSES,
    Ack,
    Add,
    Drop,
    Kind,
    MalformedRecord,
    Move,
    QueueDelete,
    QueuePut,
    Relocate,
    RelocateMany,
    ReplicaAt,
    SinkBranch,
    SinkCommit,
    Snapshot,
    SnapshotBranch,
    Tx,
    Update,
    XaCommit,
    XaForget,
    XaHeuristic,
    XaPrepare,
    XaRollback,
)
from txbroker.errors import CorruptStore

XID = "1:ab:cd"
MSG = [7, "q", "m-1", {"h": "v"}, 4, 1000, 0, 0, 1, 3]  #: 10 fields (with seq)
MSG9 = [8, "q", None, None, 4, 1000, 2000, 0, 0]  #: written before seqs
DEF = {"name": "q", "kind": "queue", "topic": None, "settings": {}, "next_seq": 4,
       "delivered_seq": 2}

#: (record as the writers build it, its bytes as the old positional encoder wrote them)
GOLDEN: list[tuple[Any, str]] = [
    (Snapshot(9, {"q": DEF}, {"q": ["m-1"]},
              {XID: SnapshotBranch("prepared", [MSG], [b"\x01\x02"], [[5, 1]], [], 100)},
              {"s": 3}),
     "85a76e6578745f696409a671756575657381a17186a46e616d65a171a46b696e64a57175657565a574"
     "6f706963c0a873657474696e677380a86e6578745f73657104ad64656c6976657265645f73657102a4"
     "6475707381a17191a36d2d31a2786181a7313a61623a636496a87072657061726564919a07a171a36d"
     "2d3181a168a17604cd03e80000010391c4020102919205019064a573696e6b7381a17303"),
    (QueuePut({"name": "t", "kind": "topic", "topic": None, "settings": {}}),
     "84a46e616d65a174a46b696e64a5746f706963a5746f706963c0a873657474696e677380"),
    (QueueDelete("q"), "a171"),
    (Add(MSG), "9a07a171a36d2d3181a168a17604cd03e800000103"),
    (Tx([MSG], [5, 6], 1234), "93919a07a171a36d2d3181a168a17604cd03e800000103920506cd04d2"),
    (Ack([5, 6]), "920506"),
    (Drop([5], "expired"), "929105a765787069726564"),
    (Move([5], "dlq", "max_deliveries", [1]), "949105a3646c71ae6d61785f64656c697665726965739101"),
    (Update(5, 2, 3000), "930502cd0bb8"),
    (Relocate(MSG), "9a07a171a36d2d3181a168a17604cd03e800000103"),
    (XaPrepare(XID, [MSG], [[5, 1]], [7], 100, 200),
     "96a7313a61623a6364919a07a171a36d2d3181a168a17604cd03e80000010391920501910764ccc8"),
    (XaCommit(XID, [7], [[8, 2]], 300), "94a7313a61623a6364910791920802cd012c"),
    (XaRollback(XID, 300), "92a7313a61623a6364cd012c"),
    (XaHeuristic(XID, "commit", [], [[7, 2]], 400),
     "95a7313a61623a6364a6636f6d6d69749091920702cd0190"),
    (XaForget(XID), "a7313a61623a6364"),
    (SinkCommit("s", 3, [SinkBranch(XID, [[7, 2]], [])], ["1:ab:ce"], 500),
     "95a173039193a7313a61623a6364919207029091a7313a61623a6365cd01f4"),
    (RelocateMany([MSG, MSG9]),
     "929a07a171a36d2d3181a168a17604cd03e8000001039908a171c0c004cd03e8cd07d00000"),
    (ReplicaAt("e1", 42), "92a265312a"),
]

#: Shapes written before a field existed: (record, its old bytes).
HISTORICAL: list[tuple[Any, str]] = [
    (Tx([MSG9], []), "92919908a171c0c004cd03e8cd07d0000090"),  # a record group; msg w/o seq
    (Move([5], "dlq", "moved"), "939105a3646c71a56d6f766564"),  # before seqs
    (XaPrepare(XID, [MSG9], [], [], 100),  # before prepared_ms
     "95a7313a61623a6364919908a171c0c004cd03e8cd07d00000909064"),
    (XaCommit(XID, []), "92a7313a61623a636490"),  # before seqs and times
    (XaCommit(XID, [], [[7, 1]]), "93a7313a61623a63649091920701"),  # before committed_ms
    (XaRollback(XID), "a7313a61623a6364"),  # the bare xid
    (XaHeuristic(XID, "rollback", []), "93a7313a61623a6364a8726f6c6c6261636b90"),
    (XaHeuristic(XID, "commit", [], [[7, 1]]), "94a7313a61623a6364a6636f6d6d69749091920701"),
    (SinkCommit("s", 3, [SinkBranch(XID, [[7, 2]])], []),  # before discards and at_ms
     "94a173039192a7313a61623a63649192070290"),
    (Snapshot(1, {}, {}), "83a76e6578745f696401a671756575657380a46475707380"),  # no xa, sinks
    (Snapshot(1, {}, {}, replica=ReplicaAt("e1", 42)),  # a backup's: where its copy stands
     "84a76e6578745f696401a671756575657380a46475707380a77265706c69636192a265312a"),
]


def test_one_class_per_kind() -> None:
    assert sorted(RECORD_CLASSES) == sorted(int(k) for k in Kind)
    assert len(set(RECORD_CLASSES.values())) == len(Kind)
    assert [record.kind for record, _ in GOLDEN] == sorted(int(k) for k in Kind)
    assert all(RECORD_CLASSES[record.kind] is type(record) for record, _ in GOLDEN)


@pytest.mark.parametrize(("record", "golden"), GOLDEN + HISTORICAL,
                         ids=lambda v: type(v).__name__ if not isinstance(v, str) else "")
def test_golden_bytes_round_trip(record: Any, golden: str) -> None:
    data = bytes.fromhex(golden)
    assert record.encode() == data
    decoded = records.decode(record.kind, data)
    assert type(decoded) is type(record)
    assert decoded == record
    assert decoded.encode() == data  # a decoded record writes back its own bytes
    assert type(record).decode(data) == record


def test_prepared_ms_of_a_record_written_before_it_is_the_creation_time() -> None:
    old = XaPrepare.decode(bytes.fromhex(HISTORICAL[2][1]))
    assert (old.prepared_ms, old.prepared_or_created) == (None, 100)
    assert XaPrepare(XID, [], [], [], 100, 250).prepared_or_created == 250


def _meta(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


#: Malformed metas: (kind, value) — truncated, extra, or a field of the wrong type.
MALFORMED: list[tuple[Kind, Any]] = [
    (Kind.ADD, MSG[:8]),  # a msg cut short
    (Kind.ADD, [*MSG, 0]),  # an 11th field
    (Kind.ADD, ["7", *MSG[1:]]),  # id as text
    (Kind.ADD, [7, "q", 5, *MSG[3:]]),  # client id as int
    (Kind.ADD, [7, "q", None, ["h"], *MSG[4:]]),  # headers as list
    (Kind.ADD, [7, "q", None, None, 4, 1000, 0, 0, True, 3]),  # a bool is not a count
    (Kind.RELOCATE, "x"),
    (Kind.RELOCATE_MANY, [MSG, MSG9[:3]]),
    (Kind.TX, [[MSG]]),
    (Kind.TX, [[MSG], [5], 1, 2]),
    (Kind.TX, [[MSG], ["5"]]),
    (Kind.TX, [MSG, []]),  # the msgs not wrapped in a list
    (Kind.ACK, 5),
    (Kind.ACK, [5, None]),
    (Kind.DROP, [[5]]),
    (Kind.DROP, [[5], 3]),
    (Kind.MOVE, [[5], "dlq"]),
    (Kind.MOVE, [[5], "dlq", "moved", [1], 9]),
    (Kind.MOVE, [[5, 6], "dlq", "moved", [1]]),  # one seq per id
    (Kind.UPDATE, [5, 2]),
    (Kind.UPDATE, [5, 2, 3, 4]),
    (Kind.UPDATE, [5, "2", 3]),
    (Kind.QUEUE_PUT, {"name": "q"}),
    (Kind.QUEUE_PUT, {"name": "q", "kind": "exchange"}),
    (Kind.QUEUE_DELETE, ["q"]),
    (Kind.SNAPSHOT, [1]),
    (Kind.SNAPSHOT, {"queues": {}, "dups": {}}),
    (Kind.SNAPSHOT, {"next_id": 1, "queues": {}, "dups": {}, "extra": 1}),
    (Kind.SNAPSHOT, {"next_id": 1, "queues": {}, "dups": {}, "xa": {XID: ["prepared"]}}),
    (Kind.SNAPSHOT, {"next_id": 1, "queues": {}, "dups": {},
                     "xa": {XID: ["prepared", [MSG], [], [], [], 0]}}),  # a ref per send
    (Kind.XA_PREPARE, [XID, [MSG], [], [], 100, 200, 300]),
    (Kind.XA_PREPARE, [XID, [MSG], [], []]),
    (Kind.XA_PREPARE, [XID, [MSG], [[5]], [], 100]),
    (Kind.XA_PREPARE, [b"xid", [], [], [], 100]),
    (Kind.XA_COMMIT, [XID]),
    (Kind.XA_COMMIT, [XID, [], [], 1, 2]),
    (Kind.XA_COMMIT, [XID, [], [[1, 2, 3]]]),
    (Kind.XA_ROLLBACK, [XID]),
    (Kind.XA_ROLLBACK, 5),
    (Kind.XA_HEURISTIC, [XID, "maybe", []]),
    (Kind.XA_HEURISTIC, [XID, "commit"]),
    (Kind.XA_FORGET, [XID]),
    (Kind.SINK_COMMIT, ["s", 3, [], []][:3]),
    (Kind.SINK_COMMIT, ["s", "3", [], []]),
    (Kind.SINK_COMMIT, ["s", 3, [[XID]], []]),
    (Kind.SINK_COMMIT, ["s", 3, [], [5]]),
    (Kind.REPLICA_AT, ["e1"]),
    (Kind.REPLICA_AT, ["e1", -1]),  # an LSN is never negative
    (Kind.REPLICA_AT, [1, 2]),
    (Kind.REPLICA_AT, ["e1", 2, 3]),
    (Kind.SNAPSHOT, {"next_id": 1, "queues": {}, "dups": {}, "replica": ["e1"]}),
]


@pytest.mark.parametrize(("kind", "value"), MALFORMED)
def test_malformed_records_raise_one_clear_error(kind: Kind, value: Any) -> None:
    with pytest.raises(MalformedRecord, match=r"malformed .*record"):
        records.decode(int(kind), _meta(value))
    assert issubclass(MalformedRecord, ValueError)  # as every refused record was


@pytest.mark.parametrize("meta", [b"", b"\xc1", b"\x92\x01", _meta(1) + b"\x00"])
def test_undecodable_meta(meta: bytes) -> None:
    with pytest.raises(MalformedRecord, match="undecodable meta"):
        records.decode(int(Kind.ACK), meta)


def test_unknown_kind() -> None:
    with pytest.raises(MalformedRecord, match="unknown record kind 99"):
        records.decode(99, _meta([]))


def test_replay_turns_a_malformed_record_into_corrupt_store_not_index_error() -> None:
    from txbroker.core import Broker

    broker = Broker()
    for kind, value in MALFORMED:
        with pytest.raises(CorruptStore, match="malformed"):
            broker.replay(records.StoredEntry(int(kind), _meta(value), ()))


# ---------------------------------------------------------------------- properties
ints = st.integers(min_value=0, max_value=2**63 - 1)
ids = st.lists(ints, max_size=4)
texts = st.text(max_size=8)
pairs = st.lists(st.lists(ints, min_size=2, max_size=2), max_size=3)
msgs = st.builds(
    lambda head, tail: head + tail,
    st.tuples(ints, texts, st.none() | texts,
              st.none() | st.dictionaries(texts, texts, max_size=2)).map(list),
    st.lists(ints, min_size=5, max_size=6))
msg_lists = st.lists(msgs, max_size=3)
optional_ints = st.none() | ints
definitions = st.builds(lambda name, kind: {"name": name, "kind": kind, "topic": None,
                                            "settings": {}},
                        texts, st.sampled_from(["queue", "topic"]))
snapshot_branches = msg_lists.flatmap(lambda sends: st.builds(
    SnapshotBranch, texts, st.just(sends),
    st.lists(st.none() | st.binary(max_size=4), min_size=len(sends), max_size=len(sends)),
    pairs, ids, ints))

RECORDS = st.one_of(
    st.builds(Snapshot, ints, st.dictionaries(texts, definitions, max_size=2),
              st.dictionaries(texts, st.lists(texts, max_size=2), max_size=2),
              st.none() | st.dictionaries(texts, snapshot_branches, max_size=2),
              st.none() | st.dictionaries(texts, ints, max_size=2)),
    st.builds(QueuePut, definitions),
    st.builds(QueueDelete, texts),
    st.builds(Add, msgs),
    st.builds(Relocate, msgs),
    st.builds(RelocateMany, msg_lists),
    st.builds(Tx, msg_lists, ids, optional_ints),
    st.builds(Ack, ids),
    st.builds(Drop, ids, texts),
    ids.flatmap(lambda moved: st.builds(
        Move, st.just(moved), texts, texts,
        st.none() | st.lists(ints, min_size=len(moved), max_size=len(moved)))),
    st.builds(Update, ints, ints, ints),
    st.builds(XaPrepare, texts, msg_lists, pairs, ids, ints, optional_ints),
    st.builds(XaCommit, texts, ids, st.none() | pairs).flatmap(
        lambda r: st.builds(XaCommit, st.just(r.xid), st.just(r.discards), st.just(r.seqs),
                            st.none() if r.seqs is None else optional_ints)),
    st.builds(XaRollback, texts, optional_ints),
    st.builds(XaHeuristic, texts, st.sampled_from(["commit", "rollback"]), ids,
              st.none() | pairs).flatmap(
        lambda r: st.builds(XaHeuristic, st.just(r.xid), st.just(r.outcome),
                            st.just(r.discards), st.just(r.seqs),
                            st.none() if r.seqs is None else optional_ints)),
    st.builds(XaForget, texts),
    st.builds(SinkCommit, texts, ints,
              st.lists(st.builds(SinkBranch, texts, pairs, st.none() | ids), max_size=2),
              st.lists(texts, max_size=2), optional_ints),
)


@settings(max_examples=300, deadline=None)
@given(RECORDS)
def test_encode_decode_round_trip(record: Any) -> None:
    data = record.encode()
    decoded = records.decode(record.kind, data)
    assert decoded == record
    assert decoded.encode() == data
