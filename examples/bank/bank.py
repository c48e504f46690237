"""What the bank example's server, client, checker, tests and benchmark share.

The facility ``BANK`` has two partitions keyed by account number: ``A`` owns
accounts 0-999 and lives in the PostgreSQL database ``bank_a``, ``B`` owns
1000-1999 in ``bank_b``. A transfer is one router transaction of two messages,
one per leg, each keyed by its account: a debit (negative amount) and a credit.
Every account starts with :data:`INITIAL_BALANCE`, so the money in both
databases together is always ``2000 * INITIAL_BALANCE``.

The router client library (``txbroker.router``) is used only through
:func:`open_client`, :func:`open_server` and :func:`admin`, so that the example
shows in one place which calls it makes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

#: The facility's name.
FACILITY = "BANK"
#: Partition name -> (low key, high key), inclusive (the issue's example).
PARTITIONS: dict[str, tuple[int, int]] = {"A": (0, 999), "B": (1000, 1999)}
#: Partition name -> its database on the PostgreSQL server.
DATABASES: dict[str, str] = {"A": "bank_a", "B": "bank_b"}
#: What each account holds at the start: small, so that some debits are refused.
INITIAL_BALANCE = 100
#: The reason a server gives when a debit would overdraw the account.
INSUFFICIENT = "INSUFFICIENT"
SCHEMA = (Path(__file__).parent / "schema.sql").read_text()


def partition_of(account: int) -> str:
    """The partition that owns ``account``."""
    for name, (low, high) in PARTITIONS.items():
        if low <= account <= high:
            return name
    raise ValueError(f"account {account} is in no partition")


def database_dsn(base_dsn: str, partition: str) -> str:
    """The DSN of ``partition``'s database on the server ``base_dsn`` points at."""
    return make_conninfo(base_dsn, dbname=DATABASES[partition])


def setup_databases(base_dsn: str, initial: int = INITIAL_BALANCE) -> None:
    """Create ``bank_a`` and ``bank_b`` if missing and reset them: every account of the
    partition at ``initial``, the TID table empty."""
    with psycopg.connect(base_dsn, autocommit=True) as pg:
        have = {row[0] for row in pg.execute("SELECT datname FROM pg_database")}
        for db in DATABASES.values():
            if db not in have:
                pg.execute(f'CREATE DATABASE "{db}"')
    for partition, (low, high) in PARTITIONS.items():
        with psycopg.connect(database_dsn(base_dsn, partition)) as pg:
            pg.execute(SCHEMA)
            pg.execute("TRUNCATE accounts, applied")
            pg.execute("INSERT INTO accounts (id, balance) "
                       "SELECT g, %s FROM generate_series(%s::int, %s::int) AS g",
                       (initial, low, high))
            pg.commit()


@dataclass(frozen=True)
class Leg:
    """One message of a transfer: ``amount`` (negative: a debit) on ``account``."""

    transfer: int
    account: int
    amount: int

    def encode(self) -> bytes:
        return json.dumps({"t": self.transfer, "a": self.account, "m": self.amount}).encode()

    @classmethod
    def decode(cls, body: bytes) -> Leg:
        data = json.loads(body)
        return cls(int(data["t"]), int(data["a"]), int(data["m"]))


# ----------------------------------------------------------------- the router library


def open_client(url: str, facility: str = FACILITY) -> Any:
    """A client transaction controller registered on ``facility``."""
    from txbroker.router import TransactionController

    controller = TransactionController(url)
    controller.register_facility(facility)
    return controller


def open_server(url: str, partition: str, *, role: str = "primary",
                explicit_prepare: bool = False, facility: str = FACILITY) -> Any:
    """A server transaction controller registered for ``partition``'s key range."""
    from txbroker.router import Role, ServerTransactionController

    controller = ServerTransactionController(url)
    controller.register_partition(facility, PARTITIONS[partition], Role(role),
                                  explicit_prepare=explicit_prepare)
    return controller


def admin(url: str, op: str, **args: Any) -> Any:
    """One administrative request (``rtr_define``, ``rtr_outcome``, ``rtr_show`` …) on
    a fresh connection."""
    import txbroker

    with txbroker.connect(url, timeout=30) as conn:
        return conn.request(op, args)


def define_facility(url: str, *, partitions: dict[str, tuple[int, int]] | None = None,
                    retry_count: int | None = None) -> Any:
    """Define the ``BANK`` facility (idempotent)."""
    parts = []
    for name, (low, high) in (partitions or PARTITIONS).items():
        part: dict[str, Any] = {"name": name, "low": low, "high": high}
        if retry_count is not None:
            part["retry_count"] = retry_count
        parts.append(part)
    return admin(url, "rtr_define", facility=FACILITY, partitions=parts)


def dbname_of(dsn: str) -> str:
    """The database a DSN names."""
    return str(conninfo_to_dict(dsn).get("dbname", ""))
