"""Shared-store HA settings: what is refused, with what words (docs/ha.md, "Settings")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from txbroker.server.config import ServerConfig, load_config, peer_address

GOOD = dict(ha="shared-store", ha_port=7001, ha_peer="127.0.0.1:7002")


def test_defaults_are_the_seeds() -> None:
    config = ServerConfig(**GOOD)  # type: ignore[arg-type]
    config.validate()
    assert (config.heartbeat_interval, config.activation_interval) == (3.0, 10.0)


@pytest.mark.parametrize("changes, text", [
    (dict(activation_interval=5.9, heartbeat_interval=3.0),
     "activation_interval (5.9 s) must be at least twice heartbeat_interval (3 s)"),
    (dict(heartbeat_interval=0.0), "heartbeat_interval must be positive"),
    (dict(ha_port=0), "--ha shared-store needs --ha-port"),
    (dict(ha_peer=""), "--ha shared-store needs --ha-peer HOST:PORT"),
    (dict(ha_peer="localhost"), "ha_peer must be HOST:PORT, not 'localhost'"),
    (dict(ha_peer="h:99999"), "ha_peer must be HOST:PORT"),
    (dict(ha_port=5445, port=5445), "ha_port 5445 is also a client port"),
    (dict(ha="replicated", ha_peers=""), "--ha replicated needs --ha-peers"),
    (dict(ha="replicated", ha_peers="a:1,b"), "ha_peer must be HOST:PORT, not 'b'"),
    (dict(ha="replicated", ha_peers="a:1", backup_timeout=0.0),
     "backup_timeout must be positive"),
    (dict(ha="raft"), "unknown ha mode 'raft'"),
    (dict(ha="replicated", ha_peers="a:1", ha_etcd="http://127.0.0.1:2379",
          ha_lease_ttl=0), "ha_lease_ttl must be 1 to 3600 seconds"),
])
def test_refused_settings(changes: dict[str, object], text: str) -> None:
    with pytest.raises(ValueError) as info:
        ServerConfig(**{**GOOD, **changes}).validate()  # type: ignore[arg-type]
    assert text in str(info.value)


def test_exactly_twice_is_allowed_and_the_file_keys_work(tmp_path: Path) -> None:
    path = tmp_path / "b.toml"
    path.write_text('[server]\nha = "shared-store"\nha_port = 7001\nha_peer = "[::1]:7002"\n'
                    "heartbeat_interval = 1\nactivation_interval = 2\n")
    config = load_config(path)
    assert (config.ha, config.ha_port, config.heartbeat_interval,
            config.activation_interval) == ("shared-store", 7001, 1, 2)
    assert peer_address(config.ha_peer) == ("::1", 7002)


def test_serve_refuses_a_bad_pair_config_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(tmp_path / "d"),
         "--ha", "shared-store", "--ha-port", "7001", "--ha-peer", "127.0.0.1:7002",
         "--heartbeat-interval", "3", "--activation-interval", "5"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result
    assert result.stderr == ("error: activation_interval (5 s) must be at least twice "
                             "heartbeat_interval (3 s): one late heartbeat must not make the "
                             "standby act\n")
    assert not (tmp_path / "d").exists()  # nothing was created


def test_a_one_second_lease_is_allowed() -> None:
    """etcd grants 1 s with an election timeout of 500 ms or less (docs/replication.md,
    "How long an etcd takeover takes"); the broker uses the TTL etcd grants."""
    config = ServerConfig(ha="replicated", ha_port=7001, ha_peers="127.0.0.1:7002",
                          ha_etcd="http://127.0.0.1:2379", ha_lease_ttl=1)
    config.validate()
    assert config.ha_lease_ttl == 1
