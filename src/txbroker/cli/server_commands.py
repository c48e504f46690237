"""``txbroker serve``: run a broker in this process.

Theory of operation
-------------------
:func:`serve` merges the config file (``--config``) with the options given
(an option given wins), starts :func:`txbroker.server.app.run` and prints one
``txbroker ready on …`` line once the broker listens (and, with ``--repair``,
what recovery dropped). A config file's problems and a port that cannot be
opened end the command with one error line, exit code 1; once the broker has
started, errors are the server's own.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from txbroker.cli.common import describe, fail


class LogLevel(StrEnum):
    """``serve --log-level`` values."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


def serve(
    data: Annotated[Path | None, typer.Option(help="data directory")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    port: Annotated[int | None, typer.Option(help="native port (0 = off)")] = None,
    stomp_port: Annotated[int | None, typer.Option(
        help="STOMP port (0 = off; default 61613)")] = None,
    amqp_port: Annotated[int | None, typer.Option(
        help="AMQP 0-9-1 port for pika, aio-pika, kombu (0 = off; default 5672; "
             "docs/amqp.md)")] = None,
    amqps_port: Annotated[int | None, typer.Option(
        help="AMQP 0-9-1 over TLS, amqps:// (0 = off, the default; 5671 is the usual port)")
    ] = None,
    http_port: Annotated[int | None, typer.Option(help=(
        "HTTP port: REST API, /api/openapi.json, /metrics (docs/http.md); "
        "default 0 = off, 8161 is the usual port"))] = None,
    tls_port: Annotated[int | None, typer.Option(
        help="native protocol over TLS, txbs:// (0 = off, the default; docs/tls.md)")] = None,
    stomp_tls_port: Annotated[int | None, typer.Option(
        help="STOMP over TLS (0 = off, the default)")] = None,
    https_port: Annotated[int | None, typer.Option(
        help="HTTPS: the HTTP port's API, /metrics and console over TLS (0 = off)")] = None,
    tls_cert: Annotated[str | None, typer.Option(
        help="TLS certificate chain, PEM (leaf first)")] = None,
    tls_key: Annotated[str | None, typer.Option(
        help="the TLS certificate's private key, PEM, unencrypted")] = None,
    tls_ca: Annotated[str | None, typer.Option(
        help="CA file: TLS clients must present a certificate it signed (mutual TLS)")
    ] = None,
    sync: Annotated[str | None, typer.Option(help="none | fdatasync | fsync")] = None,
    store: Annotated[str | None, typer.Option(help="journal | dir")] = None,
    dir_flags: Annotated[str | None, typer.Option(
        help="dir store sync flags: FSYNC or FDATASYNC, plus DSYNC (default: none)")] = None,
    segment_size: Annotated[int | None, typer.Option(help="journal segment bytes")] = None,
    body_cache_bytes: Annotated[int | None, typer.Option(
        help="bytes of recent bodies the store keeps in memory (default 32 MiB; 0 = none)")
    ] = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="skip corrupt journal regions (reports what is dropped)")] = False,
    ha: Annotated[str | None, typer.Option(
        help="HA mode: shared-store (two brokers, one data directory) or replicated "
             "(a primary and backups, each on its own disk); docs/ha.md")] = None,
    ha_port: Annotated[int | None, typer.Option(help="this broker's HA link port")] = None,
    ha_peer: Annotated[str | None, typer.Option(
        help="the other broker's HA address HOST:PORT")] = None,
    heartbeat_interval: Annotated[float | None, typer.Option(
        help="seconds between the active's heartbeats (default 3)")] = None,
    activation_interval: Annotated[float | None, typer.Option(
        help="heartbeat silence (s) before the standby acts (default 10, >= 2x heartbeat)")
    ] = None,
    ha_peers: Annotated[str | None, typer.Option(
        help="--ha replicated: the other brokers' HA addresses H:P,H:P")] = None,
    ha_node: Annotated[str | None, typer.Option(
        help="--ha replicated: this broker's name (default HOST:HA_PORT)")] = None,
    backup_timeout: Annotated[float | None, typer.Option(
        help="--ha replicated: seconds a ready backup may leave an entry unacknowledged "
             "before it leaves the ready set (default 5)")] = None,
    ha_etcd: Annotated[str | None, typer.Option(
        help="--ha replicated: etcd endpoints for automatic promotion")] = None,
    ha_cluster: Annotated[str | None, typer.Option(
        help="--ha replicated with etcd: the group's name (default 'default')")] = None,
    ha_lease_ttl: Annotated[int | None, typer.Option(
        help="--ha replicated with etcd: the primary key's lease, seconds (default 10)")
    ] = None,
    ha_catchup_bytes: Annotated[int | None, typer.Option(
        help="--ha replicated: bytes of the newest entries the primary keeps so that a "
             "backup that lost its link resumes without a full copy (default 64 MiB; 0 = "
             "none)")] = None,
    ha_secret: Annotated[str | None, typer.Option(
        help="the HA links' shared secret, proved by each peer (HMAC; at least 16 "
             "characters); prefer --ha-secret-file: a command line is visible to all users")
    ] = None,
    ha_secret_file: Annotated[str | None, typer.Option(
        help="a file holding the HA links' shared secret ([ha] secret_file)")] = None,
    ha_tls: Annotated[bool, typer.Option(
        "--ha-tls", help="the HA links over TLS with --tls-cert/--tls-key; peers verified "
                         "against --ha-tls-ca or --tls-ca")] = False,
    ha_tls_ca: Annotated[str | None, typer.Option(
        help="the CA that verifies HA peers' certificates (default: --tls-ca)")] = None,
    replica_fault: Annotated[str | None, typer.Option(
        hidden=True, help="tests only: arm a named fault point of a replicated backup "
                          "(server/ha/faults.py), e.g. vote_fail:11")] = None,
    log_level: Annotated[LogLevel, typer.Option(case_sensitive=False)] = LogLevel.INFO,
) -> None:
    """Run a broker until SIGTERM / Ctrl-C."""
    from txbroker.server.app import run

    logging.basicConfig(level=log_level.value,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, Any] = dict(
        data=data, host=host, port=port, stomp_port=stomp_port, amqp_port=amqp_port,
        amqps_port=amqps_port, http_port=http_port,
        tls_port=tls_port, stomp_tls_port=stomp_tls_port, https_port=https_port,
        tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
        sync=sync, store=store, dir_flags=dir_flags, segment_size=segment_size,
        body_cache_bytes=body_cache_bytes, repair=repair or None, ha=ha, ha_port=ha_port,
        ha_peer=ha_peer,
        heartbeat_interval=heartbeat_interval, activation_interval=activation_interval,
        ha_peers=ha_peers, ha_node=ha_node, backup_timeout=backup_timeout, ha_etcd=ha_etcd,
        ha_cluster=ha_cluster, ha_lease_ttl=ha_lease_ttl, ha_secret=ha_secret,
        ha_catchup_bytes=ha_catchup_bytes,
        ha_secret_file=ha_secret_file, ha_tls=ha_tls or None, ha_tls_ca=ha_tls_ca)
    cfg = _load_config(config, **overrides)
    started = False

    def ready(server: Any) -> None:
        nonlocal started
        started = True
        stomp = f", STOMP {server.stomp_port}" if server.stomp_port else ""
        stomp += f", AMQP {server.amqp_port}" if server.amqp_port else ""
        stomp += f", HTTP {server.http_port}" if server.http_port else ""
        if server.tls_port:
            stomp += f", TLS {server.tls_port}"
        if server.stomp_tls_port:
            stomp += f", STOMP TLS {server.stomp_tls_port}"
        if server.https_port:
            stomp += f", HTTPS {server.https_port}"
        if server.amqps_port:
            stomp += f", AMQPS {server.amqps_port}"
        print(f"txbroker ready on {cfg.host}:{server.port}{stomp} (data {cfg.data}, "
              f"sync {cfg.sync}); "
              f"recovered {server.recovered_messages} messages in "
              f"{server.recovery_seconds:.2f} s"
              + (f" [HA {cfg.ha}]" if server.ha_status is not None else ""), flush=True)
        if cfg.repair and getattr(server.store, "repair_report", None):
            for line in server.store.repair_report:
                print(f"repair: {line}", flush=True)

    try:
        if cfg.ha == "replicated":
            _run_replicated(cfg, ready, replica_fault)
        elif cfg.ha:
            _run_ha(cfg, lambda: _load_config(config, **overrides), ready)
        else:
            run(cfg, ready)
    except OSError as exc:  # a port in use, an address that is not ours …
        if started or exc.filename is not None or isinstance(exc, TimeoutError):
            raise
        raise fail(f"cannot start the broker: {describe(exc)}") from exc


def _run_ha(cfg: Any, reload: Callable[[], Any], ready: Callable[[Any], None]) -> None:
    """Run one broker of an HA pair: a line when it is standby, the usual ready line
    once it is active (after a takeover too)."""
    from txbroker.server.app import run
    from txbroker.server.ha.shared_store import HaRole, PeerRefused, SharedStoreNode

    def on_role(role: Any, server: Any) -> None:
        if role == HaRole.STANDBY:
            print(f"txbroker standby on HA {node.node} (peer {cfg.ha_peer}); lock held by "
                  f"{node.status()['lock_holder'] or 'unknown'}", flush=True)
        elif role == HaRole.ACTIVE and server is not None:
            ready(server)

    node = SharedStoreNode(cfg, reload, on_role)
    try:
        run(cfg, main=node.run)
    except PeerRefused as exc:
        raise fail(f"the HA peer refused this broker: {exc}") from exc


def _run_replicated(cfg: Any, ready: Callable[[Any], None], fault: str | None = None) -> None:
    """Run one broker of a replicated group: a line when it is a backup, the usual
    ready line once it is the primary. ``fault``: a named fault point to arm (tests)."""
    from txbroker.server.app import run
    from txbroker.server.ha.faults import FAULTS
    from txbroker.server.ha.replicated import ReplicatedNode, Role

    if fault:
        try:
            FAULTS.arm(fault)
        except ValueError as exc:
            raise fail(str(exc)) from exc

    def on_role(role: Any, server: Any) -> None:
        if role == Role.BACKUP:
            print(f"txbroker backup on HA {node.node} (peers {cfg.ha_peers})", flush=True)
        elif role == Role.PRIMARY and server is not None:
            ready(server)

    node = ReplicatedNode(cfg, on_role)
    run(cfg, main=node.run)


def _load_config(path: Path | None, **overrides: Any) -> Any:
    """The server config; a config file's problems are reported with its name."""
    from txbroker.server.config import load_config

    try:
        return load_config(path, **overrides)
    except tomllib.TOMLDecodeError as exc:
        raise fail(f"{path}: {exc}") from exc
    except (TypeError, AttributeError) as exc:  # e.g. port = "abc": config.py checks no types
        if path is None:
            raise
        raise fail(f"{path}: a value has the wrong type ({exc})") from exc
