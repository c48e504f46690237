"""Sessions (one per client connection) and topics.

A :class:`Session` owns its subscriptions, one-shot receivers, the delivery
tags it handed out (tag → consumer, for ack/nack) and its open local
transactions. When a connection ends the broker rolls its transactions back
and returns its unacked messages (``Broker.close_session``).
"""

from __future__ import annotations

from typing import Any

from txbroker.core.queues import Consumer
from txbroker.core.transactions import LocalTransaction, TxState
from txbroker.errors import TransactionError


class Session:
    """The broker-side state of one client connection."""

    __slots__ = ("consumers", "deliveries", "id", "next_tag", "next_tx", "owned_queues",
                 "receivers", "transactions", "user", "xa_timeout_ms", "xa_work", "xa_xid")

    def __init__(self, id: int, user: str | None = None) -> None:
        self.id = id
        self.user = user
        self.consumers: dict[int, Consumer] = {}  #: subscription id -> consumer
        self.receivers: set[Consumer] = set()  #: waiting one-shot receives
        self.deliveries: dict[int, Consumer] = {}  #: unacked delivery tag -> consumer
        self.transactions: dict[int, LocalTransaction] = {}
        self.owned_queues: set[str] = set()  #: non-durable subscription queues
        self.next_tag = 1
        self.next_tx = 1
        #: the XA branch associated with this session (ACTIVE) and its staged work: sends
        #: and acks outside a local transaction go there (core/xa_branches.py)
        self.xa_xid: Any = None
        self.xa_work: LocalTransaction | None = None
        self.xa_timeout_ms = 0  #: set_transaction_timeout of this session (0 = default)

    def new_tag(self) -> int:
        """The next delivery tag of this session (tags are unique per session)."""
        tag = self.next_tag
        self.next_tag += 1
        return tag

    def begin(self) -> LocalTransaction:
        """Open a new local transaction in this session."""
        tx = LocalTransaction(self.id, self.next_tx)
        self.next_tx += 1
        self.transactions[tx.id] = tx
        return tx

    def transaction(self, tx_id: Any) -> LocalTransaction:
        """The open transaction ``tx_id`` of this session (TransactionError if none)."""
        if not isinstance(tx_id, int) or isinstance(tx_id, bool):
            raise TransactionError("tx must be an integer transaction id")
        tx = self.transactions.get(tx_id)
        if tx is None or tx.state is not TxState.ACTIVE:
            raise TransactionError(f"no open transaction {tx_id} on this connection")
        return tx


class Topic:
    """A publish/subscribe destination: a message sent to it is copied to
    every subscription queue (``topic::name``)."""

    __slots__ = ("name", "subscriptions")

    def __init__(self, name: str) -> None:
        self.name = name
        self.subscriptions: set[str] = set()

    def definition(self) -> dict[str, Any]:
        """The ``def`` persisted for this topic (records.py)."""
        return {"name": self.name, "kind": "topic", "topic": None, "settings": {}}

    def info(self) -> dict[str, Any]:
        """What ``queue_info`` shows for a topic (it holds no messages itself)."""
        return {
            "name": self.name,
            "kind": "topic",
            "subscriptions": sorted(self.subscriptions),
            "depth": 0,
            "in_flight": 0,
            "consumers": 0,
            "bytes": 0,
            "settings": {},
        }
