"""Child process of the kill -9 test (see ``run_and_kill`` in contract.py).

Usage: ``python crash_child.py '{"factory": "module:callable", "kwargs": {...}, "start": N}'``

Opens the store, recovers it, prints ``ready``, then appends entries
``start, start+1, …`` (see crash_payload.py) forever, with at most
``MAX_UNACKED`` not yet durable, and prints each entry's number on its own line
as soon as its ``on_durable(None)`` fires — that line is the acknowledgement
the parent holds the store to once it has killed this process.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from crash_payload import CHILD_KIND, expected_body

#: Entries in flight at once: enough for big group commits, bounded memory.
MAX_UNACKED = 2000


def main() -> None:
    spec = json.loads(sys.argv[1])
    module_name, _, attribute = spec["factory"].partition(":")
    open_store = getattr(importlib.import_module(module_name), attribute)
    store = open_store(**spec["kwargs"])
    for _entry in store.recover():
        pass
    out = sys.stdout.fileno()
    window = threading.BoundedSemaphore(MAX_UNACKED)

    def acknowledge(number: int) -> Callable[[BaseException | None], None]:
        def on_durable(error: BaseException | None) -> None:
            if error is None:
                os.write(out, b"%d\n" % number)  # one write: atomic on a pipe
            window.release()

        return on_durable

    os.write(out, b"ready\n")
    number = spec["start"]
    while True:
        window.acquire()
        meta, bodies = expected_body(number)
        store.append(CHILD_KIND, meta, bodies, acknowledge(number))
        number += 1


if __name__ == "__main__":
    main()
