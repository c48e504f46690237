"""Holding the primary key in etcd under a lease, fencing, and the backups' promotion rule.

Keys (``PREFIX`` is e.g. ``/txbroker/<cluster>``; see ``docs/etcd.md``)::

    PREFIX/primary            value: the primary's node name; attached to its lease
    PREFIX/progress/<node>    value: {"position": N, "ready": bool}; the node's own lease

:class:`LeaseHolder` — "hold key K with value V under a lease of TTL seconds".
``acquire()`` grants a fresh lease and creates K with it in one transaction that
succeeds only if K does not exist. A keep-alive task renews the lease every TTL/3;
a watchdog task calls ``on_lost(reason)`` as soon as

    now - last_renewal_sent >= TTL - margin        (default margin: max(TTL/3, 0.5 s))

or as soon as a renewal answers that the lease has expired. ``last_renewal_sent`` is
the monotonic time at which the last renewal *that etcd granted* was **sent** (for
the first one: when the grant request was sent).

The timing argument (fencing by lease)
--------------------------------------
etcd expires a lease TTL seconds after the last renewal *it processed*; it resets
the lease's expiry when it *receives* a renewal, and that is after we *sent* it. So
the lease — and with it key K — cannot disappear before ``sent + TTL`` on our clock,
where ``sent`` is the send time of the last renewal etcd granted: nobody else can
create K earlier. The holder gives up (``on_lost``: stop serving) at
``sent + TTL - margin``, so it has stopped ``margin`` seconds before the earliest
moment another node could take the key. This holds when

* the two clocks run at rates that differ by less than ``margin / TTL`` over one
  TTL (both sides use monotonic clocks — never wall-clock time, which can jump;
  etcd's lessor also uses a monotonic clock): with the defaults (TTL 10 s, margin
  3.33 s) that is a 33 % tolerance, far above any real clock drift;
* this process's event loop is not blocked for longer than ``margin`` (the watchdog
  is an asyncio task; a stall past the margin — a swap storm, SIGSTOP of the broker —
  could make it act late). ``on_lost`` must stop serving *synchronously* (set a flag
  checked before every reply), not schedule work;
* nobody deletes K by hand (``etcdctl del``) while the holder believes it holds it.

etcd only ever *extends* leases on its own (a new etcd leader renews every lease),
which only makes the argument more conservative. etcd also grants at least its
minimum TTL (1.5 election timeouts: 2 s by default); the holder uses the TTL etcd
granted, never the one asked for.

The promotion rule (:class:`Candidate`)
---------------------------------------
Each backup publishes its replication position and whether it is *ready* on the
progress board (under its own lease, so a dead node's entry vanishes). When K is
free, a backup tries to take it only if it is ready and the board names it the most
up-to-date ready backup (ties: the smallest node name) — or, if K has stayed free for
TTL more seconds (the best one died too, or cannot reach etcd), any ready backup
tries. Exclusivity comes from the create transaction, not from the board: two
candidates racing both call ``create`` and exactly one wins. The board is an
optimisation — every ready backup holds every acknowledged entry, so promoting a
ready backup that is not the best loses nothing acknowledged, only what was not yet
acknowledged. A backup should publish its final position before calling
``try_take`` after it lost the primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from txbroker.errors import EtcdError
from txbroker.server.ha.clock import monotonic
from txbroker.server.ha.etcd import EtcdClient

__all__ = ["DEFAULT_TTL_S", "Candidate", "LeaseHolder", "Progress", "ProgressBoard",
           "best_candidate", "campaign_pause", "default_margin", "primary_key",
           "progress_key"]

log = logging.getLogger(__name__)

#: The lease TTL the HA mode should default to (docs/etcd.md: 10 s; fencing 6.67 s).
DEFAULT_TTL_S = 10

#: Pause between renewal attempts after a failed one (refused: instant failures).
RETRY_S = 0.1
#: A backup's campaign pause while the key is held by a primary it lost (s): the key
#: goes when the dead primary's lease expires, and a TTL/3 pause there added up to
#: TTL/3 to every takeover (the independent test: TTL + 1 s at TTL 3 s). For at most
#: FAST_CAMPAIGN_TTLS lease TTLs after the loss: a key held longer is a live primary's.
FAST_CAMPAIGN_PAUSE = 0.05
FAST_CAMPAIGN_TTLS = 1.5


def campaign_pause(ttl: float, *, following: bool, holder: str | None, node: str,
                   lost_for: float | None) -> float:
    """Seconds a backup's campaign waits before its next round: TTL/3 (at least
    0.2 s), but :data:`FAST_CAMPAIGN_PAUSE` while another node holds the key, this
    backup follows nobody and lost its primary less than FAST_CAMPAIGN_TTLS lease TTLs
    ago (``lost_for``: seconds since; None: never) — a dead primary's key, about to
    expire."""
    if not following and holder not in (None, node) and lost_for is not None \
            and lost_for < FAST_CAMPAIGN_TTLS * ttl:
        return FAST_CAMPAIGN_PAUSE
    return max(0.2, ttl / 3)


def primary_key(prefix: str) -> str:
    """The key the primary holds under its lease."""
    return f"{prefix.rstrip('/')}/primary"


def progress_key(prefix: str, node: str = "") -> str:
    """A node's key on the progress board (``node=""``: the board's prefix)."""
    return f"{prefix.rstrip('/')}/progress/{node}"


def default_margin(ttl: float) -> float:
    """The fencing margin for a lease of ``ttl`` seconds: TTL/3, at least 0.5 s."""
    return max(ttl / 3, 0.5)


class LeaseHolder:
    """Holds ``key = value`` in etcd under a lease and fences itself (module docstring).

    ``on_lost(reason)`` is called once, from the event loop, when the holder must
    consider the key lost; it must stop serving at once. ``clock`` is a monotonic
    clock (default: the running loop's, ``server/ha/clock.py`` — ``time.monotonic``
    in production, virtual time under the simulator). Attributes for observers and tests:
    ``last_renewal_sent``, ``deadline`` (when ``on_lost`` will fire without a
    renewal), ``granted_ttl``, ``lost_at`` and ``lost_reason``.
    """

    def __init__(self, client: EtcdClient, key: str, value: str, *, ttl: int,
                 on_lost: Callable[[str], None], margin: float | None = None,
                 clock: Callable[[], float] = monotonic) -> None:
        self.client = client
        self.key = key
        self.value = value
        self.ttl = ttl
        self.on_lost = on_lost
        self._margin = margin
        self.clock = clock
        self.lease_id: int | None = None
        self.granted_ttl = 0
        self.margin = 0.0
        self.last_renewal_sent = 0.0
        self.deadline = 0.0
        self.lost_at: float | None = None
        self.lost_reason = ""
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def held(self) -> bool:
        """Whether the key is held: acquired, neither lost nor released."""
        return self.lease_id is not None and self.lost_at is None

    async def acquire(self, unchanged: tuple[str, int] | None = None) -> bool:
        """Create the key with a fresh lease if nobody holds it (and, with ``unchanged``
        ``(key, mod_revision)``, if that key has not changed since it was read); whether
        we hold it now.

        Raises :class:`~txbroker.errors.EtcdError` (``EtcdUnavailable``) when etcd
        does not answer; the fresh lease is then revoked if possible.
        """
        if self.held:
            return True
        sent = self.clock()
        lease, granted = await self.client.grant(self.ttl)
        try:
            created = await self.client.create(self.key, self.value, lease=lease,
                                               unchanged=unchanged)
        except BaseException:
            await self._revoke_quietly(lease)
            raise
        margin = self._margin if self._margin is not None else default_margin(granted)
        if not created or sent + granted - margin <= self.clock():
            await self._revoke_quietly(lease)  # lost the race, or too slow to be safe
            return False
        self.lease_id, self.granted_ttl, self.margin = lease, granted, margin
        self.last_renewal_sent, self.deadline = sent, sent + granted - margin
        self.lost_at, self.lost_reason = None, ""
        self._tasks = [asyncio.create_task(self._renew(), name=f"etcd-renew {self.key}"),
                       asyncio.create_task(self._watch(), name=f"etcd-fence {self.key}")]
        log.info("etcd: holding %s=%s (lease %x, TTL %d s, margin %.2f s)",
                 self.key, self.value, lease, granted, margin)
        return True

    async def release(self) -> None:
        """Step down cleanly: stop renewing and revoke the lease, which deletes the key
        at once. Stop serving *before* calling this. ``on_lost`` is not called."""
        await self._stop_tasks()
        lease, self.lease_id = self.lease_id, None
        if lease is not None:
            await self.client.revoke(lease)

    async def close(self) -> None:
        """Stop the background tasks without touching etcd (the lease then expires)."""
        await self._stop_tasks()

    # -- background ---------------------------------------------------------------------

    async def _renew(self) -> None:
        assert self.lease_id is not None
        interval = self.granted_ttl / 3
        next_at = self.last_renewal_sent + interval
        while self.held:
            await asyncio.sleep(max(0.0, next_at - self.clock()))
            sent = self.clock()
            if sent >= self.deadline:  # resumed past it (a SIGSTOP): a renewal sent now
                # would keep a fenced holder's key for one more TTL and delay the takeover
                self._lose(self._silence())
                return
            try:
                remaining = await self.client.keepalive(self.lease_id)
            except EtcdError as exc:
                log.warning("etcd: renewing the lease of %s failed: %s", self.key, exc)
                next_at = self.clock() + RETRY_S
                continue
            if remaining <= 0:
                self._lose("etcd says the lease has expired")
                return
            if self.held:
                self.last_renewal_sent = sent
                self.deadline = sent + remaining - self.margin
            next_at = sent + interval

    async def _watch(self) -> None:
        while self.held:
            delay = self.deadline - self.clock()
            if delay <= 0:
                self._lose(self._silence())
                return
            await asyncio.sleep(delay)

    def _silence(self) -> str:
        silent = self.clock() - self.last_renewal_sent
        return (f"no lease renewal granted for {silent:.2f} s "
                f"(TTL {self.granted_ttl} s, margin {self.margin:.2f} s)")

    def _lose(self, reason: str) -> None:
        if self.lost_at is not None:
            return
        self.lost_at, self.lost_reason = self.clock(), reason
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        log.error("etcd: lost %s: %s", self.key, reason)
        try:
            self.on_lost(reason)
        except Exception:
            log.exception("etcd: on_lost of %s failed", self.key)

    async def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        for task in tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _revoke_quietly(self, lease: int) -> None:
        try:
            await self.client.revoke(lease)
        except EtcdError as exc:
            log.warning("etcd: could not revoke lease %x: %s", lease, exc)


@dataclass(frozen=True)
class Progress:
    """One node's entry on the progress board."""

    node: str
    position: int
    ready: bool


def best_candidate(progress: Iterable[Progress],
                   ready_nodes: Collection[str] | None = None) -> str | None:
    """The most up-to-date ready node (ties: the smallest name); None when no node is
    ready. ``ready_nodes``, when given, further restricts who counts as ready."""
    ready = [p for p in progress
             if p.ready and (ready_nodes is None or p.node in ready_nodes)]
    if not ready:
        return None
    return min(ready, key=lambda p: (-p.position, p.node)).node


class ProgressBoard:
    """A node's entry on the progress board, kept alive by its own lease, and the
    board's reader. ``publish`` as the position changes; a background task renews
    the lease (and re-creates the entry if the lease was lost)."""

    def __init__(self, client: EtcdClient, prefix: str, node: str, *, ttl: int) -> None:
        self.client = client
        self.prefix = prefix
        self.node = node
        self.ttl = ttl
        self._lease: int | None = None
        self._value = ""
        self._task: asyncio.Task[None] | None = None

    async def publish(self, position: int, *, ready: bool) -> None:
        """Publish this node's replication position and readiness."""
        self._value = json.dumps({"position": position, "ready": ready})
        if self._lease is None:
            self._lease, _ = await self.client.grant(self.ttl)
        try:
            await self.client.put(progress_key(self.prefix, self.node), self._value,
                                  lease=self._lease)
        except EtcdError as exc:
            if exc.grpc_code != 5:  # "requested lease not found": take a new one
                raise
            self._lease, _ = await self.client.grant(self.ttl)
            await self.client.put(progress_key(self.prefix, self.node), self._value,
                                  lease=self._lease)
        if self._task is None:
            self._task = asyncio.create_task(self._keepalive(), name=f"etcd-board {self.node}")

    async def read(self) -> dict[str, Progress]:
        """Every node's published progress (nodes whose lease expired are gone)."""
        board: dict[str, Progress] = {}
        base = progress_key(self.prefix).encode()
        for kv in await self.client.get_prefix(base):
            node = kv.key[len(base):].decode()
            try:
                entry = json.loads(kv.value)
                board[node] = Progress(node, int(entry["position"]), bool(entry["ready"]))
            except (ValueError, KeyError, TypeError):
                log.warning("etcd: unreadable progress entry %r=%r", kv.key, kv.value)
        return board

    async def close(self, *, revoke: bool = True) -> None:
        """Stop renewing; with ``revoke``, remove the entry at once (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        lease, self._lease = self._lease, None
        if revoke and lease is not None:
            with contextlib.suppress(EtcdError):
                await self.client.revoke(lease)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                if self._lease is None or await self.client.keepalive(self._lease) <= 0:
                    self._lease = None
                    await self.publish(**json.loads(self._value))
            except EtcdError as exc:
                log.warning("etcd: progress board entry of %s: %s", self.node, exc)


class Candidate:
    """A backup's side of promotion: its progress board entry and, once it wins,
    the :class:`LeaseHolder` of the primary key (``holder``; value: the node name)."""

    def __init__(self, client: EtcdClient, prefix: str, node: str, *, ttl: int,
                 on_lost: Callable[[str], None], margin: float | None = None,
                 clock: Callable[[], float] = monotonic) -> None:
        self.client = client
        self.prefix = prefix
        self.node = node
        self.ttl = ttl
        self.clock = clock
        self.board = ProgressBoard(client, prefix, node, ttl=ttl)
        self.holder = LeaseHolder(client, primary_key(prefix), node, ttl=ttl,
                                  on_lost=on_lost, margin=margin, clock=clock)
        self._free_since: float | None = None

    async def primary(self) -> str | None:
        """The node that holds the primary key now, or None."""
        kv = await self.client.get(primary_key(self.prefix))
        return kv.value.decode() if kv is not None else None

    async def try_take(self, unchanged: tuple[str, int] | None = None) -> bool:
        """One step of the promotion rule (module docstring); call it periodically
        (e.g. every TTL/3) while this node is a backup. True once this node holds the
        primary key — then promote. ``unchanged``: as :meth:`LeaseHolder.acquire`'s."""
        if self.holder.held:
            return True
        if await self.primary() is not None:
            self._free_since = None
            return False
        now = self.clock()
        if self._free_since is None:
            self._free_since = now
        board = await self.board.read()
        mine = board.get(self.node)
        if mine is None or not mine.ready:
            return False  # never promote a backup that is not ready
        best = best_candidate(board.values())
        if best != self.node and now - self._free_since < self.ttl:
            return False
        return await self.holder.acquire(unchanged)

    async def close(self) -> None:
        """Stop the board's and the holder's background tasks (leases expire)."""
        await self.board.close(revoke=False)
        await self.holder.close()


def ready_key(cluster: str) -> str:
    """The key of the ready set the primary records in etcd."""
    return f"/txbroker/{cluster}/ready"


async def put_ready_set(etcd: EtcdClient, cluster: str, primary: str, names: list[str],
                        lease: int) -> None:
    """Record the primary's ready set in etcd (``/txbroker/<cluster>/ready``) while it
    holds the primary key under ``lease``: a primary that was stopped past its lease
    and replaced must not overwrite its successor's record (EtcdError: not written)."""
    written = await etcd.put_if_held(
        ready_key(cluster), json.dumps({"primary": primary, "ready": names}),
        holder_key=primary_key(f"/txbroker/{cluster}"), lease=lease)
    if not written:
        raise EtcdError(f"{primary} no longer holds the primary key under lease {lease}: "
                        "the ready set is not recorded")


async def get_ready_set(etcd: EtcdClient, cluster: str
                        ) -> tuple[str | None, list[str] | None, int]:
    """The primary that last recorded its ready set in etcd, the set (None, None: none
    recorded, or unreadable), and the record's ``mod_revision`` (0: none): a promotion
    decided on it takes the key only while the record is still that one."""
    kv = await etcd.get(ready_key(cluster))
    if kv is None:
        return None, None, 0
    try:
        record = json.loads(kv.value)
        return str(record.get("primary")), [str(name) for name in record["ready"]], \
            kv.mod_revision
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None, kv.mod_revision
