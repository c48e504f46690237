"""How long compaction (and a big purge) stalls other clients.

Fills queue ``keep`` and, interleaved, three times as much into ``drop`` (100-byte
messages, 20,000 per ``send_batch``: several 64 MiB segments), purges ``drop`` so
that every segment is 25 % live, and lets compaction relocate the rest while a
second client pings every 10 ms. Prints the slowest pings with their time after
the purge, and the broker's compaction log lines::

    .venv/bin/python bench/compaction_stall.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import BrokerProcess  # noqa: E402

import txbroker  # noqa: E402

BODY = b"x" * 100
BATCH = 20_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--watch", type=float, default=15.0, help="seconds after the purge")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="txb-stall-"))
    config = work / "broker.toml"
    config.write_text("[server]\nmaintain_interval = 0.2\n")
    broker = BrokerProcess(work / "data", "--log-level", "INFO", "--config", str(config))
    broker.start()
    pings: list[tuple[float, float]] = []  # (seconds, when)
    stop = threading.Event()

    def pinger() -> None:
        with txbroker.connect(broker.url) as conn:
            while not stop.is_set():
                started = time.perf_counter()
                conn.ping()
                pings.append((time.perf_counter() - started, time.time()))
                time.sleep(0.01)

    try:
        with txbroker.connect(broker.url) as conn:
            for _ in range(args.rounds):
                conn.send_batch("keep", [BODY] * BATCH)
                for _ in range(3):
                    conn.send_batch("drop", [BODY] * BATCH)
            print("segments before:", conn.stats()["store"]["segments"])
            thread = threading.Thread(target=pinger)
            thread.start()
            time.sleep(1)
            purged_at = time.time()
            conn.purge_queue("drop")
            print(f"purge of {3 * args.rounds * BATCH} messages: {time.time() - purged_at:.2f} s")
            time.sleep(args.watch)
            stop.set()
            thread.join()
            print("segments after:", conn.stats()["store"]["segments"])
    finally:
        stop.set()
        broker.kill()
    for seconds, when in sorted(pings, reverse=True)[:5]:
        print(f"ping {seconds * 1000:7.0f} ms at +{when - purged_at:.2f} s")
    with open(broker.log_path) as log:
        print("".join(line for line in log if "compaction" in line), end="")


if __name__ == "__main__":
    main()
