"""Sync workers for the directory store's write step (``FSYNC``/``FDATASYNC``).

Theory of operation
-------------------
The seed syncs every block file on its own (one ``fsync``/``fdatasync`` per
file). One at a time, each waits for its own disk write; many at once, the
block layer and the disk serve them together, so the write step of a batch
costs about one sync latency instead of one per file.

The writer thread creates the files of a batch one after the other, in
order (creates in one directory serialize in the kernel anyway: they take
the directory's lock), and hands each open file to a :class:`SyncPool` as
soon as it is written. Up to ``threads`` workers sync and close them while
the writer creates the next ones. :meth:`SyncPool.wait` returns once every
file handed over so far is synced *and closed* and raises the first
failure, so the writer never renames a block whose sync has not returned.

The pool holds no state between batches other than its idle threads: each
``submit`` is answered by exactly one result, consumed by ``wait`` (or by
``submit`` itself when too many files are open).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

#: A sync step (``os.fsync``, ``os.fdatasync``, or a test's replacement).
SyncStep = Callable[[int], None]

_STOP = None


class SyncPool:
    """Threads that run ``sync(fd)`` and then ``os.close(fd)`` for each
    submitted file, concurrently, as soon as it is submitted.

    Used by one thread at a time (the store's writer).
    """

    def __init__(self, threads: int, *, max_open: int, name: str) -> None:
        if threads < 1 or max_open < 1:
            raise ValueError("a sync pool needs at least one thread and one open file")
        self._threads_wanted = threads
        self._max_open = max_open
        self._name = name
        self._work: queue.SimpleQueue[tuple[SyncStep, int] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        #: Files submitted whose result ``wait`` has not collected yet.
        self._pending = 0
        #: The first failure since the last ``wait`` (raised by it).
        self._failure: BaseException | None = None
        #: Set by a worker as soon as a sync fails (``wait`` clears it).
        self._worker_failed = False

    @property
    def failed(self) -> bool:
        """True once a sync of the current round failed (the writer stops early)."""
        return self._worker_failed or self._failure is not None

    def submit(self, sync: SyncStep, fd: int) -> None:
        """Hand ``fd`` over: it will be synced with ``sync`` and closed.

        Blocks while ``max_open`` files are being synced. The pool owns ``fd``
        from now on (it is closed even if the sync fails).
        """
        if not self._threads:
            self._start()
        self._work.put((sync, fd))
        self._pending += 1
        while self._pending >= self._max_open:
            self._collect_one()

    def wait(self) -> None:
        """Block until every submitted file is synced and closed; raise the
        first failure of the round (then the next round starts clean)."""
        while self._pending:
            self._collect_one()
        failure, self._failure = self._failure, None
        self._worker_failed = False
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Stop the threads (after ``wait``)."""
        for _ in self._threads:
            self._work.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _collect_one(self) -> None:
        result = self._results.get()
        self._pending -= 1
        if result is not None and self._failure is None:
            self._failure = result

    def _start(self) -> None:
        for number in range(self._threads_wanted):
            thread = threading.Thread(target=self._work_loop, name=f"{self._name}-{number}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work_loop(self) -> None:
        get, put = self._work.get, self._results.put
        while True:
            item = get()
            if item is None:
                return
            sync, fd = item
            result: BaseException | None = None
            try:
                sync(fd)
            except BaseException as exc:  # handed to the writer, raised by wait()
                result = exc
                self._worker_failed = True
            finally:
                try:
                    os.close(fd)
                except OSError as exc:
                    result = result or exc
            put(result)
