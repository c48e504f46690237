"""Scenario ``router-bank``: bank transfers through the real router, over two
partitions, with broker crashes, server crashes and message delays.

Facility BANK has partitions A (keys 0-999) and B (1000-1999), one server each.
A **server** (:class:`BankServer`) applies its leg to its own database
(:class:`Database`, which survives the server's crash): on ``MSG1`` it checks the
balance and votes (``INSUFFICIENT`` rejects a debit); on ``ACCEPTED`` it commits
the leg and records the tid in its TID table in one step, then acknowledges
(``done``); on ``UNCERTAIN`` (a replay after it may have committed) it first looks
the tid up in its TID table and votes without applying again if it is there. A
server's death closes its session; its uncommitted work is gone.

A **client** (:class:`BankClient`) runs one transfer at a time, from an account of
one partition to an account of the other: the debit (``index`` 0), then the credit
with the accept (``index`` 1, ``accept``: as the ``rtr_send`` handler does), then
waits for the outcome push and acknowledges it.
After a broker crash, or a reset of its connection (which the client may notice
before the broker does), it registers again and, as the client library does
(``router/client.py`` ``_restored``), rejects a transfer it had not accepted yet
(reason LOST) and asks ``rtr_outcome`` (with its new controller, so that a PENDING
outcome is pushed to it), asking again while PENDING.

Checkers, after a healed phase: money is conserved; every transfer is applied on
both sides or on neither, and never twice on a side; what the client was told
agrees with what was applied (ACCEPTED: both sides; REJECTED or UNKNOWN: neither);
an accept that was answered never ends UNKNOWN; every transfer sent has an outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from txbroker.core.router.commands import (
    Collected,
    Define,
    Done,
    Outcome,
    Register,
    Reject,
    Send,
    Vote,
)
from txbroker.sim.actors import Actor
from txbroker.sim.node import BrokerNode, Delivered
from txbroker.sim.world import World

FACILITY = "BANK"
PARTITIONS = [{"name": "A", "low": 0, "high": 999}, {"name": "B", "low": 1000, "high": 1999}]
#: Accounts of each partition, and their opening balance.
ACCOUNTS = {"A": range(0, 4), "B": range(1000, 1004)}
OPENING_BALANCE = 100
#: A transfer's amount (uniform): large enough that some debits are refused.
AMOUNT = (1, 60)
CLIENTS = 3
#: Virtual length of the fault phase and of the healed phase (ms).
FAULT_MS = 2_000
HEAL_MS = 3_000
#: Mean time between broker crashes, and between one server's deaths (ms).
MEAN_BROKER_CRASH_GAP_MS = 500
MEAN_SERVER_DEATH_GAP_MS = 600
RESTART_MS = (1, 60)
#: Mean time between one client's connection resets (ms; the client notices at once,
#: the broker ends the old session this much later: its heartbeat).
MEAN_CLIENT_RESET_GAP_MS = 800
RESET_NOTICED_MS = (0, 300)
#: Pause before asking again about a PENDING (or unanswered) outcome (ms).
ASK_AGAIN_MS = 150


@dataclass
class Database:
    """One partition's database: balances, the TID table, and every commit made."""

    balances: dict[int, int]
    tids: set[str] = field(default_factory=set)
    applied: list[str] = field(default_factory=list)


@dataclass
class Transfer:
    """One transfer as its client saw it."""

    tid: str
    debit: int
    credit: int
    amount: int
    sent: bool = False
    accept_sent: bool = False
    accept_answered: bool = False
    told: str | None = None


@dataclass
class _Leg:
    delta: dict[int, int]
    committed_before: bool = False


class BankServer(Actor):
    """A partition's server over its database (see the module docstring)."""

    def __init__(self, world: World, node: BrokerNode, partition: str, db: Database,
                 check_tids: bool = True, commit_on_vote: bool = False) -> None:
        super().__init__(world, node, f"srv{partition}")
        self.partition = partition
        self.db = db
        #: off only by the plant ``server-no-tid-check``
        self.check_tids = check_tids
        #: on only by the plant ``server-commit-on-vote``
        self.commit_on_vote = commit_on_vote
        self.controller: int | None = None
        self.legs: dict[str, _Leg] = {}

    def on_connected(self) -> None:
        """Register as the partition's server."""
        self.controller = None
        self.legs = {}

        def registered(ok: bool, result: Any) -> None:
            if ok:
                self.controller = int(result["controller"])
            else:
                self.die()
                self.connect_soon()

        self.call("rtr_register", lambda b, s, r, now: b.rtr(
            s, r, Register(FACILITY, server=True, partition=self.partition), now), registered)

    def die(self) -> None:
        """The server process dies: uncommitted work is gone, the database stays."""
        super().die()
        self.legs = {}
        self.controller = None

    def on_push(self, item: Delivered | dict[str, Any]) -> None:
        """A router message."""
        if not isinstance(item, dict) or self.controller is None:
            return
        kind, tid = item.get("type"), item.get("tid")
        if not isinstance(tid, str):
            return
        if kind in ("MSG1", "UNCERTAIN"):
            self._present(kind, tid, item["body"], item.get("decided") is True)
        elif kind == "ACCEPTED":
            self._commit(tid)
        elif kind == "REJECTED":
            self.legs.pop(tid, None)
            self.world.log(f"{self.name} rollback {tid} {item.get('reason')}")
            self._done(tid)

    def _present(self, kind: str, tid: str, body: bytes, decided: bool = False) -> None:
        if kind == "UNCERTAIN" and self.check_tids and tid in self.db.tids:
            self.legs[tid] = _Leg({}, committed_before=True)
            self.world.log(f"{self.name} {tid} uncertain: committed before")
            self._vote(tid, True)
            return
        op, account, amount = body.decode().split(":")
        delta = -int(amount) if op == "debit" else int(amount)
        if self.db.balances[int(account)] + delta < 0 and not decided:
            self.world.log(f"{self.name} {tid} {kind} refuses {op}")
            self._vote(tid, False)
            return
        self.legs[tid] = _Leg({int(account): delta})
        if self.commit_on_vote:  # planted: the leg is committed before the outcome
            self._apply(tid, self.legs[tid])
            self.legs[tid] = _Leg({}, committed_before=True)
        self._vote(tid, True)

    def _vote(self, tid: str, accept: bool) -> None:
        controller = self.controller
        self.call("rtr_vote", lambda b, s, r, now: b.rtr(
            s, r, Vote(controller, tid, accept, "" if accept else "INSUFFICIENT", 1), now),
            lambda ok, result: None)

    def _commit(self, tid: str) -> None:
        leg = self.legs.pop(tid, None)
        if leg is None:
            self.world.log(f"{self.name} ACCEPTED {tid} with no work")
        elif not leg.committed_before:
            self._apply(tid, leg)
        self._done(tid)

    def _apply(self, tid: str, leg: _Leg) -> None:
        """Commit a leg: the balances and the TID table change in one step."""
        for account, delta in leg.delta.items():
            self.db.balances[account] += delta
        self.db.tids.add(tid)
        self.db.applied.append(tid)
        self.world.log(f"{self.name} commit {tid}")

    def _done(self, tid: str) -> None:
        controller = self.controller
        self.call("rtr_done", lambda b, s, r, now: b.rtr(s, r, Done(controller, tid), now),
                  lambda ok, result: None)


class BankClient(Actor):
    """A client running transfers one at a time (see the module docstring)."""

    def __init__(self, world: World, node: BrokerNode, name: str,
                 transfers: dict[str, Transfer]) -> None:
        super().__init__(world, node, name)
        self.transfers = transfers
        self.controller: int | None = None
        self.current: Transfer | None = None
        self.count = 0
        self.asking = False
        #: the healed phase: finish the transfer in flight, begin no other
        self.finishing = False

    def on_connected(self) -> None:
        """Register; then ask about the transfer in flight, or start one."""
        self.controller = None

        def registered(ok: bool, result: Any) -> None:
            if not ok:
                return
            self.controller = int(result["controller"])
            if self.current is not None and self.current.sent:
                self.asking = True
                if not self.current.accept_sent:
                    self._reject_lost(self.current)
                self._ask()
            else:
                self.current = None
                self._next()

        self.call("rtr_register", lambda b, s, r, now: b.rtr(
            s, r, Register(FACILITY, server=False), now), registered)

    def _next(self) -> None:
        if self.stopped or self.finishing or self.conn is None or self.controller is None:
            return
        if self.current is not None:
            return
        self.count += 1
        rng = self.world.rng
        a, b = rng.choice(ACCOUNTS["A"]), rng.choice(ACCOUNTS["B"])
        debit_account, credit_account = (a, b) if rng.random() < 0.5 else (b, a)
        transfer = Transfer(f"{self.name}-{self.count}", debit_account, credit_account,
                            rng.randint(*AMOUNT))
        self.current = transfer
        self.transfers[transfer.tid] = transfer
        controller, tid = self.controller, transfer.tid
        debit = f"debit:{transfer.debit}:{transfer.amount}".encode()
        credit = f"credit:{transfer.credit}:{transfer.amount}".encode()
        transfer.sent = True
        self.world.log(f"{self.name} begins {tid}")

        def debited(ok: bool, result: Any) -> None:
            if not ok:
                self._ask_soon()
                return
            if "rejected" in result:
                return  # a server rejected already: the outcome is pushed

            def accept(b: Any, s: int, r: int, now: int) -> Any:
                return b.rtr(s, r, Send(controller, tid, transfer.credit, credit, None, 1,
                                        accept=True), now)

            transfer.accept_sent = True
            self.call("rtr_send_accept", accept, accepted)

        def accepted(ok: bool, result: Any) -> None:
            if not ok:
                self._ask_soon()
            elif "rejected" not in result:
                transfer.accept_answered = True
                self.world.log(f"{self.name} accept answered {tid}")

        self.call("rtr_send", lambda b, s, r, now: b.rtr(
            s, r, Send(controller, tid, transfer.debit, debit, None, 0), now), debited)

    def _reject_lost(self, transfer: Transfer) -> None:
        """As the client library does after a loss before the accept: reject the
        transaction (reason LOST) with the new controller; an error is ignored (it is
        gone, or decided: the outcome says which)."""
        controller, tid = self.controller, transfer.tid
        self.call("rtr_reject", lambda b, s, r, now: b.rtr(
            s, r, Reject(controller, tid, "LOST"), now), lambda ok, result: None)

    def _ask_soon(self) -> None:
        self.asking = True
        self.world.schedule(ASK_AGAIN_MS, self._ask)

    def _ask(self) -> None:
        transfer = self.current
        if transfer is None or not self.asking or self.conn is None or self.controller is None:
            return
        controller, tid = self.controller, transfer.tid

        def answered(ok: bool, result: Any) -> None:
            if self.current is not transfer:
                return
            state = result.get("state") if ok and isinstance(result, dict) else None
            if state in ("ACCEPTED", "REJECTED", "UNKNOWN"):
                self._told(transfer, str(state))
            else:
                self._ask_soon()  # PENDING (its outcome will be pushed too), or an error

        self.call("rtr_outcome", lambda b, s, r, now: b.rtr(
            s, r, Outcome(tid, controller), now), answered)

    def on_push(self, item: Delivered | dict[str, Any]) -> None:
        """An outcome (or a router event)."""
        if not isinstance(item, dict) or item.get("type") not in ("ACCEPTED", "REJECTED"):
            return
        transfer = self.current
        if transfer is not None and item.get("tid") == transfer.tid:
            self._told(transfer, str(item["type"]))

    def _told(self, transfer: Transfer, state: str) -> None:
        transfer.told = state
        self.world.log(f"{self.name} told {transfer.tid} {state}")
        self.current = None
        self.asking = False
        controller = self.controller
        self.call("rtr_ack", lambda b, s, r, now: b.rtr(
            s, r, Collected(controller, [transfer.tid]), now), lambda ok, result: None)
        self.world.schedule(self.world.delay(0, 20), self._next)

    def on_lost(self) -> None:
        """The broker crashed: the outcome of the transfer in flight is asked for later."""
        self.controller = None


class Setup(Actor):
    """Defines the facility, then starts the workload."""

    def __init__(self, world: World, node: BrokerNode, start: Any) -> None:
        super().__init__(world, node, "setup")
        self.start = start

    def on_connected(self) -> None:
        """Define BANK (the workload starts once, whatever retries are under way)."""
        if self.stopped:
            return

        def defined(ok: bool, result: Any) -> None:
            if self.stopped:
                return
            if not ok:  # e.g. its record failed to sync: again, on this connection
                self.world.schedule(20, self.on_connected)
                return
            self.stopped = True
            self.start()

        self.call("rtr_define", lambda b, s, r, now: b.rtr(
            s, r, Define(FACILITY, PARTITIONS), now), defined)

    def on_lost(self) -> None:
        """Define again after a crash."""


def _faults(world: World, node: BrokerNode, servers: list[BankServer],
            clients: list[BankClient], until_ms: int, client_resets: bool) -> None:
    def gap(mean: int) -> int:
        return int(world.rng.expovariate(1 / mean))

    def reset(client: BankClient) -> None:
        if world.now >= until_ms:
            return
        client.reset(world.delay(*RESET_NOTICED_MS))
        world.schedule(gap(MEAN_CLIENT_RESET_GAP_MS), lambda: reset(client))

    def kill(server: BankServer) -> None:
        if world.now >= until_ms:
            return
        server.die()
        server.connect_soon()
        world.schedule(gap(MEAN_SERVER_DEATH_GAP_MS), lambda: kill(server))

    node.crash_now_and_then(MEAN_BROKER_CRASH_GAP_MS, RESTART_MS, until_ms)
    for client in clients if client_resets else []:
        world.schedule(gap(MEAN_CLIENT_RESET_GAP_MS), lambda client=client: reset(client))  # type: ignore[misc]
    for server in servers:
        world.schedule(gap(MEAN_SERVER_DEATH_GAP_MS), lambda server=server: kill(server))  # type: ignore[misc]


def run_bank(world: World, plants: frozenset[str]) -> list[str]:
    """Run the scenario on ``world``; the checkers' violations (empty: all good)."""
    return _run_bank(world, plants, client_resets=False, failing_fsync=False)


def run_bank_resets(world: World, plants: frozenset[str]) -> list[str]:
    """Scenario ``router-bank-resets``: ``router-bank`` with client connection resets
    that the client notices before the broker does (a half-open connection, ended by
    the broker's heartbeat up to ``RESET_NOTICED_MS`` later)."""
    return _run_bank(world, plants, client_resets=True, failing_fsync=False)


def run_bank_failing_fsync(world: World, plants: frozenset[str]) -> list[str]:
    """Scenario ``router-bank-failing-fsync``: ``router-bank`` with fsyncs that fail
    now and then (the broker then takes no writes until a supervisor restarts it)."""
    return _run_bank(world, plants, client_resets=False, failing_fsync=True)


def _run_bank(world: World, plants: frozenset[str], *, client_resets: bool,
              failing_fsync: bool) -> list[str]:
    early = frozenset({"rtr_send_accept"}) if "accept-before-durable" in plants else frozenset()
    node = BrokerNode(world, early_ops=early, lying_fsync="fsync-lies" in plants)
    node.start()
    node.faults = failing_fsync
    databases = {name: Database({account: OPENING_BALANCE for account in accounts})
                 for name, accounts in ACCOUNTS.items()}
    transfers: dict[str, Transfer] = {}
    servers = [BankServer(world, node, name, db, "server-no-tid-check" not in plants,
                          "server-commit-on-vote" in plants)
               for name, db in databases.items()]
    clients = [BankClient(world, node, f"c{n}", transfers) for n in range(CLIENTS)]
    fault_end = world.now + FAULT_MS

    def start() -> None:
        for actor in [*servers, *clients]:
            actor.connect_soon()
        _faults(world, node, servers, clients, fault_end, client_resets)

    setup = Setup(world, node, start)
    setup.connect_soon()
    world.run_until(fault_end)
    world.log("heal")  # a crash's restart is already scheduled: no new fault starts
    node.faults = False
    for client in clients:
        client.finishing = True  # no new transfers; the ones in flight go on
    world.run_until(fault_end + HEAL_MS)
    if node.up:  # what the router still holds (for reading a failing trace)
        for line in node.broker.router_holds():
            world.log(f"router holds {line}")
    # a command that must not fail (a session's end) raised: a defect, whatever else holds
    return [f"core error: {e}" for e in node.core_errors] + check_bank(databases, transfers)


def check_bank(databases: dict[str, Database], transfers: dict[str, Transfer]) -> list[str]:
    """The router-bank checkers (see the module docstring)."""
    violations = []
    total = sum(sum(db.balances.values()) for db in databases.values())
    opening = OPENING_BALANCE * sum(len(accounts) for accounts in ACCOUNTS.values())
    if total != opening:
        violations.append(f"money not conserved: {total} != {opening}")
    for name, db in databases.items():
        seen: set[str] = set()
        for tid in db.applied:
            if tid in seen:
                violations.append(f"{tid} applied twice on {name}")
            seen.add(tid)
    on_a, on_b = set(databases["A"].applied), set(databases["B"].applied)
    for tid in sorted(on_a ^ on_b):
        violations.append(f"{tid} applied on {'A' if tid in on_a else 'B'} only")
    for tid, transfer in sorted(transfers.items()):
        applied = tid in on_a and tid in on_b
        if transfer.told == "ACCEPTED" and not applied:
            violations.append(f"{tid} told ACCEPTED but not applied")
        elif transfer.told in ("REJECTED", "UNKNOWN") and (tid in on_a or tid in on_b):
            violations.append(f"{tid} told {transfer.told} but applied")
        if transfer.accept_answered and transfer.told == "UNKNOWN":
            violations.append(f"{tid}: its accept was answered, then it was UNKNOWN")
        if transfer.sent and transfer.told is None:
            violations.append(f"{tid} has no outcome after the healed phase")
    return violations
