"""Scenario ``router-bank-sites-live``: ``router-bank-live``'s bank with the router's
roles — concurrent, standby and shadow servers — and a ledger per site.

The bank, its clients and its server program are ``live_bank.py``'s (the production
router libraries on the deterministic event loop, against ``BrokerServer``). Each
partition (A, B) has

- a **primary site**: two ``CONCURRENT`` servers and a ``STANDBY`` server, applying to
  the primary site's ledger of the partition (one database the three share);
- a **secondary site**: one ``SHADOW`` server applying to the secondary site's ledger,
  a separate copy that must end up equal.

Faults, during the fault phase: each server dies now and then and is restarted after a
pause, or is stopped (``SIGSTOP``) for up to 5.5 s — past its library's 5 s request
timeout at times — and continued; now and then a **whole site** (every server of the
primary or the secondary site, both partitions) or the **concurrent servers of one
partition** (its standby takes over) go down together for longer than a transfer
takes; the broker is killed and restarted on its data, as in ``router-bank-live``, or
(three faults in ten) stopped for up to 5.5 s and continued. Then a healed phase in
which every server is back.

Checkers: ``router-bank-live``'s, for each site's ledgers (money conserved; every
transfer on both legs or neither, never twice on one side; ACCEPTED applied,
REJECTED not; every transfer has an outcome); each ledger holds exactly the ACCEPTED
transfers (its TID table); the secondary site's ledger of a partition equals the
primary site's (balances and TID table); a standby is presented a transaction only
while no primary or concurrent server of its partition is registered — as far as the
standby can tell from the router events it subscribes to (``live_bank.ActiveServers``:
servers registered before it on a broker run are not seen, so that check only ever
under-reports).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from txbroker.router.aio import Role
from txbroker.sim.bank_scenario import (
    ACCOUNTS,
    FACILITY,
    OPENING_BALANCE,
    PARTITIONS,
    Database,
)
from txbroker.sim.live import SimDisk, captured_logs, run_broker, seed_client_jitter
from txbroker.sim.live_bank import (
    BROKER,
    MEAN_SERVER_DEATH_GAP_S,
    PORT,
    RESTART_S,
    URL,
    ActiveServers,
    Bank,
    BankServer,
    bank_server,
    check_bank,
    run_clients_killing_broker,
)
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World

PRIMARY_SITE = "primary"
SECONDARY_SITE = "secondary"
SITES = (PRIMARY_SITE, SECONDARY_SITE)
#: Virtual lengths of the fault phase and of the healed phase (s): the healed phase
#: gives a site that was down the time to catch up.
FAULT_S = 2.0
HEAL_S = 8.0
#: Mean time between group outages (a whole site, or a partition's concurrent
#: servers), and how long one lasts (s, uniform): a transfer takes some 10-50 ms.
MEAN_OUTAGE_GAP_S = 0.5
OUTAGE_S = (0.1, 0.6)
#: Of a server's faults, the share that stops it (SIGSTOP) instead of killing it, and
#: how long it stays stopped (s, uniform): the longest outlast its library's request
#: timeout (5 s), so it fails over when it continues.
PAUSE_SHARE = 0.3
PAUSE_S = (0.05, 5.5)
#: Of the broker's faults, the share that stops it (``live_bank.BROKER_STOP_S``)
#: instead of killing it.
BROKER_STOP_SHARE = 0.3
#: How long the run waits for every server's first registration (s).
SETUP_TIMEOUT_S = 30.0
#: The planted bugs of this scenario (``plants.py``).
PRESENTS_TO_BOTH_SITES = "router-presents-to-both-sites"
SHADOW_NO_TID_CHECK = "shadow-no-tid-check"
STANDBY_AS_CONCURRENT = "standby-serves-beside-concurrents"


@dataclass
class Slot:
    """One server program's place: which site, partition and role, on which host; the
    process running it now (None: down), and what kills it early."""

    site: str
    partition: str
    role: Role
    name: str
    host: str
    process: int | None = None
    down_until: float = 0.0
    killed: asyncio.Event = field(default_factory=asyncio.Event)


def _slots() -> list[Slot]:
    """Per partition: concurrent servers c1 and c2 and standby sb (the primary site),
    shadow sh (the secondary site)."""
    places = [(PRIMARY_SITE, Role.CONCURRENT, "c1"), (PRIMARY_SITE, Role.CONCURRENT, "c2"),
              (PRIMARY_SITE, Role.STANDBY, "sb"), (SECONDARY_SITE, Role.SHADOW, "sh")]
    return [Slot(site, partition, role, f"{partition}/{short}",
                 f"127.0.1.{10 * number + index + 1}")
            for number, partition in enumerate(ACCOUNTS)
            for index, (site, role, short) in enumerate(places)]


def ledger_name(site: str, partition: str) -> str:
    """The key of a site's ledger of a partition in ``Bank.ledgers``."""
    return f"{site}/{partition}"


class Sites:
    """The bank's servers at their sites, for one run: each slot's program, its
    supervisor (kills now and then, restarts), the group outages, the setup's wait for
    every first registration. The broker is the caller's: one (``router-bank-sites-live``)
    or a replicated trio (``router-bank-replicated-live``), at ``url``."""

    def __init__(self, loop: SimLoop, world: World, plants: frozenset[str], *,
                 url: str = URL) -> None:
        self.loop = loop
        self.world = world
        self.plants = plants
        self.url = url
        self.bank = Bank({ledger_name(site, name): Database({a: OPENING_BALANCE
                                                            for a in accounts})
                          for site in SITES for name, accounts in ACCOUNTS.items()})
        self.slots = _slots()
        self.specs: list[BankServer] = []

    async def program(self, slot: Slot) -> None:
        """The server program of ``slot`` (with this run's plants)."""
        loop, world, bank, plants = self.loop, self.world, self.bank, self.plants
        role = slot.role
        if role is Role.STANDBY and STANDBY_AS_CONCURRENT in plants:
            role = Role.CONCURRENT  # the plant: it serves beside the concurrent servers
        spec = BankServer(
            slot.partition, bank.ledgers[ledger_name(slot.site, slot.partition)],
            slot.name, role,
            tid_check=slot.role is not Role.SHADOW or SHADOW_NO_TID_CHECK not in plants,
            watch=ActiveServers(slot.partition) if slot.role is Role.STANDBY else None,
            url=self.url)
        self.specs.append(spec)
        parts = [bank_server(loop, world, bank, spec)]
        if slot.role is Role.SHADOW and PRESENTS_TO_BOTH_SITES in plants:
            # the plant: the primary site's copy of a transaction goes to the shadow
            # site too (its process takes primary-site work into its site's ledger)
            parts.append(bank_server(loop, world, bank, BankServer(
                slot.partition, spec.ledger, f"{slot.name}+", Role.CONCURRENT,
                url=self.url)))
        await asyncio.gather(*parts)

    def start(self, slot: Slot) -> None:
        """Start the server program of ``slot``."""
        slot.killed.clear()
        slot.process, _ = self.loop.spawn(slot.host, self.program(slot))
        self.world.log(f"{self.loop.time():.6f} server {slot.name} started")

    def kill(self, slot: Slot, why: str) -> None:
        """Kill the server program of ``slot`` (if it runs)."""
        if slot.process is not None:
            self.loop.kill(slot.process)
            slot.process = None
            slot.killed.set()
            self.world.log(f"{self.loop.time():.6f} server {slot.name} killed ({why})")

    async def supervise(self, slot: Slot, fault_end: float) -> None:
        """Kill the server now and then during the fault phase; start it again after a
        pause, or once its group's outage is over."""
        loop = self.loop
        while True:
            if slot.process is None:
                while loop.time() < slot.down_until:  # an outage may lengthen the pause
                    await asyncio.sleep(slot.down_until - loop.time())
                self.start(slot)
            try:
                await asyncio.wait_for(slot.killed.wait(), loop.random.expovariate(
                    1 / MEAN_SERVER_DEATH_GAP_S))
                continue  # an outage killed it: back once the outage is over
            except TimeoutError:
                pass
            if loop.time() >= fault_end:
                return
            if loop.random.random() < PAUSE_SHARE:
                await self.stop(slot, loop.random.uniform(*PAUSE_S))
                continue
            self.kill(slot, "alone")
            slot.down_until = loop.time() + loop.random.uniform(*RESTART_S)

    async def stop(self, slot: Slot, seconds: float) -> None:
        """Stop the server program of ``slot`` as SIGSTOP does for ``seconds``, then
        continue it (unless an outage killed it meanwhile)."""
        process, loop = slot.process, self.loop
        if process is None:
            return
        loop.pause(process)
        self.world.log(f"{loop.time():.6f} server {slot.name} stopped for {seconds:.3f} s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(slot.killed.wait(), seconds)
        if slot.process == process:
            loop.resume(process)
            self.world.log(f"{loop.time():.6f} server {slot.name} continued")

    async def outages(self, fault_end: float) -> None:
        """Now and then a whole site, or a partition's concurrent servers, go down
        together, until ``fault_end``."""
        loop, slots = self.loop, self.slots
        while True:
            await asyncio.sleep(loop.random.expovariate(1 / MEAN_OUTAGE_GAP_S))
            if loop.time() >= fault_end:
                return
            if loop.random.random() < 0.5:
                site = loop.random.choice(SITES)
                group = [s for s in slots if s.site == site]
                what = f"the {site} site"
            else:
                partition = loop.random.choice(list(ACCOUNTS))
                group = [s for s in slots
                         if s.partition == partition and s.role is Role.CONCURRENT]
                what = f"the concurrent servers of {partition}"
            until = loop.time() + loop.random.uniform(*OUTAGE_S)
            self.world.log(f"{loop.time():.6f} outage of {what} until {until:.6f}")
            for slot in group:
                slot.down_until = max(slot.down_until, until)
                self.kill(slot, "outage")

    async def start_all(self) -> None:
        """Start every server and wait for each one's first registration (a failure
        after :data:`SETUP_TIMEOUT_S`)."""
        loop = self.loop
        for slot in self.slots:
            self.start(slot)
        while len(self.specs) < len(self.slots):
            await asyncio.sleep(0.001)
        # every site registered once (a shadow site is one from its first registration)
        try:
            await asyncio.wait_for(asyncio.gather(*(spec.registered.wait()
                                                    for spec in self.specs)),
                                   SETUP_TIMEOUT_S)
            self.world.log(f"{loop.time():.6f} every server registered")
        except TimeoutError:
            self.bank.failures.append(f"a server did not register within "
                                      f"{SETUP_TIMEOUT_S} s")

    def start_faults(self, fault_end: float) -> None:
        """Each server's supervisor and the outages, until ``fault_end``."""
        for slot in self.slots:
            self.loop.create_task(self.supervise(slot, fault_end))
        self.loop.create_task(self.outages(fault_end))

    def check_all_up(self) -> None:
        """After the healed phase every server runs (else a failure)."""
        down = [slot.name for slot in self.slots if slot.process is None]
        if down:
            self.bank.failures.append(f"servers still down after the healed phase: {down}")


def run_bank_sites_live(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``router-bank-sites-live``; returns the violations."""
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    disk = SimDisk(loop)
    sites = Sites(loop, world, plants)
    bank = sites.bank
    facilities = {FACILITY: PARTITIONS}

    async def main() -> None:
        broker, _ = loop.spawn(BROKER, run_broker(loop, disk, BROKER, PORT, facilities))
        await asyncio.sleep(0.01)
        await sites.start_all()
        fault_end = loop.time() + FAULT_S
        end = fault_end + HEAL_S
        sites.start_faults(fault_end)
        end = await run_clients_killing_broker(loop, world, bank, disk, broker, facilities,
                                               fault_end, end, stop_share=BROKER_STOP_SHARE)
        await asyncio.sleep(max(0.0, end - loop.time()))  # every site catches up
        sites.check_all_up()

    with captured_logs(world, loop):
        loop.run(main())
    world.log(f"network {loop.network.trace_hash()}")
    violations = [f"unhandled in the event loop: {error}" for error in loop.errors]
    return violations + check_sites(bank)


def check_sites(bank: Bank) -> list[str]:
    """``check_bank`` for each site's ledgers, each ledger's TID table against the
    ACCEPTED transfers, and each secondary ledger against its primary."""
    violations: list[str] = list(bank.failures)
    for site in SITES:
        view = Bank({name: bank.ledgers[ledger_name(site, name)] for name in ACCOUNTS},
                    bank.transfers)
        violations += [f"{site} site: {v}" for v in check_bank(view)]
    accepted = {tid for tid, t in bank.transfers.items() if t.told == "ACCEPTED"}
    for key, ledger in sorted(bank.ledgers.items()):
        missing, extra = sorted(accepted - ledger.tids), sorted(ledger.tids - accepted)
        if missing or extra:
            violations.append(f"ledger {key}: ACCEPTED but not applied {missing}, applied "
                              f"but not ACCEPTED {extra}")
    for name in ACCOUNTS:
        primary = bank.ledgers[ledger_name(PRIMARY_SITE, name)]
        secondary = bank.ledgers[ledger_name(SECONDARY_SITE, name)]
        if primary.balances != secondary.balances or primary.tids != secondary.tids:
            violations.append(
                f"partition {name}: the secondary site's ledger differs from the primary "
                f"site's: balances {secondary.balances} vs {primary.balances}, only on "
                f"the primary {sorted(primary.tids - secondary.tids)}, only on the "
                f"secondary {sorted(secondary.tids - primary.tids)}")
    return violations
