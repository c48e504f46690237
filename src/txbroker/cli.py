"""The ``txbroker`` command: serve, send, recv, queues, stat, bench, passwd, audit,
``xa list|commit|rollback|forget``.

Every client command takes ``--url`` (default ``$TXBROKER_URL`` or
``txb://127.0.0.1:5445``).

Errors are translated here, at the command's boundary, and never shown as a
traceback: each is one line ``error: …`` on stderr and a non-zero exit code —

* 0: done;
* 1: an error (a :class:`~txbroker.errors.TxBrokerError`, a bad URL or config file,
  no broker answering, a timeout, a file that cannot be read …);
* 2: bad usage (an unknown option, a value out of range);
* 3: an incomplete result: ``recv`` or ``bench`` got fewer messages than asked
  (what did arrive is printed first).

``TXBROKER_DEBUG=1`` lets exceptions through with their traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import tomllib
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from txbroker.errors import TxBrokerError

#: Exit codes (documented in the module docstring, ``--help`` and the README).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3

# rich_markup_mode=None: help texts are plain text, so "[users]" or "txb://[user…]" are
# shown as written instead of being eaten as rich markup tags.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_enable=False,
                  help="txbroker: a durable, transactional message broker. Exit codes: 0 "
                       "done, 1 error, 2 bad usage, 3 fewer messages than asked (recv, "
                       "bench).")
console = Console()
err_console = Console(stderr=True)

DEFAULT_URL = "txb://127.0.0.1:5445"
UrlOption = Annotated[str, typer.Option(
    "--url", envvar="TXBROKER_URL",
    help="broker URL: txb://[user:password@]host[:port], more host[:port] after commas "
         "for failover")]
#: click's exception base (typer vendors click; older typer versions depend on it): found
#: through a public typer exception instead of importing a private module.
_ClickError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _connect(url: str) -> Any:
    from txbroker.client.sync import connect

    return connect(url, reconnect=False)


def _say_error(text: str) -> None:
    """Print ``error: text`` as one line on stderr (no markup, no wrapping)."""
    line = " ".join(text.split())
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()


def _fail(text: str, code: int = EXIT_ERROR) -> typer.Exit:
    """Print the error line; raise the result to end the command with ``code``."""
    _say_error(text)
    return typer.Exit(code)


def _describe(exc: BaseException) -> str:
    """What a user needs to read about ``exc``, in one line."""
    if isinstance(exc, TimeoutError):  # the client's "no reply within" (an OSError too)
        return f"timed out: {exc}" if str(exc) else "timed out"
    if isinstance(exc, OSError):
        if exc.filename is not None and exc.strerror:
            return f"{exc.filename}: {exc.strerror}"
        return re.sub(r"^\[Errno \d+\] ", "", str(exc)) or type(exc).__name__
    return str(exc) or type(exc).__name__


def _usage_error(exc: Exception) -> int:
    """One line for a click usage error, pointing at the command's --help."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as before
        print(exc.ctx.get_help())  # type: ignore[attr-defined]
        return EXIT_USAGE
    message = getattr(exc, "format_message", lambda: str(exc))()
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    _say_error(f"{message}{hint}")
    return int(getattr(exc, "exit_code", EXIT_USAGE))


class LogLevel(StrEnum):
    """``serve --log-level`` values."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class Phase(StrEnum):
    """``bench --phase`` values."""

    SEND = "send"
    CONSUME = "consume"
    BOTH = "both"


@app.command()
def serve(
    data: Annotated[Path | None, typer.Option(help="data directory")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    port: Annotated[int | None, typer.Option(help="native port (0 = off)")] = None,
    stomp_port: Annotated[int | None, typer.Option(
        help="STOMP port (0 = off; default 61613)")] = None,
    http_port: Annotated[int | None, typer.Option(help=(
        "HTTP console port: not built yet, nothing listens there (a non-zero port, "
        "here or in the config file, only prints a warning; default 0 = off)"))] = None,
    sync: Annotated[str | None, typer.Option(help="none | fdatasync | fsync")] = None,
    store: Annotated[str | None, typer.Option(help="journal | dir")] = None,
    dir_flags: Annotated[str | None, typer.Option(
        help="dir store sync flags: FSYNC or FDATASYNC, plus DSYNC (default: none)")] = None,
    segment_size: Annotated[int | None, typer.Option(help="journal segment bytes")] = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="skip corrupt journal regions (reports what is dropped)")] = False,
    log_level: Annotated[LogLevel, typer.Option(case_sensitive=False)] = LogLevel.INFO,
) -> None:
    """Run a broker until SIGTERM / Ctrl-C."""
    from txbroker.server.app import run

    logging.basicConfig(level=log_level.value,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = _load_config(config, data=data, host=host, port=port, stomp_port=stomp_port,
                       http_port=http_port, sync=sync, store=store, dir_flags=dir_flags,
                       segment_size=segment_size, repair=repair or None)
    if cfg.http_port:
        sys.stderr.write("warning: the HTTP console is not built yet: nothing listens on "
                         f"port {cfg.http_port}\n")
        sys.stderr.flush()
    started = False

    def ready(server: Any) -> None:
        nonlocal started
        started = True
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
    except OSError as exc:  # a port in use, an address that is not ours …
        if started or exc.filename is not None or isinstance(exc, TimeoutError):
            raise
        raise _fail(f"cannot start the broker: {_describe(exc)}") from exc


def _load_config(path: Path | None, **overrides: Any) -> Any:
    """The server config; a config file's problems are reported with its name."""
    from txbroker.server.config import load_config

    try:
        return load_config(path, **overrides)
    except tomllib.TOMLDecodeError as exc:
        raise _fail(f"{path}: {exc}") from exc
    except (TypeError, AttributeError) as exc:  # e.g. port = "abc": config.py checks no types
        if path is None:
            raise
        raise _fail(f"{path}: a value has the wrong type ({exc})") from exc


def _headers(values: list[str] | None) -> list[str] | None:
    for value in values or []:
        if "=" not in value:
            raise typer.BadParameter(f"{value!r} is not KEY=VALUE")
    return values


@app.command()
def send(
    queue: str,
    body: Annotated[str | None, typer.Argument(help="message text (default: read stdin)")] = None,
    url: UrlOption = DEFAULT_URL,
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
        with _connect(url) as conn, _progress() as progress:
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
        raise _fail(f"{_describe(exc)} (after {sent} of {count} message(s) were sent)") from exc
    elapsed = time.perf_counter() - started
    print(f"sent {count} message(s) to {queue} in {elapsed:.2f} s "
          f"({count / elapsed:,.0f} msg/s)")


@app.command()
def recv(
    queue: str,
    url: UrlOption = DEFAULT_URL,
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
    try:
        with _connect(url) as conn:
            while got < count:
                msg = conn.receive(queue, timeout=timeout)
                if msg is None:
                    break
                got += 1
                if not quiet:
                    line = Text.assemble((str(msg.seq), "dim"), " ",
                                         msg.body.decode(errors="replace"),
                                         " (redelivered)" if msg.redelivered else "")
                    console.print(line, soft_wrap=True, highlight=False)
                if not no_ack:
                    msg.ack(wait=True)
    except (TxBrokerError, OSError) as exc:
        if not got:
            raise
        raise _fail(f"{_describe(exc)} (after receiving {got} of {count} message(s))") from exc
    if got < count:
        raise _fail(f"timed out: received {got} of {count} message(s) "
                    f"(none came within {timeout:g} s)", EXIT_INCOMPLETE)


@app.command()
def queues(url: UrlOption = DEFAULT_URL,
           json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List queues and topics: depth, in-flight, consumers, bytes."""
    with _connect(url) as conn:
        found = conn.queues()
    if json_out:
        print(json.dumps(found, indent=2))
        return
    table = Table("name", "kind", "depth", "in-flight", "consumers", "bytes")
    for q in found:
        table.add_row(Text(q["name"]), q["kind"], str(q["depth"]), str(q["in_flight"]),
                      str(q["consumers"]), f"{q['bytes']:,}")
    console.print(table)


@app.command()
def stat(url: UrlOption = DEFAULT_URL) -> None:
    """Broker counters (messages, sessions, store syncs …) as JSON."""
    with _connect(url) as conn:
        print(json.dumps(conn.stats(), indent=2, sort_keys=True))


@app.command()
def bench(
    url: UrlOption = DEFAULT_URL,
    queue: Annotated[str, typer.Option(help="queue to use")] = "bench",
    count: Annotated[int, typer.Option(min=1, help="messages")] = 100_000,
    size: Annotated[int, typer.Option(min=0, help="body bytes")] = 1024,
    producers: Annotated[int, typer.Option(min=1, help="producer connections")] = 4,
    consumers: Annotated[int, typer.Option(min=1, help="consumer connections")] = 2,
    window: Annotated[int, typer.Option(min=1, help="sends in flight per producer")] = 256,
    prefetch: Annotated[int, typer.Option(min=1, help="consumer prefetch")] = 500,
    phase: Annotated[Phase, typer.Option()] = Phase.BOTH,
    json_out: Annotated[Path | None, typer.Option("--json", help="write summary here")] = None,
) -> None:
    """Native-protocol load generator: persistent sends, then consume + ack.

    When the consumers get fewer than --count messages (none for 5 s), the summary is
    printed, then "error: received N of COUNT message(s)" on stderr: exit code 3.
    """
    from txbroker.bench import run_bench

    summary = run_bench(url, queue=queue, count=count, size=size, producers=producers,
                        consumers=consumers, window=window, prefetch=prefetch,
                        phase=phase.value, progress=_progress)
    text = json.dumps(summary, indent=2)
    if json_out is not None:
        json_out.write_text(text + "\n")
    print(text, flush=True)
    consumed = summary.get("consume")
    if consumed is not None and consumed["received"] < count:
        raise _fail(f"received {consumed['received']} of {count} message(s)", EXIT_INCOMPLETE)


@app.command()
def passwd(password: Annotated[str | None, typer.Option(
        help="the password (default: asked twice on a terminal, else one line of stdin)",
        )] = None) -> None:
    """Print a scrypt hash for the config file's [users] table."""
    from txbroker.server.auth import hash_password

    if password is None:
        if sys.stdin.isatty():
            password = str(typer.prompt("Password", hide_input=True, confirmation_prompt=True))
        else:
            line = sys.stdin.readline()
            if not line:
                raise _fail("no password: give --password, type it at a terminal or pipe one "
                            "line")
            password = line.rstrip("\r\n")
    if not password:
        raise _fail("the password is empty")
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
        raise _fail(f"the audit needs the spark extra (pip install 'txbroker[spark]'): "
                    f"{exc}") from exc
    with _progress() as progress:
        task = progress.add_task("audit", total=len(STEPS))

        def step(name: str) -> None:
            if not progress.disable:
                progress.update(task, description=name,
                                completed=STEPS.index(name) if name in STEPS else 0)
            else:
                err_console.print(f"audit: {name}", highlight=False, markup=False)

        try:
            result = run_audit(data, out, master=master, progress=step)
        except TxBrokerError:
            raise
        except Exception as exc:  # Spark's own failures: their first line says enough
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise _fail(f"the audit job failed: {first}") from exc
        progress.update(task, completed=len(STEPS))
    counts = ", ".join(f"{name} {count:,}" for name, count in result.counts.items())
    console.print(f"audit of {data} written to {out}: {counts}; report {result.report}",
                  markup=False)
    for xid in result.in_doubt:
        console.print(f"[yellow]needs an operator:[/yellow] {escape(str(xid))}",
                      highlight=False)


xa_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                     help="XA branches: list them, complete prepared ones by hand, forget.")
app.add_typer(xa_app, name="xa")
XidArgument = Annotated[str, typer.Argument(help="Xid as FORMATID-GTRIDHEX-BQUALHEX")]


def _xid(text: str) -> Any:
    from txbroker.xid import Xid

    return Xid.parse(text)  # XAError (XAER_INVAL) when malformed


@xa_app.command("list")
def xa_list(url: UrlOption = DEFAULT_URL,
            json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every branch: state, age, messages sent and consumed, Xid."""
    with _connect(url) as conn:
        found = conn.xa_branches()
    if json_out:
        print(json.dumps(found, indent=2))
        return
    table = Table("state", "age (s)", "sent", "consumed", "xid")
    for b in found:
        table.add_row(b["state"], f"{b['age_ms'] / 1000:.1f}", str(b["sent"]),
                      str(b["consumed"]), Text(b["xid"]))
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
    with _connect(url) as conn:
        conn.xa_heuristic(xid, commit)
    print(f"{xid}: heuristically {'committed' if commit else 'rolled back'}")


@xa_app.command("forget")
def xa_forget(xid: XidArgument, url: UrlOption = DEFAULT_URL) -> None:
    """Forget a heuristically completed branch."""
    parsed = _xid(xid)
    with _connect(url) as conn:
        conn.xa_resource().forget(parsed)
    print(f"{parsed}: forgotten")


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err_console,
                    disable=not err_console.is_terminal and not os.environ.get("TXB_PROGRESS"))


def _invoke(argv: Sequence[str] | None) -> int:
    """Run the command line; translate every exception into one line and an exit code."""
    debug = bool(os.environ.get("TXBROKER_DEBUG"))
    try:
        result = app(args=None if argv is None else list(argv), prog_name="txbroker",
                     standalone_mode=False)
    except _ClickError as exc:  # bad usage: an unknown option, a value out of range …
        return _usage_error(exc)
    except typer.Abort:  # Ctrl-D at a prompt
        _say_error("aborted")
        return EXIT_ERROR
    except (TxBrokerError, ValueError, OSError) as exc:  # bad URL or argument, no broker …
        if debug:
            raise
        _say_error(_describe(exc))
        return EXIT_ERROR
    except Exception as exc:  # a bug: still one line, the traceback on demand
        if debug:
            raise
        _say_error(f"internal error: {type(exc).__name__}: {exc} "
                   "(TXBROKER_DEBUG=1 shows the traceback)")
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of the ``txbroker`` console script (exit codes: module docstring)."""
    try:
        code = _invoke(argv)
    except BrokenPipeError:  # `txbroker … | head`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_ERROR
    sys.exit(code)


if __name__ == "__main__":
    main()
