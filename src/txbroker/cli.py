"""The ``txbroker`` command: serve, send, recv, queues, stat, bench, passwd, audit,
``xa list|commit|rollback|forget``.

Every client command takes ``--url`` (default ``$TXBROKER_URL`` or
``txb://127.0.0.1:5445``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from txbroker.errors import TxBrokerError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="txbroker: a durable, transactional message broker.")
console = Console()
err_console = Console(stderr=True)

DEFAULT_URL = "txb://127.0.0.1:5445"
UrlOption = Annotated[str, typer.Option("--url", envvar="TXBROKER_URL",
                                        help="broker URL txb://[user:pw@]host:port[,host:port]")]


def _connect(url: str) -> Any:
    from txbroker.client.sync import connect

    return connect(url, reconnect=False)


def _fail(exc: BaseException) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {exc}")
    return typer.Exit(1)


@app.command()
def serve(
    data: Annotated[Path | None, typer.Option(help="data directory")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    port: Annotated[int | None, typer.Option(help="native port (0 = off)")] = None,
    stomp_port: Annotated[int | None, typer.Option(
        help="STOMP port (0 = off; default 61613)")] = None,
    http_port: Annotated[int | None, typer.Option(help="HTTP console port (0 = off)")] = None,
    sync: Annotated[str | None, typer.Option(help="none | fdatasync | fsync")] = None,
    store: Annotated[str | None, typer.Option(help="journal | dir")] = None,
    dir_flags: Annotated[str | None, typer.Option(
        help="dir store sync flags: FSYNC or FDATASYNC, plus DSYNC (default: none)")] = None,
    segment_size: Annotated[int | None, typer.Option(help="journal segment bytes")] = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="skip corrupt journal regions (reports what is dropped)")] = False,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING")] = "INFO",
) -> None:
    """Run a broker until SIGTERM / Ctrl-C."""
    from txbroker.server.app import run
    from txbroker.server.config import load_config

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(config, data=data, host=host, port=port, stomp_port=stomp_port,
                          http_port=http_port, sync=sync, store=store, dir_flags=dir_flags,
                          segment_size=segment_size, repair=repair or None)
    except (OSError, ValueError) as exc:
        raise _fail(exc) from exc

    def ready(server: Any) -> None:
        stomp = f", STOMP {server.stomp_port}" if server.stomp_port else ""
        print(f"txbroker ready on {cfg.host}:{server.port}{stomp} (data {cfg.data}, "
              f"sync {cfg.sync}); "
              f"recovered {server.recovered_messages} messages in "
              f"{server.recovery_seconds:.2f} s", flush=True)
        if cfg.repair and getattr(server.store, "repair_report", None):
            for line in server.store.repair_report:
                print(f"repair: {line}", flush=True)

    try:
        run(cfg, ready)
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    except (OSError, ValueError) as exc:
        raise _fail(exc) from exc


@app.command()
def send(
    queue: str,
    body: Annotated[str | None, typer.Argument(help="message text (default: read stdin)")] = None,
    url: UrlOption = DEFAULT_URL,
    count: Annotated[int, typer.Option(help="messages to send")] = 1,
    size: Annotated[int | None, typer.Option(help="generate bodies of this many bytes")] = None,
    tx: Annotated[int, typer.Option(help="send in transactions of this many messages")] = 0,
    header: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    message_id: Annotated[str | None, typer.Option(help="id for duplicate detection")] = None,
    priority: Annotated[int, typer.Option(help="0-9")] = 4,
    window: Annotated[int, typer.Option(help="sends in flight (pipelining)")] = 256,
) -> None:
    """Send messages (each acknowledged once durable)."""
    if size is not None:
        payload = (b"x" * size)
    elif body is not None:
        payload = body.encode()
    else:
        payload = sys.stdin.buffer.read()
    headers = dict(h.split("=", 1) for h in header or [])
    started = time.perf_counter()
    try:
        with _connect(url) as conn, _progress() as progress:
            task = progress.add_task("send", total=count)
            if tx > 0:
                sent = 0
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
                progress.update(task, advance=1)
            else:
                futures: list[Any] = []
                for _ in range(count):
                    futures.append(conn.send_nowait(queue, payload, headers=headers,
                                                    priority=priority))
                    if len(futures) >= window:
                        futures.pop(0).result()
                        progress.update(task, advance=1)
                for fut in futures:
                    fut.result()
                    progress.update(task, advance=1)
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    elapsed = time.perf_counter() - started
    console.print(f"sent {count} message(s) to {queue} in {elapsed:.2f} s "
                  f"({count / elapsed:,.0f} msg/s)")


@app.command()
def recv(
    queue: str,
    url: UrlOption = DEFAULT_URL,
    count: Annotated[int, typer.Option(help="messages to receive")] = 1,
    timeout: Annotated[float, typer.Option(help="seconds to wait for each message")] = 5.0,
    no_ack: Annotated[bool, typer.Option("--no-ack", help="leave messages unacked")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="do not print bodies")] = False,
) -> None:
    """Receive messages and acknowledge them."""
    got = 0
    try:
        with _connect(url) as conn:
            while got < count:
                msg = conn.receive(queue, timeout=timeout)
                if msg is None:
                    break
                got += 1
                if not quiet:
                    text = msg.body.decode(errors="replace")
                    flag = " (redelivered)" if msg.redelivered else ""
                    console.print(f"[dim]{msg.seq}[/dim] {text}{flag}", highlight=False)
                if not no_ack:
                    msg.ack(wait=True)
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    if got < count:
        err_console.print(f"received {got} of {count} (timed out)")
        raise typer.Exit(2 if got == 0 else 0)


@app.command()
def queues(url: UrlOption = DEFAULT_URL,
           json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List queues and topics: depth, in-flight, consumers, bytes."""
    try:
        with _connect(url) as conn:
            found = conn.queues()
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    if json_out:
        print(json.dumps(found, indent=2))
        return
    table = Table("name", "kind", "depth", "in-flight", "consumers", "bytes")
    for q in found:
        table.add_row(q["name"], q["kind"], str(q["depth"]), str(q["in_flight"]),
                      str(q["consumers"]), f"{q['bytes']:,}")
    console.print(table)


@app.command()
def stat(url: UrlOption = DEFAULT_URL) -> None:
    """Broker counters (messages, sessions, store syncs …) as JSON."""
    try:
        with _connect(url) as conn:
            print(json.dumps(conn.stats(), indent=2, sort_keys=True))
    except TxBrokerError as exc:
        raise _fail(exc) from exc


@app.command()
def bench(
    url: UrlOption = DEFAULT_URL,
    queue: Annotated[str, typer.Option(help="queue to use")] = "bench",
    count: Annotated[int, typer.Option(help="messages")] = 100_000,
    size: Annotated[int, typer.Option(help="body bytes")] = 1024,
    producers: Annotated[int, typer.Option(help="producer connections")] = 4,
    consumers: Annotated[int, typer.Option(help="consumer connections")] = 2,
    window: Annotated[int, typer.Option(help="sends in flight per producer")] = 256,
    prefetch: Annotated[int, typer.Option(help="consumer prefetch")] = 500,
    phase: Annotated[str, typer.Option(help="send | consume | both")] = "both",
    json_out: Annotated[Path | None, typer.Option("--json", help="write summary here")] = None,
) -> None:
    """Native-protocol load generator: persistent sends, then consume + ack."""
    from txbroker.bench import run_bench

    try:
        summary = run_bench(url, queue=queue, count=count, size=size, producers=producers,
                            consumers=consumers, window=window, prefetch=prefetch, phase=phase,
                            progress=_progress)
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    text = json.dumps(summary, indent=2)
    if json_out is not None:
        json_out.write_text(text + "\n")
    print(text)


@app.command()
def passwd(password: Annotated[str, typer.Option(prompt=True, hide_input=True,
                                                  confirmation_prompt=True)]) -> None:
    """Print a scrypt hash for the config file's [users] table."""
    from txbroker.server.auth import hash_password

    print(hash_password(password))


@app.command()
def audit(
    data: Annotated[Path, typer.Option(help="broker data directory (read only)")],
    out: Annotated[Path, typer.Option(help="output: Parquet tables and report.html")],
    master: Annotated[str, typer.Option(help="Spark master")] = "local[*]",
) -> None:
    """Audit a broker's journal with Spark: Parquet tables and an HTML report."""
    try:
        from txbroker.spark.audit import STEPS, run_audit
    except ImportError as exc:
        raise _fail(RuntimeError(f"the audit needs the spark extra "
                                 f"(pip install 'txbroker[spark]'): {exc}")) from exc
    with _progress() as progress:
        task = progress.add_task("audit", total=len(STEPS))

        def step(name: str) -> None:
            if not progress.disable:
                progress.update(task, description=name,
                                completed=STEPS.index(name) if name in STEPS else 0)
            else:
                err_console.print(f"audit: {name}", highlight=False)

        try:
            result = run_audit(data, out, master=master, progress=step)
        except TxBrokerError as exc:
            raise _fail(exc) from exc
        except Exception as exc:  # Spark's own failures: their first line says enough
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise _fail(RuntimeError(f"the audit job failed: {first}")) from exc
        progress.update(task, completed=len(STEPS))
    counts = ", ".join(f"{name} {count:,}" for name, count in result.counts.items())
    console.print(f"audit of {data} written to {out}: {counts}; report {result.report}")
    for xid in result.in_doubt:
        console.print(f"[yellow]needs an operator:[/yellow] {xid}", highlight=False)


xa_app = typer.Typer(no_args_is_help=True,
                     help="XA branches: list them, complete prepared ones by hand, forget.")
app.add_typer(xa_app, name="xa")
XidArgument = Annotated[str, typer.Argument(help="Xid as FORMATID-GTRIDHEX-BQUALHEX")]


def _xid(text: str) -> Any:
    from txbroker.xid import Xid

    try:
        return Xid.parse(text)
    except TxBrokerError as exc:
        raise _fail(exc) from exc


@xa_app.command("list")
def xa_list(url: UrlOption = DEFAULT_URL,
            json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every branch: state, age, messages sent and consumed, Xid."""
    try:
        with _connect(url) as conn:
            found = conn.xa_branches()
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    if json_out:
        print(json.dumps(found, indent=2))
        return
    table = Table("state", "age (s)", "sent", "consumed", "xid")
    for b in found:
        table.add_row(b["state"], f"{b['age_ms'] / 1000:.1f}", str(b["sent"]),
                      str(b["consumed"]), b["xid"])
    console.print(table)


@xa_app.command("commit")
def xa_commit(xid: XidArgument, url: UrlOption = DEFAULT_URL) -> None:
    """Heuristically commit a PREPARED branch (it becomes HEURISTIC_COMMITTED)."""
    _heuristic(url, xid, commit=True)


@xa_app.command("rollback")
def xa_rollback(xid: XidArgument, url: UrlOption = DEFAULT_URL) -> None:
    """Heuristically roll back a PREPARED branch (it becomes HEURISTIC_ROLLED_BACK)."""
    _heuristic(url, xid, commit=False)


def _heuristic(url: str, text: str, *, commit: bool) -> None:
    xid = _xid(text)
    try:
        with _connect(url) as conn:
            conn.xa_heuristic(xid, commit)
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    print(f"{xid}: heuristically {'committed' if commit else 'rolled back'}")


@xa_app.command("forget")
def xa_forget(xid: XidArgument, url: UrlOption = DEFAULT_URL) -> None:
    """Forget a heuristically completed branch."""
    parsed = _xid(xid)
    try:
        with _connect(url) as conn:
            conn.xa_resource().forget(parsed)
    except TxBrokerError as exc:
        raise _fail(exc) from exc
    print(f"{parsed}: forgotten")


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err_console,
                    disable=not err_console.is_terminal and not os.environ.get("TXB_PROGRESS"))


def main() -> None:
    """Entry point of the ``txbroker`` console script."""
    app()


if __name__ == "__main__":
    main()
