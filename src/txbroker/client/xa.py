"""XA in the async client: the XAResource and the DB-API 2.0 TPC names.

``conn.xa_resource()`` gives an :class:`AsyncXAResource` with the methods of
``javax.transaction.xa.XAResource`` (``start/end/prepare/commit/rollback/
recover/forget/set_transaction_timeout/get_transaction_timeout``); flags and
XA codes are the X/Open numbers (re-exported here). A failed request raises
:class:`~txbroker.errors.XAError` whose ``errcode`` is the XA code.

:class:`TpcMixin` adds the DB-API TPC names with psycopg's shape to the
connection: ``xid()``, ``tpc_begin``, ``tpc_prepare``, ``tpc_commit([xid])``
(one-phase when the branch was not prepared), ``tpc_rollback([xid])`` and
``tpc_recover()``. While a TPC transaction is open every send and ack of the
connection belongs to it (the broker stages them in the associated branch).
"""

from __future__ import annotations

from typing import Any

from txbroker.client._engine import Engine
from txbroker.core.xa import (
    TMENDRSCAN,
    TMFAIL,
    TMJOIN,
    TMNOFLAGS,
    TMONEPHASE,
    TMRESUME,
    TMSTARTRSCAN,
    TMSUCCESS,
    TMSUSPEND,
)
from txbroker.errors import (
    XA_HEURCOM,
    XA_HEURHAZ,
    XA_HEURMIX,
    XA_HEURRB,
    XA_OK,
    XA_RBROLLBACK,
    XA_RDONLY,
    XAER_INVAL,
    XAER_NOTA,
    XAER_PROTO,
    XAER_RMERR,
    XAER_RMFAIL,
    XAError,
)
from txbroker.xid import Xid

__all__ = [
    "TMENDRSCAN", "TMFAIL", "TMJOIN", "TMNOFLAGS", "TMONEPHASE", "TMRESUME", "TMSTARTRSCAN",
    "TMSUCCESS", "TMSUSPEND", "XAER_INVAL", "XAER_NOTA", "XAER_PROTO", "XAER_RMERR",
    "XAER_RMFAIL", "XA_HEURCOM", "XA_HEURHAZ", "XA_HEURMIX", "XA_HEURRB", "XA_OK",
    "XA_RBROLLBACK", "XA_RDONLY", "AsyncXAResource", "TpcMixin", "XAError", "Xid",
]


def _text(xid: Any) -> str:
    if isinstance(xid, Xid):
        return str(xid)
    if isinstance(xid, tuple) and len(xid) == 3:  # a DB-API (format_id, gtrid, bqual)
        return str(Xid(*xid))
    raise XAError(XAER_INVAL, f"not an Xid: {xid!r}")


class AsyncXAResource:
    """The XAResource of one connection (``conn.xa_resource()``).

    Across a failover (``_xa_state.py``): a branch that was not prepared is rolled
    back by it, and its ``end``, ``prepare`` and ``commit`` raise XAError with
    ``XA_RBCOMMFAIL``; a prepared branch is in the store and is completed through
    the new broker."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def _call(self, op: str, args: dict[str, Any]) -> Any:
        engine = self._engine
        state = engine.xa
        xid: str | None = args.get("xid")
        if xid is not None and state.check_lost(op, xid):
            return {}  # a rollback of a branch the failover rolled back
        engine._flush_acks()  # pipelined acks belong to the branch: send them first
        try:
            result, epoch = await engine.call(op, args, timeout=engine.options.timeout,
                                              resend=False)
        except XAError as exc:
            if xid is None:
                raise
            if state.translate(op, xid, exc, engine.epoch):
                return {}
            if exc.rolled_back:
                state.completed(xid)
            raise
        if xid is not None:
            if op == "xa_start":
                state.started(xid, epoch)
            elif op == "xa_prepare":
                state.prepared(xid)
        return result

    async def _send(self, op: str, args: dict[str, Any], wait: bool) -> None:
        engine = self._engine
        state = engine.xa
        xid: str = args["xid"]
        if op == "xa_start":
            if state.broken is not None and state.associated != xid:
                raise XAError(XAER_PROTO, f"the connection is still associated with branch "
                                          f"{state.associated} (lost in a failover): end or "
                                          f"roll it back first")
            if args["flags"] & (TMJOIN | TMRESUME):
                state.check_lost(op, xid)  # joining a lost branch: its rollback error
            state.starting(xid, engine.epoch)  # (before it is sent: a failover resumes it)
        else:
            state.check_lost(op, xid)  # end of a lost branch: its rollback error
        session = engine.session
        try:
            if wait or session is None:
                await self._call(op, args)
            else:
                engine._flush_acks()
                engine.pipeline(session, op, args)  # an error is raised by the next call
        except BaseException:
            if op == "xa_start":
                state.start_failed(xid)
            raise
        finally:
            if op == "xa_end":
                state.ended(xid)

    async def start(self, xid: Xid, flags: int = TMNOFLAGS, *, wait: bool = True) -> None:
        """Associate the connection with branch ``xid`` (TMNOFLAGS, TMJOIN, TMRESUME).
        ``wait=False`` pipelines the request: a refusal is raised by the next call."""
        await self._send("xa_start", {"xid": _text(xid), "flags": flags}, wait)

    async def end(self, xid: Xid, flags: int = TMSUCCESS, *, wait: bool = True) -> None:
        """End the association (TMSUCCESS, TMSUSPEND, TMFAIL); ``wait`` as for start."""
        await self._send("xa_end", {"xid": _text(xid), "flags": flags}, wait)

    async def prepare(self, xid: Xid) -> int:
        """Phase one; returns XA_OK (prepared, durable) or XA_RDONLY (no work: gone)."""
        result = await self._call("xa_prepare", {"xid": _text(xid)})
        return int(result["vote"])

    async def commit(self, xid: Xid, one_phase: bool = False) -> None:
        """Commit a prepared branch, or an ended one with ``one_phase=True``."""
        await self._complete("xa_commit", {"xid": _text(xid), "one_phase": bool(one_phase)})

    async def rollback(self, xid: Xid) -> None:
        """Roll the branch back; its consumed messages are redelivered. A branch a
        failover rolled back is rolled back already: nothing is sent."""
        await self._complete("xa_rollback", {"xid": _text(xid)})

    async def _complete(self, op: str, args: dict[str, Any]) -> None:
        state = self._engine.xa
        state.ended(args["xid"])  # no longer to be resumed after a failover
        try:
            await self._call(op, args)
        finally:
            state.completed(args["xid"])

    async def recover(self, flags: int = TMSTARTRSCAN | TMENDRSCAN) -> list[Xid]:
        """Prepared and heuristically completed branches."""
        found = await self._call("xa_recover", {"flags": flags})
        return [Xid.parse(text) for text in found]

    async def forget(self, xid: Xid) -> None:
        """Remove a heuristically completed branch."""
        await self._call("xa_forget", {"xid": _text(xid)})

    async def set_transaction_timeout(self, seconds: int) -> bool:
        """The transaction timeout of branches started from now on; 0 restores the
        default (180 s). Seed 002: it is an idle timeout — a branch ended and not
        prepared, committed or rolled back within it is rolled back; an ACTIVE branch
        has no timeout while this connection is open."""
        await self._call("xa_set_timeout", {"seconds": seconds})
        return True

    async def get_transaction_timeout(self) -> int:
        """The transaction timeout in seconds."""
        result = await self._call("xa_get_timeout", {})
        return int(result["seconds"])

    def is_same_rm(self, other: object) -> bool:
        """True when ``other`` talks to the same broker (JTA's ``isSameRM``)."""
        return isinstance(other, AsyncXAResource) and \
            other._engine.server_info.get("server") == self._engine.server_info.get("server") \
            and other._engine.url == self._engine.url


class TpcMixin:
    """DB-API 2.0 two-phase-commit names for :class:`AsyncConnection` (psycopg's shape)."""

    _engine: Engine
    _tpc_xid: Xid | None = None
    _tpc_prepared = False
    _tpc_read_only = False

    def xa_resource(self) -> AsyncXAResource:
        """This connection's XAResource."""
        return AsyncXAResource(self._engine)

    @staticmethod
    def xid(format_id: int, gtrid: str | bytes, bqual: str | bytes) -> Xid:
        """An Xid (gtrid/bqual: str are UTF-8 encoded; 1–64 bytes each)."""
        return Xid(format_id, gtrid, bqual)

    async def tpc_begin(self, xid: Xid | tuple[int, Any, Any]) -> None:
        """Begin a TPC transaction: sends and acks of this connection join branch ``xid``."""
        if self._tpc_xid is not None:
            raise XAError(XAER_PROTO, f"a TPC transaction ({self._tpc_xid}) is already open")
        value = xid if isinstance(xid, Xid) else Xid(*xid)
        await self.xa_resource().start(value, TMNOFLAGS)
        self._tpc_xid, self._tpc_prepared, self._tpc_read_only = value, False, False

    async def tpc_prepare(self) -> None:
        """End the work and prepare the branch (durable when this returns)."""
        xid = self._current()
        if self._tpc_prepared:
            raise XAError(XAER_PROTO, f"{xid} is already prepared")
        resource = self.xa_resource()
        try:
            await resource.end(xid, TMSUCCESS)
            vote = await resource.prepare(xid)
        except XAError as exc:
            if exc.rolled_back:
                self._tpc_xid = None
            raise
        self._tpc_prepared = True
        self._tpc_read_only = vote == XA_RDONLY

    async def tpc_commit(self, xid: Xid | tuple[int, Any, Any] | None = None) -> None:
        """Commit: the current transaction (one-phase if it was not prepared), or — for
        recovery, outside a transaction — the prepared branch ``xid``."""
        resource = self.xa_resource()
        if xid is not None:
            self._outside(xid)
            await resource.commit(xid if isinstance(xid, Xid) else Xid(*xid), False)
            return
        current = self._current()
        try:
            if self._tpc_read_only:
                return
            if self._tpc_prepared:
                await resource.commit(current, False)
            else:
                await resource.end(current, TMSUCCESS)
                await resource.commit(current, True)
        finally:
            self._tpc_xid = None

    async def tpc_rollback(self, xid: Xid | tuple[int, Any, Any] | None = None) -> None:
        """Roll back the current transaction, or (outside one) the prepared branch ``xid``."""
        resource = self.xa_resource()
        if xid is not None:
            self._outside(xid)
            await resource.rollback(xid if isinstance(xid, Xid) else Xid(*xid))
            return
        current = self._current()
        try:
            if not self._tpc_read_only:
                await resource.rollback(current)
        finally:
            self._tpc_xid = None

    async def tpc_recover(self) -> list[Xid]:
        """Xids of prepared (and heuristically completed) branches of this broker."""
        return await self.xa_resource().recover(TMSTARTRSCAN | TMENDRSCAN)

    # operator commands (``txbroker xa list|commit|rollback|forget``)
    async def xa_branches(self) -> list[dict[str, Any]]:
        """Every branch of the broker: xid, state, age_ms, sent, consumed, session."""
        result, _ = await self._engine.call("xa_list", {}, timeout=self._engine.options.timeout)
        return list(result)

    async def xa_heuristic(self, xid: Xid, commit: bool) -> None:
        """Complete a PREPARED branch by hand (HEURISTIC_COMMITTED / _ROLLED_BACK)."""
        await self._engine.call("xa_heuristic", {"xid": _text(xid),
                                                 "outcome": "commit" if commit else "rollback"},
                                timeout=self._engine.options.timeout, resend=False)

    def _current(self) -> Xid:
        if self._tpc_xid is None:
            raise XAError(XAER_PROTO, "no TPC transaction is open (call tpc_begin first)")
        return self._tpc_xid

    def _outside(self, xid: object) -> None:
        if self._tpc_xid is not None:
            raise XAError(XAER_PROTO, "tpc_commit(xid)/tpc_rollback(xid) are for recovery: "
                                      "not inside a TPC transaction")
