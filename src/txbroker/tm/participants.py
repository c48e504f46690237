"""Participants and resources of the transaction manager, and their adapters.

The contract follows ``IDataManager`` of zopefoundation/transaction:

* :meth:`Participant.begin` opens the participant's branch; the application
  then does its work on the participant's connection;
* :meth:`Participant.vote` is phase one (prepare). It may say *no* by
  raising; it returns True when the participant did no work (read-only: it
  needs no phase two);
* :meth:`Participant.finish` is phase two (commit or roll back a prepared
  branch). It must not fail: an error is logged and it returns False — the
  branch stays in doubt (the decision is kept) and recovery completes it;
* :meth:`Participant.commit_one_phase` commits alone when the participant is
  the only one (one-phase optimisation);
* :meth:`Participant.abort` cleans up a participant that did not vote yes;
* participants are ordered by :attr:`Participant.sort_key`.

A :class:`Resource` is what recovery talks to: a connection that lists the
prepared branches of one resource manager and commits or rolls them back.

Adapters: :class:`BrokerParticipant` / :class:`BrokerResource` for txbroker
connections (their XAResource), :class:`PostgresParticipant` /
:class:`PostgresResource` for psycopg 3 connections (DB-API TPC). psycopg is
not imported here: any object with psycopg's TPC methods works.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol

from txbroker.errors import XAER_NOTA, XAError
from txbroker.xid import Xid

log = logging.getLogger("txbroker.tm")


def finish_failed(name: str, xid: Xid, commit: bool, exc: Exception) -> bool:
    """What a participant's failed commit or rollback of a prepared branch means: True
    when the branch is already complete (``XAER_NOTA``, e.g. finished by recovery),
    else False, logged: recovery will finish it. Shared by the sync and async TMs."""
    if isinstance(exc, XAError) and exc.errcode == XAER_NOTA:
        return True
    log.warning("%s: %s of %s failed, recovery will finish it: %s", name,
                "commit" if commit else "rollback", xid, exc)
    return False


#: The format id of every branch this transaction manager creates ("TXBM").
TM_FORMAT_ID = 0x5458424D


def branch_xid(gtrid: bytes, bqual: str) -> Xid:
    """The Xid of one participant's branch: our format id, the global id (as hex text,
    so that psycopg's str gtrid and the broker's bytes agree) and the participant name."""
    return Xid(TM_FORMAT_ID, gtrid.hex(), bqual)


class Participant(Protocol):
    """One resource's branch of a global transaction (see the module docstring)."""

    @property
    def sort_key(self) -> str:
        """Participants are voted and finished in this order (stable across runs)."""

    def begin(self, xid: Xid) -> None:
        """Start this resource's branch ``xid``: work done from now on belongs to it."""

    def vote(self, xid: Xid) -> bool:
        """Prepare the branch: True to commit; False or raising is a "no" (the TM aborts)."""

    def commit_one_phase(self, xid: Xid) -> None:
        """The only participant: commit without a prepare (may raise: rolled back)."""

    def finish(self, xid: Xid, commit: bool) -> bool:
        """Commit or roll back the prepared branch; must not fail for good: True when
        done, False to leave it to recovery."""

    def abort(self, xid: Xid) -> None:
        """Roll back a branch that did not vote yes (cleanup: must not raise)."""


class Resource(Protocol):
    """A resource manager as recovery sees it."""

    @property
    def name(self) -> str:
        """The resource's name (the bqual of its branches)."""

    def recover(self) -> list[Xid]:
        """Xids of this resource's prepared branches of our format id."""

    def resolve(self, xid: Xid, commit: bool) -> None:
        """Commit or roll back one in-doubt branch found by :meth:`recover`."""


# ---------------------------------------------------------------------- txbroker
class BrokerParticipant:
    """A sync txbroker connection's branch: sends and acks on ``connection`` between
    :meth:`begin` and :meth:`vote` belong to it.

    It is :class:`~txbroker.tm.aio.AsyncBrokerParticipant` (the rules written once) run
    on the connection's loop thread, each call as ONE hand-over to that thread —
    ``vote``'s pipelined ``xa_end`` and ``xa_prepare`` together — and ``begin``'s
    pipelined ``xa_start`` without waiting for the thread's turn at all (a refusal is
    raised by the next call on the connection, as for any pipelined request). Each
    hand-over is a thread wake-up each way, which a busy machine makes wait for a CPU
    (issue 30)."""

    def __init__(self, connection: Any, name: str = "txbroker") -> None:
        from txbroker.tm.aio import AsyncBrokerParticipant  # (tm.aio imports this module)

        self.connection = connection
        self.name = name
        self._async = AsyncBrokerParticipant(connection.async_connection, name)

    @property
    def sort_key(self) -> str:
        """Participants are voted and finished in this order (stable across runs)."""
        return self.name

    def begin(self, xid: Xid) -> None:
        """Start this resource's branch ``xid``: work done from now on belongs to it."""
        self.connection.run_async_pipelined(self._async.begin(xid))

    def vote(self, xid: Xid) -> bool:
        """Prepare the branch: True to commit; False or raising is a "no" (the TM aborts)."""
        return bool(self.connection.run_async(self._async.vote(xid)))

    def commit_one_phase(self, xid: Xid) -> None:
        """The only participant: commit without a prepare (may raise: rolled back)."""
        self.connection.run_async(self._async.commit_one_phase(xid))

    def finish(self, xid: Xid, commit: bool) -> bool:
        """Commit or roll back the prepared branch; must not fail for good: True when
        done, False to leave it to recovery."""
        try:
            return bool(self.connection.run_async(self._async.finish(xid, commit)))
        except Exception as exc:  # finish must not fail (e.g. the connection is closed)
            return finish_failed(self.name, xid, commit, exc)

    def abort(self, xid: Xid) -> None:
        """Roll back a branch that did not vote yes (cleanup: must not raise)."""
        try:
            self.connection.run_async(self._async.abort(xid))
        except Exception as exc:
            log.info("%s: abort of %s: %s", self.name, xid, exc)


class BrokerResource:
    """Recovery's view of a broker: a txbroker connection."""

    def __init__(self, connection: Any, name: str = "txbroker") -> None:
        self.connection = connection
        self._name = name

    @property
    def name(self) -> str:
        """The resource's name (the bqual of its branches)."""
        return self._name

    def recover(self) -> list[Xid]:
        """Xids of this resource's prepared branches of our format id."""
        found: list[Xid] = self.connection.xa_resource().recover()
        return [x for x in found if x.format_id == TM_FORMAT_ID]

    def resolve(self, xid: Xid, commit: bool) -> None:
        """Commit or roll back one in-doubt branch found by :meth:`recover`."""
        xa = self.connection.xa_resource()
        if commit:
            xa.commit(xid, False)
        else:
            xa.rollback(xid)


# ---------------------------------------------------------------------- PostgreSQL
def _pg_xid(connection: Any, xid: Xid) -> Any:
    return connection.xid(xid.format_id, xid.gtrid.decode(), xid.bqual.decode())


class PostgresParticipant:
    """A psycopg 3 connection's branch (``tpc_begin`` … ``tpc_commit``); the connection
    must not be in autocommit mode. Work on ``connection`` between :meth:`begin` and
    :meth:`vote` belongs to the branch."""

    def __init__(self, connection: Any, name: str = "postgres") -> None:
        self.connection = connection
        self.name = name
        self._prepared = False

    @property
    def sort_key(self) -> str:
        """Participants are voted and finished in this order (stable across runs)."""
        return self.name

    def begin(self, xid: Xid) -> None:
        """Start this resource's branch ``xid``: work done from now on belongs to it."""
        self._prepared = False
        self.connection.tpc_begin(_pg_xid(self.connection, xid))

    def commit_one_phase(self, xid: Xid) -> None:
        """The only participant: commit without a prepare (may raise: rolled back)."""
        self.connection.tpc_commit()

    def finish(self, xid: Xid, commit: bool) -> bool:
        """Commit or roll back the prepared branch; must not fail for good: True when
        done, False to leave it to recovery."""
        try:
            if commit:
                self.connection.tpc_commit()
            else:
                self.connection.tpc_rollback()
        except Exception as exc:  # finish must not fail
            finish_failed(self.name, xid, commit, exc)
            self._reset()
            return False
        return True

    def vote(self, xid: Xid) -> bool:
        """Prepare the branch: True to commit; False or raising is a "no" (the TM aborts)."""
        try:
            self.connection.tpc_prepare()
        except Exception:
            # a failed PREPARE TRANSACTION rolls the transaction back on the server, but
            # psycopg 3.3 then believes it is prepared (its tpc_rollback looks for a
            # prepared gid that does not exist): forget its TPC state
            if hasattr(self.connection, "_tpc"):
                self.connection._tpc = None
            raise
        self._prepared = True
        return False

    def abort(self, xid: Xid) -> None:
        """Roll back a branch that did not vote yes (cleanup: must not raise)."""
        if getattr(self.connection, "_tpc", True) is None:
            return  # nothing open (the failed prepare above rolled it back)
        try:
            self.connection.tpc_rollback()
        except Exception as exc:
            log.info("%s: abort of %s: %s", self.name, xid, exc)
            self._reset()

    def _reset(self) -> None:
        with contextlib.suppress(Exception):  # a broken connection: nothing more to do
            self.connection.rollback()


class PostgresResource:
    """Recovery's view of PostgreSQL: an **autocommit** psycopg connection (PostgreSQL
    runs COMMIT PREPARED only outside a transaction block)."""

    def __init__(self, connection: Any, name: str = "postgres") -> None:
        self.connection = connection
        self._name = name
        self._database = connection.info.dbname

    @property
    def name(self) -> str:
        """The resource's name (the bqual of its branches)."""
        return self._name

    def recover(self) -> list[Xid]:
        """Xids of this resource's prepared branches of our format id."""
        found = []
        for pg in self.connection.tpc_recover():
            # tpc_recover lists every database's prepared transactions
            if pg.format_id != TM_FORMAT_ID or pg.database != self._database:
                continue
            found.append(Xid(pg.format_id, pg.gtrid, pg.bqual))
        return found

    def resolve(self, xid: Xid, commit: bool) -> None:
        """Commit or roll back one in-doubt branch found by :meth:`recover`."""
        pg = _pg_xid(self.connection, xid)
        if commit:
            self.connection.tpc_commit(pg)
        else:
            self.connection.tpc_rollback(pg)
