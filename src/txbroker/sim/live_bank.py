"""Scenario ``router-bank-live``: bank transfers through the production router, with
the production router client and server libraries, on the deterministic event loop.

``router-bank`` (``bank_scenario.py``) drives the router core and models the
libraries' recovery rules; here the libraries themselves run — ``txbroker.router.aio``
``AsyncTransactionController`` and ``AsyncServerTransactionController`` over
``txbroker.aio`` connections with failover — against ``txbroker serve``'s
``BrokerServer``, on a :class:`~txbroker.sim.loop.SimLoop`. The bugs issue 25 found
were in a client library's order of steps across a failover: this is where such
bugs show.

Facility BANK has partitions A (keys 0-999) and B (1000-1999), one server each.

- **A server** (a simulated process) applies its leg to its partition's ledger
  (``bank_scenario.Database``), which outlives the server: on ``MSG1`` it votes —
  ``INSUFFICIENT`` refuses a debit that would overdraw (unless the router says the
  transaction is decided) — and keeps the leg pending; on ``ACCEPTED`` it applies
  the pending leg and records the tid in the ledger's TID table in one step, then
  acknowledges; on ``UNCERTAIN`` (a replay after it may have committed) it looks the
  tid up first and, if it is there, only votes again. A killed server loses its
  pending leg; a new one registers after a pause.
- **A client** (a simulated process) runs one transfer at a time: ``start_transaction``
  (with a tid of its own: the run replays exactly), ``send`` of the debit,
  ``set_accept`` of the credit, then ``receive`` until the outcome — whatever the
  calls before raised (a lost transaction's outcome comes by ``receive`` too).
- **The broker** is killed at random in the fault phase and restarted on its data.

Checkers, after a healed phase: money is conserved; a transfer is applied on both
sides or on neither, and never twice on one side; what the client was told agrees
with what was applied (ACCEPTED: both sides; REJECTED: neither); every transfer has
an outcome; nothing unhandled in the loop; no server got an ACCEPTED it knew
nothing of. (Whether an accept was *answered* the library does not say — a lost
connection there is not final — so "an answered accept never ends UNKNOWN" stays
with ``router-bank``, which sees the core's answers.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from txbroker.client.aio import AsyncConnection
from txbroker.errors import TxBrokerError
from txbroker.router.aio import (
    SERVER_DOWN,
    SERVER_UP,
    AsyncServerTransactionController,
    AsyncTransactionController,
    MessageType,
    Role,
    RouterMessage,
)
from txbroker.sim.bank_scenario import (
    ACCOUNTS,
    AMOUNT,
    FACILITY,
    OPENING_BALANCE,
    PARTITIONS,
    Database,
)
from txbroker.sim.live import (
    SimDisk,
    captured_logs,
    connect_retrying,
    run_broker,
    seed_client_jitter,
)
from txbroker.sim.loop import SimLoop
from txbroker.sim.world import World

BROKER = "127.0.0.10"
PORT = 5445
URL = f"txb://{BROKER}:{PORT}"
CLIENTS = 3
#: Virtual lengths of the fault phase and of the healed phase (s).
FAULT_S = 2.0
HEAL_S = 8.0
#: Mean time between broker kills, and between one server's deaths (s); pauses.
MEAN_BROKER_KILL_GAP_S = 0.6
MEAN_SERVER_DEATH_GAP_S = 0.7
RESTART_S = (0.001, 0.06)
#: How long a stopped broker stays stopped (s, uniform; ``router-bank-sites-live``): the
#: longest outlast the libraries' 5 s request timeout, so clients and servers fail over
#: to the stopped broker's address and find it silent until it continues.
BROKER_STOP_S = (0.05, 5.5)
#: How long a healed phase's own client makes transfers (s): the faults can leave the
#: system unable to accept anything for the whole fault phase (a broker stopped
#: throughout; a trio with no primary), and the run must still show progress.
HEALED_CLIENT_S = 1.0
#: ... and how long the run goes on after that client's window at least (s): its last
#: transfer's outcome, every site catching up.
HEALED_FINISH_S = 5.0
#: How long a failing-over connection keeps trying (s): longer than any outage here.
FAILOVER_TIMEOUT_S = 30.0
INSUFFICIENT = "INSUFFICIENT"
#: The roles of a partition's primary site that keep its standbys idle.
ACTIVE_ROLES = frozenset({Role.PRIMARY.value, Role.CONCURRENT.value})


@dataclass
class Transfer:
    """One transfer as its client saw it."""

    tid: str
    debit: int
    credit: int
    amount: int
    #: ``set_accept`` returned (not: the broker answered it — a loss of the connection
    #: is not final there, and the outcome comes by ``receive``)
    accept_returned: bool = False
    #: the outcome ``receive`` gave: "ACCEPTED", "REJECTED <reason>", or None
    told: str | None = None


@dataclass
class Bank:
    """The run's shared record."""

    ledgers: dict[str, Database]
    transfers: dict[str, Transfer] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _leg(account: int, amount: int) -> bytes:
    return f"{account}:{amount}".encode()


def _unleg(body: bytes) -> tuple[int, int]:
    account, amount = body.decode().split(":")
    return int(account), int(amount)


async def _connect(loop: SimLoop, url: str) -> AsyncConnection:
    return await connect_retrying(loop, url, failover_timeout=FAILOVER_TIMEOUT_S, timeout=5.0)


class ActiveServers:
    """A standby's view of its partition's primary and concurrent servers, from the
    router events ``SERVER_UP`` and ``SERVER_DOWN`` it subscribes to. They come on its
    connection in order with the router's messages, so at each presentation (``MSG1``,
    ``UNCERTAIN``) the view is what the router had registered when it presented —
    except servers registered before the standby on this broker run, which it never
    heard of: the view is a subset of the truth. One lag is legitimate: the last
    active server's death replays its transaction to the standby *before* its
    ``SERVER_DOWN`` goes out (one router command). So a presentation under a non-empty
    view is a suspicion, cleared when ``SERVER_DOWN`` of every server it names comes
    before the standby's next presentation, and a violation otherwise. The standby's
    own ``SERVER_UP`` starts a new session's view (a broker restart forgets every
    registration; events of the old session kept in the inbox come before it)."""

    def __init__(self, partition: str) -> None:
        self.partition = partition
        self.ids: set[int] = set()
        #: a presentation under a non-empty view: its tid, and the servers not yet down
        self.suspect: tuple[str, set[int]] | None = None

    def presented(self, tid: str) -> str | None:
        """A presentation of ``tid``: the violation an unresolved earlier suspicion is
        (None: none)."""
        violation = None
        if self.suspect is not None:
            violation = (f"got {self.suspect[0]} while servers {sorted(self.suspect[1])} "
                         "of its partition's primary site were registered")
        self.suspect = (tid, set(self.ids)) if self.ids else None
        return violation

    def see(self, event: RouterMessage, own_id: int | None) -> None:
        """Take a router event in (the facility's events: only its partition's count)."""
        if event.partition != self.partition:
            return
        detail = event.detail if isinstance(event.detail, dict) else {}
        server = detail.get("server")
        if event.number == SERVER_UP:
            if server == own_id:
                self.ids.clear()
                self.suspect = None
            elif detail.get("role") in ACTIVE_ROLES and isinstance(server, int):
                self.ids.add(server)
        elif event.number == SERVER_DOWN and isinstance(server, int):
            self.ids.discard(server)
            if self.suspect is not None:
                self.suspect[1].discard(server)
                if not self.suspect[1]:
                    self.suspect = None


@dataclass
class BankServer:
    """A partition server program: the ledger it applies to and its name in the trace
    (``router-bank-live``: one per partition, named by it)."""

    partition: str
    ledger: Database
    name: str
    role: Role = Role.PRIMARY
    #: look an ``UNCERTAIN`` replay up in the TID table (off: a planted bug)
    tid_check: bool = True
    #: a standby's watch over its partition's active servers (None: not watched)
    watch: ActiveServers | None = None
    #: set once the server registered (its first registration: the run may begin)
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    #: the broker's address (a failover list: ``router-bank-replicated-live``'s trio)
    url: str = URL


async def bank_server(loop: SimLoop, world: World, bank: Bank, spec: BankServer) -> None:
    """One partition server, until it is killed (or the run ends)."""
    ledger, name = spec.ledger, spec.name
    while True:  # a server that cannot register exits and its supervisor starts it again
        conn = await _connect(loop, spec.url)
        server = AsyncServerTransactionController(conn)
        try:
            await server.register_partition(
                FACILITY, spec.partition, spec.role,
                events=[(SERVER_UP, SERVER_DOWN)]
                if spec.watch is not None else ())
            break
        except (TxBrokerError, TimeoutError) as exc:
            world.log(f"{loop.time():.6f} server {name} register: {exc!r}")
            await conn.close()
            await asyncio.sleep(loop.random.uniform(0.01, 0.05))
    spec.registered.set()
    pending: tuple[str, int, int] | None = None  # tid, account, amount (None: skip)
    while True:
        try:
            message = await server.receive(timeout=0.5)
        except (TxBrokerError, TimeoutError) as exc:
            world.log(f"{loop.time():.6f} server {name} receive: {exc!r}")
            await asyncio.sleep(0.01)
            continue
        if message is None:
            continue
        if message.is_event:
            if spec.watch is not None:
                spec.watch.see(message, server.controller_id)
            continue
        if message.tid is None:
            continue
        tid = message.tid
        if spec.watch is not None and message.type in (MessageType.MSG1,
                                                         MessageType.UNCERTAIN):
            violation = spec.watch.presented(tid)
            if violation is not None:
                bank.failures.append(f"standby {name} {violation}")
        try:
            if message.type in (MessageType.MSG1, MessageType.UNCERTAIN, MessageType.MSG):
                if (message.type is MessageType.UNCERTAIN and tid in ledger.tids
                        and spec.tid_check):
                    pending = None  # applied here before: only vote again
                    world.log(f"{loop.time():.6f} server {name} skip {tid}")
                    await server.accept_transaction()
                    continue
                account, amount = _unleg(message.body)
                if (amount < 0 and not message.decided
                        and ledger.balances[account] + amount < 0):
                    pending = None
                    await server.reject_transaction(INSUFFICIENT)
                    continue
                pending = (tid, account, amount)
                await server.accept_transaction()
            elif message.type is MessageType.ACCEPTED:
                if pending is not None and pending[0] == tid and (
                        tid not in ledger.tids or not spec.tid_check):
                    _, account, amount = pending
                    ledger.balances[account] += amount  # the commit: one step
                    ledger.tids.add(tid)
                    ledger.applied.append(tid)
                    world.log(f"{loop.time():.6f} server {name} commit {tid}")
                elif tid not in ledger.tids:
                    bank.failures.append(f"server {name}: ACCEPTED {tid} with no "
                                         "pending leg and no record of it")
                pending = None
                await server.acknowledge_outcome()
            elif message.type is MessageType.REJECTED:
                pending = None
                await server.acknowledge_outcome()
        except (TxBrokerError, TimeoutError) as exc:
            world.log(f"{loop.time():.6f} server {name} {message.type} {tid}: {exc!r}")


async def bank_client(loop: SimLoop, world: World, bank: Bank, number: int,
                      until: float, *, url: str = URL) -> None:
    """Client ``number``: one transfer after another until ``until``, each to its
    outcome; the broker at ``url``."""
    while True:
        conn = await _connect(loop, url)
        client = AsyncTransactionController(conn)
        try:
            await client.register_facility(FACILITY)
            break
        except (TxBrokerError, TimeoutError) as exc:
            world.log(f"{loop.time():.6f} client {number} register: {exc!r}")
            await conn.close()
            await asyncio.sleep(loop.random.uniform(0.01, 0.05))
    count = 0
    while loop.time() < until:
        count += 1
        tid = f"c{number}-{count}"
        first, second = ("A", "B") if loop.random.random() < 0.5 else ("B", "A")
        debit = loop.random.choice(ACCOUNTS[first])
        credit = loop.random.choice(ACCOUNTS[second])
        amount = loop.random.randint(*AMOUNT)
        transfer = bank.transfers[tid] = Transfer(tid, debit, credit, amount)
        try:
            await client.start_transaction(tid=tid)
            await client.send(_leg(debit, -amount), key=debit)
            await client.set_accept(_leg(credit, amount), key=credit)
            transfer.accept_returned = True
        except (TxBrokerError, TimeoutError) as exc:
            world.log(f"{loop.time():.6f} client {tid}: {exc!r}")
        while transfer.told is None:
            try:
                outcome = await client.receive(timeout=1.0)
            except (TxBrokerError, TimeoutError) as exc:
                world.log(f"{loop.time():.6f} client {tid} receive: {exc!r}")
                await asyncio.sleep(0.05)
                continue
            if outcome is None or outcome.is_event:
                continue
            if outcome.type is MessageType.ACCEPTED:
                transfer.told = "ACCEPTED"
            elif outcome.type is MessageType.REJECTED:
                transfer.told = f"REJECTED {outcome.reason}"
        world.log(f"{loop.time():.6f} client {tid} told {transfer.told}")
    await conn.close()


async def run_clients_killing_broker(loop: SimLoop, world: World, bank: Bank, disk: SimDisk,
                                     broker: Any, facilities: Any, fault_end: float,
                                     end: float, *, stop_share: float = 0.0) -> float:
    """The bank scenarios' fault phase: the clients run while the broker is killed and
    restarted on its disk until ``fault_end``; then each client must finish by ``end``.
    ``stop_share``: the share of the broker's faults that stop it (SIGSTOP) for
    :data:`BROKER_STOP_S` instead (0: none, and no random draw for it, so that a
    scenario without stops replays as before). Returns when the run ends: ``end``, or
    later when the healed phase's client started late (a stop outlasted the faults)."""
    clients = start_clients(loop, world, bank, fault_end)
    while True:
        gap = loop.random.expovariate(1 / MEAN_BROKER_KILL_GAP_S)
        if stop_share:  # (the phase ends at fault_end, not at a gap past it)
            gap = min(gap, max(0.0, fault_end - loop.time()))
        await asyncio.sleep(gap)
        if loop.time() >= fault_end:
            break
        if stop_share and loop.random.random() < stop_share:
            seconds = loop.random.uniform(*BROKER_STOP_S)
            loop.pause(broker)
            world.log(f"{loop.time():.6f} broker stopped for {seconds:.3f} s")
            await asyncio.sleep(seconds)
            loop.resume(broker)
            world.log(f"{loop.time():.6f} broker continued")
            continue
        loop.kill(broker)
        disk.crash()
        world.log(f"{loop.time():.6f} broker killed")
        await asyncio.sleep(loop.random.uniform(*RESTART_S))
        broker, _ = loop.spawn(BROKER, run_broker(loop, disk, BROKER, PORT, facilities))
        world.log(f"{loop.time():.6f} broker started")
    if stop_share:  # a stop can outlast the whole fault phase: the healed broker must
        # still make progress (13 of 10,000 seeds accepted nothing before this client),
        # and the client has its window and time to finish (a stop from 1.8 s to 7.1 s
        # left it 0.9 s before the run's end once: seed 20690)
        clients.append(loop.spawn(f"127.0.2.{CLIENTS + 1}", bank_client(
            loop, world, bank, CLIENTS, loop.time() + HEALED_CLIENT_S))[1])
        end = max(end, loop.time() + HEALED_CLIENT_S + HEALED_FINISH_S)
    await finish_clients(loop, bank, clients, end)
    return end


def start_clients(loop: SimLoop, world: World, bank: Bank, until: float, *,
                  url: str = URL) -> list[asyncio.Task[None]]:
    """Spawn the :data:`CLIENTS` bank clients (transfers until ``until``), the broker at
    ``url``; their processes' futures."""
    return [loop.spawn(f"127.0.2.{n + 1}", bank_client(loop, world, bank, n, until,
                                                        url=url))[1]
            for n in range(CLIENTS)]


async def finish_clients(loop: SimLoop, bank: Bank, clients: list[asyncio.Task[None]],
                         end: float) -> None:
    """Wait for each client to finish by ``end``; one that died or did not is a
    failure."""
    for client in clients:
        try:
            await asyncio.wait_for(client, max(0.0, end - loop.time()))
        except Exception as exc:  # a client that died or never finished is a finding
            bank.failures.append(f"a client did not finish: {exc!r}")


def run_bank_live(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``router-bank-live``; returns the violations."""
    loop = SimLoop(world.rng.getrandbits(63))
    seed_client_jitter(loop)
    disk = SimDisk(loop)
    bank = Bank({name: Database({a: OPENING_BALANCE for a in accounts})
                 for name, accounts in ACCOUNTS.items()})
    facilities = {FACILITY: PARTITIONS}

    async def supervise_server(partition: str, fault_end: float) -> None:
        host = "127.0.1.1" if partition == "A" else "127.0.1.2"
        while True:
            spec = BankServer(partition, bank.ledgers[partition], partition,
                              tid_check="live-server-no-tid-check" not in plants)
            process, _ = loop.spawn(host, bank_server(loop, world, bank, spec))
            await asyncio.sleep(loop.random.expovariate(1 / MEAN_SERVER_DEATH_GAP_S))
            if loop.time() >= fault_end:
                return
            loop.kill(process)
            world.log(f"{loop.time():.6f} server {partition} killed")
            await asyncio.sleep(loop.random.uniform(*RESTART_S))

    async def main() -> None:
        broker, _ = loop.spawn(BROKER, run_broker(loop, disk, BROKER, PORT, facilities))
        await asyncio.sleep(0.01)
        fault_end = loop.time() + FAULT_S
        end = fault_end + HEAL_S
        for partition in ("A", "B"):
            loop.create_task(supervise_server(partition, fault_end))
        await run_clients_killing_broker(loop, world, bank, disk, broker, facilities,
                                         fault_end, end)
        await asyncio.sleep(max(0.0, end - loop.time()))  # servers finish their outcomes

    with captured_logs(world, loop):
        loop.run(main())
    world.log(f"network {loop.network.trace_hash()}")
    violations = [f"unhandled in the event loop: {error}" for error in loop.errors]
    return violations + check_bank(bank)


def check_bank(bank: Bank) -> list[str]:
    """The checkers over ``bank``'s ledgers (one per partition) and transfers."""
    violations: list[str] = list(bank.failures)
    total = sum(sum(ledger.balances.values()) for ledger in bank.ledgers.values())
    opening = OPENING_BALANCE * sum(len(accounts) for accounts in ACCOUNTS.values())
    if total != opening:
        violations.append(f"money not conserved: {total} != {opening}")
    if not any(t.told == "ACCEPTED" for t in bank.transfers.values()):
        violations.append("no transfer was accepted: the run tested nothing")
    for tid, transfer in bank.transfers.items():
        sides = {name: ledger.applied.count(tid) for name, ledger in bank.ledgers.items()}
        if any(count > 1 for count in sides.values()):
            violations.append(f"{tid} applied twice on a side: {sides}")
        applied = [count > 0 for count in sides.values()]
        if any(applied) and not all(applied):
            violations.append(f"{tid} applied on one side only: {sides}, told "
                              f"{transfer.told}")
        if transfer.told is None:
            violations.append(f"{tid}: no outcome was received")
        elif transfer.told == "ACCEPTED" and not all(applied):
            violations.append(f"{tid}: told ACCEPTED but applied {sides}")
        elif transfer.told.startswith("REJECTED") and any(applied):
            violations.append(f"{tid}: told {transfer.told} but applied {sides}")
    return violations
