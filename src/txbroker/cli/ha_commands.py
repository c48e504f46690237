"""``txbroker ha status``: the role of each broker of an HA pair.

Theory of operation
-------------------
A standby serves no clients, so this command does not use the client (which
would move past a standby): it asks every address of the ``--url`` failover
list itself, over one short native-protocol connection each — ``hello`` with
``probe: true`` (which a standby accepts, docs/ha.md), then ``stats`` — and
prints the ``ha`` part of each answer: role, peer, last heartbeat, lock
holder. An address that does not answer is printed as such; the command
fails (exit 1) only when no address answered.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from typing import Annotated, Any

import typer

from txbroker.cli.common import DEFAULT_URL, TlsCaOption, UrlOption, describe, fail
from txbroker.client.transport import tls_client_context
from txbroker.client.url import HostPort, parse_url
from txbroker.core.ha.replicated_role import NodeRole
from txbroker.core.ha.shared_store_role import StoreRole
from txbroker.errors import TxBrokerError, error_for_code
from txbroker.protocol.native import PROTOCOL_VERSION, Err, NativeConnection, Ok, Request, Role

__all__ = ["ha_app", "probe"]

#: Seconds to connect to one address and to wait for each answer.
PROBE_TIMEOUT = 5.0

ha_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                     help="HA pairs: the role of each broker (docs/ha.md).")


def probe(host: HostPort, user: str | None, password: str | None,
          timeout: float = PROBE_TIMEOUT, tls: ssl.SSLContext | None = None,
          op: str = "stats", args: dict[str, Any] | None = None) -> dict[str, Any]:
    """``stats()`` of one broker, active or standby (a standby answers its ``ha`` part
    only); ``tls``: over TLS (a ``txbs://`` URL). ``op``: another probe op
    (``ha_promote``)."""
    codec = NativeConnection(Role.CLIENT)
    with socket.create_connection((host.host, host.port), timeout=timeout) as raw:
        raw.settimeout(timeout)
        sock = raw if tls is None else tls.wrap_socket(raw, server_hostname=host.host)

        def call(rid: int, op: str, args: dict[str, Any]) -> Any:
            sock.sendall(codec.send(Request(rid, op, args)))
            while True:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError(f"{host} closed the connection")
                codec.receive_data(data)
                for event in codec.drain():
                    if isinstance(event, Ok) and event.rid == rid:
                        return event.result
                    if isinstance(event, Err) and event.rid in (rid, 0):
                        raise error_for_code(event.code, event.message)

        hello: dict[str, Any] = {"version": PROTOCOL_VERSION, "probe": True}
        if user is not None:
            hello["user"] = user
        if password is not None:
            hello["password"] = password
        call(1, "hello", hello)
        result = call(2, op, args or {})
    return result if isinstance(result, dict) else {}


def _age(seconds: Any) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s ago"


@ha_app.command()
def status(
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Role, peer, last heartbeat and lock holder of every broker of the URL's list."""
    parsed = parse_url(url)
    tls = tls_client_context(tls_ca) if parsed.tls else None
    report: dict[str, Any] = {}
    for host in parsed.hosts:
        try:
            stats = probe(host, parsed.user, parsed.password, tls=tls)
        except (OSError, TxBrokerError) as exc:
            report[str(host)] = {"error": describe(exc)}
            continue
        report[str(host)] = stats.get("ha") or {"role": "single",
                                                 "note": "not a member of an HA pair"}
    if json_out:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for address, ha in report.items():
            print(_line(address, ha))
    if all("error" in ha for ha in report.values()):
        raise fail("no broker of the list answered")


@ha_app.command()
def promote(
    url: UrlOption = DEFAULT_URL,
    tls_ca: TlsCaOption = None,
    force: Annotated[bool, typer.Option(
        "--force", help="promote even when the peers that answer do not allow it (a group "
        "of three or more without etcd: fewer than a majority answered, or the newest "
        "ready set they hold does not name this backup): it may lose acknowledged "
        "entries")] = False,
) -> None:
    """Make the backup at --url (its first address) the primary of its replicated
    group: what a cluster manager (Pacemaker) calls once the old primary is fenced.
    In a group of three or more without etcd the backup first asks its peers
    (docs/replication.md, "Who may be promoted")."""
    parsed = parse_url(url)
    tls = tls_client_context(tls_ca) if parsed.tls else None
    host = parsed.hosts[0]
    try:
        result = probe(host, parsed.user, parsed.password, tls=tls, op="ha_promote",
                       args={"force": True} if force else None)
    except (OSError, TxBrokerError) as exc:
        raise fail(f"{host}: {describe(exc)}") from exc
    term = f" (term {result['term']})" if "term" in result else ""
    forced = " by force" if result.get("forced") else ""
    promised = f", promised by {', '.join(result['promised'])}" if result.get("promised") \
        else ""
    print(f"{host}: promoting {result.get('node', host)} to primary{term}{forced}{promised}")


def _line(address: str, ha: dict[str, Any]) -> str:
    if "error" in ha:
        return f"{address}  unreachable: {ha['error']}"
    if ha.get("role") == "single":
        return f"{address}  single broker (not a member of an HA pair)"
    if ha.get("mode") == "replicated":
        return _replicated_line(address, ha)
    since = time.strftime("%H:%M:%S", time.localtime(ha.get("since", 0)))
    other = (f"standby {ha.get('standby') or 'none'}" if ha.get("role") == StoreRole.ACTIVE.value
             else f"following {ha.get('following') or 'nobody'}")
    return (f"{address}  {ha.get('role')} since {since}  HA {ha.get('node')}  "
            f"peer {ha.get('peer')}  {other}  last heartbeat "
            f"{_age(ha.get('last_heartbeat_age'))}\n    lock {ha.get('lock_file')}: "
            f"{ha.get('lock_holder') or 'not held'}" + _link_line(ha))


def _link_line(ha: dict[str, Any]) -> str:
    """The HA link's security and refusals (docs/ha.md, "Securing the HA links")."""
    link = ha.get("link")
    if not isinstance(link, dict):
        return ""
    auth = " + ".join((["secret"] if link.get("auth") != "none" else [])
                      + (["TLS"] if link.get("tls") else [])) or "unauthenticated"
    refused = f", {link.get('refused', 0)} refused"
    if link.get("last_refusal"):
        refused += f" (last: {link['last_refusal']})"
    return f"\n    link: {auth}{refused}"


def _replicated_line(address: str, ha: dict[str, Any]) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(ha.get("since", 0)))
    head = f"{address}  {ha.get('role')} since {since}  HA {ha.get('node')}"
    lines = [head]
    replication = ha.get("replication")
    if replication:
        lines.append(f"    LSN {replication.get('lsn')} ({replication.get('bytes', 0)} bytes), "
                     f"{replication.get('in_flight')} in flight")
        catchup = replication.get("catchup")
        if catchup:
            lines.append(f"    catch-up buffer {catchup['held_bytes']} of "
                         f"{catchup['buffer_bytes']} bytes ({catchup['held_entries']} "
                         f"entries); joins: {catchup['dumps']} dumps, {catchup['suffixes']} "
                         f"suffixes ({catchup['suffix_entries']} entries, "
                         f"{catchup['suffix_bytes']} bytes)")
        for backup in replication.get("backups", []):
            lines.append(f"    backup {backup['node']} {backup['state']}  acked "
                         f"{backup['acked']}  lag {backup['lag_entries']} entries, "
                         f"{backup.get('lag_bytes', 0)} bytes ({backup['queued_bytes']} "
                         "queued on its link)"
                         + (f"  ({backup['reason']})" if backup.get("reason") else ""))
    following = ha.get("following")
    if following:
        lines.append(f"    following {following.get('primary') or '-'} at "
                     f"{following.get('primary_address')}: {following.get('state')}, "
                     f"{'ready' if following.get('ready') else 'not ready'}, durable LSN "
                     f"{following.get('durable_lsn')}")
    if "promotable" in ha and ha.get("role") == NodeRole.BACKUP.value:
        lines.append(f"    promotable: {'yes' if ha['promotable'] else 'no'}")
    if ha.get("etcd"):
        lines.append(f"    etcd: {ha['etcd']}")
    if ha.get("problem"):
        lines.append(f"    last problem: {ha['problem']}")
    return "\n".join(lines) + _link_line(ha)
