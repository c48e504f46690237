"""The async client's engine: one broker session at a time, request ids, failover.

Theory of operation
-------------------
A :class:`Session` is one stream to one broker with its own
:class:`~txbroker.protocol.native.NativeConnection` codec, its own table of
pending requests (``rid → Pending``, a future per request) and one reader
task. Requests are encoded and written at once (writes made in the same
loop iteration are joined into one ``write``); the reader (``_reader.py``)
decodes every complete frame of each read and resolves futures
(``OK``/``ERR``) or hands ``deliver`` pushes to the subscription with that
``sub`` id.

Each session has an *epoch* number; messages and transactions remember the
epoch they belong to. When the current session breaks, the :class:`Engine`
(if ``reconnect``) has its failover part (``_failover.py``) walk the failover
list starting with the next host, with a back-off after each full round,
until ``failover_timeout``. A host that refuses ``hello`` because it is a
standby (``Standby``) or stopping (``ShuttingDown``) is left at once for the
next one, here and in :meth:`Engine.start`; an error the broker sends with
request id 0 during the handshake (a refusal before ``hello``) fails the
handshake, not a later call. On the new session:

* pending sends that carry a ``message_id`` (the broker drops duplicates),
  ``receive`` and the read-only ops are re-sent on the new session; other
  pending requests fail with ConnectionLost (their outcome is unknown);
* open subscriptions are subscribed again (client-ack messages still
  buffered from the old session are dropped: the broker redelivers them);
* acking a message of an older epoch raises IllegalState, and a
  transaction that sent or received a message in an older epoch is rolled
  back (its commit raises TransactionRolledBack; one that did nothing yet is
  begun again, ``async_transaction.py``); XA branches: ``_xa_state.py``;
* ``on_failover(old_host, new_host)`` is called.

If no host answers in time, every waiter gets ConnectionLost.

Pipelined requests (acks sent without waiting) that fail with a broker error
are remembered and raised by the next call on the connection.

The limits the broker announces in ``hello`` are kept in :attr:`Engine.limits`;
the faces check each request against them before it gets here
(``operations.py``). A frame still too large for the broker's
``max_frame_size`` raises MessageTooLarge for a send (the body made it so).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from txbroker.client._coalesce import SendBatch, batchable
from txbroker.client._failover import Failover, describe_refusal
from txbroker.client._reader import Reader, return_message
from txbroker.client._session import ConnectionExtension, Pending, Session, SubscriptionSink
from txbroker.client._xa_state import XaBranchState
from txbroker.client.operations import NO_LIMITS, BrokerLimits, settle_args
from txbroker.client.options import ConnectOptions
from txbroker.client.url import ClientURL
from txbroker.errors import (
    AuthenticationFailed,
    BrokerError,
    ConnectionLost,
    MessageTooLarge,
    TxBrokerError,
)
from txbroker.protocol.native import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    LocalProtocolError,
    Request,
)

__all__ = ["Engine", "Session", "SubscriptionSink"]

log = logging.getLogger("txbroker.client")
#: Ops that are safe to send again after a failover (no side effect, or the
#: broker drops the duplicate: a ``send`` with a ``message_id``).
RESENDABLE_OPS: Final = frozenset({"receive", "ping", "queue_info", "queue_list", "stats"})
#: Ops whose frame too large for the broker means a body too large (MessageTooLarge).
SIZED_OPS: Final = frozenset({"send", "send_batch"})
#: Ops whose work goes into the associated XA branch when they name no local transaction.
XA_WORK_OPS: Final = frozenset({"send", "send_batch", "ack", "ack_by_id"})


class Engine:
    """Sessions, request ids and failover of one client connection."""

    def __init__(self, url: ClientURL, options: ConnectOptions) -> None:
        self.url = url
        self.options = options
        self.subs: dict[int, SubscriptionSink] = {}
        #: non-durable topic subscriptions this connection made (queue name ->
        #: ``topic_subscribe`` arguments): the broker drops them with the session, so a
        #: failover makes them again before the subscriptions (seed 004)
        self.topic_subscriptions: dict[str, dict[str, Any]] = {}
        self.session: Session | None = None
        self.server_info: dict[str, Any] = {}
        self._ready = asyncio.Event()
        self._closed = False
        self._failed: BaseException | None = None
        #: a broker error the next call raises (an error push, a pipelined request's error)
        self.deferred: BrokerError | None = None
        self._next_rid = 1
        self._next_sub = 1
        self._epochs = 0
        self._outstanding: set[asyncio.Future[Any]] = set()
        self._failover = Failover(self)
        #: the reading part: the sessions' reader tasks and the back-pressure gate
        self.reader = Reader(self)
        #: the XA branches this connection works on (``_xa_state.py``)
        self.xa = XaBranchState()
        #: the limits of the broker's ``hello`` (max_message_size), checked before sending
        self.limits: BrokerLimits = NO_LIMITS
        #: parts with pushes of their own, by push event name (``"rtr"``: txbroker.router)
        self.extensions: dict[str, ConnectionExtension] = {}

    # ----------------------------------------------------------------- status

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (or the event loop shut the reader down)."""
        return self._closed

    @property
    def epoch(self) -> int | None:
        """Epoch of the live session, None while (re)connecting or closed."""
        session = self.session
        return None if session is None else session.epoch

    def new_sub_id(self) -> int:
        """A subscription id unique on this connection."""
        self._next_sub += 1
        return self._next_sub - 1

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise ConnectionLost("the connection is closed")
        if self._failed is not None:
            raise ConnectionLost(str(self._failed)) from self._failed
        if self.deferred is not None:
            error, self.deferred = self.deferred, None
            raise error

    async def wait_ready(self) -> Session:
        """Return the live session, waiting through a failover; raise if unusable."""
        while True:
            self._raise_if_unusable()
            session = self.session
            if session is not None:
                return session
            await self._ready.wait()

    # --------------------------------------------------------------- requests

    def _submit_on(
        self,
        session: Session,
        op: str,
        args: dict[str, Any],
        resend: bool = False,
        discard_result: bool = False,
    ) -> Pending:
        if self._send_batch is not None:  # sends made earlier go out first: call order
            self._flush_sends()
        rid = self._next_rid
        self._next_rid = rid + 1
        try:
            data = session.codec.send(Request(rid, op, args))
        except LocalProtocolError as exc:
            if op in SIZED_OPS:  # the body (or bodies) make the frame too large
                raise MessageTooLarge(str(exc)) from None
            raise
        pending = Pending(session, rid, op, args, resend, discard_result)
        if op in XA_WORK_OPS and "tx" not in args:
            pending.branch = self.xa.associated
        session.pending[rid] = pending
        session.write(data)
        return pending

    async def call(
        self,
        op: str,
        args: dict[str, Any],
        *,
        timeout: float | None,
        resend: bool | None = None,
    ) -> tuple[Any, int]:
        """Send a request and wait for its result; return ``(result, epoch of the reply)``."""
        session = self.session
        if session is None or self.deferred is not None or self._closed:
            session = await self.wait_ready()
        if self.xa.broken is not None:
            self._check_xa_work(op, args)
        if resend is None:
            resend = op in RESENDABLE_OPS
        pending = self._submit_on(session, op, args, resend)
        completed = False
        try:
            if timeout is None:
                result = await pending.future
            else:
                async with asyncio.timeout(timeout):
                    result = await pending.future
            completed = True
        except TimeoutError:
            raise TimeoutError(f"no reply to {op!r} within {timeout} s") from None
        finally:
            if not completed:
                self._abandon(pending)
        assert pending.session is not None  # sent on a session: it has one
        return result, pending.session.epoch

    async def call_on(self, session: Session, op: str, args: dict[str, Any]) -> Any:
        """Send a request on a given session (handshakes) and wait for the result."""
        pending = self._submit_on(session, op, args)
        try:
            return await pending.future
        finally:
            if not pending.future.done():
                self._abandon(pending)

    def submit(
        self, op: str, args: dict[str, Any], *, resend: bool = False, discard_result: bool = False
    ) -> asyncio.Future[Any]:
        """Send a request without waiting: return the future of its result (or of None)."""
        self._raise_if_unusable()
        if self.xa.broken is not None:
            self._check_xa_work(op, args)
        session = self.session
        if session is not None:
            return self._submit_on(session, op, args, resend, discard_result).future
        # Failing over: the request waits with the carried ones and goes out on the next
        # session before anything asked after it, in call order — a task waiting for the
        # session could be overtaken (an ``xa_end`` sent before a send of its branch would
        # leave the send outside the branch, done at once). Work of an XA branch that is
        # not resumed there fails with the branch (``_failover.py``).
        pending = Pending(None, 0, op, args, resend, discard_result)
        if op in XA_WORK_OPS and "tx" not in args:
            pending.branch = self.xa.associated
        self._failover.carry(pending)
        return pending.future

    def submit_send(self, args: dict[str, Any], resend: bool) -> asyncio.Future[None]:
        """A pipelined ``send``: coalesced with the other sends of this loop iteration to
        the same destination into one ``send_batch`` (``_coalesce.py``)."""
        session = self.session
        if session is None or self.xa.broken is not None or not batchable(args):
            future: asyncio.Future[None] = self.submit("send", args, resend=resend,
                                                       discard_result=True)
            return future
        self._raise_if_unusable()
        key = (session, args["dest"], args.get("persistent", True))
        batch = self._send_batch
        if batch is None or batch.key != key:
            if batch is not None:
                self._flush_sends()
            self._send_batch = batch = SendBatch(key)
            asyncio.get_running_loop().call_soon(self._flush_sends)
        future = batch.add(args, resend, asyncio.get_running_loop())
        if batch.full:
            self._flush_sends()
        return future

    def _flush_sends(self) -> None:
        batch, self._send_batch = self._send_batch, None
        if batch is None:
            return
        session = self.session
        if session is None or batch.key[0] is not session or self._closed:
            batch.chain_each(lambda args: self.submit("send", args, resend=batch.resend,
                                                      discard_result=True))
            return
        try:
            if len(batch.args) == 1:
                request = self._submit_on(session, "send", batch.args[0], batch.resend,
                                          discard_result=True).future
            else:
                request = self._submit_on(session, "send_batch", batch.wire_args(),
                                          batch.resend, discard_result=True).future
        except Exception as exc:  # e.g. MessageTooLarge: every message of it fails
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            request = failed
        batch.settle_with(request)

    _send_batch: SendBatch | None = None

    def pipeline(self, session: Session, op: str, args: dict[str, Any]) -> asyncio.Future[Any]:
        """Send on ``session`` without waiting; a broker error is raised by the next call."""
        if self.xa.broken is not None:
            self._check_xa_work(op, args)
        future = self._submit_on(session, op, args).future
        self._outstanding.add(future)
        future.add_done_callback(self._pipelined_done)
        return future

    def pipeline_ack(self, session: Session, tag: int) -> None:
        """Queue a pipelined ack; acks of one loop iteration go out as ONE request."""
        if self.xa.broken is not None:
            self._check_xa_work("ack", {})
        batch = self._ack_batch
        if batch is None or batch[0] is not session:
            if batch is not None:
                self._flush_acks()
            self._ack_batch = batch = (session, [])
            asyncio.get_running_loop().call_soon(self._flush_acks)
        batch[1].append(tag)

    def _flush_acks(self) -> None:
        batch, self._ack_batch = self._ack_batch, None
        if batch is None:
            return
        session, tags = batch
        if session is self.session:  # after a failover the broker redelivers them anyway
            self.pipeline(session, "ack", settle_args(tags))

    _ack_batch: tuple[Session, list[int]] | None = None

    def _check_xa_work(self, op: str, args: dict[str, Any]) -> None:
        """Refuse work that would go into the associated XA branch when a failover lost
        it: it would be done at once instead (``_xa_state.py``)."""
        if op in XA_WORK_OPS and "tx" not in args:
            self.xa.check_work()

    def _pipelined_done(self, future: asyncio.Future[Any]) -> None:
        self._outstanding.discard(future)
        if future.cancelled():
            return
        error = future.exception()
        # A ConnectionLost here is no news: the message is redelivered after failover.
        if isinstance(error, BrokerError) and self.deferred is None:
            self.deferred = error

    def _abandon(self, pending: Pending) -> None:
        """Nobody waits for this request any more (cancelled or timed out)."""
        session, future = pending.session, pending.future
        if session is None:  # still waiting for a session: never sent
            future.cancel()
            return
        if future.done() and not future.cancelled():
            # The reply won the race: a received message must not stay in flight.
            if pending.op == "receive" and future.exception() is None:
                return_message(session, future.result())
            return
        if session.pending.pop(pending.rid, None) is not None and pending.op == "receive":
            session.abandoned.add(pending.rid)
        future.cancel()

    def give_back(self, epoch: int, tag: int) -> None:
        """Give back a delivery nobody will process (no reply wanted); nothing to do if
        its session is gone (the broker took it back)."""
        session = self.session
        if session is not None and session.epoch == epoch:
            return_message(session, {"tag": tag})

    # --------------------------------------------------------------- sessions

    async def open_session(self, index: int, timeout: float | None) -> Session:
        """Connect to host ``index`` of the list and say hello (within ``timeout``)."""
        host = self.url.hosts[index]
        async with asyncio.timeout(timeout):
            stream = await self.options.transport.open(host.host, host.port)
            self._epochs += 1
            session = Session(index, host, stream, self._epochs)
            session.reader = asyncio.create_task(self.reader.read_loop(session))
            try:
                hello: dict[str, Any] = {"version": PROTOCOL_VERSION}
                if self.url.user is not None:
                    hello["user"] = self.url.user
                if self.url.password is not None:
                    hello["password"] = self.url.password
                if self.options.client_id is not None:
                    hello["client_id"] = self.options.client_id
                info = await self.call_on(session, "hello", hello)
            except BaseException:
                session.close()
                raise
        session.info = info if isinstance(info, dict) else {}
        limit = session.info.get("max_frame_size")
        if type(limit) is int and limit > 0:
            session.codec.peer_max_frame_size = limit
            session.codec.max_frame_size = max(DEFAULT_MAX_FRAME_SIZE, limit)
        return session

    async def start(self) -> None:
        """Connect to the first host of the list that answers (one round, no waiting)."""
        errors: list[str] = []
        for index, host in enumerate(self.url.hosts):
            try:
                self.activate(await self.open_session(index, self.options.timeout))
            except AuthenticationFailed:
                raise
            except (OSError, TimeoutError, TxBrokerError) as exc:  # Standby: the next one
                errors.append(f"{host}: {describe_refusal(exc)}")
                continue
            return
        raise ConnectionLost("no broker of the list answered: " + "; ".join(errors))

    def activate(self, session: Session) -> None:
        """Make ``session`` (its hello done) the current one."""
        if session.closed:  # lost while the handshake finished
            raise ConnectionLost(f"{session.host} closed the connection after hello")
        self.session = session
        self.server_info = session.info
        self.limits = BrokerLimits.from_hello(session.info)
        self._ready.set()

    def reader_cancelled(self) -> None:
        """Only loop shutdown cancels a reader: the connection is closed, no failover."""
        self._closed = True

    def session_lost(self, session: Session, error: BaseException | None) -> None:
        """``session``'s stream ended (``error``: why): fail its requests over to the next
        session (``_failover.py``), or fail them if that is not to be."""
        pending = [p for p in session.pending.values() if not p.future.done()]
        session.pending.clear()
        current = session is self.session
        if current:
            self._branch_work_lost(session, pending)
        reason = f"connection to {session.host} lost" + (f": {error}" if error else "")
        if current:
            for extension in list(self.extensions.values()):
                extension.on_session_lost()
        if not current or self._closed or not self.options.reconnect:
            lost = ConnectionLost("the connection is closed" if self._closed else reason)
            for p in pending:
                p.future.set_exception(lost)
            if current:
                self.session = None
                self.fail(lost)
            return
        self.session = None
        self._ready.clear()
        for p in pending:
            if p.resend:
                self._failover.carry(p)
            else:
                p.future.set_exception(ConnectionLost(reason + " (request not retried)"))
        log.warning("txbroker: %s; failing over", reason)
        self._failover.start(session)

    def _branch_work_lost(self, session: Session, pending: list[Pending]) -> None:
        """The associated XA branch had work on ``session`` that the broker may not have
        got — an ack (never re-sent) or a send without a message id — unanswered, or
        acks still batched: resuming the branch on the next session would commit it
        without that work, and the message whose ack was lost would come again (applied
        twice). The branch is lost instead: its end, prepare and commit raise
        ``XA_RBCOMMFAIL`` (issue 25's audit)."""
        xa = self.xa
        if xa.associated is None or xa.broken is not None:
            return
        unconfirmed = any(p.op in XA_WORK_OPS and "tx" not in p.args and not p.resend
                          for p in pending)
        batch = self._ack_batch
        if unconfirmed or (batch is not None and batch[0] is session and batch[1]):
            xa.resume_failed("work of the branch was in flight when the connection broke")

    def resubmit(self, session: Session, pending: Pending) -> None:
        """Send a request carried over a failover again, on ``session`` with a new id."""
        rid = self._next_rid
        self._next_rid = rid + 1
        pending.session, pending.rid = session, rid
        session.pending[rid] = pending
        session.write(session.codec.send(Request(rid, pending.op, pending.args)))

    def fail(self, error: ConnectionLost) -> None:
        """No broker left: fail every waiter and end every subscription."""
        if self._failed is None and not self._closed:
            self._failed = error
        self._failover.fail_carried(error)
        subs = list(self.subs.values())
        self.subs.clear()
        for sub in subs:
            sub.on_end(None if self._closed else error)
        for extension in list(self.extensions.values()):
            extension.on_failed(error)
        self._ready.set()
        self.reader.release()

    # ---------------------------------------------------------------- closing

    async def close(self) -> None:
        """Flush pipelined acks (bounded by the timeout), then close."""
        if self._closed:
            return
        if self._outstanding and self.session is not None:
            await asyncio.wait(set(self._outstanding), timeout=self.options.timeout)
        self._closed = True
        self._failover.cancel()
        session = self.session
        if session is not None:
            session.close()
            if session.reader is not None:
                await asyncio.wait([session.reader])
        self.fail(ConnectionLost("the connection is closed"))
        if self.deferred is not None:
            log.warning("txbroker: error of a pipelined request at close: %s", self.deferred)
