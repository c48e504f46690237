"""The router's journal records (``core/router/records.py``): exact bytes, what each
writer builds, one clear error for a malformed record, and a restart that reports
(never loads) one.

The golden bytes below were written out by the writers as they were before the
router records had classes (``msgpack.packb(body_map, use_bin_type=True)`` of the
maps ``journal_record``, ``Tombstone.record_body`` and ``facilities.store`` built):
the journal's format and the replication wire must not change. The end-to-end
digest pins every entry (meta and bodies) a scripted router run writes; it was
taken before the classes too.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from tests.core.harness import Harness
from tests.core.test_router import Rig
from txbroker.core.records import StoredEntry, pack, unpack
from txbroker.core.router.model import Partition, Site, parse_facility
from txbroker.core.router.records import (
    FACILITY_KEYS,
    PARTITION_KEYS,
    TOMB_KEYS,
    TX_KEYS,
    FacilityRecord,
    TombRecord,
    TxRecord,
    decode,
)
from txbroker.core.router.states import Participant, Transaction, TxState
from txbroker.core.router.tombstones import Tombstone
from txbroker.errors import MalformedRecord


def transaction(state: TxState, reason: str | None = None, shadow: bool = False
                ) -> Transaction:
    """A transaction of two messages on two partitions (one struck once)."""
    tx = Transaction("t-1", "bank", None, 1000)
    tx.messages = [("p1", 5, b"\x00body", {"h": "v"}), ("p2", 12, b"two", None)]
    tx.participants[("p1", Site.PRIMARY)] = Participant(tx, "p1", Site.PRIMARY, strikes=1)
    tx.participants[("p2", Site.PRIMARY)] = Participant(tx, "p2", Site.PRIMARY)
    if shadow:
        tx.participants[("p2", Site.SECONDARY)] = Participant(tx, "p2", Site.SECONDARY,
                                                              strikes=2)
    tx.state, tx.reason, tx.decided_ms = state, reason, 2000
    tx.flagged_ms = 3000 if state is TxState.EXCEPTION else 0
    return tx


def facility(name: str, partitions: list[dict[str, Any]]) -> FacilityRecord:
    return FacilityRecord.of(parse_facility(name, partitions))


MESSAGES: list[Any] = [("p1", 5, b"\x00body", {"h": "v"}), ("p2", 12, b"two", None)]

#: (what the writers build, its bytes)
GOLDEN: list[tuple[str, Any, str]] = [
    ("tx VREQ", TxRecord.of(transaction(TxState.VREQ)),
     "8ca172a27478a3746964a3742d31a8666163696c697479a462616e6ba57374617465a456524551a6726561"
     "736f6ec0a9657863657074696f6ec2a7737472696b657382a2703101a2703200a86d657373616765739294"
     "a2703105c40500626f647981a168a17694a270320cc40374776fc0aa637265617465645f6d73cd03e8aa64"
     "6563696465645f6d73cd07d0aa666c61676765645f6d7300a8736861646f77656490"),
    ("tx deciding, shadowed", TxRecord.of(
        transaction(TxState.COMMIT_DECIDING, "ACCEPTED", shadow=True)),
     "8ca172a27478a3746964a3742d31a8666163696c697479a462616e6ba57374617465aa434f4d4d49545449"
     "4e47a6726561736f6ea84143434550544544a9657863657074696f6ec2a7737472696b657382a2703101a2"
     "703202a86d657373616765739294a2703105c40500626f647981a168a17694a270320cc40374776fc0aa63"
     "7265617465645f6d73cd03e8aa646563696465645f6d73cd07d0aa666c61676765645f6d7300a873686164"
     "6f77656491a27032"),
    ("tx exception", TxRecord.of(transaction(TxState.EXCEPTION, "SRVDIED")),
     "8ca172a27478a3746964a3742d31a8666163696c697479a462616e6ba57374617465a841424f5254494e47"
     "a6726561736f6ea753525644494544a9657863657074696f6ec3a7737472696b657382a2703101a2703200"
     "a86d657373616765739294a2703105c40500626f647981a168a17694a270320cc40374776fc0aa63726561"
     "7465645f6d73cd03e8aa646563696465645f6d73cd07d0aa666c61676765645f6d73cd0bb8a8736861646f"
     "77656490"),
    ("facility int", facility(
        "bank", [{"name": "p2", "low": 10, "high": 19, "retry_count": 5},
                 {"name": "p1", "low": 0, "high": 9}]),
     "84a172a8666163696c697479a46e616d65a462616e6ba86b65795f74797065a3696e74aa706172746974"
     "696f6e739285a46e616d65a27031a36c6f7700a46869676809ab72657472795f636f756e7403af766f74"
     "655f74696d656f75745f6d73cd753085a46e616d65a27032a36c6f770aa46869676813ab72657472795f"
     "636f756e7405af766f74655f74696d656f75745f6d73cd7530"),
    ("facility str", facility(
        "names", [{"name": "am", "low": "a", "high": "m", "vote_timeout_ms": 500}]),
     "84a172a8666163696c697479a46e616d65a56e616d6573a86b65795f74797065a3737472aa706172746974"
     "696f6e739185a46e616d65a2616da36c6f77a161a468696768a16dab72657472795f636f756e7403af766f"
     "74655f74696d656f75745f6d73cd01f4"),
    # written since the partitions' shadow sites became durable (an optional key, last)
    ("facility shadowed", FacilityRecord.of(parse_facility(
        "bank", [{"name": "p1", "low": 0, "high": 9}, {"name": "p2", "low": 10, "high": 19}]),
        ["p2"]),
     "85a172a8666163696c697479a46e616d65a462616e6ba86b65795f74797065a3696e74aa70617274697469"
     "6f6e739285a46e616d65a27031a36c6f7700a46869676809ab72657472795f636f756e7403af766f74655f"
     "74696d656f75745f6d73cd753085a46e616d65a27032a36c6f770aa46869676813ab72657472795f636f75"
     "6e7403af766f74655f74696d656f75745f6d73cd7530a8736861646f77656491a27032"),
    ("tomb accepted", Tombstone("t-9", "bank", "ACCEPTED", None, 99).to_record(),
     "86a172a4746f6d62a3746964a3742d39a8666163696c697479a462616e6ba57374617465a8414343455054"
     "4544a6726561736f6ec0a8756e74696c5f6d7363"),
    ("tomb unknown", Tombstone("t-8", None, "UNKNOWN", "UNKNOWN", 98).to_record(),
     "86a172a4746f6d62a3746964a3742d38a8666163696c697479c0a57374617465a7554e4b4e4f574ea67265"
     "61736f6ea7554e4b4e4f574ea8756e74696c5f6d7362"),
    ("tomb rejected", Tombstone("t-7", "bank", "REJECTED", "VOTED", 97).to_record(),
     "86a172a4746f6d62a3746964a3742d37a8666163696c697479a462616e6ba57374617465a852454a454354"
     "4544a6726561736f6ea5564f544544a8756e74696c5f6d7361"),
]


@pytest.mark.parametrize(("name", "record", "golden"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_bytes_round_trip(name: str, record: Any, golden: str) -> None:
    data = bytes.fromhex(golden)
    assert record.encode() == data
    decoded = decode(data)
    assert type(decoded) is type(record)
    assert decoded == record
    assert decoded.encode() == data  # a decoded record writes back its own bytes


def test_the_writers_build_these_fields() -> None:
    """What ``TxRecord.of``, ``FacilityRecord.of`` and ``Tombstone.to_record`` take from
    the router's state (the golden bytes above are of these)."""
    assert TxRecord.of(transaction(TxState.COMMIT_DECIDING, "ACCEPTED", shadow=True)) == \
        TxRecord("t-1", "bank", "COMMITTING", "ACCEPTED", False, {"p1": 1, "p2": 2}, MESSAGES,
                 1000, 2000, 0, ["p2"])
    assert TxRecord.of(transaction(TxState.EXCEPTION, "SRVDIED")) == TxRecord(
        "t-1", "bank", "ABORTING", "SRVDIED", True, {"p1": 1, "p2": 0}, MESSAGES, 1000, 2000,
        3000, [])
    assert TxRecord.of(transaction(TxState.ABORT_DECIDING)).state == "ABORTING"
    assert facility("bank", [{"name": "p2", "low": 10, "high": 19, "retry_count": 5},
                             {"name": "p1", "low": 0, "high": 9}]).facility.partitions == [
        Partition("p1", 0, 9), Partition("p2", 10, 19, retry_count=5)]
    assert FacilityRecord.of(parse_facility("bank", [{"name": "p1", "low": 0, "high": 9}]),
                             ["p1"]).shadowed == ["p1"]
    assert FacilityRecord.of(parse_facility("bank", [{"name": "p1", "low": 0, "high": 9}])
                             ).shadowed == []
    assert Tombstone("t-8", None, "UNKNOWN", "UNKNOWN", 98).to_record() == TombRecord(
        "t-8", None, "UNKNOWN", "UNKNOWN", 98)
    assert [len(keys) for keys in (FACILITY_KEYS, PARTITION_KEYS, TX_KEYS, TOMB_KEYS)] == [
        4, 5, 12, 6]


def _golden_value(name: str) -> dict[str, Any]:
    return dict(unpack(bytes.fromhex(next(g for n, _, g in GOLDEN if n == name))))


def _without(value: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in value.items() if k != key}


#: (a body that is not a router record, what the error says)
MALFORMED: list[tuple[str, Any, str]] = [
    ("not msgpack", b"\xc1", "undecodable"),
    ("not a map", pack(["tx"]), "not a router record"),
    ("unknown kind", pack({"r": "vote"}), "not a router record"),
    ("tx key missing", pack(_without(_golden_value("tx VREQ"), "shadowed")),
     "keys missing ['shadowed']"),
    ("tx key extra", pack({**_golden_value("tx VREQ"), "x": 1}), "unknown ['x']"),
    ("tx tid", pack({**_golden_value("tx VREQ"), "tid": 7}), "tid is int, not str"),
    ("tx exception", pack({**_golden_value("tx VREQ"), "exception": 1}), "exception"),
    ("tx strikes", pack({**_golden_value("tx VREQ"), "strikes": {"p1": "1"}}),
     "a strike count is str"),
    ("tx message fields", pack({**_golden_value("tx VREQ"), "messages": [["p1", 5, b""]]}),
     "a message is not [partition, key, body, headers]"),
    ("tx message body", pack({**_golden_value("tx VREQ"), "messages": [["p1", 5, "s", None]]}),
     "a message field has the wrong type"),
    ("tx reason", pack({**_golden_value("tx VREQ"), "reason": 3}), "reason is int"),
    ("tomb until", pack({**_golden_value("tomb accepted"), "until_ms": None}),
     "until_ms is NoneType"),
    ("tomb key missing", pack(_without(_golden_value("tomb accepted"), "reason")),
     "keys missing ['reason']"),
    ("facility partitions", pack({**_golden_value("facility str"), "partitions": {}}),
     "partitions is not a list"),
    ("facility partition key", pack({**_golden_value("facility str"), "partitions": [
        {"name": "am", "low": "a", "high": "m"}]}), "keys missing ['retry_count'"),
    ("facility overlap", pack({**_golden_value("facility int"), "partitions": [
        {"name": n, "low": 0, "high": 9, "retry_count": 3, "vote_timeout_ms": 0}
        for n in ("a", "b")]}), "overlap"),
    ("facility key type", pack({**_golden_value("facility int"), "key_type": "str"}),
     "key_type 'str', but the keys are int"),
    ("facility shadowed type", pack({**_golden_value("facility int"), "shadowed": "p1"}),
     "shadowed is str, not a list"),
    ("facility shadowed unknown", pack({**_golden_value("facility int"), "shadowed": ["p9"]}),
     "is not a sorted list of its partitions"),
    ("facility shadowed twice", pack({**_golden_value("facility int"),
                                      "shadowed": ["p2", "p1"]}),
     "is not a sorted list of its partitions"),
]


def test_a_facility_record_from_before_the_shadowed_field_has_none() -> None:
    """Old journals: a facility record without ``shadowed`` has no shadowed partition,
    and writes back its own bytes (``shadowed`` is written only when not empty)."""
    for name in ("facility int", "facility str"):
        data = bytes.fromhex(next(g for n, _, g in GOLDEN if n == name))
        decoded = decode(data)
        assert isinstance(decoded, FacilityRecord) and decoded.shadowed == []
        assert decoded.encode() == data
    shadowed = decode(bytes.fromhex(next(g for n, _, g in GOLDEN if n == "facility shadowed")))
    assert isinstance(shadowed, FacilityRecord) and shadowed.shadowed == ["p2"]


@pytest.mark.parametrize(("name", "body", "error"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_record_is_one_clear_error(name: str, body: bytes, error: str) -> None:
    with pytest.raises(MalformedRecord, match="router") as info:
        decode(body)
    assert error in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_restart_reports_a_malformed_record_and_loads_the_others() -> None:
    rig = Rig(Harness())
    rig.define()
    client = rig.client(1)
    rig.send(1, client, "t1", 1)
    rig.accept(1, client, "t1")
    h = rig.h
    record = rig.router.data.transactions["t1"].record
    assert record is not None and record.ref is not None
    value = _golden_value("tx VREQ")
    h.bodies[record.ref] = pack({**value, "exception": "yes"})  # damaged
    fresh = Harness(h.limits, h.auto_sync, h.now)
    fresh.bodies, fresh.log = dict(h.bodies), list(h.log)
    for kind, meta, refs in h.log:
        fresh.broker.replay(StoredEntry(kind, meta, tuple(refs)))
    fresh.broker.finish_recovery(h.now)
    problems = fresh.broker.restore_router(lambda m: fresh.read_body(m.ref), h.now)  # type: ignore[arg-type]
    assert problems == [f"router record {record.id}: malformed router tx record: exception is "
                        "not a bool"]
    assert list(fresh.broker.router.data.facilities) == ["BANK"]
    assert fresh.broker.router.data.transactions == {}


def log_digest(harness: Harness) -> tuple[int, str]:
    """The number of ``$router`` bodies, and a digest of every entry the harness's
    in-memory log holds: kind, meta and bodies."""
    digest = hashlib.sha256()
    router_bodies = 0
    for kind, meta, refs in harness.log:
        digest.update(kind.to_bytes(2, "big") + len(meta).to_bytes(4, "big") + meta)
        for ref in refs:
            body = harness.bodies[ref]
            router_bodies += body[:4] in (b"\x8c\xa1r\xa2", b"\x84\xa1r\xa8", b"\x85\xa1r\xa8",
                                          b"\x86\xa1r\xa4")
            digest.update(len(body).to_bytes(4, "big") + body)
    return router_bodies, digest.hexdigest()


def test_a_scripted_router_run_writes_the_same_entries() -> None:
    """Every kind of router record, written by every writer (define, set-partition, a
    server's new key range, accept, votes, strikes, an exception and its operator
    commit, tombstones) and a restart that reads them back."""
    from txbroker.core.router import admin as router_admin

    rig = Rig(Harness())
    rig.define()
    rig.call("set_partition", 90, 1, "BANK", "A", 1, None, rig.h.now)
    client = rig.client(1)
    a = rig.server(2, "A")
    b = rig.server(3, "B")
    rig.send(1, client, "t1", 1)
    rig.send(1, client, "t1", 1001)
    rig.vote(3, b, "t1")
    rig.accept(1, client, "t1")
    rig.vote(2, a, "t1")
    rig.done(2, a, "t1")
    rig.done(3, b, "t1")
    rig.send(1, client, "t2", 2)
    rig.vote(2, a, "t2", accept=False, reason="NO")
    rig.close(2)
    rig.send(1, client, "poison", 13)
    rig.accept(1, client, "poison")
    for sid in (10, 11):
        rig.server(sid, "A")
        rig.close(sid)
    rig.h.session(90)
    router_admin.commit_exception(rig.router.data, 90, 7, "poison", rig.h.now)
    rig.h.run()
    rig.send(1, client, "pending", 1500)
    rig.accept(1, client, "pending")
    assert rig.outcome(1, "never")["state"] == "UNKNOWN"
    rig.h.now += 5
    rig.h = rig.h.crash()
    servers = {12: rig.server(12, "A"), 13: rig.server(13, "B")}
    client2 = rig.client(11)
    assert rig.outcome(11, "pending", client2)["state"] == "PENDING"
    assert rig.outcome(11, "t1", client2)["state"] == "ACCEPTED"
    assert rig.outcome(11, "poison", client2)["state"] == "ACCEPTED"
    for _ in range(4):  # the servers vote for and finish whatever they are presented
        for sid, ctl in servers.items():
            for kind, tid in rig.take(sid):
                if kind in ("MSG1", "UNCERTAIN"):
                    rig.vote(sid, ctl, tid)
                elif kind in ("ACCEPTED", "REJECTED"):
                    rig.done(sid, ctl, tid)
    rig.call("collected", 11, client2, ["pending", "poison", "t1"], rig.h.now)
    assert rig.router.data.transactions == {}
    assert sorted(rig.router.data.tombstones.by_tid) == ["never", "pending", "poison", "t1"]
    assert log_digest(rig.h) == (
        14, "a6dd5de8a4b2e186f7b1cbc12c3eab83e05658e1108f3c7e68fc18a75f5a53c5")
