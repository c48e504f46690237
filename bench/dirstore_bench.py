#!/usr/bin/env python3
"""Dir store vs journal store: persistent send and consume throughput (issue 3).

Drives each store through the ``Store`` API the way the broker does: a
stand-in event loop thread appends records and runs the completions the
store dispatches; at most ``--window`` records are in flight (many clients
waiting for their replies). Two phases per store:

* **send** — ``--count`` persistent 1 KiB messages to one queue, one ``ADD``
  record each (``--group N``: ``TX`` records of N sends, as the broker groups
  pipelined sends), until every one is durable;
* **consume** — every message: ``read_body``, then an ``ACK`` record (or a
  ``TX`` of N acks); ``release`` once it is durable.

Stores: the journal with ``--sync`` none / fdatasync / fsync, and the dir
store with each flag combination of the seed (none, FDATASYNC, FSYNC, DSYNC,
FDATASYNC+DSYNC, FSYNC+DSYNC), in one run on the same disk. The ratio column
compares the dir store with the journal mode that promises the same (no
flags and DSYNC alone ~ none; FDATASYNC[+DSYNC] ~ fdatasync; FSYNC[+DSYNC] ~
fsync; only the +DSYNC variants really survive a power loss).

Usage: ``.venv/bin/python bench/dirstore_bench.py [--count 10000] [--window 256]
[--group 1] [--body 1024] [--dir /tmp] [--json out.json]
[--only "dir FDATASYNC,DSYNC"] [--settle 120]`` (``--only``: run just these
configs, by exact label; the journal configs the ratios need are added.
``--settle``: sleep before each dir store run — on ext4 without a journal,
creating a file gets slower the more files were deleted in the last minutes,
so back-to-back runs measure each other's deletions; see docs/dirstore.md)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from txbroker.core import records  # noqa: E402
from txbroker.core.records import Kind  # noqa: E402
from txbroker.storage.dirstore import DirStore  # noqa: E402
from txbroker.storage.interface import Store  # noqa: E402
from txbroker.storage.journal import JournalStore  # noqa: E402

QUEUE = "bench"
#: (label, journal sync mode it is compared with, dir flags or None for the journal)
CONFIGS: list[tuple[str, str, str | None]] = [
    ("journal none", "none", None),
    ("journal fdatasync", "fdatasync", None),
    ("journal fsync", "fsync", None),
    ("dir (no flags)", "none", ""),
    ("dir DSYNC", "none", "DSYNC"),
    ("dir FDATASYNC", "fdatasync", "FDATASYNC"),
    ("dir FDATASYNC,DSYNC", "fdatasync", "FDATASYNC,DSYNC"),
    ("dir FSYNC", "fsync", "FSYNC"),
    ("dir FSYNC,DSYNC", "fsync", "FSYNC,DSYNC"),
]


class BenchLoop:
    """The event loop stand-in: completions queued by the writer run here."""

    def __init__(self) -> None:
        self._thunks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def dispatch(self, thunk: Callable[[], None]) -> None:
        self._thunks.put(thunk)

    def run_some(self) -> None:
        """Wait for one batch of completions, then run everything pending."""
        self._thunks.get(timeout=120)()
        while True:
            try:
                self._thunks.get_nowait()()
            except queue.Empty:
                return


@dataclass
class Result:
    label: str
    send_per_s: float
    consume_per_s: float
    group_commits: int
    file_syncs: int = 0
    dir_syncs: int = 0


def msg(message_id: int) -> list[Any]:
    return [message_id, QUEUE, None, None, 4, 0, 0, 0, 0]


#: A record to append: kind, meta, bodies, and the refs its delivery reads first
#: and its completion releases (the consume phase's acked messages).
Work = tuple[int, bytes, list[bytes], list[int]]


def drive(store: Store, loop: BenchLoop, work: list[Work], window: int) -> tuple[float, list[int]]:
    """Append every record, at most ``window`` in flight; the seconds until all
    are durable, and the body refs ``append`` returned."""
    durable = [0]
    refs: list[int] = []
    written = 0
    started = time.perf_counter()

    def completion(acked: list[int]) -> Callable[[BaseException | None], None]:
        def on_durable(error: BaseException | None) -> None:
            if error is not None:
                raise error
            durable[0] += 1
            for ref in acked:
                store.release(ref)

        return on_durable

    while durable[0] < len(work):
        while written < len(work) and written - durable[0] < window:
            kind, meta, bodies, acked = work[written]
            for ref in acked:
                store.read_body(ref)  # the delivery before the ack
            refs += store.append(kind, meta, bodies, completion(acked))
            written += 1
        loop.run_some()
    return time.perf_counter() - started, refs


def bench_store(label: str, make: Callable[[BenchLoop], Store], count: int, window: int,
                group: int, body: bytes) -> Result:
    loop = BenchLoop()
    store = make(loop)
    for _entry in store.recover():
        pass
    definition = {"name": QUEUE, "kind": "queue", "topic": None, "settings": {}}
    drive(store, loop, [(int(Kind.QUEUE_PUT), records.pack(definition), [], [])], 1)
    sends: list[Work] = []
    for first in range(1, count + 1, group):
        ids = list(range(first, min(first + group, count + 1)))
        if len(ids) == 1:
            sends.append((int(Kind.ADD), records.pack(msg(ids[0])), [body], []))
        else:
            sends.append((int(Kind.TX), records.pack([[msg(i) for i in ids], []]),
                          [body] * len(ids), []))
    send_seconds, refs = drive(store, loop, sends, window)
    acks: list[Work] = []
    for first in range(0, count, group):
        ids = list(range(first + 1, min(first + group, count) + 1))
        meta = records.pack(ids) if group == 1 else records.pack([[], ids])
        kind = int(Kind.ACK) if group == 1 else int(Kind.TX)
        acks.append((kind, meta, [], refs[first:first + len(ids)]))
    consume_seconds, _ = drive(store, loop, acks, window)
    stats = store.stats()
    result = Result(label, count / send_seconds, count / consume_seconds, stats.syncs)
    if isinstance(store, DirStore):
        result.file_syncs, result.dir_syncs = store.ops.file_syncs, store.ops.dir_syncs
    store.close()
    return result


def median(runs: list[Result]) -> Result:
    """The median run by send rate, with the median consume rate."""
    by_send = sorted(runs, key=lambda r: r.send_per_s)
    middle = by_send[len(runs) // 2]
    middle.consume_per_s = statistics.median(r.consume_per_s for r in runs)
    return middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000, help="messages per phase")
    parser.add_argument("--window", type=int, default=256, help="records in flight")
    parser.add_argument("--group", type=int, default=1, help="messages per record")
    parser.add_argument("--body", type=int, default=1024, help="body bytes")
    parser.add_argument("--dir", default=None, help="where to put the data directories")
    parser.add_argument("--reps", type=int, default=3, help="runs per store (median)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                        help="pause this long before each dir store run, so that the "
                             "files the previous run deleted age out (see docs/dirstore.md)")
    parser.add_argument("--only", action="append", default=None, metavar="LABEL",
                        help="run only this config (repeatable; exact label, e.g. "
                             "'dir FDATASYNC,DSYNC'); the journal modes the ratios need "
                             "are run too")
    args = parser.parse_args()
    configs = CONFIGS
    if args.only:
        labels = {label for label, _, _ in CONFIGS}
        unknown = sorted(set(args.only) - labels)
        if unknown:
            parser.error(f"unknown config(s) {unknown}; known: {sorted(labels)}")
        wanted = set(args.only) | {f"journal {sync}" for label, sync, _ in CONFIGS
                                   if label in args.only}
        configs = [config for config in CONFIGS if config[0] in wanted]
    body = os.urandom(args.body)
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="txb-dirbench-", dir=args.dir) as tmp:
        for number, (label, sync, flags) in enumerate(configs):
            directory = Path(tmp) / f"store{number}"

            def make(loop: BenchLoop, _flags: str | None = flags, _sync: str = sync,
                     _directory: Path = directory) -> Store:
                if _flags is None:
                    return JournalStore(_directory, sync=_sync, dispatch=loop.dispatch)
                return DirStore(_directory, flags=_flags, dispatch=loop.dispatch)

            runs = []
            for rep in range(args.reps):
                if flags is not None and args.settle > 0:
                    time.sleep(args.settle)
                runs.append(bench_store(label, make, args.count, args.window, args.group, body))
                shutil.rmtree(directory, ignore_errors=True)
                print(f"  {label} #{rep + 1}: {runs[-1].send_per_s:,.0f} sends/s, "
                      f"{runs[-1].consume_per_s:,.0f} consumes/s", file=sys.stderr, flush=True)
            results[label] = median(runs)
    print(f"\n{args.count} messages of {args.body} B, window {args.window}, "
          f"{args.group} message(s) per record, median of {args.reps} runs\n")
    header = (f"{'store':22} {'send/s':>9} {'consume/s':>10} {'send ×':>8} {'consume ×':>10} "
              f"{'commits':>8} {'fsyncs/msg':>11} {'dirsyncs/msg':>13}")
    print(header)
    print("-" * len(header))
    for label, sync, flags in configs:
        result = results[label]
        journal = results[f"journal {sync}"]
        ratio_send = result.send_per_s / journal.send_per_s
        ratio_consume = result.consume_per_s / journal.consume_per_s
        per_message = 2 * args.count
        print(f"{label:22} {result.send_per_s:9,.0f} {result.consume_per_s:10,.0f} "
              f"{ratio_send:8.3f} {ratio_consume:10.3f} {result.group_commits:8,} "
              f"{result.file_syncs / per_message:11.2f} {result.dir_syncs / per_message:13.3f}"
              if flags is not None else
              f"{label:22} {result.send_per_s:9,.0f} {result.consume_per_s:10,.0f} "
              f"{'1':>8} {'1':>10} {result.group_commits:8,} {'':>11} {'':>13}")
    print("\n× = dir store / journal with the comparable sync mode (see the docstring)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "results": [asdict(r) for r in results.values()]}, indent=2))


if __name__ == "__main__":
    main()
