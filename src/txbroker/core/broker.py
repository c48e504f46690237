"""The broker core's front: one object, its parts, and every command.

Theory of operation
-------------------
:class:`Broker` is what an edge (the server, a test harness) talks to. It
takes commands with the time as ``now`` (ms) and either returns the reply at
once, returns :data:`LATER` (the reply comes as a ``Reply`` / ``Fail``
effect once a record is durable), or raises a ``BrokerError``. After every
call the edge drains :meth:`Broker.take_effects` and carries them out
(``core/effects.py``). No I/O, no clock, no threads.

The broker owns its state through parts, each holding its own and each
testable alone; the front only routes commands and wires the parts together:

=====================  ================================================  ==================
part                   owns                                              module
=====================  ================================================  ==================
``outbox``             effects, the open record group, store failure     ``outbox.py``
``index``              queues, topics, sessions, the message index       ``queue_index.py``
``delivery``           consumers, receives, acks/nacks, timers           ``delivery.py``
``sending``            send, send_batch (one message builder)            ``sending.py``
``transactions``       local transactions                                ``local_tx.py``
``xa``                 XA branches (state table: ``xa.py``)              ``xa_branches.py``
``streams``            stream readers (offset reading)                   ``streams.py``
``sinks``              the Spark sink's commits                          ``sinks.py``
``admin``              queue and topic administration                    ``admin.py``
``replay``             snapshots and replay at start-up                  ``replay.py``
``compaction``         relocation of live bodies                         ``compaction.py``
``router``             the transaction router (seed 000)                 ``router/``
=====================  ================================================  ==================

Where a send or an ack goes (a local transaction, an XA branch, or nowhere) is
``core/staged_work.py``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from txbroker.core import overflow
from txbroker.core.admin import Admin
from txbroker.core.checkpoint import load_checkpoint, take_checkpoint, take_replay_checkpoint
from txbroker.core.compaction import Compaction
from txbroker.core.delivery import Delivery
from txbroker.core.effects import Effect
from txbroker.core.limits import Limits
from txbroker.core.local_tx import LocalTransactions
from txbroker.core.messages import Message, MessageIndex
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import LATER, QueueIndex
from txbroker.core.queues import Queue
from txbroker.core.records import CHECKPOINT_KIND, ReplicaAt, StoredEntry
from txbroker.core.replay import BodySize, Replay
from txbroker.core.router.commands import RouterCommand
from txbroker.core.router.engine import Router
from txbroker.core.router.log import RouterLog, refuse_reserved
from txbroker.core.sending import Sending
from txbroker.core.sessions import Session, Topic
from txbroker.core.sinks import Sinks
from txbroker.core.staged_work import check_work_room, held_messages, work_for
from txbroker.core.streams import ReadResult, StreamReaders
from txbroker.core.xa import Branch
from txbroker.core.xa_branches import XaBranches
from txbroker.core.xa_one_phase import commit_leftover_local
from txbroker.xid import Xid


class Broker:
    """The complete broker core (see the module docstring for its parts)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.outbox = Outbox()
        self.index = QueueIndex(self.limits, self.outbox)
        self.delivery = Delivery(self.index, self.limits, self.outbox)
        self.transactions = LocalTransactions(self.index, self.limits, self.outbox)
        self.xa = XaBranches(self.index, self.limits, self.outbox)
        self.sending = Sending(self.index, self.limits,
                               functools.partial(check_work_room, self.transactions, self.xa))
        self.streams = StreamReaders(self.index, self.limits, self.outbox)
        self.sinks_part = Sinks(self.xa, self.outbox)
        self.admin = Admin(self.index, self.outbox)
        self.replay_part = Replay(self.index, self.xa, self.sinks_part, self.outbox)
        self.compaction = Compaction(self.index, self.outbox)
        self.router = Router(RouterLog(self.index, self.outbox), self.outbox, self.limits)
        self.index.held_messages = functools.partial(held_messages, self.index, self.xa)
        self.index.trim_overflow = functools.partial(overflow.trim, self.index)

    # ------------------------------------------------------------------ state, for edges
    @property
    def queues(self) -> dict[str, Queue]:
        """Queues by name."""
        return self.index.queues

    @property
    def topics(self) -> dict[str, Topic]:
        """Topics by name."""
        return self.index.topics

    @property
    def messages(self) -> MessageIndex:
        """The index of stored (or pending) messages by id."""
        return self.index.messages

    @property
    def sessions(self) -> dict[int, Session]:
        """Sessions by id."""
        return self.index.sessions

    @property
    def counters(self) -> dict[str, int]:
        """Messages sent, delivered, acked, expired, dead-lettered since start."""
        return self.index.counters

    @property
    def next_id(self) -> int:
        """The next message id."""
        return self.index.next_id

    @property
    def branches(self) -> dict[Xid, Branch]:
        """XA branches by Xid."""
        return self.xa.branches

    @property
    def sinks(self) -> dict[str, int]:
        """The Spark sinks' last committed batch ids."""
        return self.sinks_part.sinks

    @property
    def failed(self) -> BaseException | None:
        """The store's failure, once it failed (no more writes)."""
        return self.outbox.failed

    @property
    def body_size_of(self) -> BodySize | None:
        """The store's ``body_size``: the edge sets it before replaying."""
        return self.replay_part.body_size_of

    @body_size_of.setter
    def body_size_of(self, value: BodySize | None) -> None:
        self.replay_part.body_size_of = value

    # ------------------------------------------------------------------ plumbing
    def take_effects(self) -> list[Effect]:
        """Every effect produced since the last call, in order (closes the record group)."""
        return self.outbox.take()

    def set_now(self, now: int) -> None:
        """The edge tells the core the time before running durable callbacks."""
        self.outbox.set_now(now)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: int, user: str | None = None) -> Session:
        """Register a connection's session."""
        return self.delivery.open_session(session_id, user)

    def close_session(self, session_id: int, now: int) -> None:
        """The connection ended: its stream readers detach, its XA branch waits for a
        reattach, its transactions roll back, its unacked messages are redelivered
        and its non-durable subscriptions are dropped."""
        self.router.session_closed(session_id, now)
        session = self.index.sessions.get(session_id)
        if session is None:
            return
        self.streams.session_closed(session_id)
        self.xa.session_closed(session, now)
        self.delivery.detach_consumers(session)
        self.transactions.session_closed(session, now)
        self.delivery.close_session(session, now)

    # ------------------------------------------------------------------ messaging
    def send(self, session_id: int, rid: int, dest: str, body: bytes, now: int, *,
             headers: dict[str, str] | None = None, message_id: str | None = None,
             persistent: bool = True, priority: int = 4, ttl_ms: int = 0, delay_ms: int = 0,
             tx: int | None = None) -> Any:
        """Send a message to a queue or topic. Replies ``{"duplicate": bool}``."""
        refuse_reserved(dest, "send")  # the router's journal (core/router/log.py)
        session = self.index.session(session_id)
        work = session.transaction(tx) if tx is not None else session.xa_work  # (work_for, inline)
        return self.sending.send(session_id, rid, dest, body, now, work, headers, message_id,
                                 persistent, priority, ttl_ms, delay_ms)

    def send_batch(self, session_id: int, rid: int, dest: Any, bodies: list[bytes], now: int,
                   *, headers: list[dict[str, str] | None] | None = None,
                   message_ids: list[str | None] | None = None,
                   persistent: bool = True) -> Any:
        """Send many messages to one destination; replies ``{"count", "duplicates"}``."""
        refuse_reserved(dest, "send_batch")
        session = self.index.session(session_id)
        return self.sending.send_batch(session_id, rid, dest, bodies, now, session.xa_work,
                                       headers=headers, message_ids=message_ids,
                                       persistent=persistent)

    def subscribe(self, session_id: int, sub: int, queue_name: str, now: int, *,
                  prefetch: int | None = None, ack: str = "client") -> Any:
        """Start a subscription: deliveries arrive as ``Deliver`` effects."""
        refuse_reserved(queue_name, "subscribe")
        return self.delivery.subscribe(self.index.session(session_id), sub, queue_name, now,
                                       prefetch=prefetch, ack=ack)

    def unsubscribe(self, session_id: int, sub: int, now: int, *,
                    keep_unacked: bool = False) -> Any:
        """End a subscription; its unacked messages go back to the queue (or, with
        ``keep_unacked``, stay the session's unacked deliveries: ``core/delivery.py``)."""
        return self.delivery.unsubscribe(self.index.session(session_id), sub, now,
                                         keep_unacked=keep_unacked)

    def receive(self, session_id: int, rid: int, queue_name: str, now: int,
                timeout_ms: int | None) -> Any:
        """Take one message (client ack). Replies with it, or ``None`` on timeout."""
        refuse_reserved(queue_name, "receive")
        return self.delivery.receive(self.index.session(session_id), rid, queue_name, now,
                                     timeout_ms)

    def ack(self, session_id: int, rid: int, tags: Iterable[int], now: int,
            tx: int | None = None) -> Any:
        """Acknowledge deliveries (or stage the acks in a transaction or XA branch)."""
        session = self.index.session(session_id)
        work = work_for(session, tx)
        tags = list(tags)
        if work is not None:
            check_work_room(self.transactions, self.xa, work, len(tags))
        return self.delivery.ack(session, rid, tags, now, work)

    def ack_by_id(self, session_id: int, rid: int, queue: Any, message_id: Any, now: int,
                  tx: int | None = None) -> Any:
        """Acknowledge a message delivered on an earlier session of the client (seed 004:
        an ack after a failover), named by its queue and id (``core/delivery.py``)."""
        session = self.index.session(session_id)
        work = work_for(session, tx)
        if work is not None:
            check_work_room(self.transactions, self.xa, work, 1)
        return self.delivery.ack_by_id(session, rid, queue, message_id, now, work)

    def nack(self, session_id: int, tags: Iterable[int], now: int, *, requeue: bool = True,
             tx: int | None = None) -> Any:
        """Reject deliveries: redeliver them, or dead-letter them (``requeue=False``);
        staged until commit in a local transaction, never in an XA branch."""
        session = self.index.session(session_id)
        work = session.transaction(tx) if tx is not None else None
        return self.delivery.nack(session, tags, now, requeue=requeue, work=work)

    def recover(self, session_id: int, now: int) -> dict[str, int]:
        """Give back every unacked delivery of the session (JMS ``Session.recover()``);
        replies ``{"recovered": n, "next_tag": t}`` (``core/delivery.py``)."""
        return self.delivery.recover(self.index.session(session_id), now)

    # ------------------------------------------------------------------ local transactions
    def tx_begin(self, session_id: int) -> Any:
        """Open a local transaction; replies ``{"tx": id}``."""
        return self.transactions.begin(self.index.session(session_id))

    def tx_commit(self, session_id: int, rid: int, tx_id: int, now: int) -> Any:
        """Commit: one TX record with every staged send and ack; reply once durable."""
        return self.transactions.commit(self.index.session(session_id), rid, tx_id, now)

    def tx_rollback(self, session_id: int, tx_id: int, now: int, *,
                    keep_delivered: bool = False) -> Any:
        """Roll a local transaction back; consumed messages are redelivered (or, with
        ``keep_delivered``, unacked deliveries of the session again: ``core/local_tx.py``)."""
        session = self.index.session(session_id)
        self.transactions.rollback(session.transaction(tx_id), now,
                                   keep_delivered=keep_delivered)
        return {}

    # ------------------------------------------------------------------ administration
    def queue_declare(self, session_id: int, rid: int, name: str, now: int, *,
                      kind: str = "queue", settings: dict[str, Any] | None = None) -> Any:
        """Create a queue or topic (see ``core/admin.py``)."""
        return self.admin.queue_declare(session_id, rid, name, now, kind=kind,
                                        settings=settings)

    def topic_subscribe(self, session_id: int, rid: int, topic_name: str, name: str, now: int,
                        *, durable: bool = True, settings: dict[str, Any] | None = None) -> Any:
        """Create (or find) the subscription queue ``topic::name`` of a topic."""
        return self.admin.topic_subscribe(self.index.session(session_id), rid, topic_name,
                                          name, now, durable=durable, settings=settings)

    def queue_update(self, session_id: int, rid: int, name: str, settings: dict[str, Any],
                     now: int) -> Any:
        """Change a queue's settings."""
        return self.admin.queue_update(session_id, rid, name, settings, now)

    def queue_delete(self, session_id: int, rid: int, name: str, now: int) -> Any:
        """Delete a queue (and its messages) or a topic (and its subscriptions)."""
        return self.admin.queue_delete(session_id, rid, name, now)

    def queue_purge(self, session_id: int, rid: int, name: str, now: int) -> Any:
        """Drop every ready or scheduled message of a queue."""
        return self.admin.queue_purge(session_id, rid, name, now)

    def queue_browse(self, name: str, limit: int) -> list[Message]:
        """The first ``limit`` visible messages of a queue, not consumed."""
        return self.admin.queue_browse(name, limit)

    def queue_move(self, session_id: int, rid: int, source: str, target: str | None,
                   limit: int, now: int) -> Any:
        """Move visible messages to another queue (a DLQ's re-drive); LATER."""
        self.index.session(session_id)
        return self.admin.queue_move(session_id, rid, source, target, limit, now)

    def queue_info(self, name: str) -> dict[str, Any]:
        """One queue's or topic's info."""
        return self.admin.queue_info(name)

    def queue_list(self) -> list[dict[str, Any]]:
        """Every queue's and topic's info."""
        return self.admin.queue_list()

    def stats(self) -> dict[str, Any]:
        """Broker-wide counts (the router's under ``"router"``)."""
        return {**self.admin.stats(), "router": self.router_stats()}

    # ------------------------------------------------------------------ XA
    def xa_start(self, session_id: int, xid_text: Any, flags: int, now: int) -> Any:
        """Associate a branch with the session (TMNOFLAGS, TMRESUME, TMJOIN)."""
        return self.xa.start(self.index.session(session_id), xid_text, flags, now)

    def xa_end(self, session_id: int, xid_text: Any, flags: int, now: int) -> Any:
        """End the session's work on a branch (TMSUCCESS, TMSUSPEND, TMFAIL)."""
        return self.xa.end(self.index.session(session_id), xid_text, flags, now)

    def xa_prepare(self, session_id: int, rid: int, xid_text: Any, now: int) -> Any:
        """Phase one: replies ``{"vote": XA_OK}`` when durable, or XA_RDONLY at once."""
        return self.xa.prepare(self.index.session(session_id), rid, xid_text, now)

    def xa_commit(self, session_id: int, rid: int, xid_text: Any, one_phase: bool,
                  now: int) -> Any:
        """Commit a PREPARED branch, or an IDLE one with ``one_phase``."""
        return self.xa.commit(self.index.session(session_id), rid, xid_text, one_phase, now)

    def xa_rollback(self, session_id: int, rid: int, xid_text: Any, now: int) -> Any:
        """Roll a branch back."""
        return self.xa.rollback(self.index.session(session_id), rid, xid_text, now)

    def xa_heuristic(self, session_id: int, rid: int, xid_text: Any, commit: bool,
                     now: int) -> Any:
        """Operator: complete a PREPARED branch by hand."""
        return self.xa.heuristic(self.index.session(session_id), rid, xid_text, commit, now)

    def xa_forget(self, session_id: int, rid: int, xid_text: Any, now: int) -> Any:
        """Remove a heuristically completed branch."""
        return self.xa.forget(self.index.session(session_id), rid, xid_text, now)

    def xa_recover(self, session_id: int, flags: int) -> list[str]:
        """Xids of PREPARED and heuristically completed branches."""
        return self.xa.recover(session_id, flags)

    def xa_set_timeout(self, session_id: int, seconds: int) -> Any:
        """The transaction timeout (seed 002's idle timeout, from ``end``) of branches
        this session starts; 0 = the default."""
        return self.xa.set_timeout(self.index.session(session_id), seconds)

    def xa_get_timeout(self, session_id: int) -> Any:
        """The transaction timeout (seconds) of branches this session starts."""
        return self.xa.get_timeout(self.index.session(session_id))

    def xa_list(self, now: int) -> list[dict[str, object]]:
        """Every branch with its state, age and message counts."""
        return self.xa.list(now)

    # ------------------------------------------------------------------ streams and sinks
    def stream_open(self, session_id: int, queue_name: Any, name: Any) -> Any:
        """Attach as the queue's exclusive stream reader ``name``."""
        refuse_reserved(queue_name, "stream_open")
        self.index.session(session_id)
        return self.streams.open(session_id, queue_name, name)

    def stream_info(self, session_id: int, queue_name: Any) -> Any:
        """A queue's offsets and its reader, without attaching."""
        self.index.session(session_id)
        return self.streams.info(queue_name)

    def stream_read(self, session_id: int, queue_name: Any, start: int, end: int,
                    name: str | None = None, max_count: int | None = None,
                    max_bytes: int | None = None) -> ReadResult:
        """Messages with ``start <= seq < end`` (seq order), not consumed."""
        self.index.session(session_id)
        return self.streams.read(queue_name, start, end, name, max_count, max_bytes)

    def stream_commit(self, session_id: int, rid: int, queue_name: Any, name: Any,
                      end: int) -> Any:
        """Consume every message below seq ``end`` (idempotent)."""
        self.index.session(session_id)
        return self.streams.commit(session_id, rid, queue_name, name, end)

    def stream_close(self, session_id: int, queue_name: Any, name: Any) -> Any:
        """Detach the stream reader."""
        return self.streams.close(session_id, queue_name, name)

    def sink_status(self, session_id: int, sink: Any) -> Any:
        """``{"last": n}``: the sink's last committed batch id (-1: none)."""
        self.index.session(session_id)
        return self.sinks_part.status(sink)

    def sink_commit(self, session_id: int, rid: int, sink: Any, batch: Any, xids: Any,
                    now: int) -> Any:
        """Commit a batch's prepared branches with the sink's new last batch id."""
        self.index.session(session_id)
        return self.sinks_part.commit(session_id, rid, sink, batch, xids, now)

    def sink_abort(self, session_id: int, rid: int, sink: Any, batch: Any, now: int) -> Any:
        """Roll back a batch unless it is committed."""
        self.index.session(session_id)
        return self.sinks_part.abort(session_id, rid, sink, batch, now)

    # ------------------------------------------------------------------ the router
    def rtr(self, session_id: int, rid: int, command: RouterCommand, now: int) -> Any:
        """A router command (``core/router/commands.py``): the router's only door."""
        return self.router.execute(session_id, rid, command, now)

    def router_stats(self) -> dict[str, Any]:
        """The router's counts (``stats()["router"]``)."""
        return self.router.stats()

    def router_holds(self) -> list[str]:
        """The router's transactions, one line each (for reading a simulator trace)."""
        return self.router.holds()

    def restore_router(self, body_of: Callable[[Message], bytes | None], now: int
                       ) -> list[str]:
        """After recovery: rebuild the router from its journal records, whose bodies
        ``body_of`` reads (None: skip the record); returns the problems found."""
        records = [(m, body_of(m)) for m in self.router.records()]
        return self.router.restore([(m, b) for m, b in records if b is not None], now)

    def define_facility(self, name: str, partitions: Any, now: int) -> None:
        """A router facility of the configuration file (after :meth:`restore_router`)."""
        self.router.define_from_config(name, partitions, now)

    # ------------------------------------------------------------------ time
    def tick(self, now: int) -> None:
        """Time passed: scheduled messages come due, receives time out, TTLs expire,
        XA branches time out, router votes time out."""
        self.outbox.set_now(now)
        self.delivery.tick(now)
        self.xa.tick(now)
        self.router.tick(now)

    def next_wakeup(self) -> int | None:
        """The next time (ms) ``tick`` has something to do, if any."""
        times = [t for t in (self.delivery.next_wakeup(), self.xa.next_wakeup(),
                             self.router.next_wakeup()) if t is not None]
        return min(times) if times else None

    # ------------------------------------------------------------------ recovery, compaction
    def snapshot(self) -> tuple[int, bytes]:
        """``(kind, meta)`` of the metadata snapshot (records.py SNAPSHOT)."""
        return self.replay_part.snapshot()

    def replay(self, entry: StoredEntry) -> None:
        """Apply one stored entry (log order; a checkpoint first) to the recovering state."""
        if entry.kind == CHECKPOINT_KIND:
            load_checkpoint(self.replay_part, entry.meta)
        else:
            self.replay_part.replay(entry)

    def checkpoint(self) -> tuple[int, bytes] | None:
        """``(kind, meta)`` of a clean shutdown's checkpoint (``core/checkpoint.py``)."""
        meta = take_checkpoint(self.index, self.xa, self.replay_part)
        return None if meta is None else (CHECKPOINT_KIND, meta)

    def replay_checkpoint(self) -> tuple[int, bytes] | None:
        """``(kind, meta)`` of the checkpoint of a replay not finished (a replicated
        backup's), its messages settled first (``core/checkpoint.py``)."""
        self.replay_part.settle()
        meta = take_replay_checkpoint(self.index, self.xa, self.replay_part)
        return None if meta is None else (CHECKPOINT_KIND, meta)

    @property
    def replica_at(self) -> ReplicaAt | None:
        """A replicated backup's log: where its copy stands (``REPLICA_AT``; None: unknown)."""
        return self.replay_part.replica

    def replay_backlog(self) -> int:
        """Replayed messages :meth:`finish_recovery` would walk one by one."""
        return len(self.replay_part.raw)

    def settle_replay(self) -> int:
        """Settle replayed messages ahead of :meth:`finish_recovery` (a warm standby
        while it follows: ``core/replay_settled.py``); how many are left unsettled."""
        return self.replay_part.settle()

    def finish_recovery(self, now: int) -> None:
        """Replay is over: every surviving message goes into its queue; voted local
        commits left without an outcome are committed (``core/local_tx.py``)."""
        self.replay_part.finish(now)
        commit_leftover_local(self.xa, now)

    def vote_local_commits(self, voted: bool) -> None:
        """A replicated primary: local commits are voted by the backups
        (``core/local_tx.py``, "Voted commit")."""
        self.transactions.voted = voted
        self.xa.voted = voted  # and one-phase XA commits

    def live_refs(self, entries: Iterable[StoredEntry]) -> list[tuple[int, int]]:
        """``(message id, ref)`` of messages whose current body lives in ``entries``."""
        return self.compaction.live_refs(entries)

    def still_live(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those pairs whose message still has that body and may be copied."""
        return self.compaction.still_live(pairs)

    def relocate_many(self, pairs: list[tuple[int, int]], bodies: list[bytes]) -> None:
        """Write fresh copies of live messages' bodies in one entry (compaction)."""
        self.compaction.relocate_many(pairs, bodies)


__all__ = ["LATER", "Broker"]
