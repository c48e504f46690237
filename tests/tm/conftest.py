from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support import STORES, BrokerProcess, store_args
from tests.tm.pg import PostgresServer


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """The broker's store: the journal, and the dir store with FDATASYNC,DSYNC (issue 17)."""
    return str(request.param)


@pytest.fixture
def broker(tmp_path: Path, store: str) -> Iterator[BrokerProcess]:
    """A broker process on ``store``; a broken XA session's branch is rolled back after
    0.3 s."""
    config = tmp_path / "broker.toml"
    config.write_text("[limits]\nxa_reattach_ms = 300\n")
    proc = BrokerProcess(tmp_path / "data", "--config", str(config), *store_args(store)).start()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def orders(postgres: PostgresServer) -> Iterator[str]:
    """The DSN, with an empty ``orders`` table and no prepared transactions left over."""
    with psycopg.connect(postgres.dsn, autocommit=True) as pg:
        for (gid,) in pg.execute("SELECT gid FROM pg_prepared_xacts").fetchall():
            pg.execute(f"ROLLBACK PREPARED '{gid}'")
        pg.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, body bytea)")
        pg.execute("TRUNCATE orders")
    yield postgres.dsn
