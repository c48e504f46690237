"""Test doubles and runners shared by the store tests: a stand-in event loop,
a completion recorder, and the kill -9 child runner."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHILD_SCRIPT = Path(__file__).with_name("crash_child.py")


class Loop:
    """Stands in for the broker's event loop: ``dispatch`` queues thunks from any
    thread; ``run_until`` runs them on the test's thread."""

    def __init__(self) -> None:
        self.calls = 0
        self._thunks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def dispatch(self, thunk: Callable[[], None]) -> None:
        self.calls += 1
        self._thunks.put(thunk)

    def run_until(self, done: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("timed out waiting for store completions")
            try:
                self._thunks.get(timeout=remaining)()
            except queue.Empty:
                continue

    def run_pending(self) -> None:
        while True:
            try:
                thunk = self._thunks.get_nowait()
            except queue.Empty:
                return
            thunk()


class Completions:
    """Records every ``on_durable`` call, by entry number."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, BaseException | None]] = []

    def callback(self, number: int) -> Callable[[BaseException | None], None]:
        def on_durable(error: BaseException | None) -> None:
            self.calls.append((number, error))

        return on_durable

    def __len__(self) -> int:
        return len(self.calls)

    def result(self, number: int) -> BaseException | None:
        (error,) = [error for seen, error in self.calls if seen == number]
        return error


def run_and_kill(spec: dict[str, Any], start: int, kill_after: float) -> set[int]:
    """Run the crash child from entry ``start``, SIGKILL it after ``kill_after`` s
    of appending, and return the entry numbers it reported durable."""
    argument = json.dumps({**spec, "start": start})
    child = subprocess.Popen(
        [sys.executable, str(CHILD_SCRIPT), argument],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    lines: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def drain() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=30)
    except queue.Empty:
        child.kill()
        raise AssertionError(f"child never started: {child.stderr.read()!r}") from None
    assert first == b"ready\n", (first, child.stderr.read())
    # Kill ``kill_after`` s after the child's FIRST acknowledgement, not after its
    # start: on a loaded machine a slow store (fsync per file) may not have
    # acknowledged anything within a fixed delay, and the test asserts it did.
    try:
        early = [lines.get(timeout=60)]
    except queue.Empty:
        child.kill()
        raise AssertionError(f"child acknowledged nothing in 60 s: {child.stderr.read()!r}") \
            from None
    time.sleep(kill_after)
    child.kill()
    child.wait()
    reader.join(timeout=10)
    acked = {int(line) for line in early if line.endswith(b"\n")}
    while not lines.empty():
        line = lines.get()
        if line.endswith(b"\n"):  # a line cut by the kill was never fully reported
            acked.add(int(line))
    return acked
