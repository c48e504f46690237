"""The Spark sink's commits: many prepared XA branches and a batch id in one record.

Theory of operation
-------------------
**The Spark sink** writes each task's rows in an XA branch with a sink Xid
(``xid.sink_xid``: sink id, batch id, partition, attempt) and prepares it. The
driver then calls ``sink_commit(sink, batch, xids)``, which in ONE record
(``SINK_COMMIT``) commits those prepared branches, rolls back every other
prepared branch of that sink up to that batch (failed or duplicate attempts)
and advances the sink's last committed batch id. A batch at or below the
last committed id is a replay: its prepared branches are rolled back and
nothing is committed. ``sink_abort`` rolls back a batch's branches unless
that batch is committed. The last committed batch ids are metadata (in the
snapshot) that only ever grows.
"""

from __future__ import annotations

from typing import Any

from txbroker.core.effects import Reply
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import LATER
from txbroker.core.records import SinkBranch, SinkCommit
from txbroker.core.xa import Branch, BranchState, Request
from txbroker.core.xa_branches import XaBranches, parse_xid
from txbroker.core.xa_endpoints import commit_discards
from txbroker.errors import XAER_INVAL, XAER_NOTA, XAER_PROTO, BadRequest, XAError
from txbroker.xid import check_sink_id, sink_of

S = BranchState


def check_batch(batch: Any) -> int:
    """A micro-batch id: an integer >= 0 (BadRequest otherwise)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise BadRequest("batch must be an integer >= 0")
    return batch


class Sinks:
    """Sink commits and aborts over the XA branches. See the module docstring."""

    def __init__(self, xa: XaBranches, outbox: Outbox) -> None:
        self.xa = xa
        self.outbox = outbox
        self.sinks: dict[str, int] = {}  #: sink id -> last committed batch id (durable)
        self._committing: dict[str, int] = {}  #: sink -> batch whose record is on its way

    def _last_batch(self, sink: str) -> int:
        return max(self.sinks.get(sink, -1), self._committing.get(sink, -1))

    def _branches(self, sink: str, up_to: int, *, prepared: bool) -> list[Branch]:
        found = []
        for branch in self.xa.branches.values():
            owner = sink_of(branch.xid)
            if owner is None or owner[0] != sink or owner[1] > up_to:
                continue
            if (branch.state is S.PREPARED) == prepared:
                found.append(branch)
        return found

    def status(self, sink: Any) -> Any:
        """``{"last": n}``: the sink's last committed batch id (-1: none)."""
        return {"last": self.sinks.get(check_sink_id(sink), -1)}

    def commit(self, session_id: int, rid: int, sink: Any, batch: Any, xids: Any,
               now: int) -> Any:
        """Commit batch ``batch`` of ``sink``: its prepared branches ``xids``, atomically
        with the sink's new last batch id (see the module docstring)."""
        check_sink_id(sink)
        check_batch(batch)
        if not isinstance(xids, list):
            raise BadRequest("xids must be a list of Xid strings")
        last = self._last_batch(sink)
        commits: list[Branch] = []
        if batch > last:
            for xid in dict.fromkeys(parse_xid(x) for x in xids):
                if sink_of(xid) != (sink, batch):
                    raise XAError(XAER_INVAL, f"{xid} is not a branch of sink {sink!r} "
                                              f"batch {batch}")
                branch = self.xa.branches.get(xid)
                if branch is None:
                    raise XAError(XAER_NOTA, f"unknown Xid {xid}: the batch cannot commit")
                if branch.state is not S.PREPARED:
                    raise XAError(XAER_PROTO, f"branch {xid} is {branch.state.name}, "
                                              "not PREPARED")
                commits.append(branch)
        new_last = max(batch, last)
        rollbacks = [b for b in self._branches(sink, new_last, prepared=True)
                     if b not in commits]
        result = {"committed": batch > last, "last": new_last, "branches": len(commits),
                  "rolled_back": len(rollbacks)}
        if batch <= last and not rollbacks:
            return result
        return self._write(session_id, rid, sink, new_last, commits, rollbacks, now, result)

    def abort(self, session_id: int, rid: int, sink: Any, batch: Any, now: int) -> Any:
        """Roll back batch ``batch`` of ``sink`` unless it is committed."""
        check_sink_id(sink)
        check_batch(batch)
        last = self._last_batch(sink)
        if batch <= last:
            return {"rolled_back": 0, "last": last}
        for branch in self._branches(sink, batch, prepared=False):
            owner = sink_of(branch.xid)
            if owner is not None and owner[1] == batch and branch.state is not S.GONE:
                self.xa.undo(branch, now)  # never written: nothing to log
        rollbacks = [b for b in self._branches(sink, batch, prepared=True)
                     if sink_of(b.xid) == (sink, batch)]
        result = {"rolled_back": len(rollbacks), "last": last}
        if not rollbacks:
            return result
        return self._write(session_id, rid, sink, last, [], rollbacks, now, result)

    def _write(self, session_id: int, rid: int, sink: str, last: int, commits: list[Branch],
               rollbacks: list[Branch], now: int, result: dict[str, Any]) -> Any:
        xa = self.xa
        entries: list[SinkBranch] = []
        for branch in commits:
            branch.fire(Request.COMMIT)
            discards = sorted(commit_discards(xa.index, branch))
            entries.append(SinkBranch(str(branch.xid), xa.commit_seqs(branch), discards))
        for branch in rollbacks:
            branch.fire(Request.ROLLBACK)
        if last > self.sinks.get(sink, -1):
            self._committing[sink] = last

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                xa.store_failed(session_id, rid, error)
                return
            if self._committing.get(sink) == last:
                del self._committing[sink]
            self.sinks[sink] = max(self.sinks.get(sink, -1), last)
            for branch, commit in [(b, True) for b in commits] + [(b, False) for b in rollbacks]:
                xa.apply(branch, commit=commit, now=self.outbox.now)
                branch.fire(Request.COMMIT_DURABLE if commit else Request.ROLLBACK_DURABLE)
                xa.remove(branch)
            self.outbox.emit(Reply(session_id, rid, result))

        record = SinkCommit(sink, last, entries, [str(b.xid) for b in rollbacks], now)
        self.outbox.write(record, on_durable)
        return LATER


__all__ = ["Sinks", "check_batch"]
