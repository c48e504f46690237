"""The sync client's private event loop: one daemon thread per connection, and calls into it.

:class:`~txbroker.client.sync.Connection` (and its messages, subscriptions
and transactions) run the async client on a :class:`LoopThread` and wait for
each call's outcome with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from txbroker.errors import ConnectionLost

__all__ = ["THREAD_JOIN_TIMEOUT", "LoopThread"]

T = TypeVar("T")

#: Seconds to wait for the loop thread to finish at close.
THREAD_JOIN_TIMEOUT: Final = 10.0


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopThread:
    """An event loop running on its own daemon thread, and a way to call into it.

    A program may exit with connections still open (Spark never calls a stream
    reader's ``stop``): at exit every loop still running is stopped, so its
    tasks end by cancellation instead of being torn down by the interpreter
    (which made the reader think the connection was lost and print a failover
    and "Task was destroyed" warnings).
    """

    def __init__(self) -> None:
        self.loop = _new_event_loop()
        self._thread = threading.Thread(target=self._run, name="txbroker-client", daemon=True)
        self._thread.start()
        _RUNNING_LOOPS.add(self)

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _check_thread(self) -> None:
        if threading.get_ident() == self._thread.ident:
            raise RuntimeError(
                "a sync txbroker call from the client's own loop thread (e.g. in on_failover) "
                "would deadlock"
            )

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; return its concurrent future."""
        try:
            self._check_thread()
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError as exc:
            coro.close()
            if "deadlock" in str(exc):
                raise
            raise ConnectionLost("the connection is closed") from None

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its outcome (Ctrl-C cancels it)."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run a plain callback on the loop."""
        self._check_thread()
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:
            raise ConnectionLost("the connection is closed") from None

    def stop(self) -> None:
        """Stop the loop and wait for its thread."""
        if self._thread.is_alive():
            self._check_thread()
            with contextlib.suppress(RuntimeError):  # already closed
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(THREAD_JOIN_TIMEOUT)


#: Loop threads not stopped yet (see :class:`LoopThread`).
_RUNNING_LOOPS: weakref.WeakSet[LoopThread] = weakref.WeakSet()


@atexit.register
def _stop_loops_at_exit() -> None:
    for portal in list(_RUNNING_LOOPS):
        with contextlib.suppress(Exception):
            portal.stop()
