"""The client commands: ``send``, ``recv``, ``queues``, ``stat`` and ``bench``.

Theory of operation
-------------------
Each command opens one synchronous client connection (:func:`txbroker.cli.common.connect`,
``--url``), does its work and closes it. ``send`` pipelines up to ``--window``
sends (or sends in transactions of ``--tx`` messages); ``recv`` receives and
acknowledges one message at a time; ``bench`` hands over to
:func:`txbroker.bench.run_bench`. A partial result is not success: when some
messages were sent or received before an error, the error line says how many;
``recv`` and ``bench`` exit with code 3 when fewer messages came than asked.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from txbroker.cli import common  # common.connect is looked up at each call: tests replace it
from txbroker.cli.common import (
    DEFAULT_URL,
    EXIT_INCOMPLETE,
    TlsCaOption,
    UrlOption,
    console,
    describe,
    fail,
    progress_bar,
)
from txbroker.errors import TxBrokerError


class Phase(StrEnum):
    """``bench --phase`` values."""

    SEND = "send"
    CONSUME = "consume"
    BOTH = "both"


def _headers(values: list[str] | None) -> list[str] | None:
    for value in values or []:
        if "=" not in value:
            raise typer.BadParameter(f"{value!r} is not KEY=VALUE")
    return values


def send(
    queue: str,
    body: Annotated[str | None, typer.Argument(help="message text (default: read stdin)")] = None,
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
    count: Annotated[int, typer.Option(min=1, help="messages to send")] = 1,
    size: Annotated[int | None, typer.Option(
        min=0, help="generate bodies of this many bytes")] = None,
    tx: Annotated[int, typer.Option(
        min=0, help="send in transactions of this many messages")] = 0,
    header: Annotated[list[str] | None, typer.Option(
        callback=_headers, help="KEY=VALUE, repeatable")] = None,
    message_id: Annotated[str | None, typer.Option(help="id for duplicate detection")] = None,
    priority: Annotated[int, typer.Option(min=0, max=9, help="0-9")] = 4,
    window: Annotated[int, typer.Option(min=1, help="sends in flight (pipelining)")] = 256,
) -> None:
    """Send messages (each acknowledged once durable).

    On an error after some messages were acknowledged, the error line says how many.
    """
    if size is not None:
        payload = (b"x" * size)
    elif body is not None:
        payload = body.encode()
    else:
        payload = sys.stdin.buffer.read()
    headers = dict(h.split("=", 1) for h in header or [])
    started = time.perf_counter()
    sent = 0
    try:
        with common.connect(url, tls_ca) as conn, progress_bar() as progress:
            task = progress.add_task("send", total=count)
            if tx > 0:
                while sent < count:
                    batch = min(tx, count - sent)
                    with conn.transaction() as t:
                        for _ in range(batch):
                            t.send(queue, payload, headers=headers, priority=priority)
                    sent += batch
                    progress.update(task, advance=batch)
            elif count == 1:
                conn.send(queue, payload, headers=headers, message_id=message_id,
                          priority=priority)
                sent = 1
                progress.update(task, advance=1)
            else:
                futures: list[Any] = []
                for _ in range(count):
                    futures.append(conn.send_nowait(queue, payload, headers=headers,
                                                    priority=priority))
                    if len(futures) >= window:
                        futures.pop(0).result()
                        sent += 1
                        progress.update(task, advance=1)
                for fut in futures:
                    fut.result()
                    sent += 1
                    progress.update(task, advance=1)
    except (TxBrokerError, OSError) as exc:
        if not sent:
            raise
        raise fail(f"{describe(exc)} (after {sent} of {count} message(s) were sent)") from exc
    elapsed = time.perf_counter() - started
    print(f"sent {count} message(s) to {queue} in {elapsed:.2f} s "
          f"({count / elapsed:,.0f} msg/s)")


def recv(
    queue: str,
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
    count: Annotated[int, typer.Option(min=1, help="messages to receive")] = 1,
    timeout: Annotated[float, typer.Option(
        min=0, help="seconds to wait for each message")] = 5.0,
    no_ack: Annotated[bool, typer.Option("--no-ack", help="leave messages unacked")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="do not print bodies")] = False,
) -> None:
    """Receive messages and acknowledge them, one line each: sequence number and body.

    A partial result is not success: when fewer than --count messages come (none for
    --timeout seconds), those received are printed (and acknowledged), then
    "error: timed out: received N of COUNT message(s)" on stderr: exit code 3.
    """
    got = 0

    def show(msg: Any) -> None:
        if not quiet:
            line = Text.assemble((str(msg.seq), "dim"), " ", msg.body.decode(errors="replace"),
                                 " (redelivered)" if msg.redelivered else "")
            console.print(line, soft_wrap=True, highlight=False)

    try:
        with common.connect(url, tls_ca) as conn:
            if no_ack or count == 1:  # one request a message: nothing is held back
                while got < count:
                    msg = conn.receive(queue, timeout=timeout)
                    if msg is None:
                        break
                    got += 1
                    show(msg)
                    if not no_ack:
                        msg.ack(wait=True)
            else:
                got = _recv_windowed(conn, queue, count, timeout, show)
    except (TxBrokerError, OSError) as exc:
        if not got:
            raise
        raise fail(f"{describe(exc)} (after receiving {got} of {count} message(s))") from exc
    if got < count:
        raise fail(f"timed out: received {got} of {count} message(s) "
                   f"(none came within {timeout:g} s)", EXIT_INCOMPLETE)


#: How many ``receive`` requests ``recv`` keeps in flight.
RECV_WINDOW = 256


def _recv_windowed(conn: Any, queue: str, count: int, timeout: float,
                   show: Callable[[Any], None]) -> int:
    """Receive up to ``count`` messages with up to :data:`RECV_WINDOW` ``receive``
    requests in flight (not one round trip a message), acknowledging them pipelined;
    the last ack is waited for (acks are ordered: all are durable then). Exactly
    ``count`` receives are asked for, so the broker never hands out more (a
    subscription's prefetch would push ahead, and what it pushed past ``count`` would
    go back to the queue flagged redelivered). Returns how many came."""

    async def run() -> int:
        aconn = conn.async_connection
        pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        issued = got = 0
        timed_out = False
        last: Any = None
        while pending or (issued < count and not timed_out):
            while issued < count and not timed_out and len(pending) < RECV_WINDOW:
                pending.append(asyncio.ensure_future(aconn.receive(queue, timeout=timeout)))
                issued += 1
            msg = await pending.popleft()
            if msg is None:
                timed_out = True  # ask no more; those in flight may still bring one
                continue
            got += 1
            show(msg)
            if last is not None:
                await last.ack()
            last = msg
        if last is not None:
            await last.ack(wait=True)
        return got

    return int(conn.run_async(run()))


def queues(url: UrlOption = DEFAULT_URL, tls_ca: TlsCaOption = None,
           json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List queues and topics: depth, in-flight, consumers, bytes."""
    with common.connect(url, tls_ca) as conn:
        found = conn.queues()
    if json_out:
        print(json.dumps(found, indent=2))
        return
    table = Table("name", "kind", "depth", "in-flight", "consumers", "bytes")
    for q in found:
        table.add_row(Text(q["name"]), q["kind"], str(q["depth"]), str(q["in_flight"]),
                      str(q["consumers"]), f"{q['bytes']:,}")
    console.print(table)


def connections(url: UrlOption = DEFAULT_URL, tls_ca: TlsCaOption = None,
                json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List client connections (AMQP ones with their channels): protocol, user,
    address, subscriptions, unacked, transactions."""
    with common.connect(url, tls_ca) as conn:
        found = [c for c in conn.request("conn_list", {}) if c["protocol"] != "http"]
    if json_out:
        print(json.dumps(found, indent=2))
        return
    table = Table("id", "protocol", "user", "address", "subs", "unacked", "tx",
                  "channel", "consumers", "prefetch", "ch unacked", "mode")
    for c in sorted(found, key=lambda c: c["id"]):
        table.add_row(str(c["id"]), c["protocol"], Text(c["user"] or "-"),
                      Text(c["address"] or "-"), str(c["subscriptions"]), str(c["unacked"]),
                      str(c["transactions"]))
        for channel in c.get("channels") or ():
            table.add_row("", "", "", "", "", "", "", str(channel["number"]),
                          str(channel["consumers"]), str(channel["prefetch"]),
                          str(channel["unacked"]), channel["mode"])
    console.print(table)


def stat(url: UrlOption = DEFAULT_URL, tls_ca: TlsCaOption = None) -> None:
    """Broker counters (messages, sessions, store syncs …) as JSON."""
    with common.connect(url, tls_ca) as conn:
        print(json.dumps(conn.stats(), indent=2, sort_keys=True))


def bench(
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
    queue: Annotated[str, typer.Option(help="queue to use")] = "bench",
    count: Annotated[int, typer.Option(min=1, help="messages")] = 100_000,
    size: Annotated[int, typer.Option(min=0, help="body bytes")] = 1024,
    producers: Annotated[int, typer.Option(min=1, help="producer connections")] = 4,
    consumers: Annotated[int, typer.Option(min=1, help="consumer connections")] = 2,
    window: Annotated[int, typer.Option(min=1, help="sends in flight per producer")] = 256,
    prefetch: Annotated[int, typer.Option(min=1, help="consumer prefetch")] = 500,
    phase: Annotated[Phase, typer.Option()] = Phase.BOTH,
    processes: Annotated[int, typer.Option(
        min=1, help="load-generator processes the producers are spread over")] = 1,
    batch: Annotated[int, typer.Option(
        min=1, help="messages per send_batch request (1: one send per message)")] = 1,
    json_out: Annotated[Path | None, typer.Option("--json", help="write summary here")] = None,
) -> None:
    """Native-protocol load generator: persistent sends, then consume + ack.

    When the consumers get fewer than --count messages (none for 5 s), the summary is
    printed, then "error: received N of COUNT message(s)" on stderr: exit code 3.
    """
    from txbroker.bench import run_bench

    summary = run_bench(url, queue=queue, count=count, size=size, producers=producers,
                        consumers=consumers, window=window, prefetch=prefetch,
                        phase=phase.value, progress=progress_bar,
                        connect_options=common.connect_options(tls_ca), processes=processes,
                        batch=batch)
    text = json.dumps(summary, indent=2)
    if json_out is not None:
        json_out.write_text(text + "\n")
    print(text, flush=True)
    consumed = summary.get("consume")
    if consumed is not None and consumed["received"] < count:
        raise fail(f"received {consumed['received']} of {count} message(s)", EXIT_INCOMPLETE)
