"""The values the operation layer hands its edges: a :class:`Delivery`, the outcome
of acknowledging groups, and the refusals every edge words the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from txbroker.core.messages import Message
from txbroker.errors import BrokerError, IllegalState, TxBrokerError

#: The refusal of wrong credentials (whatever the protocol calls them).
WRONG_CREDENTIALS: Final = "wrong user or password"


def unknown_delivery(ack_id: object) -> IllegalState:
    """The refusal of an ack/nack naming ``ack_id`` (as the client wrote it), which is
    not an unacked delivery of the connection: the core's words, so that an id the
    core refuses and one no tag stands for read the same."""
    return IllegalState(f"delivery tag {ack_id} is not an unacked delivery of this connection")


def as_refusal(error: TxBrokerError) -> BrokerError:
    """Any error of a request as the BrokerError its client is told (``INTERNAL``
    for what is not a refusal of the broker)."""
    return error if isinstance(error, BrokerError) else BrokerError(str(error))


#: not frozen (a frozen init costs 4x as much, once per delivery), and its own
#: ``__init__``: a dataclass-generated one stays interpreted under mypyc
@dataclass(slots=True, init=False)
class Delivery:
    """A message handed to a connection: for subscription ``sub``, or the answer
    to ``receive`` request ``rid`` (``sub`` 0). ``tag`` is what acks name. Read-only
    by convention."""

    message: Message
    body: bytes
    tag: int
    sub: int
    rid: int
    redelivered: bool

    def __init__(self, message: Message, body: bytes, tag: int, sub: int, rid: int,
                 redelivered: bool) -> None:
        self.message = message
        self.body = body
        self.tag = tag
        self.sub = sub
        self.rid = rid
        self.redelivered = redelivered


@dataclass(frozen=True, slots=True)
class GroupsAcked:
    """The outcome of :meth:`Session.ack_groups`: the core's result (``LATER``:
    answered later under the rid), or the first refused group (``refused`` is its
    index, ``error`` why; the groups before it were acknowledged)."""

    result: Any
    refused: int = -1
    error: BrokerError | None = None
