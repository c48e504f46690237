"""Fixtures every test directory shares: a broker process on a chosen store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_support import EtcdServer, etcd_binary
from tests.support import BrokerProcess, store_args
from tests.tm.pg import PostgresServer, pg_bindir


@pytest.fixture
def store() -> str:
    """The broker's store: the journal, unless a module overrides ``store`` or a test
    parametrizes it (the XA, stream, recover, TM and some Spark tests run on
    ``tests.support.STORES``: the journal and the dir store, issue 17)."""
    return "journal"


@pytest.fixture
def broker(tmp_path: Path, store: str) -> Iterator[BrokerProcess]:
    """A real broker process on ``store``, on a free loopback port, killed at the end."""
    proc = BrokerProcess(tmp_path / "data", *store_args(store)).start()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    """One etcd server per test session (tests/etcd_support.py), stopped by pid."""
    if etcd_binary() is None:  # a failure, not a skip: CI must not pass without these tests
        pytest.fail("etcd is not installed: `make etcd` installs Debian's etcd-server "
                    "(`make test` runs it)", pytrace=False)
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One PostgreSQL server per test session (max_prepared_transactions = 64), shared by
    the TM tests (tests/tm) and the router's bank example (tests/router)."""
    if pg_bindir() is None:  # a failure, not a skip: CI must not pass without these tests
        pytest.fail("PostgreSQL (initdb, pg_ctl) is not installed: `make postgres` installs "
                    "it (`make test` runs it)", pytrace=False)
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()
