"""The directory store's own block infos (``dirstore_blocks.py``): an XA branch's first
block (a DUMMY holding the branch's header) and the RESOLVE block that completes a
branch — their exact bytes, their classes, and one clear error for a malformed one.

The golden bytes were written out by the store as it was before these infos had
classes (``records.pack`` of the positional lists ``dirstore_index.py`` and
``dirstore_writer.py`` built): a data directory written before must read back the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from txbroker.core.records import Kind, MalformedRecord, pack
from txbroker.storage.dirstore_blocks import (
    BRANCH_HEADER_FIELDS,
    RESOLVE_FIELDS,
    BranchHeader,
    ResolveInfo,
)
from txbroker.storage.dirstore_format import PREPARED, BlockType, decode_block
from txbroker.storage.dirstore_index import MessageIndex
from txbroker.storage.dirstore_model import decode_operation

from .contract import Entry, add_entry, append_all
from .test_dirstore import files, kind_entry, open_store
from .test_dirstore_xa import A2, A, B, C, S, _block, prepare

#: Entries in order, with the DUMMY / RESOLVE infos the index plans for each (hex).
SCRIPT: list[tuple[Entry, list[tuple[BlockType, str]]]] = [
    (add_entry(1, b"one"), []),
    (add_entry(2, b"two"), []),
    (prepare(A, [(20, b"a20"), (21, b"a21")], [1], [21]),
     [(BlockType.DUMMY, "95ae30303030303030312d41412d3031911564ccc8a87072657061726564")]),
    (prepare(A2, [], []),
     [(BlockType.DUMMY, "95ae30303030303030312d41412d30329064ccc8a87072657061726564")]),
    (prepare(C, [(23, b"c")], [2]),
     [(BlockType.DUMMY, "95ae30303030303030312d43432d30319064ccc8a87072657061726564")]),
    (prepare(B, [], []),
     [(BlockType.DUMMY, "95ae30303030303030312d42422d30319064ccc8a87072657061726564")]),
    (prepare(S, [(40, b"s")], []),
     [(BlockType.DUMMY, "95ae30303030303030312d35452d30319064ccc8a87072657061726564")]),
    (kind_entry(Kind.XA_COMMIT, [A, [21], [[20, 1]], 300]),
     [(BlockType.RESOLVE, "98a6636f6d6d6974ae30303030303030312d41412d3031a24141000403919214"
                          "019115")]),
    (kind_entry(Kind.XA_ROLLBACK, [A2, 300]),
     [(BlockType.RESOLVE, "98a8726f6c6c6261636bae30303030303030312d41412d3032a2414104010490"
                          "90")]),
    (kind_entry(Kind.XA_HEURISTIC, [C, "commit", [], [[23, 3]], 300]),
     [(BlockType.RESOLVE, "98b06865757269737469632d636f6d6d6974ae30303030303030312d43432d30"
                          "31a243430503059192170390")]),
    (kind_entry(Kind.XA_FORGET, C),
     [(BlockType.RESOLVE, "98a6666f72676574ae30303030303030312d43432d3031a24343050105909"
                          "0")]),
    (kind_entry(Kind.XA_HEURISTIC, [B, "rollback", []]),
     [(BlockType.RESOLVE, "98b26865757269737469632d726f6c6c6261636bae30303030303030312d4242"
                          "2d3031a242420801069090")]),
    (kind_entry(Kind.SINK_COMMIT, ["sink", 7, [[S, [[40, 4]], []]], [], 300]),
     [(BlockType.RESOLVE, "98a6636f6d6d6974ae30303030303030312d35452d3031a23545090207919228"
                          "0490")]),
    (kind_entry(Kind.ACK, [1]), [(BlockType.DUMMY, "")]),  # a read-only local transaction
]


def test_the_index_plans_the_same_block_infos() -> None:
    index = MessageIndex()
    for (kind, meta, bodies), expected in SCRIPT:
        plans = index.plan(decode_operation(kind, meta, list(bodies)))
        infos = [(block.type, block.info.hex()) for plan in plans for block in plan.blocks
                 if block.type in (BlockType.DUMMY, BlockType.RESOLVE)]
        assert infos == expected


def test_a_heuristic_outcome_rewrites_the_branch_header_to_the_same_bytes(
        tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, [entry for entry, _ in SCRIPT[:10]])  # up to C's heuristic
    header = decode_block((tmp_path / PREPARED / "CC-005").read_bytes())
    assert not isinstance(header, str)
    assert (header.type, header.count, header.info.hex()) == (
        BlockType.DUMMY, 1,
        "95ae30303030303030312d43432d30319064ccc8b06865757269737469632d636f6d6d6974")
    store.close()


#: (the info as the store builds it, its golden bytes)
CLASSES: list[tuple[Any, str]] = [
    (BranchHeader(A, [21], 100, 200, "prepared"), SCRIPT[2][1][0][1]),
    (BranchHeader(C, [], 100, 200, "heuristic-commit"),
     "95ae30303030303030312d43432d30319064ccc8b06865757269737469632d636f6d6d6974"),
    (ResolveInfo("commit", A, "AA", 0, 4, 3, [[20, 1]], [21]), SCRIPT[7][1][0][1]),
    (ResolveInfo("rollback", A2, "AA", 4, 1, 4, [], []), SCRIPT[8][1][0][1]),
    (ResolveInfo("heuristic-commit", C, "CC", 5, 3, 5, [[23, 3]], []), SCRIPT[9][1][0][1]),
    (ResolveInfo("forget", C, "CC", 5, 1, 5, [], []), SCRIPT[10][1][0][1]),
]


@pytest.mark.parametrize(("info", "golden"), CLASSES)
def test_the_classes_encode_and_decode_the_golden_bytes(info: Any, golden: str) -> None:
    data = bytes.fromhex(golden)
    assert info.encode() == data
    assert type(info).decode(data) == info
    assert (BRANCH_HEADER_FIELDS, RESOLVE_FIELDS) == (5, 8)


@pytest.mark.parametrize(("cls", "value", "error"), [
    (BranchHeader, [A, [], 1, 2], "4 fields, expected 5"),
    (BranchHeader, [A, [], 1, 2, "prepared", 0], "6 fields, expected 5"),
    (BranchHeader, [A, [], 1, None, "prepared"], "prepared_ms is NoneType"),
    (BranchHeader, [A, ["x"], 1, 2, "prepared"], "discards holds a str"),
    (BranchHeader, {"xid": A}, "expected a list of fields"),
    (ResolveInfo, ["commit", A, "AA", 0, 4, 3, [[20, 1]]], "7 fields, expected 8"),
    (ResolveInfo, ["commit", A, "AA", 0, 4, 3, [[20]], []], "not an [int, int] pair"),
    (ResolveInfo, ["commit", A, b"AA", 0, 4, 3, [], []], "gtrid is bytes"),
])
def test_a_malformed_info_is_one_clear_error(cls: Any, value: Any, error: str) -> None:
    with pytest.raises(MalformedRecord) as info:
        cls.decode(pack(value))
    assert error in str(info.value)
    with pytest.raises(MalformedRecord, match="undecodable"):
        cls.decode(b"\xc1")


def test_recovery_quarantines_a_branch_whose_header_does_not_decode(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, [entry for entry, _ in SCRIPT[:2]])
    store.close()
    (tmp_path / PREPARED / "EE-100").write_bytes(_block(
        BlockType.DUMMY, 900, 0, 1, 0, ["00000001-EE-01", [], 1, "2", "prepared"]))
    store, _, _ = open_store(tmp_path)
    assert store.report == [
        f"{tmp_path / PREPARED / 'EE-100'}: XA branch of transaction 384 with an unreadable "
        "header (the Xid): malformed XA branch header record: prepared_ms is str, not int; "
        f"moved to {tmp_path / 'quarantine' / 'prepared.EE-100'}"]
    assert files(tmp_path, "quarantine") == ["prepared.EE-100"]
    store.close()
