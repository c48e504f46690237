"""The engine's failover part: walk the failover list, restore the state, re-send.

Theory of operation
-------------------
When the current session breaks, the engine (``_engine.py``) hands the
pending requests that are safe to send again to :meth:`Failover.carry` and
calls :meth:`Failover.start`. The failover task then tries the hosts of the
URL's list starting with the one after the lost host, with a back-off after
each full round (:data:`INITIAL_BACKOFF` doubling up to :data:`MAX_BACKOFF`, jittered),
until ``failover_timeout``. A host that is down, refuses ``hello`` as a
standby (``Standby``: it has not taken over, or it never will) or is stopping
(``ShuttingDown``) is left at once for the next one; during a shared-store
takeover the client thus keeps going round the list until the standby
has become active. On a new session it restores, in this order: the
non-durable topic subscriptions it made (``topic_subscribe``: the broker
keeps none across a failover; seed 004 says topic subscribers carry on), the open
subscriptions, the associated XA branch (``start(TMRESUME)``; if that fails,
the branch is lost: ``_xa_state.py``), the extensions (the router's
registrations, ``ConnectionExtension.restore``), then the carried requests (with new
request ids). Only then is the session made current, so no new request
overtakes them; then ``on_failover(old, new)`` is called. If no host answers
in time, the engine fails every waiter with ConnectionLost naming what each
host said.

This part owns its state (the carried requests and the task); what it needs
of the engine is the small :class:`FailoverHost` interface.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Callable
from typing import Any, Final, Protocol

from txbroker.client._session import ConnectionExtension, Pending, Session, SubscriptionSink
from txbroker.client._xa_state import LOST_IN_FAILOVER, XaBranchState
from txbroker.client.options import ConnectOptions
from txbroker.client.url import ClientURL
from txbroker.core.xa import TMRESUME
from txbroker.errors import (
    XA_RBCOMMFAIL,
    XAER_PROTO,
    BrokerError,
    ConnectionLost,
    ShuttingDown,
    Standby,
    TxBrokerError,
    XAError,
)

__all__ = ["Failover", "FailoverHost", "describe_refusal"]

log = logging.getLogger("txbroker.client")

#: Tries (and the pause between them, s) to resume an XA branch after a failover.
XA_RESUME_ATTEMPTS: Final = 20
XA_RESUME_PAUSE: Final = 0.05
#: First pause after a full round of the failover list found no live host.
INITIAL_BACKOFF: Final = 0.05
#: Longest pause between two rounds of the failover list. A standby that detects a
#: dead active by its broken connection takes over in its recovery time (well under
#: a second for a small store): a 1 s pause added a median 0.38 s, at most 0.92 s,
#: to the takeover clients saw (bench/ha_failover.py). A round costs one refused
#: connection per address, so a quarter second stays cheap for the brokers; each
#: pause is jittered (x0.5-1) so that many clients do not knock in step.
MAX_BACKOFF: Final = 0.25


def describe_refusal(error: BaseException) -> str:
    """What a host said when the client tried it, for the error that names every host."""
    text = str(error) or type(error).__name__
    if isinstance(error, ssl.SSLCertVerificationError):
        return (f"TLS: the broker's certificate is not trusted: {error.verify_message} "
                "(check tls_ca / ssl_context and the host name)")
    if isinstance(error, ssl.SSLError):
        return f"TLS handshake failed: {error.reason or text} (is it a TLS port?)"
    if isinstance(error, Standby):
        return f"refused: it is a standby, not the active broker ({text})"
    if isinstance(error, ShuttingDown):
        return f"refused: it is shutting down ({text})"
    return text


#: The random source of the retry pauses' jitter (one per process; the simulator seeds
#: it, ``txbroker/sim/live.py``, so that a seed replays a run exactly).
JITTER = random.Random()

class FailoverHost(Protocol):
    """What the failover part needs of the engine."""

    url: ClientURL
    options: ConnectOptions
    subs: dict[int, SubscriptionSink]
    #: non-durable topic subscriptions to make again (queue name -> their arguments)
    topic_subscriptions: dict[str, dict[str, Any]]
    #: the XA branches of the connection (the associated one is resumed)
    xa: XaBranchState
    #: parts with pushes of their own (the router), restored after the XA branch
    extensions: dict[str, ConnectionExtension]

    @property
    def closed(self) -> bool:
        """True once the connection was closed (stop trying)."""
        ...

    async def open_session(self, index: int, timeout: float | None) -> Session:
        """Connect to host ``index`` of the list and say hello."""
        ...

    def activate(self, session: Session) -> None:
        """Make ``session`` the current one."""
        ...

    async def call_on(self, session: Session, op: str, args: dict[str, Any]) -> Any:
        """Send a request on ``session`` and wait for its result."""
        ...

    def resubmit(self, session: Session, pending: Pending) -> None:
        """Send a carried request again on ``session`` (with a new request id)."""
        ...

    def fail(self, error: ConnectionLost) -> None:
        """No broker left: fail every waiter."""
        ...


class Failover:
    """Finds a new session after a loss (see the module docstring)."""

    def __init__(self, host: FailoverHost) -> None:
        self._host = host
        self._carried: list[Pending] = []
        self._task: asyncio.Task[None] | None = None

    def carry(self, pending: Pending) -> None:
        """Send ``pending`` again on the next session."""
        self._carried.append(pending)

    def fail_carried(self, error: BaseException) -> None:
        """Fail the requests waiting for the next session."""
        carried, self._carried = self._carried, []
        for pending in carried:
            if not pending.future.done():
                pending.future.set_exception(error)

    def start(self, old: Session) -> None:
        """Start looking for a new session after ``old`` broke."""
        self._task = asyncio.create_task(self._run(old))

    def cancel(self) -> None:
        """Stop looking (the connection is being closed)."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()

    async def _run(self, old: Session) -> None:
        host = self._host
        loop = asyncio.get_running_loop()
        deadline = loop.time() + host.options.failover_timeout
        hosts = host.url.hosts
        index = (old.index + 1) % len(hosts)
        backoff = INITIAL_BACKOFF
        attempts = 0
        last_errors: dict[int, BaseException] = {}  # host index -> what it said last
        while not host.closed:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            timeout = remaining
            if host.options.timeout is not None:
                timeout = min(remaining, host.options.timeout)
            session: Session | None = None
            try:
                async with asyncio.timeout(timeout):
                    session = await host.open_session(index, None)
                    await self._restore(session)
                host.activate(session)
            except (OSError, TimeoutError, TxBrokerError) as exc:  # Standby: the next one
                last_errors[index] = exc
                if session is not None:
                    session.close()
            except BaseException:  # cancelled by close()
                if session is not None:
                    session.close()
                raise
            else:
                self._notify(str(old.host), str(session.host))
                return
            index = (index + 1) % len(hosts)
            attempts += 1
            if attempts % len(hosts) == 0:
                pause = backoff * JITTER.uniform(0.5, 1.0)
                await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))
                backoff = min(backoff * 2, MAX_BACKOFF)
        said = "; ".join(f"{hosts[i]}: {describe_refusal(error)}"
                         for i, error in sorted(last_errors.items()))
        host.fail(
            ConnectionLost(
                f"no broker of {host.url} answered within {host.options.failover_timeout} s"
                + (f" (last errors: {said})" if said else "")
            )
        )

    async def _resume_branch(self, session: Session, xid: str) -> None:
        """Reattach the XA branch this connection worked on. The broker may not have
        noticed yet that the old session broke (XAER_PROTO: still associated): retry.
        Another broker (or this one restarted) does not know it (XAER_NOTA): lost."""
        host = self._host
        for attempt in range(XA_RESUME_ATTEMPTS):
            try:
                await host.call_on(session, "xa_start", {"xid": xid, "flags": TMRESUME})
                host.xa.resumed(session.epoch)
                return
            except XAError as exc:
                if exc.errcode != XAER_PROTO or attempt == XA_RESUME_ATTEMPTS - 1:
                    host.xa.resume_failed(f"{session.host} could not resume it: {exc.message}")
                    return
            await asyncio.sleep(XA_RESUME_PAUSE)

    async def _restore(self, session: Session) -> None:
        """Subscribe again, resume the XA branch and re-send the carried requests."""
        host = self._host
        for queue, args in list(host.topic_subscriptions.items()):
            try:  # seed 004: topic subscribers carry on; a non-durable one is made again
                await host.call_on(session, "topic_subscribe", args)
            except BrokerError as exc:  # the topic is gone: its subscribers end below
                host.topic_subscriptions.pop(queue, None)
                log.warning("txbroker: subscription %s could not be made again: %s",
                            queue, exc)
        for sub in list(host.subs.values()):
            sub.on_failover(session.epoch)
            if not sub.active:
                continue
            try:
                await host.call_on(session, "subscribe", sub.subscribe_args())
            except BrokerError as exc:
                host.subs.pop(sub.sub_id, None)
                sub.on_end(exc)
        xa = host.xa
        # a start still waiting for a session (no epoch yet) goes out on this one:
        # resuming a branch the broker never had would lose it (issue 25's audit)
        if (xa.associated is not None and xa.broken is None
                and xa.unprepared.get(xa.associated) is not None):
            await self._resume_branch(session, xa.associated)
        for extension in list(host.extensions.values()):

            async def call(op: str, args: dict[str, Any], session: Session = session) -> Any:
                return await host.call_on(session, op, args)

            await extension.restore(call, session.epoch)
        if session.closed:
            raise ConnectionLost(f"{session.host} closed the connection")
        carried, self._carried = self._carried, []
        for pending in carried:
            if pending.future.done():
                continue
            branch = pending.branch
            if branch is not None and (xa.broken is not None or xa.associated != branch
                                       or xa.unprepared.get(branch) != session.epoch):
                # work of a branch that was not resumed on this session: sent again, it
                # would be done outside the branch (issue 25's audit)
                pending.future.set_exception(XAError(XA_RBCOMMFAIL, LOST_IN_FAILOVER.format(
                    xid=branch, reason="its work could not be carried over")))
                continue
            host.resubmit(session, pending)

    def _notify(self, old_host: str, new_host: str) -> None:
        log.warning("txbroker: failed over from %s to %s", old_host, new_host)
        callback: Callable[[str, str], object] | None = self._host.options.on_failover
        if callback is not None:
            try:
                callback(old_host, new_host)
            except Exception:
                log.exception("txbroker: on_failover callback raised")
