"""The directory store's own block infos (``dirstore_format.py``): an XA branch's first
block (a DUMMY holding the branch's header) and the RESOLVE block that completes a
branch — their exact bytes.

The golden bytes were written out by the store as it was before these infos had
classes (``records.pack`` of the positional lists ``dirstore_index.py`` and
``dirstore_writer.py`` built): a data directory written before must read back the same.
"""

from __future__ import annotations

from pathlib import Path

from txbroker.core.records import Kind
from txbroker.storage.dirstore_format import PREPARED, BlockType, decode_block
from txbroker.storage.dirstore_index import MessageIndex
from txbroker.storage.dirstore_model import decode_operation

from .contract import Entry, add_entry, append_all
from .test_dirstore import kind_entry, open_store
from .test_dirstore_xa import A2, A, B, C, S, prepare

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
