"""What every ``txbroker`` command shares: exit codes, consoles, the error line,
the ``--url`` option, the broker connection and the progress bar.

Theory of operation
-------------------
A command never prints a traceback: it ends with :func:`fail` (one line
``error: …`` on stderr, raised as ``typer.Exit`` with the exit code), or lets
the exception go to :func:`txbroker.cli.main`, which prints the same kind of
line through :func:`say_error` and :func:`describe`. Output for people goes
through :data:`console` (stdout) and :data:`err_console` (stderr: progress
bars and notes, so that stdout stays parseable).

Client commands connect through :func:`connect`, looked up on this module when
a command runs, so that a test can replace it with a stand-in connection.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: Exit codes (documented in :mod:`txbroker.cli`, ``--help`` and the README).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3

#: Standard output, for what a command reports.
console = Console()
#: Standard error, for progress and notes.
err_console = Console(stderr=True)

DEFAULT_URL = "txb://127.0.0.1:5445"
UrlOption = Annotated[str, typer.Option(
    "--url", envvar="TXBROKER_URL",
    help="broker URL: txb://[user:password@]host[:port], more host[:port] after commas "
         "for failover; txbs://… over TLS (docs/tls.md)")]
TlsCaOption = Annotated[str | None, typer.Option(
    "--tls-ca", envvar="TXBROKER_TLS_CA",
    help="with a txbs:// URL: PEM file of the CA that signed the broker's certificate "
         "(default: the system's CAs)")]


def connect_options(tls_ca: str | None) -> dict[str, Any]:
    """The client options of a command's ``--tls-ca``."""
    return {} if tls_ca is None else {"tls_ca": tls_ca}


def connect(url: str, tls_ca: str | None = None) -> Any:
    """A synchronous client connection to ``url`` (no reconnecting); ``tls_ca``: the
    ``--tls-ca`` file, for a ``txbs://`` URL."""
    from txbroker.client.sync import connect

    return connect(url, reconnect=False, **connect_options(tls_ca))


def say_error(text: str) -> None:
    """Print ``error: text`` as one line on stderr (no markup, no wrapping)."""
    line = " ".join(text.split())
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()


def fail(text: str, code: int = EXIT_ERROR) -> typer.Exit:
    """Print the error line; raise the result to end the command with ``code``."""
    say_error(text)
    return typer.Exit(code)


def describe(exc: BaseException) -> str:
    """What a user needs to read about ``exc``, in one line."""
    if isinstance(exc, TimeoutError):  # the client's "no reply within" (an OSError too)
        return f"timed out: {exc}" if str(exc) else "timed out"
    if isinstance(exc, OSError):
        if exc.filename is not None and exc.strerror:
            return f"{exc.filename}: {exc.strerror}"
        return re.sub(r"^\[Errno \d+\] ", "", str(exc)) or type(exc).__name__
    return str(exc) or type(exc).__name__


def progress_bar() -> Progress:
    """A progress bar on stderr: shown on a terminal (or with ``TXB_PROGRESS`` set)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err_console,
                    disable=not err_console.is_terminal and not os.environ.get("TXB_PROGRESS"))
