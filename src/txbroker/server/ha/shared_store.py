"""Shared-store failover (seed 004): an active and a standby on one data directory.

Theory of operation
-------------------
Two brokers are started the same way (``--ha shared-store --ha-port P
--ha-peer HOST:PORT``, one data directory on a file system both see). Each
runs a :class:`SharedStoreNode`, which listens on its HA port at once and then
*contends*:

1. try the store's lock (``storage/store_lock.py``: the store's single-writer
   lock *is* the HA lock) without waiting. Got it: **activate** — re-read the
   configuration file (an admin change made on the old active carries over),
   recover the store, open the client listeners, serve; heartbeats go to
   whichever standby connects to the HA port.
2. Else be the **standby**: connect to the peer's HA port, say ``standby``
   and follow the active's heartbeats (``protocol/ha.py``). **Detection**: no
   heartbeat for ``activation_interval`` seconds, or the TCP connection broke
   (the active's process died). **Response**: back to 1 at once. When neither
   the lock nor the connection can be had, the standby alternates between the
   two, a short pause per round, until one succeeds — exactly the seed's
   "Lock Unavailable" rule. Beside all this a poller tries the lock every
   :data:`LOCK_POLL_INTERVAL` whatever the link does, so that a standby whose
   link hangs (a partition, a stopped peer: a connect or a handshake waits up
   to ``heartbeat_interval``) still takes the lock within one poll interval of
   its release, not after the link's timeout; and a warm standby (``warm.py``)
   follows the journal into a core of its own, so a takeover reads only its suffix.

The lock decides, never the heartbeats: a standby takes over only once it holds
the lock, and the kernel (or the NFS server) hands the lock over only when its
holder's process is gone. So a stopped (SIGSTOP) or partitioned active keeps
its role and its store; the standby keeps alternating and never writes. Once
the old active is restarted it finds the lock held and becomes the standby
(**role reversal**).

A standby serves no clients: its native port answers every ``hello`` with the
``Standby`` error (code 32) and closes (a ``probe`` hello may ask ``stats`` and
``ping``: ``txbroker ha status``); its STOMP port does not listen, so that clients
with a host list move on at once (docs/ha.md says why).

The roles change only by the rules of ``core/ha/shared_store_role.py``.

``request_stop`` (SIGTERM, SIGINT) stops either role; the active shuts down as
a single broker does and its lock goes with its store.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
from collections.abc import Callable
from typing import Any, Final

from txbroker.core.ha.shared_store_role import (
    StoreRole,
    StoreRoleAction,
    StoreRoleInput,
    store_role_next,
)
from txbroker.errors import ProtocolError
from txbroker.protocol import ha as link
from txbroker.server.app import BrokerServer, wall_clock_ms
from txbroker.server.config import ServerConfig, peer_address
from txbroker.server.ha.link import LinkSecurity
from txbroker.server.ha.pair_link import AttachedStandby, PeerRefused, next_message
from txbroker.server.ha.standby import StandbyConnection, shared_store_refusal
from txbroker.server.ha.warm import WarmStandby, start_warm, takeover_server
from txbroker.server.security.auth import Authenticator
from txbroker.server.stores import StoreOpener, store_lock_path
from txbroker.storage.store_lock import FILE_LOCKS, LockOpener, StoreLock

__all__ = ["HaRole", "PeerRefused", "SharedStoreNode", "StandbyConnection"]

log = logging.getLogger("txbroker.ha")

#: Pause between two rounds of "try the lock, try the peer" when both failed (s).
RETRY_PAUSE: Final = 0.2
#: Right after detection: tries of the lock, and the pause between them (s).
FAST_LOCK_TRIES: Final = 10
FAST_LOCK_PAUSE: Final = 0.01
#: A standby tries the lock this often whatever its link does (s): one ``open`` and one
#: non-blocking ``fcntl`` per try (a few calls to the NFS server on a shared mount).
#: A blocking ``F_OFD_SETLKW`` in a thread would wait for the release exactly but
#: cannot be called off when the node stops: the thread would take the lock later.
LOCK_POLL_INTERVAL: Final = 0.05


#: The roles a node goes through (``stats()["ha"]["role"]``; ``core/ha/shared_store_role.py``).
HaRole = StoreRole


class SharedStoreNode:
    """One broker of a shared-store pair (see the module docstring).

    ``reload`` re-reads the configuration (file and command line) when the node
    activates; ``on_role(role, server)`` is told each role change (``server``:
    the running broker once active). ``store_opener``, ``locks`` (who takes the lock),
    ``clock`` (wall ms): the simulator gives its own; durations: the loop's clock.
    """

    def __init__(self, config: ServerConfig, reload: Callable[[], ServerConfig] | None = None,
                 on_role: Callable[[StoreRole, BrokerServer | None], None] | None = None, *,
                 store_opener: StoreOpener | None = None, locks: LockOpener = FILE_LOCKS,
                 clock: Callable[[], int] = wall_clock_ms) -> None:
        config.validate()
        if config.ha != "shared-store":
            raise ValueError("SharedStoreNode needs ha = \"shared-store\"")
        self.config = config
        self._reload = reload
        self._on_role = on_role
        self._store_opener, self.locks, self.clock = store_opener, locks, clock
        self.peer = peer_address(config.ha_peer)
        self.lock_path = store_lock_path(config)
        self.node = f"{config.host}:{config.ha_port}"
        #: TLS and the peers' handshake on the HA link (server/ha/link.py)
        self.security = LinkSecurity.from_config(config)
        self.role = HaRole.STARTING
        self.since = self.clock() / 1000
        self.server: BrokerServer | None = None
        self.lock: StoreLock | None = None
        #: wall-clock time of the last heartbeat from the active (standby side), or
        #: of the standby's last heartbeat ack (active side)
        self.last_heartbeat: float | None = None
        #: the active this standby follows ("HOST:PORT" of its HA port)
        self.following: str | None = None
        self._standby: AttachedStandby | None = None
        self._stopping = asyncio.Event()
        self._link_server: asyncio.Server | None = None
        self._refuser: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_problem = ""
        #: seconds between two tries of the lock while standby (LOCK_POLL_INTERVAL)
        self.lock_poll_interval = LOCK_POLL_INTERVAL
        # warm.py; it follows the journal's files: not over a store of the caller's
        self.warm_standby = store_opener is None
        self._warm: WarmStandby | None = None

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Role, peer, last heartbeat, lock holder: what ``txbroker ha status`` prints."""
        now = self.clock() / 1000
        standby = self._standby
        return {
            "mode": "shared-store",
            "role": self.role.value,
            "since": round(self.since, 3),
            "node": self.node,
            "peer": self.config.ha_peer,
            "following": self.following,
            "standby": standby.address if standby is not None else None,
            "last_heartbeat_age": (round(now - self.last_heartbeat, 3)
                                   if self.last_heartbeat is not None else None),
            "heartbeat_interval": self.config.heartbeat_interval,
            "activation_interval": self.config.activation_interval,
            "lock_file": str(self.lock_path),
            "lock_holder": self.locks.holder(self.lock_path),
            "link": self.security.status(),
            "warm": self._warm.status() if self._warm is not None else None,
        }

    def _enter(self, role: StoreRole, actions: tuple[StoreRoleAction, ...]) -> None:
        """Take the role a rule of the table gave (``store_role_next``); announce it."""
        if role is not self.role:
            log.info("HA role: %s -> %s", self.role.value, role.value)
            self.role = role
            self.since = self.clock() / 1000
        if StoreRoleAction.ANNOUNCE in actions and self._on_role is not None:
            self._on_role(role, self.server)

    # ------------------------------------------------------------------ run
    async def run(self) -> None:
        """Contend, then serve as the active until stopped (see the module docstring)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        if self.config.http_port:  # now, not during a takeover: 0.18-0.23 s at load 9
            importlib.import_module("txbroker.server.edges.http")
        host, port = self.config.host, self.config.ha_port
        self._link_server = await self.security.start_server(self._on_link, host, port)
        log.info("HA link on %s (peer %s)", self.node, self.config.ha_peer)
        self.security.warn_if_open(self.node)
        try:
            lock = await self._contend()
            if lock is not None:
                await self._activate(lock)
        finally:
            await self._close()

    def request_stop(self) -> None:
        """Stop: a standby stops contending, an active shuts down."""
        self._stopping.set()
        if self.server is not None:
            self.server.request_stop()

    async def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._refuser is not None:
            self._refuser.close()
            self._refuser = None
        if self._link_server is not None:
            self._link_server.close()
        if self._standby is not None:
            self._standby.writer.close()
            self._standby = None
        if self.lock is not None:
            self.lock.release()  # the store released it already when it closed
        self._enter(*store_role_next(self.role, StoreRoleInput.CLOSED))

    # ------------------------------------------------------------------ standby side
    async def _contend(self) -> StoreLock | None:
        """Alternate the lock and the active, the lock polled beside (:meth:`_poll_lock`)."""
        role_line = f"active broker, HA {self.node}"
        lock = self.locks.try_acquire(self.lock_path, role_line)
        if lock is not None or self._stopping.is_set():
            return lock
        poller = asyncio.ensure_future(self._poll_lock(role_line))
        follower = asyncio.ensure_future(self._follow_or_wait(role_line))
        try:
            await asyncio.wait({poller, follower}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (poller, follower):
                task.cancel()
            outcomes = await asyncio.gather(poller, follower, return_exceptions=True)
        locks = [outcome for outcome in outcomes if isinstance(outcome, StoreLock)]
        for extra in locks[1:]:  # both got it (cannot be: one open file holds it)
            extra.release()
        if locks:
            return locks[0]
        for outcome in outcomes:  # e.g. PeerRefused for good: a second standby
            if isinstance(outcome, BaseException) and \
                    not isinstance(outcome, asyncio.CancelledError):
                raise outcome
        return None

    async def _poll_lock(self, role_line: str) -> StoreLock | None:
        """Try the lock every ``lock_poll_interval`` until ours (None once stopped)."""
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lock_poll_interval):
                    await self._stopping.wait()
            if self._stopping.is_set():
                break
            lock = self.locks.try_acquire(self.lock_path, role_line)
            if lock is not None:
                log.info("HA: the lock was free at a poll")
                return lock
        return None

    async def _follow_or_wait(self, role_line: str) -> StoreLock | None:
        """Be the standby: follow the active, try the lock when it is lost, pause when
        the peer cannot be had; the lock, or None once stopped."""
        role, actions = store_role_next(self.role, StoreRoleInput.LOCK_BUSY)
        if StoreRoleAction.OPEN_REFUSER in actions:
            await self._open_refuser()
        self._enter(role, actions)
        if self.warm_standby and self._warm is None:
            self._warm = start_warm(self.config, self._tasks)
        while not self._stopping.is_set():
            followed = False
            try:
                followed = await self._follow()
            except PeerRefused as exc:
                if not exc.retry:
                    raise
                self._problem(f"peer {self.config.ha_peer} refused: {exc}")
            except ProtocolError as exc:
                self._problem(f"peer {self.config.ha_peer}: {exc}", error=True)
            except (OSError, TimeoutError) as exc:
                self._problem(f"peer {self.config.ha_peer} unreachable: "
                              f"{str(exc) or type(exc).__name__}")
            if followed:
                # the active just went silent or its connection broke: when its process
                # died, the kernel frees the lock a moment after the socket closes
                lock = await self._lock_soon(role_line)
                if lock is not None:
                    return lock
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RETRY_PAUSE):
                        await self._stopping.wait()
            lock = self.locks.try_acquire(self.lock_path, role_line)
            if lock is not None:
                return lock
        return None

    async def _lock_soon(self, role_line: str) -> StoreLock | None:
        """Try the lock a few times in quick succession (bench/ha_failover.py: in 12 of
        20 kills the first try came before the dead process's lock was released, and
        the round trip to the dead peer plus the pause cost 0.2 s)."""
        for _ in range(FAST_LOCK_TRIES):
            lock = self.locks.try_acquire(self.lock_path, role_line)
            if lock is not None or self._stopping.is_set():
                return lock
            await asyncio.sleep(FAST_LOCK_PAUSE)
        return None

    def _problem(self, text: str, *, error: bool = False) -> None:
        """Log a contention problem once per distinct text (the loop repeats it)."""
        if text != self._last_problem:
            self._last_problem = text
            log.log(logging.ERROR if error else logging.INFO, "HA: %s", text)

    async def _follow(self) -> bool:
        """Follow the active's heartbeats until detection; True if a handshake was made."""
        host, port = self.peer
        timeout = self.config.heartbeat_interval
        reader, writer = await self.security.connect(host, port, timeout)
        try:
            decoder = link.HaDecoder()
            writer.write(link.encode("standby", node=self.node,
                                     lock=self.locks.holder(self.lock_path)))
            try:
                async with asyncio.timeout(timeout):
                    welcome = await next_message(reader, decoder)
            except TimeoutError:
                raise TimeoutError(f"connected, but no answer to the HA handshake within "
                                   f"{timeout:g} s (a stopped active, or not an HA port)") from None
            if welcome["type"] == "refused":
                raise PeerRefused(str(welcome.get("reason", "")), bool(welcome.get("retry")))
            if welcome["type"] != "welcome":
                raise ProtocolError(f"expected welcome, got {welcome['type']!r}")
            self.following = str(welcome.get("node", self.config.ha_peer))
            self.last_heartbeat = self.clock() / 1000
            self._last_problem = ""
            log.info("HA: standby of the active %s", self.following)
            await self._watch(reader, writer, decoder)
            return True
        finally:
            writer.close()

    async def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     decoder: link.HaDecoder) -> None:
        """Read heartbeats until detection (silence, a broken link) or a stop."""
        activation, clock = self.config.activation_interval, asyncio.get_running_loop().time
        silent_at = clock() + activation  # detection, unless a heartbeat comes first
        while not self._stopping.is_set():
            # the timer decides: clock() may not move in between (shared-store-live seed 10)
            wake = min(silent_at, clock() + 1.0)
            try:
                async with asyncio.timeout_at(wake):
                    data = await reader.read(4096)
            except TimeoutError:
                if wake < silent_at:
                    continue  # a look at _stopping once a second
                log.warning("HA: no heartbeat from the active %s for %.1f s: trying the lock",
                            self.following, activation)
                return
            except OSError as exc:
                data = b""
                log.debug("HA link read failed: %s", exc)
            if not data:
                log.warning("HA: the connection to the active %s broke: trying the lock",
                            self.following)
                return
            for message in decoder.feed(data):
                if message["type"] == "heartbeat":
                    silent_at = clock() + activation
                    self.last_heartbeat = self.clock() / 1000
                    writer.write(link.encode("heartbeat_ack", seq=message.get("seq")))

    # ------------------------------------------------------------------ activation
    async def _activate(self, lock: StoreLock) -> None:
        """Re-read the configuration, recover the store, open the listeners, serve."""
        self.lock = lock
        self.following = None
        self.last_heartbeat = None  # from now on: the standby's last heartbeat ack
        role, actions = store_role_next(self.role, StoreRoleInput.LOCK_TAKEN)
        self._enter(role, actions)
        log.info("HA: holding the lock %s: taking over", self.lock_path)
        config = self.config
        if self._reload is not None:
            try:
                config = self._reload()
            except (OSError, ValueError) as exc:  # keep the settings we started with
                log.error("HA: cannot re-read the configuration (%s): keeping the current one",
                          exc)
        if StoreRoleAction.CLOSE_REFUSER in actions and self._refuser is not None:
            self._refuser.close()
            self._refuser = None
        server = (await takeover_server(self._warm, config, lock) if self._store_opener is None
                  else BrokerServer(config, lock=lock, store_opener=self._store_opener))
        server.clock = self.clock
        server.ha_status = self.status
        self.server = server
        await server.recover()
        await server.open_listeners()
        self._enter(*store_role_next(self.role, StoreRoleInput.SERVING))
        if self._stopping.is_set():
            server.request_stop()
        await server.serve_forever()

    # ------------------------------------------------------------------ active side
    async def _on_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A peer connected to our HA port: welcome it as our standby, or refuse."""
        peer = writer.get_extra_info("peername")
        address = f"{peer[0]}:{peer[1]}" if peer else "?"
        decoder = link.HaDecoder()
        try:
            async with asyncio.timeout(self.config.heartbeat_interval):
                hello = await next_message(reader, decoder)
        except ProtocolError as exc:
            log.error("HA: %s on the HA port: %s", address, exc)
            writer.close()
            return
        except (OSError, TimeoutError):
            writer.close()
            return
        refusal = self._refusal(hello)
        if refusal is not None:
            reason, retry = refusal
            writer.write(link.encode("refused", reason=reason, retry=retry))
            if not retry:
                log.error("HA: refused %s (%s): %s", hello.get("node"), address, reason)
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            return
        node = str(hello.get("node", address))
        standby = AttachedStandby(node, writer, asyncio.get_running_loop().time())
        if self._standby is not None:  # the same standby again, or one that went silent
            self._standby.writer.close()
        self._standby = standby
        writer.write(link.encode("welcome", node=self.node,
                                 lock=self.locks.holder(self.lock_path),
                                 heartbeat_interval=self.config.heartbeat_interval))
        log.info("HA: %s is the standby", node)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._heartbeats(standby, reader, decoder)
        finally:
            self._tasks.discard(task)
            if self._standby is standby:
                self._standby = None
                log.warning("HA: the standby %s is gone", node)
            writer.close()

    def _refusal(self, hello: dict[str, Any]) -> tuple[str, bool] | None:
        """Why this active does not take ``hello``'s sender as its standby, if it does not."""
        if hello.get("type") != "standby":
            return f"expected a standby hello, got {hello.get('type')!r}", False
        _, actions = store_role_next(self.role, StoreRoleInput.STANDBY_HELLO)
        if StoreRoleAction.CHECK_STANDBY not in actions:
            return f"{self.node} is {self.role.value}, not the active", True
        current, now = self._standby, asyncio.get_running_loop().time()
        if current is not None and current.address != hello.get("node") and \
                now - current.last_ack < self.config.activation_interval:
            return (f"the active {self.node} already has a standby ({current.address}); "
                    "a shared store has one active and one standby"), False
        ours = self.locks.holder(self.lock_path)
        if hello.get("lock") != ours:
            return (f"the peer reads {hello.get('lock')!r} in its lock file but this active "
                    f"wrote {ours!r}: the two brokers do not share one data directory"), False
        return None

    async def _heartbeats(self, standby: AttachedStandby, reader: asyncio.StreamReader,
                          decoder: link.HaDecoder) -> None:
        """Send a heartbeat every interval; read the acks; return when the link breaks."""
        interval, clock = self.config.heartbeat_interval, asyncio.get_running_loop().time
        reading = asyncio.ensure_future(reader.read(4096))
        seq = 0
        try:
            while True:
                seq += 1
                standby.writer.write(link.encode("heartbeat", seq=seq))
                deadline = clock() + interval
                while (remaining := deadline - clock()) > 0:
                    done, _ = await asyncio.wait([reading], timeout=remaining)
                    if not done:
                        break
                    data = reading.result()
                    if not data:
                        return
                    for message in decoder.feed(data):
                        if message["type"] == "heartbeat_ack":
                            standby.last_ack = clock()
                            self.last_heartbeat = self.clock() / 1000
                    reading = asyncio.ensure_future(reader.read(4096))
        except (OSError, ProtocolError) as exc:
            log.info("HA: link to the standby %s: %s", standby.address, exc)
        finally:
            reading.cancel()

    # ------------------------------------------------------------------ client ports
    async def _open_refuser(self) -> None:
        """While standby, the native port answers ``Standby`` (STOMP: not listening)."""
        config = self.config
        if not config.port or self._refuser is not None:
            return
        auth = Authenticator(config.users)
        self._refuser = await asyncio.get_running_loop().create_server(
            lambda: StandbyConnection(
                config, auth, status=self.status, role=lambda: self.role.value,
                refusal=lambda op: shared_store_refusal(config, self.following, op)),
            config.host, config.port, reuse_address=True)
