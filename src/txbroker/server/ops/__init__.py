"""The operation layer: every decision about a client and its requests, made once for
every protocol edge (``operations.py`` has the theory of operation).

* ``operations.py`` — :class:`Operations`: admission, permissions, administration, and
  the core's later effects routed to sessions;
* ``session.py`` — :class:`Session`: one connection's requests (authentication, send,
  subscriptions, acknowledgements, transactions);
* ``values.py`` — what the layer hands its edges (:class:`Delivery`) and the refusals
  every edge words the same way;
* ``seams.py`` — the two small protocol types between the layer, the running server
  (``ServerPort``) and a connection (``SessionSink``).

The names below are the layer's public face; the edges import them from here.
"""

from txbroker.server.ops.operations import (
    BROKER_ACTIONS,
    TOO_MANY_CONNECTIONS,
    Operations,
    is_loopback,
)
from txbroker.server.ops.session import Session
from txbroker.server.ops.values import (
    WRONG_CREDENTIALS,
    Delivery,
    GroupsAcked,
    as_refusal,
    unknown_delivery,
)

__all__ = ["BROKER_ACTIONS", "TOO_MANY_CONNECTIONS", "WRONG_CREDENTIALS", "Delivery",
           "GroupsAcked", "Operations", "Session", "as_refusal", "is_loopback",
           "unknown_delivery"]
