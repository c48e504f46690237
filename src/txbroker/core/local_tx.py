"""Local transactions: begin, commit as one record, roll back.

Theory of operation
-------------------
The staged work and the state table of one transaction are
``core/transactions.py``'s. :class:`LocalTransactions` runs the commands:
``tx_begin`` opens one in the session; sends, acks and nacks naming it are
staged there (``core/sending.py``, ``core/delivery.py``); ``tx_commit``
writes every staged send and ack as ONE ``TX`` record and applies them once
it is durable (sends become visible, acked messages go, nacked ones come
back); ``tx_rollback`` — or the end of the session — drops the staged sends
and puts the consumed messages back to be redelivered.

**Voted commit** (:attr:`LocalTransactions.voted`, set on a replicated primary:
seed 001, "TX Commit/Rollback: do prepare phase as for DTX"). The commit is
written as the ``XA_PREPARE`` of an internal branch (``xid.local_tx_xid``, a
reserved format id) instead of a ``TX``: replication votes on every
``XA_PREPARE`` (``server/ha/replication.py``). Every ready backup wrote it: the
work applies, the client is answered and an ``XA_COMMIT`` (carrying the sends'
seqs) follows in the log without being waited for. A backup could not write it
(``ReplicaVoteFailed``): an ``XA_ROLLBACK`` is written and, once durable, the
work rolls back and the client gets ``TransactionRolledBack``. **Presumed
commit**: an internal branch that recovery finds without an outcome was never
answered as rolled back (the rollback is durable before that answer), so it is
committed (``commit_leftover_local``, ``core/xa_one_phase.py``), like a ``TX``
entry written before a crash.
"""

from __future__ import annotations

from typing import Any

from txbroker.core.effects import Fail, Reply
from txbroker.core.limits import Limits
from txbroker.core.messages import Message, State
from txbroker.core.outbox import Outbox
from txbroker.core.queue_index import LATER, QueueIndex
from txbroker.core.records import Tx, XaCommit, XaPrepare, XaRollback
from txbroker.core.sessions import Session
from txbroker.core.transactions import LocalTransaction, TxEvent, TxState
from txbroker.errors import ReplicaVoteFailed, TransactionError, TransactionRolledBack
from txbroker.xid import local_tx_xid


class LocalTransactions:
    """The local transaction commands. See the module docstring."""

    def __init__(self, index: QueueIndex, limits: Limits, outbox: Outbox) -> None:
        self.index = index
        self.limits = limits
        self.outbox = outbox
        #: a replicated primary: commits are voted by the backups (module docstring)
        self.voted = False

    def check_room(self, tx: LocalTransaction, more: int) -> None:
        """Refuse work beyond ``max_tx_operations``."""
        if tx.operations + more > self.limits.max_tx_operations:
            raise TransactionError(
                f"transaction {tx.id} has {tx.operations} operations, the limit "
                f"(max_tx_operations)"
            )

    def begin(self, session: Session) -> Any:
        """Open a transaction in the session; replies ``{"tx": id}``."""
        return {"tx": session.begin().id}

    def commit(self, session: Session, rid: int, tx_id: int, now: int) -> Any:
        """Commit: one TX record with every staged send and ack; reply once durable."""
        tx = session.transaction(tx_id)
        if self.outbox.failed is not None:
            self.rollback(tx, now)
            raise TransactionRolledBack(f"the store failed; transaction {tx_id} rolled back")
        tx.fire(TxEvent.COMMIT)
        index = self.index
        stored_sends = [m for m in tx.sends if m.persistent]
        stored_acks = [m for m in tx.acks.values() if m.persistent]
        if self.voted and (stored_sends or stored_acks):
            return self._commit_voted(session, rid, tx, stored_sends, stored_acks, now)
        for message in tx.acks.values():
            # gone from now on: compaction must not copy a message whose ack is
            # already in the log (a copy after the ack would bring it back)
            message.state = State.GONE
        for message in stored_sends:
            index.messages[message.id] = message
        index.assign_seqs(stored_sends)
        if not stored_sends and not stored_acks:
            self.finish(tx, now)
            return {}

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(stored_sends, refs, strict=True):
                message.ref = ref

        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                self._store_failed(tx, session.id, rid, error)
                return
            self.finish(tx, max(self.outbox.now, now))
            self.outbox.emit(Reply(session.id, rid, {}))

        record = Tx([m.to_record() for m in stored_sends], [m.id for m in stored_acks], now)
        bodies = [m.body for m in stored_sends if m.body is not None]
        self.outbox.write(record, on_durable, bodies, on_refs)
        return LATER

    def _commit_voted(self, session: Session, rid: int, tx: LocalTransaction,
                      stored_sends: list[Message], stored_acks: list[Message],
                      now: int) -> Any:
        """The commit as an internal branch's XA_PREPARE, voted by the backups; then
        XA_COMMIT, or XA_ROLLBACK and TransactionRolledBack (module docstring)."""
        index, outbox = self.index, self.outbox
        xid = str(local_tx_xid(session.id, tx.id, now))
        # Until the vote is in, the sends stay out of the index (as a prepared branch's:
        # compaction must not copy a message that may still roll back) and the acked
        # messages stay HELD (never copied either).

        def on_refs(refs: list[int]) -> None:
            for message, ref in zip(stored_sends, refs, strict=True):
                message.ref = ref

        def on_durable(error: BaseException | None) -> None:
            if isinstance(error, ReplicaVoteFailed):
                self._vote_failed(tx, session.id, rid, xid, error)
                return
            if error is not None:
                self._store_failed(tx, session.id, rid, error)
                return
            at = max(outbox.now, now)
            index.assign_seqs(stored_sends)  # seqs in log order: the XA_COMMIT's
            for message in tx.acks.values():
                message.state = State.GONE  # its ack is in the log from now on
            outbox.write(XaCommit(xid, [], [[m.id, m.seq] for m in stored_sends if m.seq], at),
                         self._outcome_written)
            self.finish(tx, at)
            outbox.emit(Reply(session.id, rid, {}))

        # an internal branch is created and prepared at once: prepared_ms == created_ms
        record = XaPrepare(xid, [m.to_record() for m in stored_sends],
                           [[m.id, m.delivery_count] for m in stored_acks], [], now, now)
        bodies = [m.body for m in stored_sends if m.body is not None]
        outbox.write(record, on_durable, bodies, on_refs)
        return LATER

    def _vote_failed(self, tx: LocalTransaction, session_id: int, rid: int, xid: str,
                     error: ReplicaVoteFailed) -> None:
        """A ready backup could not write the commit: roll it back everywhere (an
        XA_ROLLBACK follows in the log), then tell the client."""
        outbox = self.outbox

        def rolled_back(failure: BaseException | None) -> None:
            if failure is not None and not isinstance(failure, ReplicaVoteFailed):
                self._store_failed(tx, session_id, rid, failure)
                return
            tx.fire(TxEvent.VOTE_FAILED)
            self._undo(tx, outbox.now)
            outbox.emit(Fail(session_id, rid, TransactionRolledBack(
                f"transaction {tx.id} rolled back: {error}")))

        outbox.write(XaRollback(xid, outbox.now), rolled_back)

    def _outcome_written(self, error: BaseException | None) -> None:
        """The XA_COMMIT of a voted commit is durable (nobody waits for it)."""
        if error is not None:
            self.outbox.storage_failed(error)

    def _store_failed(self, tx: LocalTransaction, session_id: int, rid: int,
                      error: BaseException) -> None:
        self.outbox.storage_failed(error)
        tx.fire(TxEvent.FAILED)
        for message in tx.sends:
            self.index.drop_pending(message)
        self.outbox.emit(Fail(session_id, rid, TransactionRolledBack(
            f"the store failed; transaction {tx.id} rolled back: {error}")))

    def finish(self, tx: LocalTransaction, now: int) -> None:
        """The TX record is durable (or there was nothing to write): apply the work."""
        if tx.state is TxState.COMMITTING:
            tx.fire(TxEvent.DURABLE)
        index = self.index
        session = index.sessions.get(tx.session)
        if session is not None:
            session.transactions.pop(tx.id, None)
        index.apply_adds(tx.sends, now)
        for message in tx.acks.values():
            index.count_acked(message)
        for message in tx.nacks.values():
            index.requeue_held(message, now)

    def rollback(self, tx: LocalTransaction, now: int, *, keep_delivered: bool = False
                 ) -> None:
        """Drop the staged sends; consumed (and nacked) messages are redelivered, or,
        with ``keep_delivered`` (AMQP's ``tx.rollback``, as RabbitMQ), are the session's
        unacked deliveries again, under their tags."""
        tx.fire(TxEvent.ROLLBACK)
        if tx.state is not TxState.ROLLED_BACK:
            return  # a commit already on its way to disk completes on its own
        self._undo(tx, now, keep_delivered=keep_delivered)

    def _undo(self, tx: LocalTransaction, now: int, *, keep_delivered: bool = False) -> None:
        """A rolled-back transaction's work: sends dropped, consumed messages back (to
        their queue, or, ``keep_delivered``, to the session's unacked deliveries)."""
        index = self.index
        session = index.sessions.get(tx.session)
        if session is not None:
            session.transactions.pop(tx.id, None)
        for message in tx.sends:
            index.drop_pending(message)
        for message in list(tx.acks.values()) + list(tx.nacks.values()):
            found = tx.delivered.get(message.id)
            queue = index.queues.get(message.queue)
            if keep_delivered and session is not None and found is not None \
                    and queue is not None and message.state is State.HELD:
                tag, consumer = found
                message.state = State.DELIVERED
                queue.in_flight += 1
                consumer.unacked[tag] = message
                session.deliveries[tag] = consumer
            else:
                index.requeue_held(message, now)

    def session_closed(self, session: Session, now: int) -> None:
        """The session ended: its open transactions roll back."""
        for tx in list(session.transactions.values()):
            if tx.state is TxState.ACTIVE:
                self.rollback(tx, now)


__all__ = ["LocalTransactions"]
