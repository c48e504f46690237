"""The pure broker core: no asyncio, sockets, files or clocks.

``Broker`` (engine + admin + recovery) takes commands with the time as
``now`` (ms) and returns effects (``core/effects.py``) for the edge to carry out.
"""

from txbroker.core.engine import LATER
from txbroker.core.limits import Limits
from txbroker.core.recovery import Broker

__all__ = ["LATER", "Broker", "Limits"]
