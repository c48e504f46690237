"""The sync client's hand-over to its loop thread (``client/_portal.py``): a call's
outcome, order, many threads at once, Ctrl-C, and a loop that ended."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
import time

import pytest

from txbroker.client._portal import LoopThread
from txbroker.errors import ConnectionLost


@pytest.fixture
def portal() -> LoopThread:
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.stop()


async def _value(value: object, delay: float = 0.0) -> object:
    await asyncio.sleep(delay)
    return value


async def _fail() -> None:
    raise ValueError("refused by the broker")


def test_a_call_returns_its_coroutines_value_and_raises_its_error(portal: LoopThread) -> None:
    assert portal.call(_value(41)) == 41
    with pytest.raises(ValueError, match="refused by the broker"):
        portal.call(_fail())
    assert portal.call(_value("after the error")) == "after the error"


def test_calls_of_many_threads_each_get_their_own_outcome(portal: LoopThread) -> None:
    results: dict[int, list[object]] = {}

    def work(n: int) -> None:
        results[n] = [portal.call(_value((n, i))) for i in range(300)]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {n: [(n, i) for i in range(300)] for n in range(8)}


def test_a_call_from_the_loop_thread_is_refused(portal: LoopThread) -> None:
    async def nested() -> str:
        coro = _value(1)
        try:
            portal.call(coro)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    assert "would deadlock" in portal.call(nested())


def test_a_call_after_the_loop_ended_is_connection_lost(portal: LoopThread) -> None:
    portal.stop()
    coro = _value(1)
    with pytest.raises(ConnectionLost, match="closed"):
        portal.call(coro)
    assert coro.cr_frame is None  # closed: no "never awaited" warning


def test_a_call_the_loop_cancels_raises_cancelled(portal: LoopThread) -> None:
    async def cancelled() -> None:
        raise asyncio.CancelledError

    with pytest.raises(concurrent.futures.CancelledError):
        portal.call(cancelled())


def test_ctrl_c_while_waiting_cancels_the_call_on_the_loop(portal: LoopThread) -> None:
    started, ended = threading.Event(), []

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    main = threading.main_thread().ident
    assert main == threading.get_ident()

    def interrupt() -> None:  # Ctrl-C: SIGINT to the main thread, blocked in the call
        started.wait(5)
        time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        portal.call(slow())
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended == ["cancelled"]
    assert portal.call(_value("still serving")) == "still serving"
