"""The ``txbroker`` command: serve, send, recv, queues, stat, bench, passwd, audit,
``xa list|commit|rollback|forget``, ``ha status``, ``router define|show|set-partition|
exceptions``.

Every client command takes ``--url`` (default ``$TXBROKER_URL`` or
``txb://127.0.0.1:5445``; ``txbs://…`` over TLS) and ``--tls-ca`` (default
``$TXBROKER_TLS_CA``: the CA file for a ``txbs://`` URL; docs/tls.md).

Errors are translated here, at the command's boundary, and never shown as a
traceback: each is one line ``error: …`` on stderr and a non-zero exit code —

* 0: done;
* 1: an error (a :class:`~txbroker.errors.TxBrokerError`, a bad URL or config file,
  no broker answering, a timeout, a file that cannot be read …);
* 2: bad usage (an unknown option, a value out of range);
* 3: an incomplete result: ``recv`` or ``bench`` got fewer messages than asked
  (what did arrive is printed first).

``TXBROKER_DEBUG=1`` lets exceptions through with their traceback.

Theory of operation
-------------------
This package's ``__init__`` holds the typer :data:`app`, the table of its
commands (in the order ``--help`` lists them) and :func:`main`, which runs the
command line and translates every exception into the error line and exit
code above. The commands live by group: ``serve`` in
:mod:`~txbroker.cli.server_commands`; ``send``, ``recv``, ``queues``,
``stat``, ``bench`` in :mod:`~txbroker.cli.client_commands`; ``passwd``,
``audit`` and the ``xa`` group in :mod:`~txbroker.cli.admin_commands`; the ``ha``
group in :mod:`~txbroker.cli.ha_commands`; the ``router`` group in
:mod:`~txbroker.cli.router_commands`. What
they share (exit codes, consoles, ``--url``, the connection, the error line,
the progress bar) is :mod:`~txbroker.cli.common`. ``python -m txbroker.cli``
runs :mod:`txbroker.cli.__main__`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import typer

from txbroker.cli import (
    admin_commands,
    client_commands,
    ha_commands,
    router_commands,
    server_commands,
)
from txbroker.cli.common import EXIT_ERROR, EXIT_OK, EXIT_USAGE, describe, say_error
from txbroker.errors import TxBrokerError

__all__ = ["app", "main"]

# rich_markup_mode=None: help texts are plain text, so "[users]" or "txb://[user…]" are
# shown as written instead of being eaten as rich markup tags.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_enable=False,
                  help="txbroker: a durable, transactional message broker. Exit codes: 0 "
                       "done, 1 error, 2 bad usage, 3 fewer messages than asked (recv, "
                       "bench).")
#: The commands, in the order ``txbroker --help`` lists them (each named after its function).
_COMMANDS = (
    server_commands.serve,
    client_commands.send,
    client_commands.recv,
    client_commands.queues,
    client_commands.connections,
    client_commands.stat,
    client_commands.bench,
    admin_commands.passwd,
    admin_commands.audit,
)
for _command in _COMMANDS:
    app.command()(_command)
app.add_typer(admin_commands.xa_app, name="xa")
app.add_typer(ha_commands.ha_app, name="ha")
app.add_typer(router_commands.router_app, name="router")

#: click's exception base (typer vendors click; older typer versions depend on it): found
#: through a public typer exception instead of importing a private module.
_ClickError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _usage_error(exc: Exception) -> int:
    """One line for a click usage error, pointing at the command's --help."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as before
        print(exc.ctx.get_help())  # type: ignore[attr-defined]
        return EXIT_USAGE
    message = getattr(exc, "format_message", lambda: str(exc))()
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    say_error(f"{message}{hint}")
    return int(getattr(exc, "exit_code", EXIT_USAGE))


def _invoke(argv: Sequence[str] | None) -> int:
    """Run the command line; translate every exception into one line and an exit code."""
    debug = bool(os.environ.get("TXBROKER_DEBUG"))
    try:
        result = app(args=None if argv is None else list(argv), prog_name="txbroker",
                     standalone_mode=False)
    except _ClickError as exc:  # bad usage: an unknown option, a value out of range …
        return _usage_error(exc)
    except typer.Abort:  # Ctrl-D at a prompt
        say_error("aborted")
        return EXIT_ERROR
    except (TxBrokerError, ValueError, OSError) as exc:  # bad URL or argument, no broker …
        if debug:
            raise
        say_error(describe(exc))
        return EXIT_ERROR
    except Exception as exc:  # a bug: still one line, the traceback on demand
        if debug:
            raise
        say_error(f"internal error: {type(exc).__name__}: {exc} "
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
