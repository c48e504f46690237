"""Staged work: where a send or an ack goes, and what open work holds.

Where work goes: a send or an ack that names a local transaction (``tx``) is
staged there; otherwise, while the session is associated with an XA branch,
in the branch; otherwise it is done at once (:func:`work_for`). A nack is
staged only in a local transaction (``core/xa_branches.py`` says why).
Staged work has a size limit, a local transaction's or an XA branch's
(:func:`check_work_room`), and the messages it consumed stay HELD until it
completes (:func:`held_messages`).
"""

from __future__ import annotations

from collections.abc import Iterator

from txbroker.core.local_tx import LocalTransactions
from txbroker.core.messages import Message
from txbroker.core.queue_index import QueueIndex
from txbroker.core.sessions import Session
from txbroker.core.transactions import LocalTransaction
from txbroker.core.xa_branches import XaBranches


def work_for(session: Session, tx: int | None) -> LocalTransaction | None:
    """Where a send or ack goes: the named local transaction, else the session's
    XA branch, else nowhere (done at once)."""
    return session.transaction(tx) if tx is not None else session.xa_work


def check_work_room(transactions: LocalTransactions, xa: XaBranches, work: LocalTransaction,
                    more: int) -> None:
    """Refuse ``more`` messages in ``work`` past its limit (an XA branch's or a local
    transaction's)."""
    if work.is_xa:
        xa.check_room(work, more)
    else:
        transactions.check_room(work, more)


def held_messages(index: QueueIndex, xa: XaBranches) -> Iterator[Message]:
    """Messages consumed inside open local transactions and XA branches."""
    for session in index.sessions.values():
        for tx in session.transactions.values():
            yield from tx.acks.values()
            yield from tx.nacks.values()
    for branch in xa.branches.values():
        yield from branch.work.acks.values()
