"""A PostgreSQL participant model for the simulation: one table of rows, prepared
transactions that survive the model's crash, and a recovery scan.

Theory of operation
-------------------
:class:`PgDatabase` is the server, a simulated process on the
:class:`~txbroker.sim.loop.SimLoop`; :class:`PgConnection` is a client connection
with the face of a ``psycopg.AsyncConnection`` that the transaction manager's
participants use (``xid``, ``tpc_begin``, ``tpc_prepare``, ``tpc_commit``,
``tpc_rollback``, ``rollback``, ``tpc_recover``, ``info.dbname``, psycopg's
``_tpc``), plus :meth:`PgConnection.insert` for the application's one statement.

- **A request** leaves the client at once, reaches the server after a network delay
  and is carried out there in one step, in the server's process (so it still
  arrives when the client has died meanwhile, and never when the server has); its
  answer comes back after another delay.
- **Durability**, as PostgreSQL with ``synchronous_commit``: committed rows and
  prepared transactions (``PREPARE TRANSACTION``) are on disk when answered; the
  work of an open transaction is in memory only.
- **A crash** (:meth:`PgDatabase.crash`) loses the open transactions, keeps the rows
  and the prepared transactions, and breaks every connection: what is waiting for
  an answer fails with a connection error (``sqlstate`` None, as psycopg's
  ``OperationalError``), and so does every later call on it.
- **A client that dies**: the server notices (:meth:`PgDatabase.client_died`) and
  rolls back that client's open transactions; its prepared ones stay.
- **Keys.** Inserting a key that is committed fails (``23505``, unique violation); a
  key held by another open or prepared transaction fails at once (``55P03``, as
  under ``lock_timeout``) instead of waiting, so that a worker never waits on a
  branch only recovery can finish.

:attr:`PgDatabase.outcomes` keeps what became of each global transaction's branch
(``committed`` / ``rolled back``): the checkers compare it with the broker's side.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from txbroker.sim.memnet import PROCESS

__all__ = ["DATABASE", "PgConnection", "PgDatabase", "PgError", "PgXid"]

T = TypeVar("T")

#: The database's name (``info.dbname``; ``tpc_recover`` lists its branches only).
DATABASE = "app"
#: One-way delay between a client and the server (s, uniform).
DELAY_S = (0.0001, 0.002)


class PgError(Exception):
    """An error from the model, as psycopg raises: ``sqlstate`` is the server's code,
    None when the connection failed (psycopg's ``OperationalError``)."""

    def __init__(self, message: str, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


@dataclass(frozen=True, slots=True)
class PgXid:
    """psycopg's ``Xid``: format id, global id and branch qualifier (text), database."""

    format_id: int
    gtrid: str
    bqual: str
    database: str = DATABASE

    @property
    def gid(self) -> str:
        """The name PostgreSQL knows a prepared transaction by."""
        return f"{self.format_id}_{self.gtrid}_{self.bqual}"


@dataclass
class _Open:
    """An open (not prepared) transaction of one session."""

    xid: PgXid | None
    rows: dict[str, str] = field(default_factory=dict)


@dataclass
class _Info:
    dbname: str = DATABASE


class PgDatabase:
    """The server: rows and prepared transactions (durable), open transactions
    (memory); up or down (see the module docstring)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        #: committed rows: key -> value
        self.rows: dict[str, str] = {}
        #: prepared transactions: gid -> (xid, rows it inserts)
        self.prepared: dict[str, tuple[PgXid, dict[str, str]]] = {}
        #: open transactions by session number
        self.open: dict[int, _Open] = {}
        #: global id (the branch's gtrid text) -> "committed" or "rolled back" (what the
        #: checkers compare)
        self.outcomes: dict[str, str] = {}
        self.up = False
        #: the server process's context: requests are carried out in it
        self.context: contextvars.Context | None = None
        self.epoch = 0  #: one more at each crash: older connections are broken
        self._sessions = 0
        self._owners: dict[int, int] = {}  #: session -> client process
        #: futures waiting for an answer, per session (dicts: failed in a fixed order)
        self._waiting: dict[int, dict[asyncio.Future[Any], None]] = {}
        #: a planted bug (``pg-loses-prepared``): a crash loses prepared transactions
        self.lose_prepared = False

    async def serve(self) -> None:
        """The server process: up until killed (``SimLoop.kill`` + :meth:`crash`)."""
        self.context = contextvars.copy_context()
        self.up = True
        await self.loop.create_future()

    def crash(self) -> None:
        """The server died: open work is gone, every connection broken."""
        self.up = False
        self.context = None
        self.epoch += 1
        self.open.clear()
        if self.lose_prepared:
            self.prepared.clear()
        for waiting in self._waiting.values():
            for future in waiting:
                if not future.done():
                    future.set_exception(PgError("server closed the connection", None))
                    future.exception()  # its waiter may be dead: no "never retrieved"
        self._waiting.clear()

    def client_died(self, process: int) -> None:
        """A client process died: its sessions' open transactions roll back."""
        for session, owner in list(self._owners.items()):
            if owner == process:
                self.open.pop(session, None)
                del self._owners[session]

    async def connect(self) -> PgConnection:
        """A new connection from the running process (fails while the server is down)."""
        await asyncio.sleep(self.loop.random.uniform(*DELAY_S))
        if not self.up:
            raise PgError("connection refused", None)
        self._sessions += 1
        self._owners[self._sessions] = PROCESS.get()
        return PgConnection(self, self._sessions, self.epoch)

    # -- carrying requests -------------------------------------------------------------

    async def request(self, session: int, epoch: int, work: Callable[[], T]) -> T:
        """Carry ``work`` out at the server (see the module docstring)."""
        if epoch != self.epoch or not self.up or self.context is None:
            raise PgError("the connection is closed", None)
        future: asyncio.Future[T] = self.loop.create_future()
        self._waiting.setdefault(session, {})[future] = None
        if PROCESS.get() not in self.loop.dead:  # a dead client sends nothing
            self.loop.call_later(self.loop.random.uniform(*DELAY_S), self._arrive, session,
                                 work, future, context=self.context)
        try:
            return await future
        finally:
            self._waiting.get(session, {}).pop(future, None)

    def _arrive(self, session: int, work: Callable[[], T], future: asyncio.Future[T]) -> None:
        try:
            result: Any = work()
            error: PgError | None = None
        except PgError as exc:
            result, error = None, exc
        self.loop.call_later(self.loop.random.uniform(*DELAY_S), _answer, future, result,
                             error, context=self.context)

    # -- the server's work (each runs in one step) -------------------------------------

    def begin(self, session: int, xid: PgXid | None) -> None:
        """BEGIN (with the branch's Xid to prepare under)."""
        if session in self.open:
            raise PgError("a transaction is already in progress", "25001")
        self.open[session] = _Open(xid)

    def insert(self, session: int, key: str, value: str) -> None:
        """INSERT one row (see the module docstring for conflicts)."""
        tx = self.open.get(session)
        if tx is None:
            raise PgError("no transaction is in progress", "25P01")
        if key in self.rows:
            self.open.pop(session)  # an error aborts the transaction
            raise PgError(f"duplicate key {key}", "23505")
        held = any(key in other.rows for other in self.open.values() if other is not tx) \
            or any(key in rows for _, rows in self.prepared.values())
        if held:
            self.open.pop(session)  # an error aborts the transaction
            raise PgError(f"key {key} is locked", "55P03")
        tx.rows[key] = value

    def prepare(self, session: int) -> None:
        """PREPARE TRANSACTION: the open transaction becomes durable under its gid."""
        tx = self.open.pop(session, None)
        if tx is None or tx.xid is None:
            raise PgError("no transaction to prepare", "25P01")
        if tx.xid.gid in self.prepared:
            raise PgError(f"transaction identifier {tx.xid.gid} is already in use", "42710")
        self.prepared[tx.xid.gid] = (tx.xid, tx.rows)

    def commit_one_phase(self, session: int) -> None:
        """COMMIT of the open transaction."""
        tx = self.open.pop(session, None)
        if tx is None:
            raise PgError("no transaction is in progress", "25P01")
        self.rows.update(tx.rows)
        if tx.xid is not None:
            self.outcomes[tx.xid.gtrid] = "committed"

    def rollback(self, session: int) -> None:
        """ROLLBACK of the open transaction (nothing when there is none)."""
        tx = self.open.pop(session, None)
        if tx is not None and tx.xid is not None:
            self.outcomes.setdefault(tx.xid.gtrid, "rolled back")

    def finish_prepared(self, gid: str, commit: bool) -> None:
        """COMMIT PREPARED / ROLLBACK PREPARED."""
        found = self.prepared.pop(gid, None)
        if found is None:
            raise PgError(f"prepared transaction {gid} does not exist", "42704")
        if commit:
            self.rows.update(found[1])
        self.outcomes[found[0].gtrid] = "committed" if commit else "rolled back"

    def prepared_xids(self) -> list[PgXid]:
        """``pg_prepared_xacts``, in gid order."""
        return [xid for _, (xid, _) in sorted(self.prepared.items())]


def _answer(future: asyncio.Future[Any], result: Any, error: PgError | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class PgConnection:
    """A client connection with psycopg's two-phase-commit face (module docstring)."""

    def __init__(self, database: PgDatabase, session: int, epoch: int) -> None:
        self._db = database
        self._session = session
        self._epoch = epoch
        self.info = _Info()
        #: psycopg's TPC state: the branch's Xid while one is open or prepared, else None
        self._tpc: PgXid | None = None
        self._prepared = False

    async def _do(self, work: Callable[[], T]) -> T:
        return await self._db.request(self._session, self._epoch, work)

    @staticmethod
    def xid(format_id: int, gtrid: str, bqual: str) -> PgXid:
        """A branch Xid (psycopg's ``Connection.xid``)."""
        return PgXid(format_id, gtrid, bqual)

    async def tpc_begin(self, xid: PgXid) -> None:
        """Begin the branch ``xid``."""
        self._tpc, self._prepared = xid, False
        await self._do(lambda: self._db.begin(self._session, xid))

    async def insert(self, key: str, value: str) -> None:
        """``INSERT INTO rows VALUES (key, value)`` in the open transaction."""
        await self._do(lambda: self._db.insert(self._session, key, value))

    async def tpc_prepare(self) -> None:
        """``PREPARE TRANSACTION``."""
        await self._do(lambda: self._db.prepare(self._session))
        self._prepared = True

    async def tpc_commit(self, xid: PgXid | None = None) -> None:
        """``COMMIT PREPARED`` (prepared, or ``xid`` given) or a one-phase commit."""
        if xid is not None:
            await self._do(lambda: self._db.finish_prepared(xid.gid, True))
            return
        tpc, prepared = self._tpc, self._prepared
        self._tpc, self._prepared = None, False
        if prepared and tpc is not None:
            await self._do(lambda: self._db.finish_prepared(tpc.gid, True))
        else:
            await self._do(lambda: self._db.commit_one_phase(self._session))

    async def tpc_rollback(self, xid: PgXid | None = None) -> None:
        """``ROLLBACK PREPARED`` (prepared, or ``xid`` given) or a rollback."""
        if xid is not None:
            await self._do(lambda: self._db.finish_prepared(xid.gid, False))
            return
        tpc, prepared = self._tpc, self._prepared
        self._tpc, self._prepared = None, False
        if prepared and tpc is not None:
            await self._do(lambda: self._db.finish_prepared(tpc.gid, False))
        else:
            await self._do(lambda: self._db.rollback(self._session))

    async def rollback(self) -> None:
        """``ROLLBACK`` of whatever is open."""
        self._tpc, self._prepared = None, False
        await self._do(lambda: self._db.rollback(self._session))

    async def tpc_recover(self) -> list[PgXid]:
        """The prepared transactions (``pg_prepared_xacts``)."""
        return await self._do(self._db.prepared_xids)
