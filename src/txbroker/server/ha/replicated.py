"""Replicated HA (seed 001): one primary, backups that each keep a copy on their own
disk, promotion decided outside the brokers (``txbroker ha promote``, or etcd).

Theory of operation
-------------------
Every broker of the group is started the same way (``--ha replicated --ha-port P
--ha-peers H:P,H:P``, each with its own data directory) and starts as a **backup**:
it holds its own store's lock, listens on its HA port, answers clients with
``Standby`` (a client moves on through its failover list), and looks for the
primary among its peers: the peer that welcomes its ``join``. It then follows the
primary (``server/ha/replica.py``), joining again after any break.

A backup becomes the **primary** only when told: ``txbroker ha promote --url`` (a
cluster manager such as Pacemaker — the seed's rgmanager), or by taking the etcd key
(``etcd.py``). Its copy must be whole (no ``REPLICA_INCOMPLETE`` marker); a group of
three or more without etcd also asks a majority (``quorum.py``, ``core/ha/promotion.py``).
Promotion finishes recovery from the state the backup replayed (or its own store),
opens the client listeners and starts the hub (``replication.py``): the others join.

The role's changes are the rules of ``core/ha/replicated_role.py`` (backup, promoting,
primary, stopped): :meth:`ReplicatedNode.step` feeds the table, announces changes.

Nothing a client left open reaches a backup: only committed entries and prepared
XA branches are replicated, so after a failover every open, unprepared transaction
of the old primary is gone (rolled back) and every prepared branch is still
prepared, for the transaction manager to complete (seed requirement 5). The simulator
gives a node its ``make_server``, ``clock_ns`` and ``etcd`` (an httpx transport).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from txbroker.core.ha.follower import CopyState
from txbroker.core.ha.replicated_role import NodeRole, RoleAction, RoleInput, role_next
from txbroker.core.ha.transition import IllegalTransition
from txbroker.errors import EtcdError, IllegalState, ProtocolError
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig, peer_address
from txbroker.server.ha import replicated_etcd as on_etcd
from txbroker.server.ha.clock import monotonic
from txbroker.server.ha.etcd import EtcdClient, EtcdTransport
from txbroker.server.ha.etcd_lease import (
    Candidate,
    campaign_pause,
    get_ready_set,
    ready_key,
)
from txbroker.server.ha.link import LinkAuthFailed, LinkSecurity
from txbroker.server.ha.quorum import QuorumPromotion
from txbroker.server.ha.replica import (
    LOCK_LINE,
    Follower,
    PrimaryRefused,
    ServerFactory,
    end_position,
    new_server,
)
from txbroker.server.ha.replica_files import (
    forget_standing,
    incomplete,
    read_standing,
    write_record,
)
from txbroker.server.ha.replicated_link import on_link
from txbroker.server.ha.replicated_status import node_status
from txbroker.server.ha.replication import ReplicationHub
from txbroker.server.ha.standby import BackupPorts
from txbroker.server.ha.standings import announce_promotion
from txbroker.server.process import gc_paused
from txbroker.server.stores import store_lock_path
from txbroker.storage.store_lock import StoreLock

log = logging.getLogger("txbroker.ha")

__all__ = ["ReplicatedNode", "Role"]

#: Pause between two rounds over the peers when none is a primary (s).
SEARCH_PAUSE: Final = 0.3

#: The roles of a replicated broker (``core/ha/replicated_role.py``).
Role = NodeRole


class LinkEnd(enum.StrEnum):
    """How one attempt to follow a peer ended (``ReplicatedNode._follow``)."""

    ENDED = "ended"  #: the link ended (or never began): try the next peer
    PROMOTE = "promote"  #: this node is promoted
    STOP = "stop"  #: the node stops
    SEARCH = "search"  #: a peer announced its promotion before any welcome: search anew


class ReplicatedNode:
    """One broker of a replicated group (module docstring)."""

    def __init__(self, config: ServerConfig,
                 on_role: Callable[[NodeRole, BrokerServer | None], None] | None = None,
                 *, make_server: ServerFactory = new_server, etcd: EtcdTransport | None = None,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        config.validate()
        self._make_server, self._clock_ns, self._etcd_via = make_server, clock_ns, etcd
        if config.ha != "replicated":
            raise ValueError('ReplicatedNode needs ha = "replicated"')
        self.config = config
        self._on_role = on_role
        self.node = config.ha_node or f"{config.host}:{config.ha_port}"
        self.peers = [peer_address(p.strip()) for p in config.ha_peers.split(",") if p.strip()]
        self.lock_path = store_lock_path(config)
        #: TLS and the peers' handshake on the replication link (server/ha/link.py)
        self.security = LinkSecurity.from_config(config)
        self.role = Role.BACKUP
        self.since = time.time()
        self.server: BrokerServer | None = None
        self.hub: ReplicationHub | None = None
        self.follower: Follower | None = None
        self.lock: StoreLock | None = None
        self._promote = asyncio.Event()
        self._stopping = asyncio.Event()
        self._link_server: asyncio.Server | None = None
        #: the client ports while a backup (native: Standby; HTTP: POST /api/ha/promote)
        self._ports = BackupPorts(config, status=self.status, promote=self.request_promotion,
                                  refusal=self._refusal, role=lambda: self.role.value)
        self.last_problem = ""
        self._link_problems: dict[tuple[str, int], str] = {}  #: the last failure per peer
        #: whether the primary counted our copy as ready when we last lost it, as synced in
        #: the data directory (REPLICA_STATE; None: no record, e.g. a primary's directory)
        self.copy_ready: bool | None = read_standing(config.data)
        self.copy_position = -1  #: the LSN our last copy had durable
        #: etcd (``--ha-etcd``): the client, our candidacy, who holds the primary key
        self.etcd: EtcdClient | None = None
        self.candidate: Candidate | None = None
        self.etcd_primary: str | None = None
        #: the ready set the last primary recorded in etcd (None: none recorded)
        self.etcd_ready: list[str] | None = None
        self.etcd_ready_primary: str | None = None  #: the primary that recorded it
        self._manual = False  #: an operator asked for promotion (etcd: take the key)
        self._nudge = asyncio.Event()  #: ends the campaign's pause (promote, loss, stop)
        self.search_now = asyncio.Event()  #: a peer is being promoted: search now
        #: monotonic time this backup last lost the primary it followed (etcd campaign)
        self._lost_primary_at: float | None = None
        self.fenced = ""
        #: without etcd, three nodes or more: the ready set is recorded on a majority and
        #: a promotion asks a majority (core/ha/promotion.py); a pair keeps its own view
        self.quorum = QuorumPromotion(self) if not config.ha_etcd and len(self.peers) >= 2 \
            else None

    @property
    def stopping(self) -> asyncio.Event:
        """Set once the node stops, or is fenced."""
        return self._stopping

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """What ``txbroker ha status`` prints for this broker (``replicated_status.py``)."""
        return node_status(self)

    def step(self, event: RoleInput) -> tuple[RoleAction, ...]:
        """Move the role by the table (``core/ha/replicated_role.py``); announce it."""
        role, actions = role_next(self.role, event)
        if role is not self.role:
            log.info("HA role: %s -> %s", self.role.value, role.value)
            self.role, self.since = role, time.time()
        if RoleAction.ANNOUNCE in actions and self._on_role is not None:
            self._on_role(role, self.server)
        return actions

    def promotable(self) -> str | None:
        """Why this broker may not become the primary now (None: it may)."""
        try:
            role_next(self.role, RoleInput.PROMOTE)
        except IllegalTransition:
            return f"it is the {self.role.value}"
        follower = self.follower
        if follower is not None and follower.server is not None and follower.connected:
            if follower.state is not CopyState.FOLLOWING:
                return "its copy of the primary is incomplete (still copying)"
            if not follower.ready:
                return ("the primary does not count it as ready (it is catching up): "
                        "it may miss acknowledged entries")
            return None
        if incomplete(self.config.data):
            return "its copy of the primary is incomplete (REPLICA_INCOMPLETE)"
        if self.copy_ready is False:
            return ("the primary it lost did not count it as ready (it was catching up): "
                    "it may miss acknowledged entries; promote a ready backup")
        return None

    def request_promotion(self, args: dict[str, Any] | None = None
                          ) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """``ha_promote``: become the primary (IllegalState when not promotable). In a
        group that records its ready set, the answer waits for the peers' standings
        (``{"force": true}``: promote even when they do not allow it)."""
        why = self.promotable()
        if why is not None:
            raise IllegalState(f"{self.node} cannot be promoted: {why}")
        if self.candidate is not None:  # etcd decides: take the primary key first
            why = on_etcd.etcd_refusal(self)
            if why is not None:
                raise IllegalState(f"{self.node} cannot be promoted: {why}")
            self._manual = True
            self._nudge.set()  # take the key now, not at the campaign's next round
            return {"node": self.node, "promoting": True, "via": "etcd"}
        if self.quorum is not None:  # the peers first (server/ha/quorum.py)
            return self.quorum.check(bool((args or {}).get("force")), self._promote)
        self._promote.set()
        return {"node": self.node, "promoting": True}

    def request_stop(self) -> None:
        """Stop in any role."""
        if RoleAction.STOP in self.step(RoleInput.STOP):
            self._stopping.set()
            self._nudge.set()
            if self.server is not None:  # promoting: serve_forever returns at once
                self.server.request_stop()

    # ------------------------------------------------------------------ run
    async def run(self) -> None:
        """Be a backup until promoted, then the primary, until stopped."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        self.lock = StoreLock.try_acquire(self.lock_path, LOCK_LINE.format(node=self.node))
        if self.lock is None:
            raise RuntimeError(f"the data directory {self.config.data} is in use by another "
                               "broker (its store lock is held)")
        follower = Follower(self.config, self.lock, self.lock_path, self.node, self.security,
                            make_server=self._make_server)
        if follower.resume_disk_copy():  # the copy on disk, to resume (replica.py)
            self.follower = follower
        self.lock = follower.lock
        self._link_server = await self.security.start_server(
            functools.partial(on_link, self), self.config.host, self.config.ha_port)
        self.security.warn_if_open(self.node)
        await self._ports.open()
        if self._on_role is not None:
            self._on_role(Role.BACKUP, None)
        etcd_task = None
        if self.config.ha_etcd:
            config = self.config
            ttl = config.ha_lease_ttl
            self.etcd = EtcdClient([e.strip() for e in config.ha_etcd.split(",") if e.strip()],
                                   timeout=max(0.5, ttl / 3), transport=self._etcd_via)
            self.candidate = Candidate(self.etcd, f"/txbroker/{config.ha_cluster}", self.node,
                                       ttl=ttl, on_lost=self.fence)
            etcd_task = asyncio.ensure_future(self._campaign())
        try:
            promoted = await self._be_backup()
            if promoted:
                await self._be_primary()
        finally:
            if etcd_task is not None:
                etcd_task.cancel()
            await self._close()

    async def _be_backup(self) -> bool:
        """Follow whichever peer is the primary; True once promoted."""
        while not self._stopping.is_set():
            for host, port in self.peers:
                if self._promote.is_set():
                    return True
                if self._stopping.is_set():
                    return False
                assert self.lock is not None
                follower = self.follower
                if follower is None:  # else: a whole copy kept to resume (replica.py)
                    follower = Follower(self.config, self.lock, self.lock_path, self.node,
                                        self.security, make_server=self._make_server)
                self.follower = follower
                outcome = await self._follow(follower, host, port)
                if outcome is LinkEnd.SEARCH:  # a peer is being promoted: from the first peer
                    break
                self.lock = follower.lock  # it takes the lock again when it replaces a copy
                if outcome is LinkEnd.PROMOTE and follower.state is CopyState.FOLLOWING:
                    return True  # promoted from the copy it replayed
                if follower.server is not None:
                    self.copy_ready = follower.state is CopyState.FOLLOWING and follower.ready
                    self.copy_position = follower.durable_lsn
                if outcome is LinkEnd.ENDED and follower.resumable() \
                        and self.config.ha_catchup_bytes:
                    continue  # keep the copy: the next primary may send just the suffix
                self._drop_copy(follower, checkpoint=outcome is LinkEnd.STOP)
                if outcome is LinkEnd.PROMOTE:
                    return True  # promoted from its own store (recovered from disk)
                if outcome is LinkEnd.STOP:
                    return False
            await self._search_pause()
        return False

    async def _search_pause(self) -> None:
        """SEARCH_PAUSE, or less: a promotion, or a peer saying it is being promoted."""
        waits = {asyncio.ensure_future(self._promote.wait()),
                 asyncio.ensure_future(self.search_now.wait())}
        try:
            await asyncio.wait(waits, timeout=SEARCH_PAUSE, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        self.search_now.clear()

    def _drop_copy(self, follower: Follower, checkpoint: bool = False) -> None:
        """Close a copy's store (its data stays on disk; ``checkpoint``: the node stops,
        ``Follower.close_store``) and take the lock again: the store gives it up when it
        closes."""
        self.follower = None
        if follower.server is None:
            return
        follower.close_store(checkpoint)
        self.lock = StoreLock.try_acquire(self.lock_path, LOCK_LINE.format(node=self.node))
        if self.lock is None:
            raise RuntimeError(f"the data directory {self.config.data} was taken by another "
                               "process while this backup changed primaries")

    async def _follow(self, follower: Follower, host: str, port: int) -> LinkEnd:
        """Follow one peer until the link ends (ENDED), a promotion (PROMOTE), a stop
        (STOP), or a peer says it is being promoted while this attempt has no
        primary's welcome yet (SEARCH: a connect to a peer behind a black hole would
        otherwise hold the search for its whole timeout while the new primary waits
        for its majority: simulation seed 39104)."""
        links = follower.links
        task = asyncio.ensure_future(follower.follow(host, port))
        waiter = asyncio.ensure_future(self._promote.wait())
        stopper = asyncio.ensure_future(self._stopping.wait())
        searcher = asyncio.ensure_future(self._announced(follower, links))
        try:
            await asyncio.wait({task, waiter, stopper, searcher},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stopper.cancel()
            searcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            if self._promote.is_set():
                return LinkEnd.PROMOTE
            return LinkEnd.STOP if self._stopping.is_set() else LinkEnd.SEARCH
        if follower.links != links:  # a primary welcomed us and the link ended: lost it
            self._lost_primary_at = monotonic()
            self._nudge.set()  # etcd: publish our final position, watch the key closely
        try:
            task.result()
            self._link_problems.pop((host, port), None)
            if follower.server is not None:
                log.warning("replication: lost the primary %s", follower.primary)
                self.last_problem = f"lost the primary {follower.primary}"
        except PrimaryRefused as exc:
            self.last_problem = f"{host}:{port}: {exc}"
            if exc.standing is not None and self.quorum is not None:
                self.quorum.heard[exc.standing.node] = exc.standing
        except LinkAuthFailed as exc:  # TLS or the handshake: say it once per peer and cause
            problem = f"{host}:{port}: {exc}"
            if self._link_problems.get((host, port)) != problem:
                self._link_problems[(host, port)] = problem
                log.error("HA: peer %s", problem)
            self.last_problem = problem
        except (OSError, TimeoutError, ProtocolError) as exc:
            self.last_problem = f"{host}:{port}: {exc!r}"
        if self._promote.is_set():
            return LinkEnd.PROMOTE
        return LinkEnd.ENDED

    async def _announced(self, follower: Follower, links: int) -> None:
        """Return when a peer announces its promotion while ``follower`` has had no
        welcome since ``links`` (it is not following a primary on this attempt)."""
        while True:
            await self.search_now.wait()
            if follower.links == links:
                return
            self.search_now.clear()  # following a primary: the announcement is old news

    async def _be_primary(self) -> None:
        """Finish recovery (from the replayed copy or our own store), then serve."""
        self.step(RoleInput.PROMOTE)
        started = monotonic()
        follower = self.follower
        if follower is not None and follower.server is not None \
                and follower.state is CopyState.FOLLOWING:
            server = follower.server
            end_position(server)  # before recovery's own entries (leftover commits)
            server.finish_recovery(started)
        else:
            if follower is not None:
                self._drop_copy(follower)
            server = self._make_server(self.config, self.lock)
            with gc_paused():  # BrokerServer.recover, with the count ended in between
                server.open_store()
                end_position(server)
                server.finish_recovery(started)
        self.follower, self.last_problem = None, ""
        hub = ReplicationHub(server, self.node, self.config.backup_timeout,
                             self.config.ha_catchup_bytes, clock_ns=self._clock_ns)
        if self.quorum is not None:  # answers wait until the term's record is on a majority
            data = self.config.data
            hub.records.write_own = lambda record: write_record(data, record)
            hub.records.on_superseded = self._superseded
            hub.records.start_term(self.quorum.term, self.quorum.backups_needed())
        else:
            forget_standing(self.config.data)
        if self.etcd is not None:
            server.ops.answer_guard = functools.partial(on_etcd.lease_guard, self)
            hub.on_ready_change = functools.partial(on_etcd.record_ready, self)
            await on_etcd.record_first_ready_set(self)  # until a backup is ready, none may succeed
        server.wrap_store(hub.wrap)
        # seed 001, "TX Commit/Rollback: do prepare phase as for DTX": the backups vote
        server.broker.vote_local_commits(True)
        self.hub, self.server = hub, server
        server.ha_status = self.status
        hub.spawn(announce_promotion(self.security, self.peers))  # backups join (promoting)
        if self.quorum is not None:  # until a majority holds our term; clients get Standby
            await hub.records.first_confirmed(self._stopping)
        self._ports.close()
        await server.open_listeners()
        log.info("replication: %s is the primary (promoted in %.2f s)", self.node,
                 monotonic() - started)
        self.step(RoleInput.SERVING)
        if self._stopping.is_set():
            server.request_stop()
        await server.serve_forever()

    # ------------------------------------------------------------------ etcd
    async def _campaign(self) -> None:
        """While a backup: publish our position, and take the primary key when the
        rule says so (``server/ha/etcd_lease.py``) — then promote."""
        candidate = self.candidate
        assert candidate is not None
        ttl = self.config.ha_lease_ttl
        published: tuple[int, bool] | None = None
        while self.role is Role.BACKUP and not self._stopping.is_set():
            pause = campaign_pause(ttl, following=True, holder=None, node=self.node,
                                   lost_for=None)
            self._nudge.clear()
            try:
                follower = self.follower
                following = follower is not None and follower.state is CopyState.FOLLOWING \
                    and follower.connected
                if follower is not None and following:
                    position, ready = follower.durable_lsn, follower.ready
                else:  # a copy whose primary is gone: ready if it was ready then (a node
                    # that has followed nobody since it started waits for `ha promote`)
                    position = self.copy_position
                    ready = self.copy_ready is True and self.promotable() is None
                self.etcd_ready_primary, self.etcd_ready, revision = await get_ready_set(
                    candidate.client, self.config.ha_cluster)
                # the key is taken only while the record read now is still the last one:
                # a node stopped between this read and the take decides on nothing stale
                unchanged = (ready_key(self.config.ha_cluster), revision)
                if self.etcd_ready is not None and self.node not in self.etcd_ready:
                    ready = False  # the last primary stopped counting on this copy
                if (position, ready) != published:  # its own task keeps the entry alive
                    await candidate.board.publish(position, ready=ready)
                    published = (position, ready)
                self.etcd_primary = await candidate.primary()
                taken = False
                if self._manual:  # asked earlier: does it still stand? (else dropped)
                    self._manual = on_etcd.manual_request_stands(self)
                if self._manual and self.etcd_primary is None:
                    taken = await candidate.holder.acquire(unchanged)
                elif self.etcd_primary is None and not following:
                    taken = await candidate.try_take(unchanged)
                if taken:
                    self.etcd_primary = self.node
                    log.info("etcd: %s took the primary key", self.node)
                    self._promote.set()
                    return
                lost = self._lost_primary_at
                pause = campaign_pause(ttl, following=following, holder=self.etcd_primary,
                                       node=self.node, lost_for=None if lost is None
                                       else monotonic() - lost)
            except EtcdError as exc:
                self.last_problem = f"etcd: {exc}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudge.wait(), pause)

    def fence(self, reason: str, event: RoleInput = RoleInput.LEASE_LOST) -> None:
        """The primary lost its etcd lease, or a backup holds a newer term (another
        primary was promoted): stop serving NOW (before anyone can take over): every
        client connection is cut, then the broker stops."""
        if self.fenced and self.server is not None:  # again: nothing more is written
            self.server.ops.abort_all()
            return
        if RoleAction.FENCE not in self.step(event):
            return
        what = "etcd: lost the primary key" if event is RoleInput.LEASE_LOST \
            else "HA: superseded"
        log.critical("%s (%s): fencing — no more replies", what, reason)
        self.fenced = reason
        server = self.server
        if server is not None:
            server.ops.abort_all()
            server.request_stop()
        self._stopping.set()

    def _superseded(self, reason: str) -> None:
        self.fence(reason, RoleInput.SUPERSEDED)

    async def _close(self) -> None:
        candidate = self.candidate
        if candidate is not None:
            with contextlib.suppress(EtcdError):
                if candidate.holder.held and not self.fenced:
                    await candidate.holder.release()  # a clean stop frees the key at once
            await candidate.close()
        if self.etcd is not None:
            await self.etcd.close()
        self._ports.close()
        if self._link_server is not None:
            self._link_server.close()
        if self.follower is not None:
            self.follower.close_store(checkpoint=True)
        if self.lock is not None and self.lock.held:
            self.lock.release()
        self.step(RoleInput.CLOSED)

    # ------------------------------------------------------------------ the HA port
    def _refusal(self, op: str) -> str:
        follower = self.follower
        primary = follower.primary_address if follower is not None else ""
        return (f"this broker ({self.node}) is a backup of a replicated group"
                + (f" (the primary's HA address is {primary})" if primary else "")
                + ": try the next address")
