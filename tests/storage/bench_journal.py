"""Journal micro-benchmarks (not a test: run by hand, numbers go to docs/storage.md).

    .venv/bin/python tests/storage/bench_journal.py [--entries 1000000] [--dir /tmp/jbench]

Measures, for 1 KiB bodies: the cost of ``append`` on the calling thread
(median and p99 of bursts of 100 while the writer runs), the group-commit
ratio (syncs per append with fdatasync), and the time to ``recover`` a journal
of ``--entries`` entries (page cache warm, and cold if run as root).
``--compare-index`` instead writes the journal with its recovery index and times
recovery from the segments (index off) and from the indexes, each with the
journal's files evicted from the page cache (``posix_fadvise``) and warm, 3 rounds.
Wall-clock numbers on a shared VM are noisy: compare the CPU time too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

from txbroker.storage.journal import JournalStore

BODY = os.urandom(1024)
META = os.urandom(40)


def bench_append(directory: Path, entries: int) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    store = JournalStore(directory)
    list(store.recover())
    acked = [0]

    def on_durable(error: BaseException | None) -> None:
        acked[0] += 1

    bursts = []
    started = time.perf_counter()
    for _ in range(entries // 100):
        begin = time.perf_counter()
        for _ in range(100):
            store.append(4, META, [BODY], on_durable)
        bursts.append((time.perf_counter() - begin) / 100 * 1e6)
        time.sleep(0)  # let the writer in, as an event loop would between callbacks
    store.flush()
    wall = time.perf_counter() - started
    stats = store.stats()
    store.close()
    bursts.sort()
    print(
        f"append: median {statistics.median(bursts):.2f} µs, "
        f"p99 {bursts[int(len(bursts) * 0.99)]:.2f} µs per append (bursts of 100); "
        f"{entries / wall:,.0f} durable appends/s; "
        f"syncs/appends {stats.syncs}/{stats.appends} = {stats.syncs / stats.appends:.4f}"
    )


def make_journal(directory: Path, entries: int, index: bool = False) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    store = JournalStore(directory, sync="none", body_cache_bytes=0, recovery_index=index)
    list(store.recover())
    for _ in range(entries):
        store.append(4, META, [BODY], lambda error: None)
    store.close()


def evict(directory: Path) -> None:
    """Drop the files under ``directory`` from the page cache (no root needed)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_recover(directory: Path, label: str, index: bool = False) -> None:
    started, cpu_started = time.perf_counter(), time.process_time()
    store = JournalStore(directory, recovery_index=index)
    count = sum(1 for _ in store.recover())
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    stats = store.stats()
    store.close()
    print(
        f"recover ({label}): {count:,} entries, {stats.disk_bytes / 2**20:,.0f} MiB, "
        f"read {stats.recovered_bytes / 2**20:,.0f} MiB "
        f"in {elapsed:.2f} s ({cpu:.2f} s CPU) = {elapsed / count * 1e6:.2f} µs/entry"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/txbroker-journal-bench"))
    parser.add_argument("--compare-index", action="store_true")
    args = parser.parse_args()
    if args.compare_index:
        make_journal(args.dir, args.entries, index=True)
        for run in range(3):
            for index in (False, True):
                name = "index" if index else "segments"
                evict(args.dir)
                bench_recover(args.dir, f"cold, {name} #{run + 1}", index)
                bench_recover(args.dir, f"warm, {name} #{run + 1}", index)
        shutil.rmtree(args.dir, ignore_errors=True)
        return
    bench_append(args.dir, min(args.entries, 200_000))
    make_journal(args.dir, args.entries)
    for run in range(3):
        bench_recover(args.dir, f"warm #{run + 1}")
    if os.geteuid() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        bench_recover(args.dir, "cold page cache")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
