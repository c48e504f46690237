"""Benchmark: CPU the transaction manager itself spends per global transaction.

No network and no disk sync: two no-op participants, the decision log without fsync.
It measures what the TM adds to a real transaction (the 2PC engine, the drivers, the
decision log's writes) with ``time.process_time``, so a loaded machine inflates it less
than a rate would. Best of ``--runs`` runs of ``--count`` transactions::

    python bench/tm_overhead.py [--count 10000] [--runs 5]

To compare with another checkout's TM: ``PYTHONPATH=<that checkout>/src python ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import txbroker.tm
from txbroker.tm import TransactionManager
from txbroker.tm.aio import AsyncTransactionManager
from txbroker.xid import Xid

#: Transactions in flight on the event loop in the asyncio case (the order of the
#: xa_dequeue_insert bench's 4 workers x 12).
IN_FLIGHT = 50


class NoOp:
    """A participant that does nothing (votes yes, finishes)."""

    def __init__(self, name: str) -> None:
        self.sort_key = name

    def begin(self, xid: Xid) -> None:
        """Nothing to open."""

    def vote(self, xid: Xid) -> bool:
        """Yes, not read-only."""
        return False

    def commit_one_phase(self, xid: Xid) -> None:
        """Nothing to commit."""

    def finish(self, xid: Xid, commit: bool) -> bool:
        """Done."""
        return True

    def abort(self, xid: Xid) -> None:
        """Nothing to abort."""


class AsyncNoOp:
    """The asyncio form of :class:`NoOp`."""

    def __init__(self, name: str) -> None:
        self.sort_key = name

    async def begin(self, xid: Xid) -> None:
        """Nothing to open."""

    async def vote(self, xid: Xid) -> bool:
        """Yes, not read-only."""
        return False

    async def commit_one_phase(self, xid: Xid) -> None:
        """Nothing to commit."""

    async def finish(self, xid: Xid, commit: bool) -> bool:
        """Done."""
        return True

    async def abort(self, xid: Xid) -> None:
        """Nothing to abort."""


def sync_us(count: int, directory: Path) -> float:
    """CPU microseconds per transaction of the sync manager (one thread)."""
    tm = TransactionManager(directory / "sync.log", fsync=False)
    participants = [NoOp("postgres"), NoOp("txbroker")]
    started = time.process_time()
    for _ in range(count):
        with tm.begin(participants):
            pass
    spent = time.process_time() - started
    tm.close()
    assert tm.counters["committed"] == count
    return spent / count * 1e6


def async_us(count: int, directory: Path) -> float:
    """CPU microseconds per transaction of the asyncio manager, IN_FLIGHT at once."""
    async def main() -> float:
        tm = AsyncTransactionManager(directory / "async.log", fsync=False)

        async def slot() -> None:
            participants = [AsyncNoOp("postgres"), AsyncNoOp("txbroker")]
            for _ in range(count // IN_FLIGHT):
                async with await tm.begin(participants):
                    pass

        started = time.process_time()
        await asyncio.gather(*(slot() for _ in range(IN_FLIGHT)))
        spent = time.process_time() - started
        tm.close()
        return spent / (count // IN_FLIGHT * IN_FLIGHT) * 1e6

    return asyncio.run(main())


def main() -> None:
    """Print the best of ``--runs`` for the sync and the asyncio manager."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("txbroker.tm from", Path(txbroker.tm.__file__).parent)
    with tempfile.TemporaryDirectory() as temp:
        directory = Path(temp)
        sync = min(sync_us(args.count, directory) for _ in range(args.runs))
        aio = min(async_us(args.count, directory) for _ in range(args.runs))
    print(f"sync manager, 2 participants: {sync:.1f} us CPU per global transaction")
    print(f"asyncio manager, 2 participants, {IN_FLIGHT} in flight: {aio:.1f} us CPU per "
          f"global transaction (with the log's worker thread)")


if __name__ == "__main__":
    main()
