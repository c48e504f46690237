"""The sync client's event loop: one daemon thread shared by the process's connections.

:class:`~txbroker.client.sync.Connection` (and its messages, subscriptions
and transactions) run the async client on a :class:`LoopThread` and wait for
each call's outcome with ``run_coroutine_threadsafe``.

Every sync connection of a process runs on ONE loop thread,
:data:`SHARED_LOOP` (started by the first connection, stopped when the last one
closes; a forked child starts its own). Issue 30 measured why: with a thread
per connection, 8 application threads each on its own connection meant 16
threads handing every call over and back — each hand-over a thread wake-up
that waits for a CPU on a busy machine — and the client spent 0.85 ms of CPU
per XA cycle (start, receive, ack, end, prepare, commit); with one shared
loop thread, whose iterations serve every connection's requests and replies
together, it spent 0.35 ms and each hand-over took half the wall time.

A call hands over as little as it can (issue 30, round 3): the caller queues a
:class:`_Call` and waits on a bare lock; the loop takes every call queued since
its last turn in one callback (one wake-up of the loop for a burst of callers),
runs each as a task, and releases the caller's lock when it ends. With 8 threads
on 8 connections ``run_coroutine_threadsafe`` and its ``concurrent.futures`` had
cost a third of the process's GIL time (a ``Condition`` per call, its
``notify_all``, the chained futures).
"""

from __future__ import annotations

import _thread
import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from txbroker.errors import ConnectionLost

__all__ = ["SHARED_LOOP", "THREAD_JOIN_TIMEOUT", "LoopThread", "SharedLoop"]

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


class _Call:
    """One sync call handed to the loop: its coroutine, the caller's lock (held until
    the call ends), and its outcome."""

    __slots__ = ("cancelled", "coro", "done", "error", "result", "task")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None
        self.task: asyncio.Task[Any] | None = None
        #: the caller gave up (Ctrl-C) before the loop started it
        self.cancelled = False

    def finish(self, task: asyncio.Task[Any]) -> None:
        """The task ended (on the loop): record its outcome, wake the caller."""
        if task.cancelled():
            self.error = concurrent.futures.CancelledError()
        else:
            self.error = task.exception()
            if self.error is None:
                self.result = task.result()
        self.done.release()

    def fail(self, error: BaseException) -> None:
        """It will never run (the loop ended): wake the caller with ``error``."""
        self.coro.close()
        self.error = error
        self.done.release()

    def cancel(self) -> None:
        """The caller gave up (on the loop)."""
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()


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
        #: calls queued for the loop's next :meth:`_start_calls`, under ``_calls_lock``
        self._calls: list[_Call] = []
        self._calls_lock = threading.Lock()
        #: a :meth:`_start_calls` is scheduled on the loop (no other wake-up needed)
        self._calls_scheduled = False
        #: the loop ended: calls are refused
        self._ended = False
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
            with self._calls_lock:
                self._ended = True
                calls, self._calls = self._calls, []
            for call in calls:
                call.fail(ConnectionLost("the connection is closed"))

    @property
    def alive(self) -> bool:
        """True while the loop's thread runs."""
        return self._thread.is_alive()

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
        try:
            self._check_thread()
        except RuntimeError:
            coro.close()
            raise
        call = _Call(coro)
        with self._calls_lock:
            if self._ended:
                coro.close()
                raise ConnectionLost("the connection is closed")
            self._calls.append(call)
            wake = not self._calls_scheduled
            self._calls_scheduled = True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._start_calls)
            except RuntimeError:  # the loop is closed
                with self._calls_lock:
                    self._calls_scheduled = False
                    if call in self._calls:
                        self._calls.remove(call)
                coro.close()
                raise ConnectionLost("the connection is closed") from None
        try:
            call.done.acquire()
        except BaseException:  # Ctrl-C while waiting: cancel the call on the loop
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(call.cancel)
            raise
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[no-any-return]

    def _start_calls(self) -> None:
        """On the loop: start every call queued since the last turn."""
        with self._calls_lock:
            calls, self._calls = self._calls, []
            self._calls_scheduled = False
        create_task = self.loop.create_task
        for call in calls:
            if call.cancelled:
                call.fail(concurrent.futures.CancelledError())
                continue
            task = call.task = create_task(call.coro)
            task.add_done_callback(call.finish)

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


class SharedLoop:
    """One :class:`LoopThread` for many users: :meth:`acquire` starts it for the first
    (or after a fork: the child has no copy of the parent's thread), :meth:`release`
    stops it when the last one leaves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal: LoopThread | None = None
        self._users = 0
        self._pid = os.getpid()

    def acquire(self) -> LoopThread:
        """The shared loop thread, with one more user."""
        with self._lock:
            portal = self._portal
            if portal is None or self._pid != os.getpid() or not portal.alive:
                self._portal = portal = LoopThread()
                self._users, self._pid = 0, os.getpid()
            self._users += 1
            return portal

    def release(self, portal: LoopThread) -> None:
        """One user of ``portal`` left; the last one stops it."""
        with self._lock:
            if portal is self._portal:
                self._users -= 1
                if self._users > 0:
                    return
                self._portal = None
        portal.stop()

    def after_fork(self) -> None:
        """In a forked child: forget the parent's thread (and a lock it may have held)."""
        self._lock = threading.Lock()
        self._portal, self._users, self._pid = None, 0, os.getpid()


#: The loop thread of every sync connection of this process (see the module's doc).
SHARED_LOOP: Final = SharedLoop()
os.register_at_fork(after_in_child=SHARED_LOOP.after_fork)

#: Loop threads not stopped yet (see :class:`LoopThread`).
_RUNNING_LOOPS: weakref.WeakSet[LoopThread] = weakref.WeakSet()


@atexit.register
def _stop_loops_at_exit() -> None:
    for portal in list(_RUNNING_LOOPS):
        with contextlib.suppress(Exception):
            portal.stop()
