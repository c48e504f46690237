"""Server settings: command-line options over a TOML config file over defaults.

Config file (all keys optional)::

    [server]
    host = "127.0.0.1"
    port = 5445                 # 0 disables the native listener
    stomp_port = 61613          # 0 disables the STOMP listener
    amqp_port = 5672            # AMQP 0-9-1 (docs/amqp.md); 0 disables it
    http_port = 8161            # REST API and /metrics (docs/http.md); default 0 = off
    data = "./txbroker-data"
    sync = "fdatasync"          # none | fdatasync | fsync
    store = "journal"
    segment_size = 67108864
    body_cache_bytes = 33554432  # recent bodies kept in memory; 0 = none
    compact_live_fraction = 0.5  # relocate old live data when copying it writes less
                                 # than this share of what it frees (docs/storage.md)
    compact_min_segments = 4     # ... and the journal has at least this many segments
    compact_idle_live_fraction = 0.8  # the fraction while nothing else is written
    recovery_index = false       # restarts read an index per sealed segment, not bodies
    recovery_checkpoint = false  # a clean shutdown writes its state; the next start
                                 # reads it instead of the log (not with shared-store
                                 # HA; docs/storage.md, docs/replication.md)
    checkpoint_interval = 60.0   # ... and while running, every so many seconds (0 = never)
    max_frame_size = 8388608
    max_connections = 1024

    tls_cert = "/etc/txbroker/broker.pem"   # certificate chain, PEM (leaf first)
    tls_key = "/etc/txbroker/broker.key"    # its private key, PEM, unencrypted
    tls_ca = ""                 # "" = no client certificates; a CA file = mutual TLS
    tls_port = 5443             # native protocol over TLS (txbs://); 0 = off
    stomp_tls_port = 61614      # STOMP over TLS; 0 = off   (docs/tls.md)
    https_port = 8443           # the HTTP routes over TLS; 0 = off
    amqps_port = 5671           # AMQP 0-9-1 over TLS (amqps://); 0 = off

    ha = "shared-store"         # "" (off) | shared-store  (docs/ha.md)
    ha_port = 5446              # the HA link: heartbeats between the pair
    ha_peer = "10.0.0.2:5446"   # the other broker's HA port
    heartbeat_interval = 3.0    # seconds between the active's heartbeats
    activation_interval = 10.0  # heartbeat silence before the standby acts (>= 2x)
    ha_catchup_bytes = 67108864 # replicated: newest entries kept for backups that resume

    [ha]                        # the HA links' security (both modes; docs/ha.md)
    secret_file = "/etc/txbroker/ha.secret"  # or secret = "…": peers prove it (HMAC)
    tls = true                  # the HA links over TLS with tls_cert / tls_key
    tls_ca = "/etc/txbroker/ha-ca.pem"  # verifies the peers ("" = the server's tls_ca)

    [limits]                    # core limits (core/limits.py)
    max_message_size = 4194304
    max_unacked_per_consumer = 10000

    [users]                     # empty = open broker, loopback only
    alice = "scrypt$16384$8$1$…"   # from `txbroker passwd`

    [acl]                       # absent: every user may do everything (server/security/acl.py)
    groups = { ops = ["alice"] }
    [[acl.rules]]               # present: only what a rule grants (docs/security.md)
    group = "ops"               # or user = "alice"
    pattern = "#"               # words split by ".", * = one word, # = any number
    permissions = ["send", "consume", "browse", "admin"]

    [server] audit_log = "audit.jsonl" also writes the audit events to that file.

    [router.facilities.BANK]    # the transaction router's facilities (docs/router.md)
    partitions = [{name = "A", low = 0, high = 999},
                  {name = "B", low = 1000, high = 1999, retry_count = 3}]
"""

from __future__ import annotations

import ssl
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from txbroker.core.limits import Limits
from txbroker.core.router.model import parse_facility
from txbroker.errors import BadRequest
from txbroker.server.security.acl import AclConfig, parse_acl
from txbroker.server.security.tls import check_files, peer_context
from txbroker.storage.interface import SyncMode
from txbroker.storage.journal_format import (  # the journal's own defaults
    DEFAULT_BODY_CACHE_BYTES,
    DEFAULT_SEGMENT_SIZE,
)
from txbroker.storage.journal_space import (  # the journal's own defaults
    RELOCATE_BELOW_LIVE_FRACTION,
    RELOCATE_IDLE_LIVE_FRACTION,
    RELOCATE_MIN_SEGMENTS,
    CompactionSettings,
)

#: The native protocol's port (Artemis' core protocol default).
DEFAULT_PORT = 5445
DEFAULT_STOMP_PORT = 61613
#: The AMQP 0-9-1 port (IANA ``amqp``; RabbitMQ's default).
DEFAULT_AMQP_PORT = 5672
DEFAULT_HTTP_PORT = 8161
#: Frames above 8 MiB are refused: twice the default max message size.
DEFAULT_MAX_FRAME_SIZE = 8 * 1024 * 1024
#: Connections one broker accepts (a default file-descriptor limit is 1024).
DEFAULT_MAX_CONNECTIONS = 1000
#: Requests a connection may have waiting for durability before we stop reading it.
DEFAULT_MAX_PENDING_REQUESTS = 10_000
#: How often the store is asked to drop dead segments / compact (seconds).
DEFAULT_MAINTAIN_INTERVAL = 1.0
#: Seconds between the running broker's recovery checkpoints (``recovery_checkpoint``).
DEFAULT_CHECKPOINT_INTERVAL = 60.0
#: Shared-store HA (seed 004): the active's heartbeat period, and the heartbeat
#: silence after which the standby acts (at least twice the heartbeat), seconds.
DEFAULT_HEARTBEAT_INTERVAL = 3.0
DEFAULT_ACTIVATION_INTERVAL = 10.0
#: The HA modes ``--ha`` accepts ("" = a single broker).
HA_MODES = ("", "shared-store", "replicated")
#: A ready backup silent this long on an entry (s) leaves the ready set (docs/ha.md).
DEFAULT_BACKUP_TIMEOUT = 5.0
#: The replication catch-up buffer's default bound (``ha_catchup_bytes``, bytes): the
#: newest entries' frames a primary keeps so that a backup that lost its link resumes
#: without a dump. 64 MiB holds about 60,000 sends of 1 KiB: 4-5 s of the peak of
#: bench/ha_replicated.py with one backup (13.7k msg/s), far longer at a usual load.
DEFAULT_HA_CATCHUP_BYTES = 64 * 1024 * 1024
#: The shortest HA secret accepted (characters): 128 bits as hex, as
#: ``openssl rand -hex 16`` writes; a shorter one is open to guessing offline from a
#: recorded handshake (docs/ha.md).
MIN_HA_SECRET_LENGTH = 16
#: The ``[ha]`` table's keys and the settings they set.
HA_TABLE_KEYS = {"secret": "ha_secret", "secret_file": "ha_secret_file", "tls": "ha_tls",
                 "tls_ca": "ha_tls_ca"}
#: The listeners' port settings: each non-zero one must differ from the others.
CLIENT_PORTS = ("port", "stomp_port", "tls_port", "stomp_tls_port", "http_port", "https_port",
                "amqp_port", "amqps_port")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``txbroker serve`` needs."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    stomp_port: int = DEFAULT_STOMP_PORT
    #: the AMQP 0-9-1 listener (docs/amqp.md); 0 = off
    amqp_port: int = DEFAULT_AMQP_PORT
    #: the HTTP listener (REST API, /metrics: docs/http.md); 0, the default, is off:
    #: ``make run`` passes DEFAULT_HTTP_PORT
    http_port: int = 0
    #: TLS listeners (docs/tls.md): the native protocol (``txbs://``) and STOMP, each
    #: on its own port beside the plaintext ones; 0 = off.
    tls_port: int = 0
    stomp_tls_port: int = 0
    #: HTTPS: the HTTP listener's routes (API, /metrics, console) over TLS; 0 = off.
    https_port: int = 0
    #: AMQP 0-9-1 over TLS (``amqps://``, docs/amqp.md; RabbitMQ uses 5671); 0 = off.
    amqps_port: int = 0
    #: The listeners' certificate chain and private key (PEM files); "" = none.
    tls_cert: str = ""
    tls_key: str = ""
    #: A CA file: clients must present a certificate it signed (mutual TLS); "" = off.
    tls_ca: str = ""
    data: Path = Path("./txbroker-data")
    sync: str = SyncMode.FDATASYNC
    store: str = "journal"
    #: Enduro/X NDRX_XA_FLAGS for the dir store ("FSYNC"/"FDATASYNC", "DSYNC"); "" = the
    #: seed's default, flush to the OS only (docs/dirstore.md says what that risks).
    dir_flags: str = ""
    segment_size: int = DEFAULT_SEGMENT_SIZE
    #: bound of the store's body cache (bytes; 0 = every delivery reads from disk)
    body_cache_bytes: int = DEFAULT_BODY_CACHE_BYTES
    #: journal compaction (docs/storage.md): relocate the oldest segments' live
    #: messages when that writes less than this fraction of what it frees (0 = never)
    compact_live_fraction: float = RELOCATE_BELOW_LIVE_FRACTION
    #: ... and only when the journal has at least this many segments
    compact_min_segments: int = RELOCATE_MIN_SEGMENTS
    #: ... the fraction used while nothing but compaction writes (0 = the same)
    compact_idle_live_fraction: float = RELOCATE_IDLE_LIVE_FRACTION
    #: the journal writes a recovery index per sealed segment and a restart reads it
    #: instead of the segment (its bodies' CRCs are then not checked at start, so
    #: corruption in a stored body no longer stops the start; docs/storage.md)
    recovery_index: bool = False
    #: a clean shutdown of a broker without HA writes a checkpoint of its state and the
    #: next start reads it instead of replaying the log (off by default, as the recovery
    #: index: the log's CRCs are then not checked at start; docs/storage.md); a
    #: replicated backup checkpoints its copy (docs/replication.md); not shared-store HA
    recovery_checkpoint: bool = False
    #: with ``recovery_checkpoint``, the running broker writes one every so many seconds
    #: when its log grew, so that a start after a crash replays only the log after it
    #: (0: at a clean shutdown only; docs/storage.md)
    checkpoint_interval: float = DEFAULT_CHECKPOINT_INTERVAL
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS
    maintain_interval: float = DEFAULT_MAINTAIN_INTERVAL
    repair: bool = False
    #: HA mode: "" (none) or "shared-store" (docs/ha.md)
    ha: str = ""
    ha_port: int = 0
    #: the other broker's HA address, "HOST:PORT"
    ha_peer: str = ""
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    activation_interval: float = DEFAULT_ACTIVATION_INTERVAL
    #: --ha replicated: the other brokers' HA addresses, "H:P,H:P" (docs/ha.md)
    ha_peers: str = ""
    #: --ha replicated: this broker's name in the group ("" = HOST:HA_PORT)
    ha_node: str = ""
    #: --ha replicated: a ready backup that leaves an entry unacknowledged this long
    #: (s) leaves the ready set, so that the primary is not held up by it
    backup_timeout: float = DEFAULT_BACKUP_TIMEOUT
    #: --ha replicated: etcd endpoints ("http://H:P[,…]") for automatic promotion
    ha_etcd: str = ""
    #: --ha replicated with etcd: the group's name (its keys: /txbroker/<name>/…)
    ha_cluster: str = "default"
    #: --ha replicated with etcd: the primary key's lease (s); the primary fences itself
    #: a third of it before the lease can expire (server/ha/etcd_lease.py)
    ha_lease_ttl: int = 10
    #: --ha replicated: bytes of the newest entries the primary keeps so that a backup
    #: that lost its link resumes from its copy (0 = none: every join gets a dump)
    ha_catchup_bytes: int = DEFAULT_HA_CATCHUP_BYTES
    #: the HA links' shared secret (``[ha] secret``; "" = none: unauthenticated links,
    #: a warning at start); never printed
    ha_secret: str = field(default="", repr=False)
    #: a file holding the secret (``[ha] secret_file``; its surrounding whitespace is
    #: ignored); read at start
    ha_secret_file: str = ""
    #: the HA links over TLS with tls_cert / tls_key, each side verifying the other
    ha_tls: bool = False
    #: the CA that verifies HA peers ("" = tls_ca)
    ha_tls_ca: str = ""
    limits: Limits = field(default_factory=Limits)
    users: dict[str, str] = field(default_factory=dict)
    #: the ``[acl]`` table (None: no table, every user may do everything)
    acl: AclConfig | None = None
    #: a file that gets every audit event as a JSON line ("" = the logger only)
    audit_log: str = ""
    #: the ``[router.facilities.NAME]`` tables: facility -> its partitions (docs/router.md)
    router_facilities: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ValueError on settings that cannot work."""
        if self.sync not in SyncMode.ALL:
            raise ValueError(f"sync must be one of {', '.join(SyncMode.ALL)}, not {self.sync!r}")
        if self.store not in ("journal", "dir"):
            raise ValueError(f"unknown store {self.store!r} (available: journal, dir)")
        if self.store == "dir":
            from txbroker.storage.dirstore_format import parse_flags

            parse_flags(self.dir_flags)
        for name in CLIENT_PORTS:
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be 0..65535")
        taken: dict[int, str] = {}
        for name in CLIENT_PORTS:
            value = getattr(self, name)
            if value and value in taken:
                raise ValueError(f"{name} and {taken[value]} are both {value}: each listener "
                                 "needs its own port")
            taken[value] = name
        if self.body_cache_bytes < 0:
            raise ValueError("body_cache_bytes must be >= 0 (0 = no body cache)")
        self.compaction()  # raises ValueError on bad compaction settings
        if self.max_frame_size < 1024:
            raise ValueError("max_frame_size must be at least 1024")
        if not self.checkpoint_interval >= 0:
            raise ValueError("checkpoint_interval must be >= 0 seconds (0 = only at a clean "
                             "shutdown)")
        self._validate_tls()
        self._validate_ha()

    def compaction(self) -> CompactionSettings:
        """The journal's compaction settings (``compact_*``)."""
        return CompactionSettings(self.compact_live_fraction, self.compact_min_segments,
                                  self.compact_idle_live_fraction)

    def _validate_tls(self) -> None:
        """A TLS port needs a certificate and its key, and the files must load."""
        wanted = [name for name in ("tls_port", "stomp_tls_port", "https_port", "amqps_port")
                  if getattr(self, name)]
        if (self.tls_key or self.tls_ca) and not self.tls_cert:
            raise ValueError("tls_key / tls_ca given without tls_cert (the certificate chain)")
        if self.tls_cert and not self.tls_key:
            raise ValueError("tls_cert given without tls_key (its private key)")
        if not self.tls_cert:
            if wanted:
                raise ValueError(f"{wanted[0]} {getattr(self, wanted[0])} needs tls_cert and "
                                 "tls_key (the certificate chain and its private key)")
            return
        self.server_ssl_context()

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The context of every TLS listener (``server/security/tls.py``), None without
        ``tls_cert``; ValueError, one line, on files that cannot serve."""
        if not self.tls_cert:
            return None
        return check_files(Path(self.tls_cert), Path(self.tls_key),
                           Path(self.tls_ca) if self.tls_ca else None)

    def _validate_ha(self) -> None:
        if self.ha not in HA_MODES:
            raise ValueError(f"unknown ha mode {self.ha!r}; available: shared-store, "
                             "replicated")
        if not self.ha:
            return
        if self.ha == "replicated":
            self._validate_replicated()
            return
        if not 1 <= self.ha_port <= 65535:
            raise ValueError("--ha shared-store needs --ha-port (1..65535): the HA link's port")
        peer_address(self.ha_peer)
        if not self.heartbeat_interval > 0:
            raise ValueError("heartbeat_interval must be positive")
        if self.activation_interval < 2 * self.heartbeat_interval:
            raise ValueError(
                f"activation_interval ({self.activation_interval:g} s) must be at least twice "
                f"heartbeat_interval ({self.heartbeat_interval:g} s): one late heartbeat must "
                "not make the standby act")
        if self.ha_port in [getattr(self, name) for name in CLIENT_PORTS]:
            raise ValueError(f"ha_port {self.ha_port} is also a client port")
        self._validate_ha_security()

    def _validate_ha_security(self) -> None:
        """The secret must be readable and long enough; TLS needs the broker's
        certificate and a CA to verify the peers."""
        self.ha_secret_bytes()
        self.ha_ssl_contexts()

    def ha_secret_bytes(self) -> bytes | None:
        """The HA links' secret (None: none configured); ValueError, one line, when it
        is unusable."""
        if self.ha_secret and self.ha_secret_file:
            raise ValueError("give the HA secret once: [ha] secret or secret_file, not both")
        if self.ha_secret_file:
            try:
                text = Path(self.ha_secret_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"ha secret_file {self.ha_secret_file}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
            where = f"the HA secret in {self.ha_secret_file}"
        elif self.ha_secret:
            text, where = self.ha_secret, "the HA secret"
        else:
            return None
        if len(text) < MIN_HA_SECRET_LENGTH:
            raise ValueError(f"{where} has {len(text)} characters; at least "
                             f"{MIN_HA_SECRET_LENGTH} are needed (openssl rand -hex 32)")
        return text.encode()

    def ha_ssl_contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
        """The HA links' TLS contexts, (listener, connector), None without ``ha_tls``;
        ValueError, one line, when they cannot be made."""
        if not self.ha_tls:
            return None
        if not (self.tls_cert and self.tls_key):
            raise ValueError("[ha] tls needs tls_cert and tls_key (the broker's certificate "
                             "and key serve the HA links too)")
        ca = self.ha_tls_ca or self.tls_ca
        if not ca:
            raise ValueError("[ha] tls needs a CA to verify the peers: [ha] tls_ca, or the "
                             "server's tls_ca")
        listener = check_files(Path(self.tls_cert), Path(self.tls_key), Path(ca))
        return listener, peer_context(Path(self.tls_cert), Path(self.tls_key), Path(ca))

    def _validate_replicated(self) -> None:
        if not 1 <= self.ha_port <= 65535:
            raise ValueError("--ha replicated needs --ha-port (1..65535): the HA link's port")
        peers = [p.strip() for p in self.ha_peers.split(",") if p.strip()]
        if not peers:
            raise ValueError("--ha replicated needs --ha-peers H:P[,H:P…]: the other "
                             "brokers' HA addresses")
        for peer in peers:
            peer_address(peer)
        if not self.backup_timeout > 0:
            raise ValueError("backup_timeout must be positive")
        if self.ha_catchup_bytes < 0:
            raise ValueError("ha_catchup_bytes must be >= 0 (0 = every join gets a dump)")
        if self.ha_etcd and not 1 <= self.ha_lease_ttl <= 3600:
            raise ValueError("ha_lease_ttl must be 1 to 3600 seconds (etcd grants no less "
                             "than 1.5 of its election timeouts, 2 s by default; the broker "
                             "uses the TTL etcd grants)")
        if self.ha_port in [getattr(self, name) for name in CLIENT_PORTS]:
            raise ValueError(f"ha_port {self.ha_port} is also a client port")
        self._validate_ha_security()


def peer_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` → (host, port); ValueError naming the problem."""
    host, sep, port = text.rpartition(":")
    if not text:
        raise ValueError("--ha shared-store needs --ha-peer HOST:PORT (the other broker's "
                         "HA port)")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"ha_peer must be HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


def parse_router(table: Any, path: Path | None) -> dict[str, list[dict[str, Any]]]:
    """The ``[router]`` table: ``[router.facilities.NAME]`` with ``partitions = [{name,
    low, high, retry_count?, vote_timeout_ms?}…]`` (every check of ``rtr_define``)."""
    if not isinstance(table, dict) or set(table) - {"facilities"}:
        raise ValueError(f"[router] in {path} takes only [router.facilities.NAME] tables")
    facilities: dict[str, list[dict[str, Any]]] = {}
    for name, facility in table.get("facilities", {}).items():
        if not isinstance(facility, dict) or set(facility) != {"partitions"}:
            raise ValueError(f"[router.facilities.{name}] in {path} takes one key, partitions")
        try:
            parse_facility(name, facility["partitions"])
        except BadRequest as exc:
            raise ValueError(f"[router.facilities.{name}] in {path}: {exc.message}") from None
        facilities[name] = facility["partitions"]
    return facilities


def parse_ha_table(table: Any, path: Path | None) -> dict[str, Any]:
    """The ``[ha]`` table (the HA links' security) as settings: ``secret``,
    ``secret_file``, ``tls``, ``tls_ca``."""
    if not isinstance(table, dict):
        raise ValueError(f"[ha] in {path} must be a table")
    unknown = set(table) - set(HA_TABLE_KEYS)
    if unknown:
        raise ValueError(f"unknown [ha] keys in {path}: {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(HA_TABLE_KEYS)})")
    if "tls" in table and not isinstance(table["tls"], bool):
        raise ValueError(f"[ha] tls in {path} must be true or false")
    return {HA_TABLE_KEYS[key]: value for key, value in table.items()}


def load_config(path: Path | None, **overrides: Any) -> ServerConfig:
    """Read the TOML file (if any) and apply command-line overrides (None = unset)."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    server = dict(data.get("server", {}))
    unknown = set(server) - {f.name for f in fields(ServerConfig)}
    if unknown:
        raise ValueError(f"unknown [server] keys in {path}: {', '.join(sorted(unknown))}")
    limits_data = dict(data.get("limits", {}))
    limit_names = {f.name for f in fields(Limits)}
    if set(limits_data) - limit_names:
        raise ValueError(f"unknown [limits] keys in {path}: "
                         f"{', '.join(sorted(set(limits_data) - limit_names))}")
    users = data.get("users", {})
    if not all(isinstance(v, str) for v in users.values()):
        raise ValueError("[users] values must be password hashes (txbroker passwd)")
    if "data" in server:
        server["data"] = Path(server["data"])
    server.update(parse_ha_table(data.get("ha", {}), path))
    acl = parse_acl(data["acl"], users) if "acl" in data else None
    config = ServerConfig(**server, limits=Limits(**limits_data), users=dict(users), acl=acl,
                          router_facilities=parse_router(data.get("router", {}), path))
    clean = {k: v for k, v in overrides.items() if v is not None}
    if "data" in clean:
        clean["data"] = Path(clean["data"])
    config = replace(config, **clean)
    config.validate()
    return config
