"""The HA drivers' clock for durations: the running event loop's.

In production the loop's clock *is* ``time.monotonic()`` (asyncio's ``BaseEventLoop.time``);
under the simulator (``txbroker/sim/loop.py``) it is virtual time, so heartbeats, backup
timeouts and the quiet point's deadline run on the simulation's clock (issue 26 asks that
the state tables' inputs carry the time; issue 27 runs these drivers on a ``SimLoop``).
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["monotonic"]


def monotonic() -> float:
    """The running loop's ``time()``; ``time.monotonic()`` when no loop runs (the same
    clock in production)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
