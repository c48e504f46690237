"""The pure broker core: no asyncio, sockets, files or clocks.

:class:`Broker` (``core/broker.py``) is the one front object: it takes
commands with the time as ``now`` (ms) and returns effects
(``core/effects.py``) for the edge to carry out; its parts each own their
state (the table in ``core/broker.py`` lists them).
"""

from txbroker.core.broker import Broker
from txbroker.core.limits import Limits
from txbroker.core.queue_index import LATER

__all__ = ["LATER", "Broker", "Limits"]
