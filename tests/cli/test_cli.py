"""The ``txbroker`` command against a real broker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, BrokerProcess


def txb(
    *args: str, input: bytes | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "txbroker.cli", *args], cwd=ROOT, env=env,
                          input=None if input is None else input.decode(), text=True,
                          capture_output=True, check=check, timeout=120)


@pytest.fixture
def broker(tmp_path: Path):  # type: ignore[no-untyped-def]
    proc = BrokerProcess(tmp_path / "data").start()
    yield proc
    proc.kill()


def test_send_recv_queues_stat(broker: BrokerProcess) -> None:
    url = ["--url", broker.url]
    out = txb("send", "orders", "first order", *url).stdout
    assert "sent 1 message(s) to orders" in out
    txb("send", "orders", *url, "--count", "500", "--size", "64")
    txb("send", "orders", *url, "--count", "30", "--tx", "10", "--size", "8")
    table = txb("queues", *url).stdout
    assert "orders" in table and "531" in table
    listed = json.loads(txb("queues", *url, "--json").stdout)
    assert [(q["name"], q["depth"]) for q in listed] == [("orders", 531)]
    got = txb("recv", "orders", *url).stdout
    assert "first order" in got
    txb("recv", "orders", *url, "--count", "10", "--quiet")
    stats = json.loads(txb("stat", *url).stdout)
    assert stats["messages"] == 520 and stats["store"]["syncs"] > 0


def test_send_reads_stdin_and_env_url(broker: BrokerProcess) -> None:
    env_url = broker.url
    os.environ["TXBROKER_URL"] = env_url
    try:
        txb("send", "piped", input=b"from stdin")
        assert "from stdin" in txb("recv", "piped").stdout
    finally:
        del os.environ["TXBROKER_URL"]


def test_recv_times_out_with_exit_code(broker: BrokerProcess) -> None:
    result = txb("recv", "empty", "--url", broker.url, "--timeout", "0.2", check=False)
    assert result.returncode == 2
    assert "received 0 of 1" in result.stderr


def test_bench_prints_json_summary(broker: BrokerProcess, tmp_path: Path) -> None:
    out_file = tmp_path / "bench.json"
    out = txb("bench", "--url", broker.url, "--count", "2000", "--producers", "2",
              "--consumers", "2", "--json", str(out_file)).stdout
    summary = json.loads(out)
    assert json.loads(out_file.read_text()) == summary
    assert summary["consume"]["received"] == 2000
    assert summary["send"]["msgs_per_sync"] > 1  # group commit at work


def test_unreachable_broker_is_a_clear_error() -> None:
    from tests.support import free_port

    result = txb("queues", "--url", f"txb://127.0.0.1:{free_port()}", check=False)
    assert result.returncode == 1
    assert "error:" in result.stderr


def test_passwd_prints_a_verifiable_hash() -> None:
    from txbroker.server.auth import verify_password

    result = subprocess.run([sys.executable, "-m", "txbroker.cli", "passwd", "--password",
                             "pw"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert verify_password("pw", result.stdout.strip())
    assert not verify_password("other", result.stdout.strip())


def test_serve_rejects_bad_options(tmp_path: Path) -> None:
    result = txb("serve", "--data", str(tmp_path / "d"), "--sync", "sometimes", check=False)
    assert result.returncode == 1 and "sync must be one of" in result.stderr
