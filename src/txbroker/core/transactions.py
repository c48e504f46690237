"""Local transactions: the state table and the staged work of one transaction.

Theory of operation
-------------------
A local transaction stages sends and acks in memory. Nothing of it is written
until commit, which writes the whole group as ONE ``TX`` record: after a
crash the log holds all of it or none of it. While the record is on its way
to disk the transaction is COMMITTING and takes no more work; once durable
the broker applies it (sends become visible, acked messages go) and it is
COMMITTED. Rollback — asked for, or because the session went away — drops
the staged sends and puts the consumed messages back to be redelivered.

An XA branch stages its work in a ``LocalTransaction`` too (``is_xa``); its
own state table is ``core/xa.py``.
"""

from __future__ import annotations

from enum import Enum

from txbroker.core.messages import Message
from txbroker.core.queues import Consumer
from txbroker.errors import TransactionError


class TxState(Enum):
    """States of a local transaction (the table below)."""

    ACTIVE = "active"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"


class TxEvent(Enum):
    """What happens to a local transaction (the table below)."""

    WORK = "work"  #: a staged send, ack or nack
    COMMIT = "commit"  #: the client asks to commit
    ROLLBACK = "rollback"  #: the client asks to roll back, or its session ended
    DURABLE = "durable"  #: the TX record is on disk
    FAILED = "failed"  #: the store could not write it
    VOTE_FAILED = "vote failed"  #: a replicated primary's backup could not write it


#: (state, event) -> next state. Anything missing is a TransactionError.
TRANSITIONS: dict[tuple[TxState, TxEvent], TxState] = {
    # Rule 1: an active transaction takes any amount of work (up to the limit).
    (TxState.ACTIVE, TxEvent.WORK): TxState.ACTIVE,
    # Rule 2: commit writes one record group and waits for it to be durable.
    (TxState.ACTIVE, TxEvent.COMMIT): TxState.COMMITTING,
    # Rule 3: rollback is allowed any time before commit was asked for.
    (TxState.ACTIVE, TxEvent.ROLLBACK): TxState.ROLLED_BACK,
    # Rule 4: the record group is durable: the transaction's effects apply.
    (TxState.COMMITTING, TxEvent.DURABLE): TxState.COMMITTED,
    # Rule 5: the store failed: nothing was acknowledged, the client is told
    # the transaction rolled back (the broker stops taking writes anyway).
    (TxState.COMMITTING, TxEvent.FAILED): TxState.ROLLED_BACK,
    # Rule 5b: replicated HA (``core/local_tx.py``, voted commit): a ready backup could
    # not write the commit; it is rolled back everywhere and the client is told so.
    (TxState.COMMITTING, TxEvent.VOTE_FAILED): TxState.ROLLED_BACK,
    # Rule 6: a session ending while its commit is on the way to disk does
    # not undo it; the commit completes on its own.
    (TxState.COMMITTING, TxEvent.ROLLBACK): TxState.COMMITTING,
}


class LocalTransaction:
    """The staged work of one local transaction of a session."""

    __slots__ = ("acks", "delivered", "id", "is_xa", "nacks", "sends", "session", "state")

    def __init__(self, session: int, id: int, *, is_xa: bool = False) -> None:
        self.session = session
        self.id = id
        #: the staged work of an XA branch (``core/xa.py``), not a local transaction
        self.is_xa = is_xa
        self.state = TxState.ACTIVE
        self.sends: list[Message] = []  #: messages to add at commit (bodies in memory)
        self.acks: dict[int, Message] = {}  #: message id -> consumed message (HELD)
        self.nacks: dict[int, Message] = {}  #: message id -> message to requeue at commit
        #: message id -> (delivery tag, consumer) of each staged ack and nack: a rollback
        #: that keeps them delivered (AMQP's ``tx.rollback``) makes them unacked again
        self.delivered: dict[int, tuple[int, Consumer]] = {}

    def fire(self, event: TxEvent) -> TxState:
        """Apply one event of the table; raise TransactionError if it is not allowed."""
        try:
            self.state = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise TransactionError(
                f"transaction {self.id} is {self.state.value}: cannot {event.value}"
            ) from None
        return self.state

    @property
    def operations(self) -> int:
        """Staged sends, acks and nacks (the ``max_tx_operations`` limit counts them)."""
        return len(self.sends) + len(self.acks) + len(self.nacks)
