"""Offset reading (stream readers), batched sends and the Spark sink's commits.

Theory of operation
-------------------
**Sequence numbers.** Every message committed into a queue gets the queue's
next *seq* when its record is built (``Queue.assign_seq``): 1, 2, 3 … in log
order, gap-free, written in the record (``msg`` field 10, MOVE and commit
records) so that a replay gives every message the same seq again. A seq is
*unsettled* until its record is durable; readers see only seqs below
``Queue.readable_seq``, so a range once read is the same range forever — as
long as nothing consumed from it (a consumed message leaves a hole).

**Stream readers** (Kafka-style offset reading, for the Spark source):

==================  ====================================================
``stream_open``     attach as the queue's exclusive reader (refused while
                    consumers or unacked deliveries exist, or another live
                    reader of another name holds it; the same name from a
                    new connection takes over). While attached nothing is
                    delivered from the queue and new consumers are refused.
``stream_read``     messages with ``start <= seq < end``, in seq order,
                    without consuming them: repeatable.
``stream_commit``   everything below ``end`` is consumed (ACK records):
                    idempotent, "release below an offset".
``stream_close``    detach (also when the connection ends).
==================  ====================================================

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

from dataclasses import dataclass
from typing import Any

from txbroker.core.effects import Fail, Reply
from txbroker.core.engine import LATER, check_name
from txbroker.core.messages import Message, State
from txbroker.core.queues import Queue
from txbroker.core.records import Kind
from txbroker.core.transactions import TxEvent
from txbroker.core.xa import Branch, BranchState, Request
from txbroker.core.xa_engine import XaEngine, parse_xid
from txbroker.errors import (
    XAER_INVAL,
    XAER_NOTA,
    XAER_PROTO,
    XAER_RMFAIL,
    BadRequest,
    Disabled,
    IllegalState,
    MessageTooLarge,
    NotFound,
    QuotaExceeded,
    XAError,
)
from txbroker.xid import check_sink_id, sink_of

S = BranchState


@dataclass(slots=True)
class ReadResult:
    """What ``stream_read`` returns: the edge reads the bodies and encodes it."""

    queue: str
    messages: list[Message]
    next: int  #: the seq to continue from (``end`` when the range is done)


class Streams(XaEngine):
    """Stream readers, ``send_batch`` and sink commits. See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks: dict[str, int] = {}  #: sink id -> last committed batch id (durable)
        self._sinks_committing: dict[str, int] = {}  #: sink -> batch whose record is on its way
        self._stream_sessions: dict[int, set[str]] = {}  #: session -> queues it reads

    # ------------------------------------------------------------------ stream readers
    def _stream_queue(self, name: Any) -> Queue:
        queue = self.queues.get(check_name(name))
        if queue is None:
            if name in self.topics:
                raise BadRequest(f"{name!r} is a topic: read one of its durable subscriptions "
                                 f"('{name}::<subscription>')")
            raise NotFound(f"no queue {name!r}")
        if queue.seq_keys is None:
            queue.build_index(m for m in self.messages.values() if m.queue == queue.name)
        return queue

    def _check_reader(self, queue: Queue, name: str | None) -> None:
        owner = queue.stream_owner
        if owner is not None and owner[0] != name and owner[1] in self.sessions:
            raise IllegalState(f"queue {queue.name!r} is owned by stream reader {owner[0]!r}")

    @staticmethod
    def _info(queue: Queue) -> dict[str, Any]:
        return {"queue": queue.name, "first": queue.first_seq(), "next": queue.readable_seq,
                "reader": queue.stream_owner[0] if queue.stream_owner else None}

    def stream_open(self, session_id: int, queue_name: Any, name: Any) -> Any:
        """Attach as the queue's exclusive stream reader ``name``; replies its offsets."""
        self.session(session_id)
        reader = check_name(name, "stream reader")
        queue = self._stream_queue(queue_name)
        self._check_reader(queue, reader)
        others = [c for c in queue.consumers]
        if others:
            raise IllegalState(f"queue {queue.name!r} has {len(others)} consumer(s): a stream "
                               "reader needs the queue to itself")
        if queue.in_flight:
            raise IllegalState(f"queue {queue.name!r} has {queue.in_flight} unacked "
                               "deliveries: a stream reader needs the queue to itself")
        if queue.stream_owner is not None:
            self._stream_sessions.get(queue.stream_owner[1], set()).discard(queue.name)
        queue.stream_owner = (reader, session_id)
        self._stream_sessions.setdefault(session_id, set()).add(queue.name)
        return self._info(queue)

    def stream_info(self, session_id: int, queue_name: Any) -> Any:
        """A queue's offsets (``first``, ``next``) and its reader, without attaching."""
        self.session(session_id)
        return self._info(self._stream_queue(queue_name))

    def stream_read(self, session_id: int, queue_name: Any, start: int, end: int,
                    name: str | None = None, max_count: int | None = None,
                    max_bytes: int | None = None) -> ReadResult:
        """Messages with ``start <= seq < end`` (seq order), not consumed."""
        self.session(session_id)
        queue = self._stream_queue(queue_name)
        if name is not None:  # reading consumes nothing: anonymous reads are allowed
            self._check_reader(queue, name)
        if start < 0 or end < start:
            raise BadRequest("a range needs 0 <= start <= end")
        limit = self.limits.max_stream_read
        count = limit if max_count is None else max(1, min(max_count, limit))
        size = self.limits.max_stream_read_bytes
        size = size if max_bytes is None else max(1, min(max_bytes, size))
        found, after = queue.read_range(start, end, count, size)
        return ReadResult(queue.name, found, after)

    def stream_commit(self, session_id: int, rid: int, queue_name: Any, name: Any,
                      end: int) -> Any:
        """Consume every message below seq ``end`` (idempotent). Replies ``{"released"}``."""
        self.session(session_id)
        reader = check_name(name, "stream reader")
        queue = self._stream_queue(queue_name)
        self._check_reader(queue, reader)
        released = [m for m in queue.below(end) if m.state is State.READY]
        for message in released:
            queue.discard(message)  # out of the ready lists; _consume counts it out
        result = {"released": len(released)}
        if not released:
            return result
        if self._consume(released, None) is not LATER:
            return result
        self._group_replies.append((session_id, rid, result))
        return LATER

    def stream_close(self, session_id: int, queue_name: Any, name: Any) -> Any:
        """Detach the stream reader; the queue delivers to consumers again."""
        queue = self.queues.get(check_name(queue_name))
        if queue is not None and queue.stream_owner == (name, session_id):
            queue.stream_owner = None
            self._stream_sessions.get(session_id, set()).discard(queue.name)
            self._dispatch(queue, self._now)
        return {}

    def close_session(self, session_id: int, now: int) -> None:
        for name in self._stream_sessions.pop(session_id, set()):
            queue = self.queues.get(name)
            if queue is not None and queue.stream_owner and queue.stream_owner[1] == session_id:
                queue.stream_owner = None
        super().close_session(session_id, now)

    # ------------------------------------------------------------------ batched sends
    def send_batch(self, session_id: int, rid: int, dest: Any, bodies: list[bytes], now: int,
                   *, headers: list[dict[str, str] | None] | None = None,
                   message_ids: list[str | None] | None = None,
                   persistent: bool = True) -> Any:
        """Send many messages to one destination in one request (all checked first).

        Replies ``{"count", "duplicates"}`` once every stored one is durable (inside
        a transaction or XA branch: at once, staged).
        """
        count = len(bodies)
        if headers is not None and len(headers) != count:
            raise BadRequest("headers must be a list as long as bodies")
        if message_ids is not None and len(message_ids) != count:
            raise BadRequest("message_ids must be a list as long as bodies")
        limit = self.limits.max_message_size
        if not set(map(type, bodies)) <= {bytes}:  # (map: no Python-level loop per body)
            index = next(i for i, body in enumerate(bodies) if type(body) is not bytes)
            raise BadRequest(f"bodies[{index}] must be bytes")
        sizes = list(map(len, bodies))
        if sizes and max(sizes) > limit:
            index = next(i for i, size in enumerate(sizes) if size > limit)
            raise MessageTooLarge(f"bodies[{index}] is {sizes[index]} bytes, above "
                                  f"max_message_size ({limit}); nothing was sent")
        session = self.session(session_id)
        transaction = session.xa_work
        if transaction is not None:
            transaction.fire(TxEvent.WORK)
            if count:
                self._check_tx_room(transaction, count)
        if not isinstance(dest, str) or (dest not in self.queues and dest not in self.topics):
            check_name(dest, "destination")
        targets = self._targets(dest, now)
        total = sum(sizes)
        for queue in targets:
            self._check_batch_room(queue, count, total, quota=transaction is None)
        made: list[Message] = []
        duplicates = 0
        next_id = self.next_id
        for index, body in enumerate(bodies):
            message_id = message_ids[index] if message_ids is not None else None
            if message_id is not None:
                if targets and all(queue.seen(message_id) for queue in targets):
                    duplicates += 1
                    continue
                for queue in targets:
                    queue.remember(message_id, pending=persistent and queue.durable)
            header = (headers[index] or None) if headers is not None else None
            for queue in targets:
                ttl = queue.settings.default_ttl_ms
                made.append(Message(next_id, queue.name, sizes[index], message_id, header, 4, now,
                                    now + ttl if ttl else 0, 0, 0,
                                    persistent and queue.durable, body))
                next_id += 1
        self.next_id = next_id
        for queue in targets:
            mine = [m for m in made if m.queue == queue.name] if len(targets) > 1 else made
            queue.pending += len(mine)
            queue.pending_bytes += sum(m.size for m in mine)
        self.counters["sent"] += count - duplicates
        reply = {"count": count - duplicates, "duplicates": duplicates}
        if transaction is not None:
            transaction.sends.extend(made)
            return reply
        stored = [m for m in made if m.persistent]
        for message in made:
            if not message.persistent:
                self._apply_add(message, now)
        if not stored:
            return reply
        messages = self.messages
        for message in stored:
            messages[message.id] = message
        self._group_adds.extend(stored)
        self._group_replies.append((session_id, rid, reply))
        return LATER

    def _check_batch_room(self, queue: Queue, count: int, size: int, *, quota: bool) -> None:
        settings = queue.settings
        if not settings.ingress:
            raise Disabled(f"queue {queue.name!r} does not accept messages (ingress disabled)")
        if not quota:
            return  # an XA branch's quota is checked at prepare (seed 002)
        if settings.max_messages and queue.messages + queue.pending + count > settings.max_messages:
            raise QuotaExceeded(f"queue {queue.name!r} is full: max_messages "
                                f"{settings.max_messages}; nothing was sent")
        if settings.max_bytes and queue.bytes + queue.pending_bytes + size > settings.max_bytes:
            raise QuotaExceeded(f"queue {queue.name!r} is full: max_bytes {settings.max_bytes}; "
                                "nothing was sent")

    # ------------------------------------------------------------------ the Spark sink
    def _last_batch(self, sink: str) -> int:
        return max(self.sinks.get(sink, -1), self._sinks_committing.get(sink, -1))

    def _sink_branches(self, sink: str, up_to: int, *, prepared: bool) -> list[Branch]:
        found = []
        for branch in self.branches.values():
            owner = sink_of(branch.xid)
            if owner is None or owner[0] != sink or owner[1] > up_to:
                continue
            if (branch.state is S.PREPARED) == prepared:
                found.append(branch)
        return found

    def sink_status(self, session_id: int, sink: Any) -> Any:
        """``{"last": n}``: the sink's last committed batch id (-1: none)."""
        self.session(session_id)
        return {"last": self.sinks.get(check_sink_id(sink), -1)}

    def sink_commit(self, session_id: int, rid: int, sink: Any, batch: Any, xids: Any,
                    now: int) -> Any:
        """Commit batch ``batch`` of ``sink``: its prepared branches ``xids``, atomically
        with the sink's new last batch id (see the module docstring)."""
        self.session(session_id)
        check_sink_id(sink)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise BadRequest("batch must be an integer >= 0")
        if not isinstance(xids, list):
            raise BadRequest("xids must be a list of Xid strings")
        last = self._last_batch(sink)
        commits: list[Branch] = []
        if batch > last:
            for xid in dict.fromkeys(parse_xid(x) for x in xids):
                if sink_of(xid) != (sink, batch):
                    raise XAError(XAER_INVAL, f"{xid} is not a branch of sink {sink!r} "
                                              f"batch {batch}")
                branch = self.branches.get(xid)
                if branch is None:
                    raise XAError(XAER_NOTA, f"unknown Xid {xid}: the batch cannot commit")
                if branch.state is not S.PREPARED:
                    raise XAError(XAER_PROTO, f"branch {xid} is {branch.state.name}, "
                                              "not PREPARED")
                commits.append(branch)
        new_last = max(batch, last)
        rollbacks = [b for b in self._sink_branches(sink, new_last, prepared=True)
                     if b not in commits]
        result = {"committed": batch > last, "last": new_last, "branches": len(commits),
                  "rolled_back": len(rollbacks)}
        if batch <= last and not rollbacks:
            return result
        return self._write_sink_record(session_id, rid, sink, new_last, commits, rollbacks,
                                       now, result)

    def sink_abort(self, session_id: int, rid: int, sink: Any, batch: Any, now: int) -> Any:
        """Roll back batch ``batch`` of ``sink`` unless it is committed."""
        self.session(session_id)
        check_sink_id(sink)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise BadRequest("batch must be an integer >= 0")
        last = self._last_batch(sink)
        if batch <= last:
            return {"rolled_back": 0, "last": last}
        for branch in self._sink_branches(sink, batch, prepared=False):
            owner = sink_of(branch.xid)
            if owner is not None and owner[1] == batch and branch.state is not S.GONE:
                self._undo(branch, now)  # never written: nothing to log
        rollbacks = [b for b in self._sink_branches(sink, batch, prepared=True)
                     if sink_of(b.xid) == (sink, batch)]
        result = {"rolled_back": len(rollbacks), "last": last}
        if not rollbacks:
            return result
        return self._write_sink_record(session_id, rid, sink, last, [], rollbacks, now, result)

    def _write_sink_record(self, session_id: int, rid: int, sink: str, last: int,
                           commits: list[Branch], rollbacks: list[Branch], now: int,
                           result: dict[str, Any]) -> Any:
        entries = []
        for branch in commits:
            branch.fire(Request.COMMIT)
            discards = sorted(self._commit_discards(branch))
            entries.append([str(branch.xid), self._commit_seqs(branch), discards])
        for branch in rollbacks:
            branch.fire(Request.ROLLBACK)
        if last > self.sinks.get(sink, -1):
            self._sinks_committing[sink] = last

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self._storage_failed(error)
                self._emit(Fail(session_id, rid, XAError(XAER_RMFAIL, f"store failed: {error}")))
                return
            if self._sinks_committing.get(sink) == last:
                del self._sinks_committing[sink]
            self.sinks[sink] = max(self.sinks.get(sink, -1), last)
            for branch, commit in [(b, True) for b in commits] + [(b, False) for b in rollbacks]:
                self._apply(branch, commit=commit, now=self._now)
                branch.fire(Request.COMMIT_DURABLE if commit else Request.ROLLBACK_DURABLE)
                self._remove(branch)
            self._emit(Reply(session_id, rid, result))

        meta = [sink, last, entries, [str(b.xid) for b in rollbacks], now]
        self._persist(Kind.SINK_COMMIT, meta, on_durable)
        return LATER

    # ------------------------------------------------------------------ replay
    def _replay_sink(self, meta: Any) -> None:
        sink, last, entries, rollbacks = meta[:4]
        self.sinks[sink] = max(self.sinks.get(sink, -1), int(last))
        for entry in entries:
            self._replay_commit(parse_xid(entry[0]), entry[2] if len(entry) > 2 else [],
                                entry[1])
        for xid_text in rollbacks:
            xid = parse_xid(xid_text)
            branch = self.branches.pop(xid, None)
            self._replay_completed.add(xid)
            if branch is not None:
                self._replay_outcome(branch, commit=False)


__all__ = ["ReadResult", "Streams"]
