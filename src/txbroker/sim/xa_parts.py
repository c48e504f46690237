"""Parts of scenario ``xa-live`` (``live_xa.py``): an event loop whose executor work
takes virtual time, and the transaction manager's disk with the decision log's file
on it.

Theory of operation
-------------------
The decision log (``tm/log.py``) writes and syncs in a worker thread
(``asyncio.to_thread``). On :class:`XaLoop` that work runs on the one thread, at a
random moment within :data:`LOG_SYNC_S`, and its answer arrives at the end: the
manager may die before the sync, after it but before it knows, or after. The log's
bytes go through :class:`SimLogFile` to a :class:`TmDisk`, which keeps written and
synced bytes apart: a kill keeps the synced ones and a random prefix of the rest (a
torn tail, which the log cuts when it is opened again).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any, TypeVar, TypeVarTuple, Unpack

from txbroker.sim.loop import SimLoop

__all__ = ["LOG_SYNC_S", "SimLogFile", "TmDisk", "XaLoop"]

#: A decision-log sync: the write and sync happen within it, the answer at its end (s).
LOG_SYNC_S = (0.0002, 0.004)

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class XaLoop(SimLoop):
    """A SimLoop whose executor work takes virtual time: the function runs at a random
    moment within :data:`LOG_SYNC_S`, its answer arrives at the end (the decision
    log's write + fsync runs "in a thread" this way: the process may die before, in
    between, or after)."""

    def run_in_executor(self, executor: Any, func: Callable[[Unpack[_Ts]], _T],
                        *args: *_Ts) -> asyncio.Future[_T]:
        """Run ``func`` a little later, answer a little after that."""
        future: asyncio.Future[_T] = self.create_future()
        total = self.random.uniform(*LOG_SYNC_S)
        ran_at = self.random.uniform(0.0, total)

        def run() -> None:
            try:
                result = func(*args)
            except BaseException as exc:  # handed to the awaiting code
                self.call_later(total - ran_at, _settle, future, None, exc)
                return
            self.call_later(total - ran_at, _settle, future, result, None)

        self.call_later(ran_at, run)
        return future

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        """As SimLoop's; a future nobody retrieved that is collected once the run is
        over (a dead process's request, failed when its connection was torn down at
        the end) is no news either."""
        if self.is_closed() and "task" not in context:
            return
        super().call_exception_handler(context)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class TmDisk:
    """The transaction manager's disk: synced bytes survive a kill, written ones may
    leave a torn piece."""

    def __init__(self) -> None:
        self.synced = bytearray()
        self.written = bytearray()

    def crash(self, rng: random.Random) -> None:
        """A kill: what was written and not synced is lost, but a random prefix."""
        self.synced += self.written[:rng.randint(0, len(self.written))]
        self.written.clear()


class SimLogFile:
    """The :class:`~txbroker.tm.log.LogFile` of a decision log on a :class:`TmDisk`."""

    def __init__(self, disk: TmDisk) -> None:
        self.disk = disk
        self.closed = False

    def read(self) -> bytes:
        """What survived."""
        return bytes(self.disk.synced)

    def truncate(self, size: int) -> None:
        """Cut a torn tail."""
        del self.disk.synced[size:]

    def append(self, data: bytes) -> None:
        """Written, not yet synced."""
        if self.closed:
            raise ValueError("write to a closed file")
        self.disk.written += data

    def sync(self) -> None:
        """Everything written is synced."""
        self.disk.synced += self.disk.written
        self.disk.written.clear()

    def replace(self, data: bytes) -> None:
        """Compaction: atomically the new content, synced."""
        self.disk.synced[:] = data
        self.disk.written.clear()

    def close(self) -> None:
        """No more appends."""
        self.closed = True
