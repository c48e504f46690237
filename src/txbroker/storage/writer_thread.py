"""What the journal's and the dir store's writer threads share.

A store's caller (the broker's event loop) puts work items in a
:class:`PendingQueue`; one :class:`WriterThread` takes everything queued,
does the disk work of the batch, and hands the batch's completions back in
one :func:`completion` closure through the store's ``dispatch``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from txbroker.errors import StorageFailed, StoreError
from txbroker.storage.interface import (
    BATCH_ENTRIES_BUCKETS,
    BATCH_SECONDS_BUCKETS,
    DurableCallback,
    Histogram,
)

log = logging.getLogger("txbroker.storage")


class Barrier:
    """Work item: set ``done`` once everything queued before it is processed."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class PendingQueue:
    """Work shared by the appending thread and the writer, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        self.items: list[Any] = []
        #: Set once a write or sync failed; ``append`` raises from then on.
        self.failure: StorageFailed | None = None
        self.stopping = False
        #: True while the writer waits for work (so ``put`` knows to notify).
        self.writer_idle = False

    def put(self, item: Any) -> None:
        """Queue a work item and wake the writer if it sleeps."""
        with self.lock:
            self.items.append(item)
            if self.writer_idle:
                self.wakeup.notify()

    def put_barrier(self) -> Barrier | None:
        """Queue a :class:`Barrier` (``flush``), or None once the writer is stopping: it
        processes everything queued before it ends, and a barrier queued after it
        ended would never be set (a flush from another thread racing a close would
        wait for ever)."""
        with self.lock:
            if self.stopping:
                return None
            barrier = Barrier()
            self.items.append(barrier)
            if self.writer_idle:
                self.wakeup.notify()
            return barrier


def completion(
    callbacks: list[DurableCallback], failure: StorageFailed | None
) -> Callable[[], None]:
    """One closure that runs a batch's callbacks in order."""

    def complete() -> None:
        for callback in callbacks:
            try:
                callback(None if failure is None else StorageFailed(str(failure)))
            except Exception:
                log.exception("on_durable callback raised")

    return complete


class WriterThread:
    """The single writer thread of a store; subclasses implement ``_run``."""

    #: Thread name, and how errors name the store.
    thread_name = "txbroker-writer"
    store_label = "store"

    def __init__(self, queue: PendingQueue) -> None:
        self.queue = queue
        #: The batch being written (``read_body`` looks here for unwritten bodies).
        self.in_flight: list[Any] = []
        #: time to write and sync each batch, and its size (``/metrics``)
        self.batch_seconds = Histogram(BATCH_SECONDS_BUCKETS)
        self.batch_entries = Histogram(BATCH_ENTRIES_BUCKETS)
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def _process(self, batch: list[Any]) -> None:
        """Do the disk work of one batch and dispatch its completions."""
        raise NotImplementedError

    def _poison(self, batch: list[Any], failure: StorageFailed) -> None:
        """Fail every entry of ``batch`` (and make later appends fail)."""
        raise NotImplementedError

    def _run(self) -> None:
        queue = self.queue
        while True:
            with queue.lock:
                while not queue.items and not queue.stopping:
                    queue.writer_idle = True
                    queue.wakeup.wait()
                queue.writer_idle = False
                batch = queue.items
                queue.items = []
                self.in_flight = batch
                if not batch and queue.stopping:
                    return
            started = time.perf_counter()
            try:
                self._process(batch)
            except BaseException:  # a bug: fail loudly rather than hang every caller
                log.exception("%s writer crashed", self.store_label)
                self._poison(batch, StorageFailed(f"{self.store_label} writer crashed"))
                raise
            self.batch_seconds.observe(time.perf_counter() - started)
            self.batch_entries.observe(len(batch))

    def _close_files(self) -> None:
        """Close what the thread kept open (after it ended)."""

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def check_not_writer_thread(self) -> None:
        """Refuse to be stopped by a completion running on the writer itself."""
        if threading.current_thread() is self._thread:
            raise StoreError(
                f"close() called from a completion running on the {self.store_label} writer "
                "thread; give the store a dispatch function (e.g. loop.call_soon_threadsafe)"
            )

    def stop(self) -> None:
        """Process everything queued, then end the thread and close its files."""
        self.check_not_writer_thread()
        with self.queue.lock:
            self.queue.stopping = True
            self.queue.wakeup.notify()
        if self._thread.is_alive():
            self._thread.join()
        self._close_files()
