"""Replaying XA branches and sink commits, and the XA part of a snapshot
(``core/replay.py``'s :class:`Replay` calls these; its docstring says what comes
back: prepared branches with their consumed messages held, completions applied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txbroker.core import records
from txbroker.core.effects import Release
from txbroker.core.messages import Message
from txbroker.core.records import Kind, SnapshotBranch
from txbroker.core.xa import Branch, BranchState, Request
from txbroker.core.xa_branches import parse_xid
from txbroker.xid import Xid

if TYPE_CHECKING:
    from txbroker.core.replay import Replay

S = BranchState


def pack_ref(ref: int | None) -> bytes | None:
    """A body ref as msgpack can carry it: refs are opaque ints of up to 136 bits."""
    return None if ref is None else ref.to_bytes((ref.bit_length() + 7) // 8 or 1, "big")


def unpack_ref(value: Any) -> int | None:
    """The inverse of :func:`pack_ref` (also takes a plain int)."""
    return int.from_bytes(value, "big") if isinstance(value, bytes) else value


def xa_snapshot(replay: Replay) -> dict[str, SnapshotBranch]:
    """The ``"xa"`` part of the SNAPSHOT: the durable branches whose XA_PREPARE
    entry no stored body keeps (consumes only), and heuristic ones."""
    found: dict[str, SnapshotBranch] = {}
    for branch in replay.xa.branches.values():
        if branch.state in (S.PREPARED, S.COMMITTING, S.ROLLING_BACK):
            sends = [m for m in branch.work.sends if m.persistent]
            if sends and None not in [m.ref for m in sends]:
                # Its XA_PREPARE entry holds these bodies, so the store keeps that
                # entry's segment while they live (they are never relocated): replay
                # finds the branch there. Copying it here would cost every segment
                # roll as much as all prepared sends (a Spark micro-batch prepares
                # millions), quadratic in the batch.
                continue
            found[str(branch.xid)] = SnapshotBranch(
                S.PREPARED.value, [m.to_record() for m in sends],
                [pack_ref(m.ref) for m in sends],
                [[m.id, m.delivery_count] for m in branch.work.acks.values()]
                + branch.ref_ids,
                sorted(branch.discards), branch.created_ms)
        elif branch.state in (S.HEURISTIC_COMMITTED, S.HEURISTIC_ROLLED_BACK):
            found[str(branch.xid)] = SnapshotBranch(branch.state.value, [], [], [], [],
                                                    branch.created_ms)
    return found


def replay_xa(replay: Replay, kind: int, meta: Any, refs: tuple[int, ...]) -> None:
    """Apply one XA record (``XA_PREPARE`` .. ``XA_FORGET``)."""
    if kind == Kind.XA_PREPARE:
        prepare = records.XaPrepare.from_value(meta)
        xid = parse_xid(prepare.xid)
        replay.completed.discard(xid)
        branch = recovered_branch(replay, xid, prepare.sends, list(refs), prepare.consumed,
                                  prepare.discards, prepare.created_ms)
        branch.prepared_ms = prepare.prepared_or_created
    elif kind == Kind.XA_COMMIT:
        commit_ = records.XaCommit.from_value(meta)
        replay_commit(replay, parse_xid(commit_.xid), commit_.discards, commit_.seqs or [])
    elif kind == Kind.XA_ROLLBACK:
        replay_rollback(replay, parse_xid(records.XaRollback.from_value(meta).xid))
    elif kind == Kind.XA_HEURISTIC:
        heuristic = records.XaHeuristic.from_value(meta)
        known = replay.xa.branches.get(parse_xid(heuristic.xid))
        if known is not None and known.state is S.PREPARED:
            commit = heuristic.commit
            known.discards.update(heuristic.discards)
            if commit and heuristic.seqs is not None:
                seqs_of(known, heuristic.seqs)
            apply_outcome(replay, known, commit=commit)
            known.fire(Request.HEURISTIC_COMMIT if commit else Request.HEURISTIC_ROLLBACK)
    else:  # XA_FORGET
        xid = parse_xid(records.XaForget.from_value(meta).xid)
        replay.xa.branches.pop(xid, None)
        replay.completed.add(xid)


def replay_commit(replay: Replay, xid: Xid, discards: list[int], seqs: list[Any]) -> None:
    """Replay a branch's commit (XA_COMMIT, or one branch of a SINK_COMMIT)."""
    branch = replay.xa.branches.pop(xid, None)
    replay.completed.add(xid)
    if branch is not None:
        branch.discards.update(discards)
        seqs_of(branch, seqs)
        apply_outcome(replay, branch, commit=True)


def replay_rollback(replay: Replay, xid: Xid) -> None:
    """Replay a branch's rollback (XA_ROLLBACK, or one branch of a SINK_COMMIT)."""
    branch = replay.xa.branches.pop(xid, None)
    replay.completed.add(xid)
    if branch is not None:
        apply_outcome(replay, branch, commit=False)


def seqs_of(branch: Branch, pairs: list[list[int]]) -> None:
    """Give a branch's sends the seqs ``[id, seq]`` its completion recorded."""
    seqs = dict((int(pair[0]), int(pair[1])) for pair in pairs)
    for message in branch.work.sends:
        message.seq = seqs.get(message.id, 0)


def xa_snapshot_entries(replay: Replay, found: dict[str, SnapshotBranch]) -> None:
    """Bring back the branches a SNAPSHOT keeps (unless completed by a record)."""
    for xid_text, saved in found.items():
        xid = parse_xid(xid_text)
        if xid in replay.completed:
            continue
        wanted = S(saved.state)
        branch = replay.xa.branches.get(xid)
        if branch is None:
            branch = recovered_branch(replay, xid, saved.sends, list(saved.refs),
                                      saved.consumed, saved.discards, saved.created_ms)
            branch.prepared_ms = saved.created_ms  # (a snapshot does not keep it)
        if wanted is not S.PREPARED and branch.state is S.PREPARED:
            commit = wanted is S.HEURISTIC_COMMITTED
            apply_outcome(replay, branch, commit=commit)
            branch.fire(Request.HEURISTIC_COMMIT if commit else Request.HEURISTIC_ROLLBACK)


def recovered_branch(replay: Replay, xid: Xid, sends: list[Any], refs: list[Any],
                     consumed: list[Any], discards: list[int], created: int) -> Branch:
    """A branch recovered PREPARED, its sends rebuilt (``XA_PREPARE`` or a snapshot)."""
    index = replay.index
    branch = Branch(xid, 0, created, 0)
    branch.session = None
    branch.work.session = 0
    branch.fire(Request.RECOVER)
    body_size_of = replay.body_size_of
    for msg, packed in zip(sends, refs, strict=True):
        ref = unpack_ref(packed)
        size = int(body_size_of(ref)) if body_size_of is not None and ref is not None else 0
        message = Message.from_record(msg, size, ref)
        branch.work.sends.append(message)
        if message.id >= index.next_id:
            index.next_id = message.id + 1
    branch.ref_ids = [[int(pair[0]), int(pair[1])] for pair in consumed]  # [id, count]
    branch.discards = set(discards)
    replay.xa.branches[xid] = branch
    return branch


def apply_outcome(replay: Replay, branch: Branch, *, commit: bool) -> None:
    """A branch's outcome: on commit its sends join the replayed messages and what it
    consumed is gone; on rollback its sends' bodies are released."""
    for message in branch.work.sends:
        if commit and message.id not in branch.discards:
            replay.put_raw([*message.to_record(), message.ref])
        elif message.ref is not None:
            replay.outbox.emit(Release(message.ref))
    if commit:
        replay.gone([message_id for message_id, _ in branch.ref_ids])
    branch.work.sends = []
    branch.ref_ids = []
    branch.discards = set()


def replay_sink(replay: Replay, record: records.SinkCommit) -> None:
    """Apply a SINK_COMMIT: the sink's last batch and its branches' outcomes."""
    sinks = replay.sinks.sinks
    sinks[record.sink] = max(sinks.get(record.sink, -1), record.last_batch)
    for committed in record.commits:
        replay_commit(replay, parse_xid(committed.xid), committed.discards or [], committed.seqs)
    for xid_text in record.rollbacks:
        replay_rollback(replay, parse_xid(xid_text))


__all__ = ["apply_outcome", "pack_ref", "recovered_branch", "replay_commit", "replay_rollback",
           "replay_sink", "replay_xa", "seqs_of", "unpack_ref", "xa_snapshot",
           "xa_snapshot_entries"]
