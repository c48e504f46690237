"""Scenario ``replicated-live``: the replicated trio (``--ha replicated``) with manual
promotion, on the deterministic event loop, with nodes killed, restarted and cut off.

Everything but the disks is the code users run (``sim/live_trio.py`` says what is a
model): three ``ReplicatedNode`` processes on three hosts, each with its own disk;
``txbroker.aio`` clients with the failover list of all three; an **operator** who,
once the primary is dead, promotes a backup the way ``txbroker ha promote`` does (the
native probe's ``ha_promote`` on the node's client port, which refuses a backup that
is not promotable) — trying the live nodes in a random order until one accepts.

Faults in the fault phase (one every ~0.35 s): kill -9 the primary (restarted later:
it joins the new primary as a backup), kill a backup (restarted later), cut a backup
off from the primary (both ways or one way) for up to 1.2 s; every disk has slow
syncs. Then everything heals (the dead restart, the cuts mend) and the queue drains.

Checkers: those of ``queue-live`` (no answered send lost, no duplicate without the
redelivered flag, no answered ack undone, transactions all-or-nothing, an empty queue
at the end), and

- **one primary at a time**: a node becomes primary only while no other live node is
  one, and each primary epoch belongs to one node;
- **every backup's log a prefix of the primary's**: after the healed phase every node
  follows the primary, caught up; the entries each streamed to it (LSN by LSN, after
  its dump) are the primary's entries of the same LSNs (kind, meta, body sizes);
- nothing unhandled in the loop, no client dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import shutil
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from txbroker.core.ha.follower import CopyState
from txbroker.core.ha.replicated_role import NodeRole
from txbroker.core.records import Kind, ReplicaAt
from txbroker.errors import TxBrokerError
from txbroker.server.app import BrokerServer
from txbroker.server.ha.replicated import ReplicatedNode
from txbroker.sim.live import captured_logs, seed_client_jitter
from txbroker.sim.live_clients import Record, check_queue, consumer, left_in_queue, producer
from txbroker.sim.live_trio import CLIENT_PORT, TrioNode, cancel_tasks, data_root, probe
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World

HOSTS: Final = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
URL: Final = "txb://" + ",".join(f"{host}:{CLIENT_PORT}" for host in HOSTS)
#: Virtual lengths of the fault phase and of the healed phase (s).
FAULT_S: Final = 3.0
HEAL_S: Final = 5.0
#: Mean time between faults, a dead node's pause before its restart, a cut's length (s).
MEAN_FAULT_GAP_S: Final = 0.35
RESTART_S: Final = (0.02, 0.4)
PARTITION_S: Final = (0.1, 1.2)
#: How long the operator takes to notice a dead primary (s, uniform).
OPERATOR_S: Final = (0.02, 0.2)
#: How long after the healed phase every backup may take to catch up (s).
SETTLE_S: Final = 5.0
PRODUCERS: Final = 2
CONSUMERS: Final = 2
#: ``replicated-live-checkpoints``: the nodes' checkpoint interval, drawn per seed (s).
CHECKPOINT_INTERVAL_S: Final = (0.05, 0.5)


@dataclass
class Trio:
    """The run: its nodes, who the operator made primary, what went wrong."""

    loop: SimLoop
    world: World
    plants: frozenset[str]
    nodes: list[TrioNode]
    record: Record = field(default_factory=Record)
    primary: TrioNode | None = None
    #: the primary that died last (the operator promotes a backup it counted as ready)
    lost: TrioNode | None = None
    #: the epoch of the primary now (its ``ha status``), and of the one that died last
    epoch: str = ""
    lost_epoch: str = ""
    #: the operator promotes any node that accepts (``BLIND_OPERATOR_SEEDS``)
    blind: bool = False
    #: False: the operator promotes nobody, and the run can never finish (no primary:
    #: the clients retry for ever) — the test of the loop's stuck verdict
    promotes: bool = True
    need_primary: asyncio.Event = field(default_factory=asyncio.Event)
    partitioned: bool = False
    #: epoch -> the node that was primary in it
    epochs: dict[str, int] = field(default_factory=dict)
    #: nodes the operator gave up for dead while they were stopped (SIGSTOP) as the
    #: primary: still primaries in their own eyes until they fence or die
    deposed: set[int] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    #: the run is over: what the loop's shutdown does to the nodes is not news
    over: bool = False
    #: ``replicated-live-checkpoints``: one backup fault in three is a clean stop, and
    #: the trace says which starts read a checkpoint
    checkpoints: bool = False

    def log(self, line: str) -> None:
        """A trace line stamped with virtual time."""
        self.world.log(f"{self.loop.time():.6f} {line}")

    # -- the nodes -----------------------------------------------------------------
    def start(self, node: TrioNode) -> None:
        """Start (or restart) a node's process."""
        self.deposed.discard(node.index)
        node.start(self.on_role, self.prepare, self.exited)
        self.log(f"node {node.index} started")

    def prepare(self, node: ReplicatedNode) -> None:
        """Plant ``promote-outside-ready-set``: every copy says it is promotable."""
        if "promote-outside-ready-set" in self.plants:  # and no peer is asked
            setattr(node, "promotable", lambda: None)  # noqa: B010 (the plant)
            node.quorum = None

    def on_role(self, node: TrioNode, role: NodeRole, server: BrokerServer | None) -> None:
        """A node announced a role: check one primary at a time and one node per epoch."""
        if self.over:
            return
        self.log(f"node {node.index} is {role.value}")
        store = node.disk.store
        if self.checkpoints and role is NodeRole.BACKUP and store is not None:
            stats = store.stats()  # (the checkpoint scenario: what its start read)
            if stats.recovered_from_checkpoint:
                self.log(f"node {node.index} read a checkpoint and "
                         f"{stats.recovered_entries - 1} entries after it")
        replicated = node.node
        if role is not NodeRole.PRIMARY or replicated is None or replicated.hub is None:
            return
        hub = replicated.hub
        for other in self.nodes:
            if other is not node and other.alive and other.node is not None \
                    and other.node.role is NodeRole.PRIMARY and other.index not in self.deposed:
                self.violations.append(f"node {node.index} became primary at "
                                       f"{self.loop.time():.6f} while node {other.index} "
                                       "was the primary")
        owner = self.epochs.setdefault(hub.epoch, node.index)
        if owner != node.index:
            self.violations.append(f"epoch {hub.epoch} had two primaries: nodes {owner} and "
                                   f"{node.index}")
        if "reply-before-backups" in self.plants:  # replies wait for the local disk only
            setattr(hub, "_ready", list)  # noqa: B010 (the plant)

    def kill(self, node: TrioNode) -> None:
        """kill -9 a node; it restarts after a pause (if still dead then)."""
        node.kill()
        self.log(f"node {node.index} killed")
        if node is self.primary:
            self.primary, self.lost, self.lost_epoch = None, node, self.epoch
            self.epoch = ""
            self.need_primary.set()
        self.loop.call_later(self.loop.random.uniform(*RESTART_S), self.restart, node)

    def stop(self, node: TrioNode) -> None:
        """SIGTERM a backup: it closes its copy (with a checkpoint) and exits; restarted
        as after an exit."""
        if node.node is not None:
            self.log(f"node {node.index} stopped")
            node.node.request_stop()

    def exited(self, node: TrioNode) -> None:
        """A node's process ended by itself (fenced: superseded by a newer term): its
        supervisor starts it again after a pause, as after a kill."""
        if self.over:
            return
        self.log(f"node {node.index} exited")
        if node is self.primary:
            self.primary, self.lost, self.lost_epoch = None, node, self.epoch
            self.epoch = ""
            self.need_primary.set()
        self.loop.call_later(self.loop.random.uniform(*RESTART_S), self.restart, node)

    def restart(self, node: TrioNode) -> None:
        """Start a dead node again (a supervisor's restart)."""
        if not node.alive:
            self.start(node)

    # -- the operator ----------------------------------------------------------------
    async def operator(self, name: str = "operator") -> None:
        """Once the primary is dead, ``txbroker ha promote`` a node that the dead primary
        counted as ready (its ``ha status``), else the old primary itself once it is back
        (its own disk has every entry it answered), then any other live node (the nodes
        refuse what they must: ``core/ha/promotion.py``); the first time, any node. With
        ``blind`` (``BLIND_OPERATOR_SEEDS``): any node that accepts, in random order. Two
        operators (``name``) act on their own, each on what it sees: their promotions
        may overlap (the promises of ``core/ha/promotion.py`` must keep one primary)."""
        loop = self.loop
        while True:
            await self.need_primary.wait()
            if not self.promotes:
                await asyncio.Event().wait()  # for ever
            await asyncio.sleep(loop.random.uniform(*OPERATOR_S))
            order = [node for node in self.nodes if node.alive]
            loop.random.shuffle(order)
            if not self.blind and self.lost is not None:  # those first, then the rest:
                # a refusal names whom to promote instead (a stale "ready" is refused)
                first = await self._ready_for(self.lost, order)
                order = first + [node for node in order if node not in first]
            for node in order:
                if not self.need_primary.is_set():
                    break
                starts = node.starts
                try:
                    await probe(node.host, "ha_promote")
                except (TxBrokerError, OSError, TimeoutError) as exc:
                    why = f": {exc}" if isinstance(exc, TxBrokerError) else ""
                    self.log(f"{name}: node {node.index} refused: {type(exc).__name__}{why}")
                    if "unknown op 'ha_promote'" not in why:
                        continue
                    # it serves clients: an earlier promotion whose answer came too late
                if node.starts != starts or not node.alive:  # killed while it answered
                    self.log(f"{name}: node {node.index} died while being promoted")
                    continue
                self.primary = node
                self.deposed.discard(node.index)  # (a stopped primary, back and serving)
                self.need_primary.clear()
                self.log(f"{name}: promoted node {node.index}")
                await self._note_epoch(node)
                break
            else:
                await asyncio.sleep(0.05)

    async def _note_epoch(self, node: TrioNode) -> None:
        """Ask the new primary its epoch (``ha status``), once it serves: its backups'
        ``ha status`` names the epoch they follow."""
        while self.primary is node:
            with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
                status = await probe(node.host, "stats")
                epoch = status.get("ha", {}).get("replication", {}).get("epoch")
                if epoch:
                    self.epoch = str(epoch)
                    self.log(f"operator: node {node.index} serves epoch {epoch}")
                    return
            await asyncio.sleep(0.01)

    async def _ready_for(self, lost: TrioNode, nodes: list[TrioNode]) -> list[TrioNode]:
        """Of ``nodes``, those whose ``ha status`` says the lost primary counted them
        as ready, the most up-to-date first (as etcd's election does); else the lost
        primary itself, if it is back."""
        ready: list[tuple[int, TrioNode]] = []
        for node in nodes:
            try:
                status = await probe(node.host, "stats")
            except (TxBrokerError, OSError, TimeoutError):
                continue
            following = status.get("ha", {}).get("following") or {}
            if following.get("epoch") == self.lost_epoch and following.get("ready") is True:
                ready.append((-int(following.get("durable_lsn", 0)), node))
        ready.sort(key=lambda pair: pair[0])  # stable: ties keep the random order
        return [node for _, node in ready] or [node for node in nodes if node is lost]

    # -- the faults --------------------------------------------------------------------
    async def faults(self, fault_end: float) -> None:
        """Kills and cuts until ``fault_end``."""
        loop = self.loop
        rng = loop.random
        while True:
            await asyncio.sleep(rng.expovariate(1 / MEAN_FAULT_GAP_S))
            if loop.time() >= fault_end:
                return
            choice = rng.random()
            primary = self.primary
            backups = [n for n in self.nodes if n.alive and n is not primary]
            if choice < 0.4 and primary is not None and primary.alive:
                self.kill(primary)
            elif choice < 0.6 and backups:
                backup = rng.choice(backups)
                if self.checkpoints and rng.random() < 1 / 3:
                    self.stop(backup)
                else:
                    self.kill(backup)
            elif backups and primary is not None and not self.partitioned:
                self.cut(primary, backups)

    def cut(self, primary: TrioNode, backups: list[TrioNode]) -> None:
        """Cut one of ``backups`` off from ``primary`` (both ways, or one way in either
        direction) for :data:`PARTITION_S`."""
        loop, rng = self.loop, self.loop.random
        backup = rng.choice(backups)
        one_way = rng.random() < 0.3
        if one_way and rng.random() < 0.5:
            loop.network.partition(primary.host, backup.host, one_way=True)
        else:
            loop.network.partition(backup.host, primary.host, one_way=one_way)
        self.partitioned = True
        self.log(f"cut node {backup.index} from node {primary.index} "
                 f"({'one way' if one_way else 'both ways'})")
        loop.call_later(rng.uniform(*PARTITION_S), self.heal)

    def heal(self) -> None:
        """Mend every cut."""
        if self.partitioned:
            self.loop.network.heal()
            self.partitioned = False
            self.log("network healed")


def _caught_up(trio: Trio) -> str | None:
    """Why the trio is not settled yet: every node alive, one primary with nothing in
    flight, every other node following it, ready, with its newest entry durable."""
    primaries = [n for n in trio.nodes if n.alive and n.node is not None
                 and n.node.role is NodeRole.PRIMARY and n.node.hub is not None]
    if len(primaries) != 1:
        return f"{len(primaries)} primaries"
    hub = primaries[0].node.hub if primaries[0].node is not None else None
    assert hub is not None
    if hub.pending:
        return f"{len(hub.pending)} entries in flight on the primary"
    for node in trio.nodes:
        if node is primaries[0]:
            continue
        follower = node.node.follower if node.node is not None else None
        if follower is None or follower.state is not CopyState.FOLLOWING \
                or follower.epoch != hub.epoch or not follower.ready:
            return f"node {node.index} does not follow the primary, ready"
        if follower.durable_lsn != hub.lsn:
            return f"node {node.index} has LSN {follower.durable_lsn} of {hub.lsn}"
    return None


async def _settle(trio: Trio) -> str | None:
    deadline = trio.loop.time() + SETTLE_S
    while (why := _caught_up(trio)) is not None and trio.loop.time() < deadline:
        await asyncio.sleep(0.05)
    return why


async def settle_and_check(trio: Trio,
                           on_settled: Callable[[], None] | None = None) -> list[str]:
    """After the healed phase: the trio settles within :data:`SETTLE_S` (else that is
    the violation), then every backup's log is checked against the primary's."""
    why = await _settle(trio)
    if why is not None:
        return [f"{SETTLE_S:g} s after the healed phase the trio has not settled: {why}"]
    if on_settled is not None:
        on_settled()
    return _check_prefixes(trio)


def _check_prefixes(trio: Trio) -> list[str]:
    """Every backup's streamed entries are the primary's entries of the same LSNs, and its
    log counts them so (``REPLICA_AT``, ``server/ha/replica.py``): a restart resumes
    from the LSN its disk holds."""
    primary = next(n for n in trio.nodes if n.node is not None
                   and n.node.role is NodeRole.PRIMARY)
    assert primary.node is not None and primary.node.hub is not None
    hub = primary.node.hub
    ours = primary.disk.state
    base = len(ours.entries) - hub.lsn  # the entries before this epoch's LSN 1
    violations = []
    if _position(ours.entries) is not None:  # end_position: a restart must not resume it
        violations.append("the primary's log still counts a primary's LSNs")
    for node in trio.nodes:
        follower = node.node.follower if node.node is not None else None
        if node is primary or follower is None:
            continue
        theirs, at, problem = node.disk.state, None, None
        for copy in theirs.entries:
            if copy.kind == Kind.REPLICA_AT:
                at = ReplicaAt.decode(copy.meta)
                at = at if at.epoch else None
                continue
            if at is None or copy.kind == Kind.SNAPSHOT:
                continue  # the dump's entries
            lsn = at.lsn + 1
            at = ReplicaAt(at.epoch, lsn)
            if at.epoch != hub.epoch or base + lsn - 1 >= len(ours.entries):
                problem = f"its log counts LSN {lsn} of epoch {at.epoch}, past the primary's"
                break
            mine = ours.entries[base + lsn - 1]
            if (mine.kind, mine.meta, [ours.sizes[r] for r in mine.refs]) != \
                    (copy.kind, copy.meta, [theirs.sizes[r] for r in copy.refs]):
                problem = f"its entry of LSN {lsn} is not the primary's (kind {copy.kind} " \
                          f"vs {mine.kind})"
                break
        if problem is None and (at is None or at.lsn < follower.durable_lsn):
            problem = (f"its log counts to {at.lsn if at else None}, not to the LSN "
                       f"{follower.durable_lsn} it holds durable")
        if problem is not None:
            violations.append(f"node {node.index}: {problem}")
    return violations


def _position(entries: list[Any]) -> ReplicaAt | None:
    """Where a log says its copy stands, counted as replay counts (``core/replay.py``)."""
    at: ReplicaAt | None = None
    for stored in entries:
        if stored.kind == Kind.REPLICA_AT:
            at = ReplicaAt.decode(stored.meta)
            at = at if at.epoch else None
        elif at is not None and stored.kind != Kind.SNAPSHOT:
            at = ReplicaAt(at.epoch, at.lsn + 1)
    return at


def run_trio(trio: Trio, main: Callable[[], Coroutine[Any, Any, None]], *, root: Path,
             first_line: int, ended: list[int]) -> None:
    """Run ``main()`` on the trio's loop as the replicated scenarios do: the ``txbroker``
    logs in the trace, and no cyclic collection while the run lasts but the loop's own
    (``SimLoop``: at fixed step counts) — what a collection frees would run at moments
    set by the process's earlier allocations (a StreamWriter collected unclosed closes
    its transport: another network trace after other seeds ran in the process). Then
    the trace ends where the run did (``ended``: its length then, which ``main`` or a
    stuck run notes; what the loop's shutdown logs — its cancellations go in a set's
    order — is not part of the run), the data directory ``root`` goes, and the trace
    names it ``<data>`` from line ``first_line`` on."""
    world, loop = trio.world, trio.loop

    def stuck() -> None:  # the run ends where it stuck (SimulationStuck)
        trio.over = True
        ended.append(len(world.trace))

    loop.on_stuck = stuck
    collecting = gc.isenabled()
    gc.collect()  # what earlier seeds left goes now, before the run (no finalizer of
    # theirs runs inside it)
    gc.disable()
    try:
        with captured_logs(world, loop):
            loop.run(main())
    finally:
        del world.trace[ended[0] if ended else len(world.trace):]
        if collecting:
            gc.enable()
        shutil.rmtree(root, ignore_errors=True)
        world.trace[first_line:] = [line.replace(str(root), "<data>")
                                    for line in world.trace[first_line:]]


def two_operators(seed: int) -> bool:
    """Whether seed ``seed`` has a second, independent operator (three seeds in ten):
    drawn apart from the run's one random source, so that the other seeds' runs stay
    what they were."""
    return random.Random(f"two operators {seed}").random() < 0.3


def run_replicated_live_checkpoints(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``replicated-live-checkpoints``: ``replicated-live`` with the nodes'
    recovery checkpoints on (``recovery_checkpoint``, an interval drawn per seed): the
    backups checkpoint their copies while they follow and when one fault of a backup
    in three, a clean stop, closes it; their restarts read a checkpoint and the log
    after it (``server/ha/replica_checkpoints.py``)."""
    return run_replicated_live(world, plants, checkpoints=True)


def run_replicated_live(world: World, plants: frozenset[str], *,
                        blind: bool = False, promotes: bool = True,
                        checkpoints: bool = False) -> list[str]:
    """One seed of ``replicated-live``; returns the violations. ``blind``: the operator
    promotes whichever live node accepts ``ha_promote`` (``BLIND_OPERATOR_SEEDS``);
    ``promotes=False``: it promotes nobody, and the run ends only as stuck
    (:class:`~txbroker.sim.loop.SimulationStuck`); ``checkpoints``: see
    :func:`run_replicated_live_checkpoints`."""
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    root = data_root()
    first_line = len(world.trace)
    interval = loop.random.uniform(*CHECKPOINT_INTERVAL_S) if checkpoints else 0.0
    if checkpoints:
        world.log(f"checkpoint interval {interval:.3f} s")
    trio = Trio(loop, world, plants, [TrioNode(loop, n, HOSTS, root, interval)
                                      for n in range(len(HOSTS))],
                blind=blind or "promote-outside-ready-set" in plants, promotes=promotes,
                checkpoints=checkpoints)
    left: list[int] = []
    unsettled: list[str] = []
    errors: list[str] = []
    ended: list[int] = []  # the trace's length when the run ended

    async def main() -> None:
        for node in trio.nodes:
            trio.start(node)
        trio.need_primary.set()
        operators = [asyncio.ensure_future(trio.operator())]
        if two_operators(world.seed):
            trio.log("two operators")
            operators.append(asyncio.ensure_future(trio.operator("operator 2")))
        await asyncio.sleep(0.05)
        fault_end = loop.time() + FAULT_S
        end = fault_end + HEAL_S
        clients = [loop.spawn(f"127.0.1.{n + 1}", producer(
            loop, world, n, trio.record, fault_end, url=URL,
            plain=checkpoints and n == 0))[1]  # (settled: runs in the checkpoints)
            for n in range(PRODUCERS)]
        clients += [loop.spawn(f"127.0.2.{n + 1}",
                               consumer(loop, world, trio.record, end, url=URL))[1]
                    for n in range(CONSUMERS)]
        await trio.faults(fault_end)
        trio.heal()
        for node in trio.nodes:
            trio.restart(node)
        for client in clients:
            try:
                await client
            except Exception as exc:  # a client that died is a finding
                trio.record.failures.append(f"a client raised {exc!r}")
        _, counting = loop.spawn("127.0.3.1", left_in_queue(loop, url=URL))
        left.append(await counting)
        unsettled.extend(await settle_and_check(trio))
        await cancel_tasks(operators)
        trio.over = True
        errors.extend(loop.errors)  # (not what the shutdown's cancellations leave)
        ended.append(len(world.trace))

    run_trio(trio, main, root=root, first_line=first_line, ended=ended)
    violations = list(trio.violations) + unsettled
    world.log(f"network {loop.network.trace_hash()}")
    violations += [f"unhandled in the event loop: {error}" for error in errors]
    return violations + check_queue(trio.record, left[0] if left else -1)
