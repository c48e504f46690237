"""Recovery for asyncio applications: :func:`recover_async` and its resources.

Theory of operation
-------------------
The same recovery as :func:`txbroker.tm.recovery.recover` — the decision log's open
COMMIT decisions, every resource's prepared branches of our format id, commit what
was decided, roll back the rest (presumed abort), forget what is complete; the rule
per branch is :data:`~txbroker.tm.recovery.RESOLUTIONS`, and the bookkeeping is the
same :class:`~txbroker.tm.recovery.Tally` — over resources whose calls are awaited:
:class:`AsyncBrokerResource` (an :class:`~txbroker.client.aio.AsyncConnection`) and
:class:`AsyncPostgresResource` (an autocommit ``psycopg.AsyncConnection``).

Run it when no global transaction of this log is in flight (at start-up, before new
transactions): a branch prepared by a transaction that has not decided yet has no
decision, and would be rolled back under it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from txbroker.tm.log import DecisionLog
from txbroker.tm.participants import TM_FORMAT_ID, _pg_xid
from txbroker.tm.recovery import RecoveryReport, Tally
from txbroker.xid import Xid

__all__ = ["AsyncBrokerResource", "AsyncPostgresResource", "AsyncResource",
           "recover_async"]


class AsyncResource(Protocol):
    """A resource manager as recovery sees it, with awaited calls."""

    @property
    def name(self) -> str:
        """The resource's name (the bqual of its branches)."""

    async def recover(self) -> list[Xid]:
        """Xids of this resource's prepared branches of our format id."""

    async def resolve(self, xid: Xid, commit: bool) -> None:
        """Commit or roll back one in-doubt branch found by :meth:`recover`."""


async def recover_async(decisions: DecisionLog, resources: Sequence[AsyncResource],
                        in_flight: Collection[bytes] = ()) -> RecoveryReport:
    """Resolve every in-doubt branch of ``resources`` from the decision log, except
    those of the global ids ``in_flight`` (``tm/recovery.py``: transactions in flight;
    :meth:`AsyncTransactionManager.recover` passes its own)."""
    tally = Tally(decisions, in_flight)
    for resource in resources:
        try:
            found = await resource.recover()
        except Exception as exc:
            tally.recover_failed(resource.name, exc)
            continue
        for xid in found:
            commit = tally.commit_of(resource.name, xid)
            if commit is None:
                continue
            error: Exception | None = None
            try:
                await resource.resolve(xid, commit)
            except Exception as exc:
                error = exc
            tally.resolved(resource.name, xid, commit, error)
    return tally.finish(decisions)


class AsyncBrokerResource:
    """Recovery's view of a broker: a txbroker :class:`~txbroker.client.aio.AsyncConnection`."""

    def __init__(self, connection: Any, name: str = "txbroker") -> None:
        self.connection = connection
        self._name = name

    @property
    def name(self) -> str:
        """The resource's name (the bqual of its branches)."""
        return self._name

    async def recover(self) -> list[Xid]:
        """Xids of this resource's prepared branches of our format id."""
        found: list[Xid] = await self.connection.xa_resource().recover()
        return [x for x in found if x.format_id == TM_FORMAT_ID]

    async def resolve(self, xid: Xid, commit: bool) -> None:
        """Commit or roll back one in-doubt branch found by :meth:`recover`."""
        xa = self.connection.xa_resource()
        if commit:
            await xa.commit(xid, False)
        else:
            await xa.rollback(xid)


class AsyncPostgresResource:
    """Recovery's view of PostgreSQL: an **autocommit** ``psycopg.AsyncConnection``
    (PostgreSQL runs COMMIT PREPARED only outside a transaction block)."""

    def __init__(self, connection: Any, name: str = "postgres") -> None:
        self.connection = connection
        self._name = name
        self._database = connection.info.dbname

    @property
    def name(self) -> str:
        """The resource's name (the bqual of its branches)."""
        return self._name

    async def recover(self) -> list[Xid]:
        """Xids of this resource's prepared branches of our format id (of this
        database: ``tpc_recover`` lists every database's)."""
        return [Xid(pg.format_id, pg.gtrid, pg.bqual)
                for pg in await self.connection.tpc_recover()
                if pg.format_id == TM_FORMAT_ID and pg.database == self._database]

    async def resolve(self, xid: Xid, commit: bool) -> None:
        """Commit or roll back one in-doubt branch found by :meth:`recover`."""
        pg = _pg_xid(self.connection, xid)
        if commit:
            await self.connection.tpc_commit(pg)
        else:
            await self.connection.tpc_rollback(pg)
