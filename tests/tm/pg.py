"""A private PostgreSQL server for tests: initdb in a temp dir as the postgres user.

``PostgresServer.start()`` runs ``initdb`` and ``pg_ctl start`` (both refuse to run as
root, so they run as the ``postgres`` system user when we are root) on a free port
with ``max_prepared_transactions=64``; ``stop()`` stops it and removes the directory.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support import free_port

#: Two-phase commit needs prepared transactions (PostgreSQL's default is 0).
MAX_PREPARED_TRANSACTIONS = 64


def pg_bindir() -> Path | None:
    """Where initdb and pg_ctl live (Debian: /usr/lib/postgresql/<version>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    """One throw-away PostgreSQL cluster on 127.0.0.1."""

    def __init__(self) -> None:
        bindir = pg_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (make test installs it)")
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="txb-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_root = os.geteuid() == 0

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self.root.chmod(0o700)
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres",
                      "--no-sync")
        self.pg_ctl_start()
        return self

    def pg_ctl_start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   f"-c max_prepared_transactions={MAX_PREPARED_TRANSACTIONS} "
                   f"-c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l",
                  str(self.root / "log"), "-w", "start")

    def kill(self) -> None:
        """Stop at once (crash-like: no checkpoint)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
