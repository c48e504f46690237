"""Scenario ``replicated-etcd-live``: the replicated trio with etcd promotion
(``--ha replicated --ha-etcd``) on the deterministic event loop, with nodes killed,
stopped past their lease and cut off from each other and from etcd.

Everything but the disks and etcd is the code users run: three ``ReplicatedNode``
processes (``sim/live_trio.py`` says what is a model) whose ``EtcdClient`` reaches an
etcd model on virtual time through an httpx transport (``sim/live_etcd_net.py``,
``sim/etcd_model.py``): the lease holder, its watchdog and fencing, the progress
board, the recorded ready set and the campaign are production code. Nobody promotes
by hand: a backup takes the primary key when ``etcd_lease.py``'s rule says so. A node
whose process ends (a primary that fenced itself) is restarted, as a supervisor would.

Faults in the fault phase (one every ~0.45 s): kill -9 of the primary or of a backup
(restarted 20–400 ms later), ``SIGSTOP`` of the primary (or a backup) for up to 3.5 s —
often past its 2 s lease — then ``SIGCONT``, a cut between the primary and a backup
(both ways or one way), a cut between a node and etcd (packets dropped or refused).
Then everything heals and the queue drains.

Checkers: those of ``replicated-live`` (no answered send lost, no duplicate without
the redelivered flag, no answered ack undone, transactions all-or-nothing, an empty
queue, one node per epoch, every backup's log a prefix of the primary's, the trio
settled after the healed phase: one primary, every backup following it ready), and

- **at most one node serves clients per lease**: every byte a node's broker writes to
  a client (not a backup's ``Standby`` refusal) is written while etcd holds the
  primary key with that node's name, under the lease it created the key with — before
  the model revoked that lease. A primary whose lease expired must have stopped
  answering before anyone could take the key (``docs/etcd.md``'s fencing argument);
- **one running primary at a time**: a node becomes primary only while no other node
  that runs (is neither dead nor stopped) is one;
- nothing unhandled in the loop, no client dead, no node process that raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Final

from txbroker.core.ha.replicated_role import NodeRole
from txbroker.errors import TxBrokerError
from txbroker.server.app import BrokerServer
from txbroker.server.ha.replicated import ReplicatedNode
from txbroker.server.ha.standby import StandbyConnection
from txbroker.sim.etcd_model import EtcdModel
from txbroker.sim.live import EPOCH_MS, seed_client_jitter
from txbroker.sim.live_clients import check_queue, consumer, left_in_queue, producer
from txbroker.sim.live_etcd_net import SimEtcd, SimEtcdTransport
from txbroker.sim.live_replicated import (
    CONSUMERS,
    HOSTS,
    PRODUCERS,
    RESTART_S,
    URL,
    Trio,
    run_trio,
    settle_and_check,
)
from txbroker.sim.live_trio import CLIENT_PORT, TrioNode, cancel_tasks, data_root, probe
from txbroker.sim.loop import SimLoop
from txbroker.sim.memnet import MemoryTransport
from txbroker.sim.world import World

__all__ = ["LEASE_TTL_S", "EtcdTrio", "run_replicated_etcd_live", "serving_violations"]

#: etcd's address (one endpoint: the model is a cluster that never fails).
ETCD_URL: Final = "http://127.0.0.50:2379"
CLUSTER: Final = "sim"
#: The primary key's lease (s): etcd's least; the holder fences 2/3 s before it ends.
LEASE_TTL_S: Final = 2
FAULT_S: Final = 5.0
HEAL_S: Final = 10.0
MEAN_FAULT_GAP_S: Final = 0.45
#: A SIGSTOP's length (s, uniform): often past the lease.
STOP_S: Final = (0.2, 3.5)
#: A cut between a node and etcd (s, uniform).
ETCD_CUT_S: Final = (0.2, 3.0)
#: The operator looks every OPERATOR_CHECK_S and promotes by hand once the primary key
#: has been free for OPERATOR_WAIT_S (two lease TTLs: etcd's own promotion had time).
OPERATOR_CHECK_S: Final = 0.1
OPERATOR_WAIT_S: Final = 2.0 * LEASE_TTL_S
PRIMARY_KEY: Final = f"/txbroker/{CLUSTER}/primary".encode()
READY_KEY: Final = f"/txbroker/{CLUSTER}/ready".encode()
#: Producers go on sending this long into the healed phase (s): a run whose faults
#: left no primary for the whole fault phase still tests something.
SEND_INTO_HEAL_S: Final = 5.0
#: ... and, while no send has been answered yet, until this long before the healed
#: phase ends (the consumers' time to drain): seed 60023 had no primary from 5.4 s
#: (a zombie's renewal, then the operator's wait) to 11.4 s.
DRAIN_S: Final = 2.0
#: A client still blocked this long after the healed phase means the group is stuck (s).
STUCK_S: Final = 10.0


@dataclass
class EtcdTrio:
    """The run: the trio (``replicated-live``'s record, checks and clients), etcd, who
    wrote to clients when, and what went wrong."""

    trio: Trio
    etcd: SimEtcd
    #: (virtual time, host) of every write of a node's broker to a client
    writes: list[tuple[float, str]] = field(default_factory=list)
    stopped: dict[int, int] = field(default_factory=dict)  #: node index -> process
    crashed: list[str] = field(default_factory=list)  #: node processes that raised
    #: the operator promotes any node that accepts (``BLIND_OPERATOR_SEEDS``)
    blind: bool = False

    @property
    def loop(self) -> SimLoop:
        """The simulation's loop."""
        return self.trio.loop

    # -- the nodes -------------------------------------------------------------------
    def start(self, node: TrioNode) -> None:
        """Start (or restart) a node's process: ``txbroker serve --ha replicated
        --ha-etcd``, its etcd client through the simulated transport."""
        loop = self.loop
        replicated = ReplicatedNode(
            node.config, lambda role, server: self.on_role(node, role, server),
            make_server=node.make_server, etcd=SimEtcdTransport(self.etcd, node.host),
            clock_ns=lambda: EPOCH_MS * 1_000_000 + int(loop.time() * 1e9))
        if "primary-ignores-lost-lease" in self.trio.plants:
            setattr(replicated, "fence", lambda reason, event=None: None)  # noqa: B010 (the plant)
        node.node = replicated
        node.starts += 1
        process, task = loop.spawn(node.host, replicated.run())
        node.process = process
        task.add_done_callback(lambda done: self.on_exit(node, process, done))
        self.trio.log(f"node {node.index} started")

    def on_exit(self, node: TrioNode, process: int, task: asyncio.Task[None]) -> None:
        """A node's process ended by itself (a fenced primary stops): the supervisor
        restarts it."""
        if node.process != process or self.trio.over:
            return
        if not task.cancelled() and task.exception() is not None:
            self.crashed.append(f"node {node.index}'s process raised {task.exception()!r}")
        fenced = node.node.fenced if node.node is not None else ""
        self.trio.log(f"node {node.index} exited" + (f" (fenced: {fenced})" if fenced else ""))
        self.kill(node, quiet=True)

    def on_role(self, node: TrioNode, role: NodeRole, server: BrokerServer | None) -> None:
        """A node announced a role: one running primary at a time, one node per epoch."""
        trio = self.trio
        if trio.over:
            return
        trio.log(f"node {node.index} is {role.value}")
        replicated = node.node
        if role is not NodeRole.PRIMARY or replicated is None or replicated.hub is None:
            if trio.primary is node:
                trio.primary = None
            return
        for other in trio.nodes:
            if other is not node and other.alive and other.index not in self.stopped \
                    and other.node is not None and other.node.role is NodeRole.PRIMARY:
                trio.violations.append(f"node {node.index} became primary at "
                                       f"{self.loop.time():.6f} while node {other.index} "
                                       "was a running primary")
        owner = trio.epochs.setdefault(replicated.hub.epoch, node.index)
        if owner != node.index:
            trio.violations.append(f"epoch {replicated.hub.epoch} had two primaries: nodes "
                                   f"{owner} and {node.index}")
        trio.primary = node

    def kill(self, node: TrioNode, *, quiet: bool = False) -> None:
        """kill -9 a node (``quiet``: its process already ended); it restarts after a
        pause (if still dead then)."""
        self.stopped.pop(node.index, None)
        node.kill()
        if not quiet:
            self.trio.log(f"node {node.index} killed")
        if node is self.trio.primary:
            self.trio.primary = None
        self.loop.call_later(self.loop.random.uniform(*RESTART_S), self.restart, node)

    def restart(self, node: TrioNode) -> None:
        """Start a dead node again (a supervisor's restart)."""
        if not node.alive and not self.trio.over:
            self.start(node)

    def stop(self, node: TrioNode, seconds: float) -> None:
        """SIGSTOP a node for ``seconds``, then SIGCONT."""
        assert node.process is not None
        process = node.process
        self.loop.pause(process)
        self.stopped[node.index] = process
        self.trio.log(f"node {node.index} stopped for {seconds:.3f} s")
        self.loop.call_later(seconds, self.cont, node, process)

    def cont(self, node: TrioNode, process: int) -> None:
        """SIGCONT (if that process is still the node's, and stopped)."""
        if self.stopped.get(node.index) == process:
            del self.stopped[node.index]
            self.loop.resume(process)
            self.trio.log(f"node {node.index} continued")

    def on_send(self, source: MemoryTransport, data: bytes | None) -> None:
        """The network's observer: note each write of a node's broker to a client."""
        if data and source.side == "s" and source.local[1] == CLIENT_PORT \
                and not self.trio.over \
                and not isinstance(source.get_protocol(), StandbyConnection):
            self.writes.append((self.loop.time(), source.local[0]))

    # -- the operator ----------------------------------------------------------------
    async def operator(self) -> None:
        """``txbroker ha promote`` by hand: at the start (the group's first primary:
        ``docs/replication.md``), and whenever the primary key has been free for
        :data:`OPERATOR_WAIT_S` with no primary running (a whole-group loss, or no
        backup ready) — on a node the ready set recorded in etcd names, or the primary
        that recorded it (``etcdctl get …/ready``), as the documentation says. With
        :attr:`blind` (``BLIND_OPERATOR_SEEDS``): any live node, relying on ``ha
        promote`` to refuse one that is not in the recorded ready set."""
        loop, trio, model = self.loop, self.trio, self.etcd.model
        free_since: float | None = None  # None: promote at once (the first primary)
        while True:
            await asyncio.sleep(OPERATOR_CHECK_S)
            running = [n for n in trio.nodes if n.alive and n.index not in self.stopped]
            if PRIMARY_KEY in model.keys or any(
                    n.node is not None and n.node.role is NodeRole.PRIMARY for n in running):
                free_since = loop.time()
                continue
            if free_since is not None and loop.time() - free_since < OPERATOR_WAIT_S:
                continue
            loop.random.shuffle(running)
            record = model.keys.get(READY_KEY)
            if record is not None and not self.blind:
                recorded = json.loads(record.value)
                names = [*recorded["ready"], recorded["primary"]]
                running = [n for name in names for n in running if n.host == name]
            for node in running:
                try:
                    await probe(node.host, "ha_promote")
                except (TxBrokerError, OSError, TimeoutError) as exc:
                    trio.log(f"operator: node {node.index} refused: {exc}")
                    continue
                trio.log(f"operator: promoted node {node.index}")
                free_since = loop.time()
                break

    # -- the faults ------------------------------------------------------------------
    async def faults(self, fault_end: float) -> None:
        """Kills, stops and cuts until ``fault_end``."""
        loop, trio, etcd = self.loop, self.trio, self.etcd
        rng = loop.random
        while True:
            await asyncio.sleep(rng.expovariate(1 / MEAN_FAULT_GAP_S))
            if loop.time() >= fault_end:
                return
            choice = rng.random()
            primary = trio.primary if trio.primary is not None and trio.primary.alive \
                and trio.primary.index not in self.stopped else None
            running = [n for n in trio.nodes if n.alive and n.index not in self.stopped]
            backups = [n for n in running if n is not primary]
            if choice < 0.2 and primary is not None:
                self.kill(primary)
            elif choice < 0.3 and backups:
                self.kill(rng.choice(backups))
            elif choice < 0.5 and running:
                target = primary if primary is not None and rng.random() < 0.75 \
                    else rng.choice(running)
                self.stop(target, rng.uniform(*STOP_S))
            elif choice < 0.75 and running and not etcd.cut:
                target = primary if primary is not None and rng.random() < 0.6 \
                    else rng.choice(running)
                how = "reject" if rng.random() < 0.3 else "drop"
                etcd.cut[target.host] = how
                trio.log(f"cut node {target.index} from etcd ({how})")
                loop.call_later(rng.uniform(*ETCD_CUT_S), self.heal_etcd)
            elif backups and primary is not None and not trio.partitioned:
                trio.cut(primary, backups)

    def heal_etcd(self) -> None:
        """Every node reaches etcd again."""
        if self.etcd.cut:
            self.etcd.cut.clear()
            self.trio.log("etcd reachable again")

    def heal_all(self) -> None:
        """The end of the fault phase: cuts mend, stopped nodes continue, dead ones
        restart."""
        self.trio.heal()
        self.heal_etcd()
        for node in self.trio.nodes:
            process = self.stopped.get(node.index)
            if process is not None:
                self.cont(node, process)
            self.restart(node)


def serving_violations(model: EtcdModel, key: bytes, writes: list[tuple[float, str]]
                       ) -> tuple[list[str], list[str]]:
    """Judge every write of a node's broker to a client against the holdings of ``key``
    (from its creation with the node's name until its deletion: the lease's revocation,
    or otherwise). Returns (violations, late answers):

    - a **violation**: a write at ``t`` by a node that never held the key, or after
      another node took the key (created it after the writer's last holding ended, at
      or before ``t``): two nodes served clients, one without the key;
    - a **late answer**: a write after the writer's own holding ended, before anyone
      else took the key — the fencing argument's margin broken (``docs/etcd.md``: it
      holds while the loop is not stalled past the margin), but nobody else served yet.
    """
    holdings: list[tuple[str, int, float, float]] = []  # value, lease, from, until
    open_: tuple[str, int, float] | None = None
    for change in model.history:
        if change.key != key:
            continue
        if open_ is not None and (change.value is None or change.value.decode() != open_[0]
                                  or change.lease != open_[1]):
            holdings.append((*open_, change.time))
            open_ = None
        if change.value is not None and open_ is None:
            open_ = (change.value.decode(), change.lease, change.time)
    if open_ is not None:
        holdings.append((*open_, float("inf")))
    violations: list[str] = []
    late: list[str] = []
    for at, host in writes:
        if any(value == host and start <= at < end for value, _, start, end in holdings):
            continue
        mine = [h for h in holdings if h[0] == host and h[2] <= at]
        if not mine:
            violations.append(f"{host} answered a client at {at:.6f}: it never held the "
                              "primary key")
            continue
        _, lease, _, ended = mine[-1]
        taken = [h for h in holdings if h[0] != host and ended <= h[2] <= at]
        what = (f"{host} answered a client at {at:.6f} after its holding of the primary "
                f"key (lease {lease:x}) ended at {ended:.6f}")
        if taken:
            violations.append(f"{what}; {taken[0][0]} took the key at {taken[0][2]:.6f}")
        else:
            late.append(what)
    return violations[:3], late


def run_replicated_etcd_live(world: World, plants: frozenset[str], *,
                             blind: bool = False) -> list[str]:
    """One seed of ``replicated-etcd-live``; returns the violations. ``blind``: the
    operator promotes whichever live node accepts ``ha_promote``."""
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    root = data_root()
    first_line = len(world.trace)
    nodes = [TrioNode(loop, n, HOSTS, root) for n in range(len(HOSTS))]
    for node in nodes:
        node.config = dataclasses.replace(node.config, ha_etcd=ETCD_URL, ha_cluster=CLUSTER,
                                          ha_lease_ttl=LEASE_TTL_S)
    trio = Trio(loop, world, plants, nodes)
    run = EtcdTrio(trio, SimEtcd(loop, trio.log), blind=blind)
    loop.network.on_send = run.on_send
    left: list[int] = []
    unsettled: list[str] = []
    errors: list[str] = []
    ended: list[int] = []

    async def main() -> None:
        run.etcd.start()
        for node in nodes:
            run.start(node)
        operator = asyncio.ensure_future(run.operator())
        await asyncio.sleep(0.05)
        fault_end = loop.time() + FAULT_S
        end = fault_end + HEAL_S
        spawned = [loop.spawn(f"127.0.1.{n + 1}",
                              producer(loop, world, n, trio.record,
                                       fault_end + SEND_INTO_HEAL_S, url=URL,
                                       or_first_answer_by=end - DRAIN_S))
                   for n in range(PRODUCERS)]
        spawned += [loop.spawn(f"127.0.2.{n + 1}",
                               consumer(loop, world, trio.record, end, url=URL))
                    for n in range(CONSUMERS)]
        await run.faults(fault_end)
        run.heal_all()
        await asyncio.wait([task for _, task in spawned], timeout=end + STUCK_S - loop.time())
        for process, client in spawned:
            if not client.done():  # still waiting for a primary: the group is stuck
                loop.kill(process)
                trio.record.failures.append(f"a client was still blocked {STUCK_S:g} s "
                                            "after the healed phase")
            elif not client.cancelled() and client.exception() is not None:
                trio.record.failures.append(f"a client raised {client.exception()!r}")
        counter, counting = loop.spawn("127.0.3.1", left_in_queue(loop, url=URL))
        try:
            left.append(await asyncio.wait_for(counting, STUCK_S))
        except TimeoutError:
            loop.kill(counter)
            unsettled.append("the queue could not be counted: no primary")
        else:
            unsettled.extend(await settle_and_check(trio))
        await cancel_tasks([operator])
        trio.over = True
        errors.extend(loop.errors)
        ended.append(len(world.trace))

    run_trio(trio, main, root=root, first_line=first_line, ended=ended)
    violations = list(trio.violations) + unsettled + run.crashed
    world.log(f"network {loop.network.trace_hash()} etcd requests {run.etcd.requests}")
    two_served, late = serving_violations(run.etcd.model, PRIMARY_KEY, run.writes)
    for line in late[:3]:
        world.log(f"LATE ANSWER {line}")
    violations += two_served
    violations += [f"unhandled in the event loop: {error}" for error in errors]
    return violations + check_queue(trio.record, left[0] if left else -1)
