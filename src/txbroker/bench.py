"""The native-protocol load generator behind ``txbroker bench``.

Producers pipeline persistent sends (``window`` in flight each); then
consumers drain the queue with client acks. The summary reports messages per
second for each phase and, from the broker's store counters, syncs per second
and messages per sync — the figure that shows group commit at work.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections import deque
from collections.abc import Callable
from typing import Any

#: Progress is reported in steps of this many messages (cheap at 50k msg/s).
TICK_EVERY = 1024


async def _producer(url: str, opts: dict[str, Any], queue: str, count: int, body: bytes,
                    window: int, tick: Callable[[int], None], batch: int = 1) -> None:
    """Send ``count`` messages keeping ``window`` sends in flight (``batch`` > 1: as
    ``send_batch`` requests of that many messages, ``window`` requests in flight)."""
    from txbroker.aio import connect

    conn = await connect(url, reconnect=False, **opts)
    try:
        if batch > 1:
            await _batch_producer(conn, queue, count, body, window, tick, batch)
            return
        in_flight: deque[asyncio.Future[Any]] = deque()
        done = 0
        for _ in range(count):
            if len(in_flight) >= window:
                await in_flight.popleft()
                done += 1
                if done % TICK_EVERY == 0:
                    tick(TICK_EVERY)
            in_flight.append(conn.send_nowait(queue, body))
        for fut in in_flight:
            await fut
        tick(count - done // TICK_EVERY * TICK_EVERY)
    finally:
        await conn.close()


async def _batch_producer(conn: Any, queue: str, count: int, body: bytes, window: int,
                          tick: Callable[[int], None], batch: int) -> None:
    in_flight: deque[asyncio.Task[int]] = deque()
    sent = 0
    while sent < count:
        n = min(batch, count - sent)
        if len(in_flight) >= window:
            tick(await in_flight.popleft())
        in_flight.append(asyncio.ensure_future(conn.send_batch(queue, [body] * n)))
        sent += n
    for task in in_flight:
        tick(await task)


async def _consumer(url: str, opts: dict[str, Any], queue: str, quota: list[int], prefetch: int,
                    tick: Callable[[int], None], idle: float, finished: list[float]) -> int:
    """Consume and ack until ``quota`` is used up (or nothing comes for ``idle`` s)."""
    from txbroker.aio import connect

    conn = await connect(url, reconnect=False, **opts)
    got = 0
    try:
        sub = await conn.subscribe(queue, prefetch=prefetch, ack="client")
        quiet_since = time.perf_counter()
        while quota[0] > 0 and time.perf_counter() - quiet_since < idle:
            batch = await sub.get_batch(prefetch, timeout=0.05)
            if not batch:
                continue
            quiet_since = time.perf_counter()
            for msg in batch:
                await msg.ack()  # pipelined: acks of one loop turn go out as one request
            quota[0] -= len(batch)
            got += len(batch)
            tick(len(batch))
            if quota[0] <= 0 and not finished:
                finished.append(time.perf_counter())
        await conn.ping()  # every ack before it has been processed
        await sub.close()
    finally:
        await conn.close()
    return got


async def _stats(url: str, opts: dict[str, Any]) -> dict[str, Any]:
    from txbroker.aio import connect

    conn = await connect(url, reconnect=False, **opts)
    try:
        result: dict[str, Any] = await conn.stats()
        return result
    finally:
        await conn.close()


def _loop_factory() -> Any:
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        return None


def _send_process(url: str, opts: dict[str, Any], queue: str, shares: list[int], body: bytes,
                  window: int, barrier: Any, results: Any, batch: int) -> None:
    """One load-generator process: its producers start when every process is ready."""

    async def run() -> None:
        barrier.wait()
        await asyncio.gather(*(_producer(url, opts, queue, n, body, window, lambda k: None,
                                         batch) for n in shares))

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(run())
        results.put(("done", time.monotonic()))
    except BaseException as exc:  # reported to the parent, which fails the run
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _send_in_processes(url: str, opts: dict[str, Any], queue: str, shares: list[int],
                       body: bytes, window: int, processes: int, batch: int) -> float:
    """Run the producers spread over ``processes`` processes; seconds from the common
    start to the last producer's last acknowledged send."""
    ctx = multiprocessing.get_context("spawn")
    groups = [shares[i::processes] for i in range(processes)]
    groups = [g for g in groups if any(g)]
    barrier = ctx.Barrier(len(groups) + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_send_process, daemon=True,
                         args=(url, opts, queue, g, body, window, barrier, results, batch))
             for g in groups]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=120)
        started = time.monotonic()
        ends: list[float] = []
        for _ in procs:
            kind, value = results.get(timeout=3600)
            if kind != "done":
                raise RuntimeError(f"load-generator process failed: {value}")
            ends.append(value)
        return max(ends) - started
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


async def _run(url: str, opts: dict[str, Any], *, queue: str, count: int, size: int,
               producers: int, consumers: int, window: int, prefetch: int, phase: str,
               tick: Callable[[str, int], None], processes: int = 1, batch: int = 1,
               ) -> dict[str, Any]:
    body = b"x" * size
    summary: dict[str, Any] = {"count": count, "size": size, "producers": producers,
                               "consumers": consumers, "window": window, "prefetch": prefetch,
                               "processes": processes, "batch": batch}
    if phase in ("send", "both"):
        before = (await _stats(url, opts)).get("store", {})
        share = [count // producers + (1 if i < count % producers else 0)
                 for i in range(producers)]
        if processes > 1:
            elapsed = await asyncio.to_thread(_send_in_processes, url, opts, queue, share,
                                              body, window, processes, batch)
            tick("send", count)
        else:
            started = time.perf_counter()
            await asyncio.gather(*(_producer(url, opts, queue, n, body, window,
                                             lambda k: tick("send", k), batch)
                                   for n in share if n))
            elapsed = time.perf_counter() - started
        after = (await _stats(url, opts)).get("store", {})
        syncs = after.get("syncs", 0) - before.get("syncs", 0)
        summary["send"] = {
            "seconds": round(elapsed, 3),
            "msg_per_s": round(count / elapsed),
            "syncs": syncs,
            "syncs_per_s": round(syncs / elapsed),
            "msgs_per_sync": round(count / syncs, 1) if syncs else None,
        }
    if phase in ("consume", "both"):
        before = (await _stats(url, opts)).get("store", {})
        quota = [count]
        finished: list[float] = []
        started = time.perf_counter()
        got = await asyncio.gather(*(_consumer(url, opts, queue, quota, prefetch,
                                               lambda k: tick("consume", k), 5.0, finished)
                                     for _ in range(consumers)))
        elapsed = (finished[0] if finished else time.perf_counter()) - started
        after = (await _stats(url, opts)).get("store", {})
        received = sum(got)
        syncs = after.get("syncs", 0) - before.get("syncs", 0)
        summary["consume"] = {
            "seconds": round(elapsed, 3),
            "received": received,
            "msg_per_s": round(received / elapsed) if elapsed else 0,
            "syncs": syncs,
            "syncs_per_s": round(syncs / elapsed) if elapsed else 0,
        }
    return summary


def run_bench(url: str, *, queue: str = "bench", count: int = 100_000, size: int = 1024,
              producers: int = 4, consumers: int = 2, window: int = 256, prefetch: int = 500,
              phase: str = "both", progress: Callable[[], Any] | None = None,
              connect_options: dict[str, Any] | None = None,
              processes: int = 1, batch: int = 1) -> dict[str, Any]:
    """Run the benchmark and return its JSON summary; ``connect_options``: keyword
    options of every connection (``tls_ca=`` for a ``txbs://`` URL, say);
    ``processes`` > 1 spreads the producers over that many load-generator processes, so
    that the client's CPU is not what the send phase measures; ``batch`` > 1 makes each
    producer send ``send_batch`` requests of that many messages."""
    opts = dict(connect_options or {})
    if phase not in ("send", "consume", "both"):
        raise ValueError("phase must be send, consume or both")
    loop_factory = _loop_factory()
    bar = progress() if progress is not None else None
    tasks: dict[str, Any] = {}

    def tick(name: str, k: int) -> None:
        if bar is None:
            return
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=count)
        bar.update(tasks[name], advance=k)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        if bar is not None:
            with bar:
                return runner.run(_run(url, opts, queue=queue, count=count, size=size,
                                       producers=producers, consumers=consumers, window=window,
                                       prefetch=prefetch, phase=phase, tick=tick,
                                       processes=processes, batch=batch))
        return runner.run(_run(url, opts, queue=queue, count=count, size=size, producers=producers,
                               consumers=consumers, window=window, prefetch=prefetch,
                               phase=phase, tick=tick, processes=processes, batch=batch))
