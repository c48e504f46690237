"""Scenario ``router-bank-replicated-live``: ``router-bank-sites-live``'s bank — two
partitions, each with two concurrent servers and a standby at the primary site and a
shadow at the secondary site — over ``replicated-live``'s replicated trio with manual
promotion, instead of one broker.

Nothing of the two is copied: the bank's servers, clients, ledgers, supervisors,
outages and checkers are ``live_bank_sites.py``'s (:class:`Sites`, ``check_sites``)
and ``live_bank.py``'s (``start_clients``, ``finish_clients``); the trio, its operator
(``txbroker ha promote`` over the client port, a ready backup first), its kills,
restarts and cuts, its settling and its prefix check are ``live_replicated.py``'s
(:class:`Trio`, ``_settle``, ``_check_prefixes``, ``run_trio``). Each node is configured
with the bank's router facility (its configuration file's ``[router]`` section), so a
promoted backup defines it again on top of what it replayed. Every router client and
server connects with the failover list of the three nodes: it moves to the new primary
and restores its router session there (``router/_base.py``).

Faults in the fault phase (:data:`FAULT_S`): the trio's — kill -9 of the primary (the
operator promotes a backup that was ready), kills of backups, a backup cut off from the
primary (both ways or one way), a node stopped (SIGSTOP) and continued, a primary
stopped past :data:`GIVE_UP_S` given up for dead and replaced (:func:`stops`) — and the
sites' — a server killed alone or stopped, a whole site down, a partition's
concurrent servers down (its standby takes over). Then every cut
heals, every dead node restarts, the clients finish their last transfers, one more
client makes transfers for :data:`HEALED_CLIENT_S` (the healed system must make
progress: the faults can leave the trio without a primary for the whole fault phase)
and every server is back (:data:`HEAL_S`); the trio must then settle: every node alive, one
primary with nothing in flight, the other two following it, ready and caught up.

Checkers: ``router-bank-sites-live``'s (money conserved; each ACCEPTED transfer
applied once on each side at each site, REJECTED ones nowhere; every transfer has an
outcome; each ledger's TID table is the ACCEPTED transfers; the secondary site's
ledgers equal the primary site's; a standby presented work only while its partition's
active servers are down), ``replicated-live``'s trio checks (one primary at a time, one
node per epoch, every backup's log a prefix of the primary's), nothing unhandled in
the loop. The plants of both scenarios apply (``plants.py``: ``also``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Final

from txbroker.core.ha.replicated_role import NodeRole
from txbroker.sim.bank_scenario import FACILITY, PARTITIONS
from txbroker.sim.live import seed_client_jitter
from txbroker.sim.live_bank import (
    CLIENTS,
    HEALED_CLIENT_S,
    bank_client,
    finish_clients,
    start_clients,
)
from txbroker.sim.live_bank_sites import Sites, check_sites
from txbroker.sim.live_replicated import (
    HOSTS,
    URL,
    Trio,
    run_trio,
    settle_and_check,
)
from txbroker.sim.live_trio import TrioNode, cancel_tasks, data_root
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World

__all__ = ["FAULT_S", "HEALED_CLIENT_S", "HEAL_S", "PROMOTE_OUTSIDE_READY_SET",
           "run_bank_replicated_live"]

#: Virtual lengths of the fault phase and of the healed phase (s): the sites
#: scenario's (a transfer takes 10-50 ms; the healed phase lets a site that was down,
#: and the clients' last transfers, finish across the trio's last promotion).
FAULT_S: Final = 2.0
HEAL_S: Final = 8.0
#: How long the trio has to elect its first primary before the servers start (s).
FIRST_PRIMARY_S: Final = 0.05
#: Mean time between two stops (SIGSTOP) of a trio node in the fault phase, how long a
#: stop lasts (s, uniform), and how long a stopped primary goes unanswered before the
#: operator gives it up for dead and promotes a backup (s): the old primary, continued,
#: must find itself superseded and fence (its backups hold the newer term).
MEAN_STOP_GAP_S: Final = 1.0
STOP_S: Final = (0.1, 3.0)
GIVE_UP_S: Final = 0.5
#: The trio's plant that also makes the operator blind (``replicated-live`` does too).
PROMOTE_OUTSIDE_READY_SET: Final = "promote-outside-ready-set"


def _summary(trio: Trio) -> str:
    """The settled trio in a trace line: the primary, its epoch and LSN."""
    for node in trio.nodes:
        hub = node.node.hub if node.node is not None else None
        if node.alive and hub is not None and node.node is not None \
                and node.node.role is NodeRole.PRIMARY:
            return f"node {node.index} primary in epoch {hub.epoch} at LSN {hub.lsn}"
    return "no primary"


async def stops(trio: Trio, fault_end: float) -> None:
    """Now and then, until ``fault_end``, stop a live node as SIGSTOP does and continue
    it later; a primary stopped for :data:`GIVE_UP_S` is given up for dead (the
    operator promotes a ready backup, as after a kill)."""
    loop = trio.loop
    while True:  # (a gap past the phase's end ends it: a gap of 9.7 s once held the
        # healed phase back past the run's end, seed 20779)
        gap = loop.random.expovariate(1 / MEAN_STOP_GAP_S)
        await asyncio.sleep(min(gap, max(0.0, fault_end - loop.time())))
        if loop.time() >= fault_end:
            return
        alive = [node for node in trio.nodes if node.alive and node.process not in loop.paused]
        if not alive:
            continue
        node = loop.random.choice(alive)
        process, seconds = node.process, loop.random.uniform(*STOP_S)
        assert process is not None
        loop.pause(process)
        trio.log(f"node {node.index} stopped for {seconds:.3f} s")
        loop.call_later(seconds, _continue, trio, node, process)
        if node is trio.primary and seconds > GIVE_UP_S:
            loop.call_later(GIVE_UP_S, _give_up, trio, node, process)


def _continue(trio: Trio, node: TrioNode, process: int) -> None:
    if node.process == process:  # (not killed meanwhile)
        trio.loop.resume(process)
        trio.log(f"node {node.index} continued")


def _give_up(trio: Trio, node: TrioNode, process: int) -> None:
    if node.process != process or node is not trio.primary:
        return
    trio.log(f"operator: node {node.index} does not answer: given up for dead")
    trio.deposed.add(node.index)
    trio.primary, trio.lost, trio.lost_epoch = None, node, trio.epoch
    trio.epoch = ""
    trio.need_primary.set()


def run_bank_replicated_live(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``router-bank-replicated-live``; returns the violations."""
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    root = data_root()
    first_line = len(world.trace)
    nodes = [TrioNode(loop, n, HOSTS, root) for n in range(len(HOSTS))]
    for node in nodes:  # each node's configuration file has the bank's [router] section
        node.config = dataclasses.replace(node.config,
                                          router_facilities={FACILITY: PARTITIONS})
    trio = Trio(loop, world, plants, nodes, blind=PROMOTE_OUTSIDE_READY_SET in plants)
    sites = Sites(loop, world, plants, url=URL)
    bank = sites.bank
    unsettled: list[str] = []
    errors: list[str] = []
    ended: list[int] = []  # the trace's length when the run ended

    async def main() -> None:
        for node in trio.nodes:
            trio.start(node)
        trio.need_primary.set()
        operator = asyncio.ensure_future(trio.operator())
        await asyncio.sleep(FIRST_PRIMARY_S)
        await sites.start_all()
        fault_end = loop.time() + FAULT_S
        end = fault_end + HEAL_S
        sites.start_faults(fault_end)
        clients = start_clients(loop, world, bank, fault_end, url=URL)
        stopping = asyncio.ensure_future(stops(trio, fault_end))
        await trio.faults(fault_end)
        await stopping
        trio.heal()
        for node in trio.nodes:
            trio.restart(node)
        while any(node.process in loop.paused for node in trio.nodes):
            await asyncio.sleep(0.01)  # a stop can outlast the fault phase by 3 s: the
            # healed client's window starts when every node runs (seed 22160 accepted
            # nothing: no primary until its window was over)
        clients.append(loop.spawn(f"127.0.2.{CLIENTS + 1}", bank_client(
            loop, world, bank, CLIENTS, loop.time() + HEALED_CLIENT_S, url=URL))[1])
        await finish_clients(loop, bank, clients, end)
        await asyncio.sleep(max(0.0, end - loop.time()))  # every site catches up
        sites.check_all_up()
        unsettled.extend(await settle_and_check(
            trio, lambda: trio.log(f"trio settled: {_summary(trio)}")))
        await cancel_tasks([operator])
        trio.over = True
        errors.extend(loop.errors)  # (not what the shutdown's cancellations leave)
        ended.append(len(world.trace))

    run_trio(trio, main, root=root, first_line=first_line, ended=ended)
    world.log(f"network {loop.network.trace_hash()}")
    violations = list(trio.violations) + unsettled
    violations += [f"unhandled in the event loop: {error}" for error in errors]
    return violations + check_sites(bank)
