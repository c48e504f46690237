"""The operator's commands: ``passwd``, ``audit`` and ``xa list|commit|rollback|forget``.

Theory of operation
-------------------
``passwd`` prints a scrypt hash for the config file's ``[users]`` table (the
password from ``--password``, a terminal prompt, or one line of stdin).
``audit`` runs the Spark audit job (:mod:`txbroker.spark.audit`) over a data
directory, read only, with a progress bar on stderr. The ``xa`` group
(:data:`xa_app`) lists the broker's XA branches and completes prepared ones
by hand through the client connection (:func:`txbroker.cli.common.connect`):
a heuristic commit or rollback, then ``forget``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from txbroker.cli import common  # common.connect is looked up at each call: tests replace it
from txbroker.cli.common import (
    DEFAULT_URL,
    TlsCaOption,
    UrlOption,
    console,
    err_console,
    fail,
    progress_bar,
)
from txbroker.errors import TxBrokerError


def passwd(password: Annotated[str | None, typer.Option(
        help="the password (default: asked twice on a terminal, else one line of stdin)",
        )] = None) -> None:
    """Print a scrypt hash for the config file's [users] table."""
    from txbroker.server.security.auth import hash_password

    if password is None:
        if sys.stdin.isatty():
            password = str(typer.prompt("Password", hide_input=True, confirmation_prompt=True))
        else:
            line = sys.stdin.readline()
            if not line:
                raise fail("no password: give --password, type it at a terminal or pipe one "
                           "line")
            password = line.rstrip("\r\n")
    if not password:
        raise fail("the password is empty")
    print(hash_password(password))


def audit(
    data: Annotated[Path, typer.Option(help="broker data directory (read only)")],
    out: Annotated[Path, typer.Option(help="output: Parquet tables and report.html")],
    master: Annotated[str, typer.Option(help="Spark master")] = "local[*]",
) -> None:
    """Audit a broker's journal with Spark: Parquet tables and an HTML report."""
    try:
        from txbroker.spark.audit import STEPS, run_audit
    except ImportError as exc:
        raise fail(f"the audit needs the spark extra (pip install 'txbroker[spark]'): "
                   f"{exc}") from exc
    with progress_bar() as progress:
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
            raise fail(f"the audit job failed: {first}") from exc
        progress.update(task, completed=len(STEPS))
    counts = ", ".join(f"{name} {count:,}" for name, count in result.counts.items())
    console.print(f"audit of {data} written to {out}: {counts}; report {result.report}",
                  markup=False)
    for xid in result.in_doubt:
        console.print(f"[yellow]needs an operator:[/yellow] {escape(str(xid))}",
                      highlight=False)


xa_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                     help="XA branches: list them, complete prepared ones by hand, forget.")
XidArgument = Annotated[str, typer.Argument(help="Xid as FORMATID-GTRIDHEX-BQUALHEX")]


def _xid(text: str) -> Any:
    from txbroker.xid import Xid

    return Xid.parse(text)  # XAError (XAER_INVAL) when malformed


@xa_app.command("list")
def xa_list(url: UrlOption = DEFAULT_URL, tls_ca: TlsCaOption = None,
            json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every branch: state, age, messages sent and consumed, Xid."""
    with common.connect(url, tls_ca) as conn:
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
def xa_commit(xid: XidArgument, url: UrlOption = DEFAULT_URL,
              tls_ca: TlsCaOption = None) -> None:
    """Heuristically commit a PREPARED branch (it becomes HEURISTIC_COMMITTED)."""
    _heuristic(url, tls_ca, xid, commit=True)


@xa_app.command("rollback")
def xa_rollback(xid: XidArgument, url: UrlOption = DEFAULT_URL,
                tls_ca: TlsCaOption = None) -> None:
    """Heuristically roll back a PREPARED branch (it becomes HEURISTIC_ROLLED_BACK)."""
    _heuristic(url, tls_ca, xid, commit=False)


def _heuristic(url: str, tls_ca: str | None, text: str, *, commit: bool) -> None:
    xid = _xid(text)
    with common.connect(url, tls_ca) as conn:
        conn.xa_heuristic(xid, commit)
    print(f"{xid}: heuristically {'committed' if commit else 'rolled back'}")


@xa_app.command("forget")
def xa_forget(xid: XidArgument, url: UrlOption = DEFAULT_URL,
              tls_ca: TlsCaOption = None) -> None:
    """Forget a heuristically completed branch."""
    parsed = _xid(xid)
    with common.connect(url, tls_ca) as conn:
        conn.xa_resource().forget(parsed)
    print(f"{parsed}: forgotten")
