"""``txbroker router define|show|set-partition|retire-shadow|exceptions``: the
transaction router's facilities, partitions, servers, secondary sites and exception
transactions (docs/router.md).

Theory of operation
-------------------
Each command opens one client connection (:func:`txbroker.cli.common.connect`,
so a test can replace it) and sends the router's admin request with
``Connection.request``: ``rtr_define``, ``rtr_show``, ``rtr_set_partition``,
``rtr_retire_shadow``, ``rtr_exceptions``, ``rtr_exception_commit`` / ``rtr_exception_discard``. The
broker checks the admin right. ``--partition NAME:LOW-HIGH`` bounds are ints
when both parse as ints, else strings (``NAME:LOW..HIGH`` splits strings that
contain ``-``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from txbroker.cli import common  # common.connect is looked up at each call: tests replace it
from txbroker.cli.common import DEFAULT_URL, TlsCaOption, UrlOption, console

__all__ = ["exceptions_app", "parse_partition", "router_app"]

router_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="The transaction router: facilities, partitions, servers, "
                              "exception transactions (docs/router.md).")
exceptions_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                             help="Exception transactions (three strikes): list them, "
                                  "commit or discard one by hand.")
router_app.add_typer(exceptions_app, name="exceptions")

JsonOption = Annotated[bool, typer.Option("--json", help="print JSON")]
RetryOption = Annotated[int | None, typer.Option(
    "--retry-count", min=0, help="presentations lost before a vote that a transaction "
                                 "survives (three strikes: default 3)")]
VoteTimeoutOption = Annotated[int | None, typer.Option(
    "--vote-timeout", min=1, help="ms to wait for a vote before rejecting (TIMEOUT); "
                                  "default 30000")]
_INT_RANGE = re.compile(r"^(-?\d+)-(-?\d+)$")


def parse_partition(text: str) -> dict[str, Any]:
    """``NAME:LOW-HIGH`` (or ``NAME:LOW..HIGH``) as a partition dict; ValueError if bad."""
    name, sep, bounds = text.partition(":")
    if not sep or not name or not bounds:
        raise typer.BadParameter(f"{text!r}: expected NAME:LOW-HIGH")
    low: Any
    high: Any
    if ".." in bounds:
        low, _, high = bounds.partition("..")
    elif (match := _INT_RANGE.match(bounds)) is not None:
        low, high = match.group(1), match.group(2)
    else:
        low, _, high = bounds.partition("-")
    if low == "" or high == "":
        raise typer.BadParameter(f"{text!r}: expected NAME:LOW-HIGH")
    if re.fullmatch(r"-?\d+", low) and re.fullmatch(r"-?\d+", high):
        low, high = int(low), int(high)
    return {"name": name, "low": low, "high": high}


def _settings(retry_count: int | None, vote_timeout: int | None) -> dict[str, int]:
    settings: dict[str, int] = {}
    if retry_count is not None:
        settings["retry_count"] = retry_count
    if vote_timeout is not None:
        settings["vote_timeout_ms"] = vote_timeout
    return settings


def _partition_table(partitions: list[dict[str, Any]]) -> Table:
    table = Table("partition", "low", "high", "retry count", "vote timeout (ms)")
    for p in partitions:
        table.add_row(Text(str(p["name"])), Text(repr(p["low"])), Text(repr(p["high"])),
                      str(p.get("retry_count", "")), str(p.get("vote_timeout_ms", "")))
    return table


@router_app.command()
def define(
    facility: Annotated[str, typer.Argument(help="facility name (1-200 characters)")],
    partition: Annotated[list[str], typer.Option(
        "--partition", help="NAME:LOW-HIGH (repeat for each partition)")],
    retry_count: RetryOption = None,
    vote_timeout: VoteTimeoutOption = None,
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
) -> None:
    """Define a facility and its partitions (again with the same definition: no change)."""
    settings = _settings(retry_count, vote_timeout)
    partitions = [{**parse_partition(p), **settings} for p in partition]
    with common.connect(url, tls_ca) as conn:
        result = conn.request("rtr_define", {"facility": facility, "partitions": partitions})
    console.print(f"facility {facility}: {len(partitions)} partition(s) defined",
                  markup=False, highlight=False)
    console.print(_partition_table(result.get("partitions", partitions)
                                   if isinstance(result, dict) else partitions))


def _ask(op: str, facility: str | None, url: str, tls_ca: str | None) -> Any:
    """One read-only request, of one facility or all."""
    args = {} if facility is None else {"facility": facility}
    with common.connect(url, tls_ca) as conn:
        return conn.request(op, args)


@router_app.command()
def show(
    facility: Annotated[str | None, typer.Argument(help="only this facility")] = None,
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
    json_out: JsonOption = False,
) -> None:
    """Facilities: partitions (shadowed: a secondary site registered), their servers and
    roles, transactions by state."""
    result = _ask("rtr_show", facility, url, tls_ca)
    facilities: list[dict[str, Any]] = result.get("facilities", []) if isinstance(
        result, dict) else []
    if json_out:
        print(json.dumps(result, indent=2, sort_keys=True, default=repr))
        return
    if not facilities:
        console.print("no facility defined", markup=False)
        return
    for fac in facilities:
        counts = fac.get("transactions") or {}
        states = ", ".join(f"{state} {n}" for state, n in counts.items()) or "none"
        console.print(f"facility {fac['name']} ({fac.get('key_type')} keys): "
                      f"{fac.get('clients', 0)} client(s), transactions: {states}, "
                      f"exceptions: {fac.get('exceptions', 0)}", markup=False, highlight=False)
        table = Table("partition", "low", "high", "retry", "vote timeout (ms)", "shadowed",
                      "server", "role", "site", "busy", "prepare")
        for p in fac.get("partitions", []):
            servers = p.get("servers") or [{}]
            for i, s in enumerate(servers):
                first = i == 0
                table.add_row(
                    Text(str(p["name"])) if first else "", Text(repr(p["low"])) if first else "",
                    Text(repr(p["high"])) if first else "",
                    str(p.get("retry_count", "")) if first else "",
                    str(p.get("vote_timeout_ms", "")) if first else "",
                    ("yes" if p.get("shadowed") else "no") if first else "",
                    str(s.get("controller", "-")) if s else "-",
                    str(s.get("role", "")), str(s.get("site", "")),
                    Text(str(s.get("busy_tid") or "")) if s else "",
                    ("explicit" if s.get("explicit_prepare") else "implicit") if s else "")
        console.print(table)


FacilityArgument = Annotated[str, typer.Argument(help="facility name")]
PartitionArgument = Annotated[str, typer.Argument(help="partition name")]


@router_app.command("set-partition")
def set_partition(
    facility: FacilityArgument,
    partition: PartitionArgument,
    retry_count: RetryOption = None,
    vote_timeout: VoteTimeoutOption = None,
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
) -> None:
    """Change a partition's retry count or vote timeout."""
    settings = _settings(retry_count, vote_timeout)
    if not settings:
        raise typer.BadParameter("give --retry-count and/or --vote-timeout")
    with common.connect(url, tls_ca) as conn:
        result = conn.request("rtr_set_partition",
                              {"facility": facility, "partition": partition, **settings})
    console.print(_partition_table([result if isinstance(result, dict) else
                                    {"name": partition, "low": None, "high": None, **settings}]))


@router_app.command("retire-shadow")
def retire_shadow(
    facility: FacilityArgument,
    partition: PartitionArgument,
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
) -> None:
    """Retire a partition's secondary site: its transactions stop waiting for it.

    Unregister the site's shadow servers first (refused while one is registered). Its
    decided transactions that only waited for it are forgotten; a shadow server that
    registers later makes the partition shadowed again, from then on."""
    with common.connect(url, tls_ca) as conn:
        result = conn.request("rtr_retire_shadow", {"facility": facility,
                                                    "partition": partition})
    released = result.get("released", 0) if isinstance(result, dict) else 0
    print(f"{facility}/{partition}: secondary site retired ({released} transaction(s) no "
          "longer wait for it)")


@exceptions_app.command("list")
def exceptions_list(
    facility: Annotated[str | None, typer.Argument(help="only this facility")] = None,
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
    json_out: JsonOption = False,
) -> None:
    """Exception transactions: tid, facility, partitions, strikes, reason, messages."""
    found = _ask("rtr_exceptions", facility, url, tls_ca)
    found = found if isinstance(found, list) else []
    if json_out:
        print(json.dumps(found, indent=2, sort_keys=True, default=repr))
        return
    table = Table("tid", "facility", "partitions", "strikes", "reason", "messages")
    for e in found:
        table.add_row(Text(str(e["tid"])), Text(str(e.get("facility", ""))),
                      Text(",".join(str(p) for p in e.get("partitions", []))),
                      str(e.get("strikes", "")), Text(str(e.get("reason", ""))),
                      str(e.get("messages", "")))
    console.print(table)


TidArgument = Annotated[str, typer.Argument(help="the exception transaction's tid")]


@exceptions_app.command("commit")
def exceptions_commit(tid: TidArgument, url: UrlOption = DEFAULT_URL,
                      tls_ca: TlsCaOption = None) -> None:
    """Commit an exception transaction by hand (its servers get it as accepted)."""
    with common.connect(url, tls_ca) as conn:
        conn.request("rtr_exception_commit", {"tid": tid})
    print(f"{tid}: committed")


@exceptions_app.command("discard")
def exceptions_discard(tid: TidArgument, url: UrlOption = DEFAULT_URL,
                       tls_ca: TlsCaOption = None) -> None:
    """Discard an exception transaction (it stays rejected)."""
    with common.connect(url, tls_ca) as conn:
        conn.request("rtr_exception_discard", {"tid": tid})
    print(f"{tid}: discarded")
