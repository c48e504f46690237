"""XA branches on the directory store (seed 003, issue 17): the seed's file
lifecycle for prepare, commit, rollback, the read-only dummy, heuristic
outcomes and forget; a kill between any two disk steps and a power cut that
loses un-synced directory entries, for every one of them; and the files
recovery must refuse (an unknown Xid, a torn block, a block in the wrong
directory)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.errors import StorageFailed
from txbroker.storage.dirstore import DirStore
from txbroker.storage.dirstore_format import (
    ACTIVE,
    COMMITTED,
    FLAG_LOCAL,
    FLAG_XA,
    PREPARED,
    BlockType,
    branch_block_name,
    decode_block,
    encode_block,
    message_name,
    parse_branch_block_name,
)

from .contract import Entry, add_entry, append_all, msg_record, queue_put
from .test_dirstore import (
    STEPS,
    append_and_wait,
    count_steps,
    files,
    kill_at,
    kind_entry,
    matching_prefix,
    open_store,
    power_cut_case,
    state_of,
)

#: Xids in their text form: format id 1, gtrids AA / BB / CC / DD, bquals 01 / 02.
A, A2, B, C, D, S = ("00000001-AA-01", "00000001-AA-02", "00000001-BB-01", "00000001-CC-01",
                     "00000001-DD-01", "00000001-5E-01")


def prepare(xid: str, sends: list[tuple[int, bytes]], consumed: list[int],
            discards: list[int] | None = None, queue: str = "out") -> Entry:
    """An XA_PREPARE as the core writes it (sends carry no seq yet)."""
    msgs = [[*msg_record(message_id, queue, client_id=f"c{message_id}"), 0]
            for message_id, _ in sends]
    meta = [xid, msgs, [[message_id, 1] for message_id in consumed], discards or [], 100, 200]
    return int(Kind.XA_PREPARE), records.pack(meta), [body for _, body in sends]


#: Durable before each crash case: queues, four messages, three prepared branches.
XA_SETUP: list[Entry] = [
    queue_put("q0"),
    queue_put("out"),
    add_entry(1, b"one"),
    add_entry(2, b"two"),
    add_entry(3, b"three"),
    add_entry(4, b"four"),
    prepare(A, [(20, b"a20"), (21, b"a21" * 50)], [1]),
    prepare(A2, [(22, b"a22")], [2]),  # the same gtrid, another bqual
    prepare(C, [(23, b"c23")], [3]),
]
#: Appended at once while a step is "killed": every way a branch completes.
XA_VICTIMS: list[Entry] = [
    prepare(B, [(30, b"b30")], [4]),
    prepare(D, [], []),  # read-only: the seed's dummy block alone
    kind_entry(Kind.XA_COMMIT, [A, [], [[20, 1], [21, 2]], 300]),
    kind_entry(Kind.XA_ROLLBACK, [A2, 300]),
    kind_entry(Kind.XA_HEURISTIC, [C, "commit", [], [[23, 3]], 300]),
    kind_entry(Kind.XA_FORGET, C),
    prepare(S, [(40, b"s40"), (41, b"s41")], []),
    kind_entry(Kind.SINK_COMMIT, ["sink", 7, [[S, [[40, 4]], [41]]], [D], 300]),
]


def prepared_names(directory: Path) -> list[str]:
    return files(directory, PREPARED)


# -- the seed's file lifecycle -----------------------------------------------------------


def test_prepare_commit_and_rollback_follow_the_seed(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path, flags="FDATASYNC,DSYNC")
    append_all(store, loop, XA_SETUP[:6])
    counts = count_steps(store)
    append_all(store, loop, [XA_SETUP[6]])
    # prepare: one file per block created in active/ and synced, renamed to prepared/
    assert counts["write_file"] == counts["sync_file"] == counts["rename"] == 4
    assert files(tmp_path, ACTIVE) == []
    assert prepared_names(tmp_path) == ["AA-000", "AA-001", "AA-002", "AA-003"]
    blocks = [decode_block((tmp_path / PREPARED / name).read_bytes())
              for name in prepared_names(tmp_path)]
    assert all(not isinstance(b, str) for b in blocks)
    first, send, send2, consumed = blocks
    assert not isinstance(first, str) and first.type is BlockType.DUMMY
    assert records.unpack(first.info) == [A, [], 100, 200, "prepared"]  # the Xid is kept here
    assert not isinstance(send, str) and (send.type, send.message_id, send.body) == (
        BlockType.NEW, 20, b"a20")
    assert not isinstance(send2, str) and send2.message_id == 21
    assert not isinstance(consumed, str) and (consumed.type, consumed.message_id) == (
        BlockType.DELETE, 1)
    assert {b.flags for b in blocks if not isinstance(b, str)} == {FLAG_XA}
    assert files(tmp_path, COMMITTED) == [message_name(n) for n in (1, 2, 3, 4)]

    append_all(store, loop, [XA_SETUP[7]])  # a second branch of the same gtrid
    assert prepared_names(tmp_path)[4:] == ["AA-004", "AA-005", "AA-006"]

    # commit: the send moves to committed/<id> (with its seq), the consumed file goes
    append_all(store, loop, [kind_entry(Kind.XA_COMMIT, [A, [], [[20, 1], [21, 2]], 300])])
    assert prepared_names(tmp_path) == ["AA-004", "AA-005", "AA-006"]
    assert files(tmp_path, COMMITTED) == [message_name(n) for n in (2, 3, 4, 20, 21)]
    message = decode_block((tmp_path / COMMITTED / message_name(21)).read_bytes())
    assert not isinstance(message, str) and message.flags == FLAG_LOCAL
    assert records.unpack(message.info)[records.MSG_SEQ] == 2
    assert message.body == b"a21" * 50

    # rollback: the branch's blocks are removed, nothing else changes
    append_all(store, loop, [kind_entry(Kind.XA_ROLLBACK, [A2, 300])])
    assert prepared_names(tmp_path) == []
    assert files(tmp_path, COMMITTED) == [message_name(n) for n in (2, 3, 4, 20, 21)]
    store.close()


def test_read_only_heuristic_and_forget_leave_the_seeds_dummy(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, XA_SETUP)
    append_all(store, loop, [prepare(D, [], [])])
    assert prepared_names(tmp_path)[-1:] == ["DD-010"]  # the dummy alone
    append_all(store, loop, [kind_entry(Kind.XA_HEURISTIC, [C, "commit", [], [[23, 3]], 300])])
    # the branch's first block stays, rewritten as a one-block branch with its outcome
    assert [n for n in prepared_names(tmp_path) if n.startswith("CC")] == ["CC-007"]
    header = decode_block((tmp_path / PREPARED / "CC-007").read_bytes())
    assert not isinstance(header, str) and header.count == 1
    assert records.unpack(header.info)[4] == "heuristic-commit"
    assert message_name(23) in files(tmp_path, COMMITTED)
    assert message_name(3) not in files(tmp_path, COMMITTED)
    store.close()

    store, loop, recovered = open_store(tmp_path)
    state = state_of(store, recovered)
    assert state.branches[C] == ("heuristic_committed", [], [], [])
    assert state.branches[D] == ("prepared", [], [], [])
    assert state.branches[A][0] == "prepared" and state.branches[A][2] == [1]
    # 3 was consumed by C's heuristic commit; 1 and 2 are held by the prepared A and A2
    assert [m[0] for m in state.messages] == [4, 23, 1, 2]
    append_all(store, loop, [kind_entry(Kind.XA_FORGET, C)])
    assert "CC-007" not in prepared_names(tmp_path)
    store.close()


def test_recovery_hands_back_every_branch_with_its_bodies(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, XA_SETUP + XA_VICTIMS)
    store.close()
    store, _, recovered = open_store(tmp_path)
    assert matching_prefix(state_of(store, recovered), XA_SETUP + XA_VICTIMS) == \
        len(XA_SETUP + XA_VICTIMS)
    kinds = [entry.kind for entry in recovered]
    assert kinds.count(Kind.XA_PREPARE) == 1  # B: the only branch still prepared
    assert not store.report
    state = state_of(store, recovered)
    assert state.sinks == {"sink": 7}
    assert state.branches == {B: ("prepared", [(30, "out", "c30", b"b30")], [4], [])}
    store.close()


# -- crashes --------------------------------------------------------------------------


@pytest.mark.parametrize("flags", ["", "FDATASYNC,DSYNC"])
def test_kill_between_any_two_steps_of_every_xa_outcome(tmp_path: Path, flags: str) -> None:
    """Every disk step of prepare, commit, rollback, heuristic, forget and a sink
    commit, killed in turn: recovery finds a prefix of the victims that holds
    every acknowledged one — no prepared branch lost, no committed message lost
    or duplicated, nothing left in active/, nothing quarantined."""
    store, loop, _ = open_store(tmp_path / "count", flags=flags)
    append_all(store, loop, XA_SETUP)
    counts = count_steps(store)
    append_all(store, loop, XA_VICTIMS)
    store.close()
    cases = 0
    for step in STEPS:
        for call in range(counts[step]):
            cases += 1
            directory = tmp_path / f"{step}-{call}"
            store, loop, _ = open_store(directory, flags=flags)
            append_all(store, loop, XA_SETUP)
            kill_at(store, step, call)
            outcomes = append_and_wait(store, loop, XA_VICTIMS)
            assert any(isinstance(o, StorageFailed) for o in outcomes), (step, call)
            acknowledged = next(i for i, o in enumerate(outcomes) if o is not None)
            store.close()
            store, _, recovered = open_store(directory, flags=flags)
            length = matching_prefix(state_of(store, recovered), XA_SETUP + XA_VICTIMS)
            assert length >= len(XA_SETUP) + acknowledged, (step, call, length)
            assert files(directory, ACTIVE) == [], (step, call)
            assert not store.report, (step, call, store.report)
            store.close()
            # and the next start finds the same (recovery itself left nothing to redo)
            store, _, again = open_store(directory, flags=flags)
            assert matching_prefix(state_of(store, again), XA_SETUP + XA_VICTIMS) == length
            store.close()
    assert cases >= 60


def test_a_kill_during_recovery_of_a_commit_is_finished_next_time(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path / "count")
    append_all(store, loop, XA_SETUP)
    counts = count_steps(store)
    append_all(store, loop, XA_VICTIMS[2:3])  # the commit of A alone
    store.close()
    renames = counts["rename"]
    for call in range(renames):  # killed at each rename of the commit, then in recovery
        directory = tmp_path / f"r{call}"
        store, loop, _ = open_store(directory)
        append_all(store, loop, XA_SETUP)
        kill_at(store, "rename", call)
        assert isinstance(append_and_wait(store, loop, XA_VICTIMS[2:3])[0], StorageFailed)
        store.close()
        store = DirStore(directory)
        kill_at(store, "unlink", 0)
        with contextlib.suppress(OSError):
            list(store.recover())
        store.close()
        store, _, recovered = open_store(directory)
        length = matching_prefix(state_of(store, recovered), XA_SETUP + XA_VICTIMS[2:3])
        assert length in (len(XA_SETUP), len(XA_SETUP) + 1), (call, length)
        assert not store.report
        store.close()


def test_power_cut_with_dsync_keeps_every_acknowledged_xa_step(tmp_path: Path) -> None:
    """A power cut undoes every create, rename and unlink no directory fsync
    covered: with FDATASYNC,DSYNC nothing acknowledged — a prepared branch, a
    committed or rolled back one — is lost."""
    lost_changes = 0
    call = 0
    while True:
        call += 1
        acknowledged, length, undone = power_cut_case(
            tmp_path / f"d{call}", "FDATASYNC,DSYNC", call, XA_SETUP, XA_VICTIMS)
        assert length >= len(XA_SETUP) + acknowledged, (call, acknowledged, length)
        lost_changes += undone
        if acknowledged == len(XA_VICTIMS):
            break
    assert call > 20 and lost_changes > 0


# -- bad files ------------------------------------------------------------------------


def _block(block_type: BlockType, tid: int, sequence: int, count: int, message_id: int,
           info: Any, body: bytes = b"", flags: int = FLAG_XA) -> bytes:
    return b"".join(encode_block(block_type, sequence=sequence, count=count, tid=tid,
                                 message_id=message_id, info=records.pack(info), body=body,
                                 flags=flags))


def test_bad_xa_files_are_reported_and_quarantined(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, XA_SETUP)
    store.close()
    prepared = tmp_path / PREPARED
    msg = [*msg_record(90, "out"), 0]
    # blocks of an unknown Xid: a NEW and a DELETE without their first block
    (prepared / "EE-100").write_bytes(_block(BlockType.NEW, 900, 1, 3, 90, msg, b"x"))
    (prepared / "EE-101").write_bytes(_block(BlockType.DELETE, 900, 2, 3, 2, 1))
    # a branch missing a block (torn away): first block and one of two sends
    (prepared / "FF-200").write_bytes(_block(BlockType.DUMMY, 901, 0, 3, 0,
                                             ["00000001-FF-01", [], 1, 2, "prepared"]))
    (prepared / "FF-201").write_bytes(_block(BlockType.NEW, 901, 1, 3, 91, msg, b"y"))
    # a torn block of a branch
    (prepared / "AB-300").write_bytes(_block(BlockType.DUMMY, 902, 0, 1, 0,
                                             ["00000001-AB-01", [], 1, 2, "prepared"])[:30])
    # a branch filed under another gtrid's name
    (prepared / "CD-400").write_bytes(_block(BlockType.DUMMY, 903, 0, 1, 0,
                                             ["00000001-AB-01", [], 1, 2, "prepared"]))
    # a prepared branch's message block in committed/ (the wrong directory)
    (tmp_path / COMMITTED / message_name(92)).write_bytes(
        _block(BlockType.NEW, 904, 1, 2, 92, msg_record(92, "out"), b"z"))
    # a committed message file copied into prepared/ (the wrong directory)
    (prepared / message_name(2)).write_bytes((tmp_path / COMMITTED / message_name(2)).read_bytes())
    before = prepared_names(tmp_path)
    store, _, recovered = open_store(tmp_path)
    report = "\n".join(store.report)
    assert "unknown Xid" in report and "EE-100" in report and "EE-101" in report
    assert "has 2 of its 3 blocks" in report and "FF-200" in report
    assert "AB-300" in report and "damaged prepared block" in report
    assert "under another gtrid's name" in report and "CD-400" in report
    assert "the wrong directory" in report and message_name(92) in report
    assert f"prepared/{message_name(2)}: a message file (named by a message id) in the wrong " \
        "directory" in report
    assert len(store.report) == 8
    quarantined = files(tmp_path, "quarantine")
    assert quarantined == sorted(
        [f"prepared.{n}" for n in ("AB-300", "CD-400", "EE-100", "EE-101", "FF-200", "FF-201",
                                   message_name(2))]
        + [f"committed.{message_name(92)}"])
    # the real branches are untouched and come back prepared; nothing bad was loaded
    assert matching_prefix(state_of(store, recovered), XA_SETUP) == len(XA_SETUP)
    assert sorted(prepared_names(tmp_path)) == sorted(
        n for n in before if parse_branch_block_name(n) and n[:2] in ("AA", "CC"))
    state = state_of(store, recovered)
    assert sorted(state.branches) == [A, A2, C]
    assert 90 not in [m[0] for m in state.messages] and 92 not in [m[0] for m in state.messages]
    store.close()


def test_the_xa_block_names_are_the_gtrid_in_uppercase_hex() -> None:
    assert branch_block_name("0A0B", 7) == "0A0B-007"
    assert parse_branch_block_name("0A0B-007") == ("0A0B", 7)
    assert parse_branch_block_name("0a0b-007") is None  # local names are lowercase
    assert parse_branch_block_name("0A0-007") is None  # whole bytes only
    assert parse_branch_block_name("A" * 130 + "-000") is None  # at most 64 bytes
    assert parse_branch_block_name("AB-12") is None


def test_a_branch_prepared_twice_or_an_unknown_outcome_is_refused(tmp_path: Path) -> None:
    store, loop, _ = open_store(tmp_path)
    append_all(store, loop, XA_SETUP)
    with pytest.raises(ValueError, match="prepared already"):
        store.append(*prepare(A, [(50, b"x")], []), lambda error: None)
    with pytest.raises(ValueError, match="not prepared"):
        store.append(*kind_entry(Kind.XA_COMMIT, [B, [], [], 1]), lambda error: None)
    with pytest.raises(ValueError, match="cannot take forget"):
        store.append(*kind_entry(Kind.XA_FORGET, A), lambda error: None)
    with pytest.raises(ValueError, match=r"malformed|Xid"):
        store.append(*kind_entry(Kind.XA_ROLLBACK, ["not an xid", 1]), lambda error: None)
    append_all(store, loop, [kind_entry(Kind.XA_ROLLBACK, [A, 1])])  # still works after
    assert os.path.exists(tmp_path / PREPARED / "AA-004")
    store.close()
