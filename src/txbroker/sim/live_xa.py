"""Scenario ``xa-live``: global transactions through the production asyncio transaction
manager (``txbroker.tm``) over the production broker and a PostgreSQL model, with the
broker, the database and the transaction manager killed at random points.

Everything but the disks and the database is the code users run, on a
:class:`~txbroker.sim.loop.SimLoop`: ``BrokerServer`` (as in ``queue-live``), the
``txbroker.aio`` client and its XA resource, ``AsyncTransactionManager`` over the
sans-IO engine (``tm/engine.py``) with its ``DecisionLog`` and group commit,
``AsyncBrokerParticipant`` and ``AsyncPostgresParticipant``, and recovery
(``recover_async``, :data:`~txbroker.tm.recovery.RESOLUTIONS`).

- **The broker** (127.0.0.10:5445) holds a queue of :data:`MESSAGES` messages, loaded
  before the faults begin; killed and restarted on its simulated disk.
- **The database** is :mod:`~txbroker.sim.pg_model` (a process on 127.0.0.20):
  prepared transactions survive its crash, open ones do not.
- **The transaction manager** is one process (127.0.0.30) with :data:`WORKERS`
  workers, each with a broker connection and a database connection: begin a global
  transaction, receive a message, ack it in the branch, insert its row (key: the
  message id, value: the global id), commit — one in ten rolled back by the
  application instead. Its decision log lives on a simulated disk
  (``xa_parts.TmDisk``: written and synced bytes apart; a kill keeps the synced ones and
  a torn piece of the rest); a log sync takes virtual time (``xa_parts.XaLoop``).
  It runs recovery at start and, every :data:`RECOVERY_PERIOD_S`, under its running
  workers, through the manager (``AsyncTransactionManager.recover``), which leaves the
  branches of its transactions in flight to them (``tm/recovery.py``). It is killed
  at random moments and at the engine's crash points (its ``hook``), and started
  again after a pause.

After the fault phase everything is up and stays up (the healed phase): the workers
drain the queue, then stop; the manager runs recovery a last time. Checkers
(``xa_checks.py``): the broker and the database agree on every global transaction
(its message consumed for good ⇔ its row committed); no message lost, none consumed
twice; what a worker was told agrees with both; nothing left prepared in either;
the queue drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable

from txbroker.client.aio import AsyncConnection
from txbroker.core.limits import Limits
from txbroker.core.records import Kind, decode
from txbroker.errors import TxBrokerError
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.sim.live import EPOCH_MS, SimDisk, captured_logs, connect_retrying, seed_client_jitter
from txbroker.sim.pg_model import PgConnection, PgDatabase, PgError
from txbroker.sim.world import World
from txbroker.sim.xa_checks import XaRecord, check_xa
from txbroker.sim.xa_parts import SimLogFile, TmDisk, XaLoop
from txbroker.storage.memory import MemoryState
from txbroker.tm.aio import (
    AsyncBrokerParticipant,
    AsyncPostgresParticipant,
    AsyncTransactionManager,
    RolledBack,
    TMError,
)
from txbroker.tm.aio_recovery import (
    AsyncBrokerResource,
    AsyncPostgresResource,
    AsyncResource,
    recover_async,
)
from txbroker.tm.log import DecisionLog

BROKER, PORT = "127.0.0.10", 5445
PG_HOST, TM_HOST = "127.0.0.20", "127.0.0.30"
QUEUE = "orders"
#: Messages loaded before the faults.
MESSAGES = 40
WORKERS = 3
#: Virtual lengths of the fault phase and of the healed phase (s).
FAULT_S = 2.0
HEAL_S = 8.0
#: Mean time between kills in the fault phase (s), and a process's restart pause (s).
MEAN_KILL_GAP_S = 0.35
RESTART_S = (0.001, 0.08)
#: How long the database takes to notice a dead client (s).
NOTICE_S = (0.001, 0.2)
#: Chance that the manager dies at one of the engine's crash points (fault phase).
HOOK_KILL = 0.04
#: One application rollback in this many transactions.
APP_ROLLBACK = 0.1
RECOVERY_PERIOD_S = 0.02
#: Rewrite the decision log past this size (small: compaction runs in every seed).
COMPACT_BYTES = 1_500

#: The broker's XA timers (``[limits]``), shortened from 180 s so that the healed phase
#: outlasts them: a branch whose session broke (the manager died, or a worker dropped
#: its connection) waits SUSPENDED this long for a resume, then is rolled back; an ended
#: branch not prepared within the transaction timeout is rolled back.
XA_REATTACH_MS = 1_000
XA_TRANSACTION_TIMEOUT_MS = 1_500


class _NoDecisionLog(DecisionLog):
    """Plant ``tm-commit-without-log``: decisions are "made" without being written."""

    def decide_many(self, gtrids: list[bytes]) -> None:
        """Nothing is written: phase two starts with no durable decision."""


def _forget_prepared(state: MemoryState) -> None:
    """Plant ``forget-prepared-at-restart``: the broker's journal loses every prepared
    branch that was not finished (as a restart that forgot them)."""
    ended = {decode(e.kind, e.meta).xid for e in state.entries
             if e.kind in (int(Kind.XA_COMMIT), int(Kind.XA_ROLLBACK))}
    state.entries = [e for e in state.entries if e.kind != int(Kind.XA_PREPARE)
                     or decode(e.kind, e.meta).xid in ended]


class XaRun:
    """One seed's world: the processes, their faults, what the workers were told."""

    def __init__(self, world: World, plants: frozenset[str]) -> None:
        self.world = world
        self.plants = plants
        self.loop = XaLoop(world.rng.getrandbits(63))
        seed_client_jitter(self.loop)
        self.disk = SimDisk(self.loop)
        self.tm_disk = TmDisk()
        self.db = PgDatabase(self.loop)
        self.db.lose_prepared = "pg-loses-prepared" in plants
        self.record = XaRecord()
        self.faults = True  # the fault phase: kills allowed
        self.draining = False  # the healed phase's end: workers stop when idle
        self.context = contextvars.copy_context()  # the simulation's own
        self.broker = self.pg = self.tm = 0
        self.tm_task: asyncio.Task[None] | None = None

    def log(self, what: str) -> None:
        """One trace line, stamped with the loop's virtual time."""
        self.world.log(f"{self.loop.time():.6f} {what}")

    # -- processes -----------------------------------------------------------------

    def start_broker(self) -> None:
        """Start a broker process on the simulated disk."""
        if "forget-prepared-at-restart" in self.plants:
            _forget_prepared(self.disk.state)
        self.broker, _ = self.loop.spawn(BROKER, self._run_broker())
        self.log("broker started")

    async def _run_broker(self) -> None:
        """``txbroker serve`` on the simulated disk (as ``live.run_broker``), with the
        XA timers above."""
        config = ServerConfig(host=BROKER, port=PORT, stomp_port=0, amqp_port=0,
                              limits=Limits(xa_reattach_ms=XA_REATTACH_MS,
                                            xa_transaction_timeout_ms=XA_TRANSACTION_TIMEOUT_MS))
        server = BrokerServer(config, store_opener=self.disk.open)
        server.clock = lambda: EPOCH_MS + int(self.loop.time() * 1000)
        await server.start()
        await server.serve_forever()

    def kill_broker(self) -> None:
        """Kill the broker (``kill -9``): what it had not synced is lost."""
        self.loop.kill(self.broker)
        self.disk.crash()
        self.log("broker killed")

    def start_pg(self) -> None:
        """Start the database process."""
        self.pg, _ = self.loop.spawn(PG_HOST, self.db.serve())
        self.log("database started")

    def kill_pg(self) -> None:
        """Kill the database: its open transactions are lost."""
        self.loop.kill(self.pg)
        self.db.crash()
        self.log("database killed")

    def start_tm(self) -> None:
        """Start the transaction manager process."""
        self.tm, self.tm_task = self.loop.spawn(TM_HOST, self._tm_main())
        self.log("manager started")

    def kill_tm(self) -> None:
        """Kill the transaction manager; the database notices its dead sessions."""
        process = self.tm
        self.loop.kill(process)
        self.tm_disk.crash(self.loop.random)
        self.log("manager killed")
        self.loop.call_later(self.loop.random.uniform(*NOTICE_S), self.db.client_died,
                             process, context=self.context)

    def later(self, start: Callable[[], None]) -> None:
        """Call ``start`` after a restart pause, from the simulation itself."""
        self.loop.call_later(self.loop.random.uniform(*RESTART_S), start,
                             context=self.context)

    def hook(self, step: str) -> None:
        """The manager's crash points: now and then it dies there."""
        if self.faults and self.loop.random.random() < HOOK_KILL:
            self.log(f"manager dies at {step}")
            self.kill_tm()
            self.later(self.start_tm)

    # -- the transaction manager ---------------------------------------------------

    def _new_gtrid(self) -> bytes:
        return self.loop.random.getrandbits(128).to_bytes(16, "big")

    async def _tm_main(self) -> None:
        log_class = _NoDecisionLog if "tm-commit-without-log" in self.plants else DecisionLog
        decisions = log_class("tm.log", file=SimLogFile(self.tm_disk),
                              compact_bytes=COMPACT_BYTES)
        tm = AsyncTransactionManager("tm.log", decision_log=decisions, hook=self.hook,
                                     new_gtrid=self._new_gtrid)
        while not await self._recover(tm):
            await asyncio.sleep(0.05)
        workers = [asyncio.ensure_future(self._worker(tm, n)) for n in range(WORKERS)]
        bare = "recovery-in-flight" in self.plants
        while not self.draining:
            # recovery under the running workers, and often: the window it must leave
            # alone is the few ms between a branch's prepare and the decision
            await asyncio.sleep(RECOVERY_PERIOD_S)
            await self._recover(tm, bare=bare)
        await asyncio.gather(*workers)
        while not await self._recover(tm):
            await asyncio.sleep(0.05)
        self.record.final_recovery = self.loop.time()
        self.log("manager: final recovery clean")

    async def _recover(self, tm: AsyncTransactionManager, bare: bool = False) -> bool:
        """One recovery run, through the manager (or, ``bare``: the
        ``recovery-in-flight`` plant, the bare function that knows nothing of the
        transactions in flight); True when it resolved everything."""
        conn: AsyncConnection | None = None
        pg: PgConnection | None = None
        try:
            conn = await asyncio.wait_for(
                connect_retrying(self.loop, f"txb://{BROKER}:{PORT}", reconnect=False,
                                 timeout=1.0), 0.5)
            pg = await self.db.connect()
            resources: list[AsyncResource] = [AsyncBrokerResource(conn),
                                              AsyncPostgresResource(pg)]
            report = await (recover_async(tm.log, resources) if bare
                            else tm.recover(resources))
        except (TxBrokerError, PgError, TimeoutError, OSError) as exc:
            self.log(f"manager: recovery failed: {exc!r}")
            return False
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        for name, xid in report.committed:
            self.log(f"recovery committed {xid.gtrid.decode()} on {name}")
        for name, xid in report.rolled_back:
            self.log(f"recovery rolled back {xid.gtrid.decode()} on {name}")
        if report.heuristic:
            self.record.failures.append(f"heuristic outcome in recovery: {report.heuristic}")
        return report.clean

    async def _worker(self, tm: AsyncTransactionManager, number: int) -> None:
        conn: AsyncConnection | None = None
        pg: PgConnection | None = None
        while not self.draining:
            try:
                if conn is None:
                    conn = await connect_retrying(self.loop, f"txb://{BROKER}:{PORT}",
                                                  reconnect=False, timeout=1.0)
                if pg is None:
                    pg = await self.db.connect()
                await self._one(tm, conn, pg, number)
            except (TxBrokerError, PgError, TimeoutError, OSError) as exc:
                self.log(f"w{number}: {exc!r}")
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
                conn = pg = None
                await asyncio.sleep(self.loop.random.uniform(0.005, 0.03))
        if conn is not None:
            await conn.close()

    async def _one(self, tm: AsyncTransactionManager, conn: AsyncConnection,
                   pg: PgConnection, number: int) -> None:
        """One global transaction: receive, ack, insert, commit (or roll back)."""
        gtx = await tm.begin([AsyncBrokerParticipant(conn), AsyncPostgresParticipant(pg)])
        gtrid = gtx.gtrid.hex()
        try:
            message = await conn.receive(QUEUE, timeout=0.05)
            if message is None:
                await gtx.rollback()
                await asyncio.sleep(0.02)
                return
            message_id = message.body.decode()
            self.record.deliveries.append((gtrid, message_id))
            self.log(f"w{number} {gtrid[:8]} got {message_id} {message.redelivered}")
            await message.ack()
            await pg.insert(message_id, gtrid)
        except BaseException:
            if not gtx.done:
                with contextlib.suppress(Exception):
                    await gtx.rollback()
            raise
        if self.loop.random.random() < APP_ROLLBACK:
            await gtx.rollback()
            self.record.told[gtrid] = "rolled back"
        else:
            try:
                await gtx.commit()
                self.record.told[gtrid] = "committed"
            except RolledBack:
                self.record.told[gtrid] = "rolled back"
            except TMError:
                self.record.told[gtrid] = "unknown"
        self.log(f"w{number} {gtrid[:8]} {self.record.told[gtrid]}")

    # -- the run -----------------------------------------------------------------------

    async def _load(self) -> None:
        conn = await connect_retrying(self.loop, f"txb://{BROKER}:{PORT}", timeout=5.0)
        for n in range(MESSAGES):
            await conn.send(QUEUE, f"m{n}".encode(), message_id=f"m{n}")
        await conn.close()

    async def main(self) -> None:
        """The run: start, load, faults, heal, drain, look."""
        loop = self.loop
        self.start_broker()
        self.start_pg()
        await asyncio.sleep(0.01)
        _, loading = loop.spawn("127.0.0.40", self._load())
        await loading
        self.start_tm()
        fault_end = loop.time() + FAULT_S
        kills = {"broker": (self.kill_broker, self.start_broker),
                 "database": (self.kill_pg, self.start_pg),
                 "manager": (self.kill_tm, self.start_tm)}
        while True:
            await asyncio.sleep(loop.random.expovariate(1 / MEAN_KILL_GAP_S))
            if loop.time() >= fault_end:
                break
            kill, start = kills[loop.random.choice(sorted(kills))]
            if (kill == self.kill_tm and self.tm in loop.dead) \
                    or (kill == self.kill_pg and not self.db.up):
                continue  # already down (died at a crash point, or restarting)
            kill()
            await asyncio.sleep(loop.random.uniform(*RESTART_S))
            start()
        self.faults = False
        self.log("healed")
        await asyncio.sleep(RESTART_S[1] * 2)  # a restart under way finishes
        if not self.db.up:
            self.start_pg()
        heal_end = loop.time() + HEAL_S
        while loop.time() < heal_end and len(self.db.rows) < MESSAGES:
            await asyncio.sleep(0.1)
        self.draining = True
        self.log("draining")
        assert self.tm_task is not None
        try:
            await asyncio.wait_for(asyncio.shield(self.tm_task), heal_end + 2.0 - loop.time())
        except TimeoutError:
            self.log("the manager did not finish")
        except Exception as exc:  # the manager's program failed: a finding
            self.record.failures.append(f"the manager raised {exc!r}")
        _, looking = loop.spawn("127.0.0.41", self._look())
        await looking

    async def _look(self) -> None:
        """What is left: messages in the queue, prepared branches in the broker and
        in the database."""
        conn = await connect_retrying(self.loop, f"txb://{BROKER}:{PORT}", timeout=5.0)
        info = await conn.queue_info(QUEUE)
        self.record.left_in_queue = int(info["messages"])
        self.record.broker_prepared = [x.gtrid.decode()
                                       for x in await conn.xa_resource().recover()]
        for _ in range(self.record.left_in_queue):  # which ones (those not held)
            message = await conn.receive(QUEUE, timeout=0.05)
            if message is None:
                break
            self.record.left_ids.add(message.body.decode())
        await conn.close()
        self.record.pg_prepared = [xid.gtrid for xid in self.db.prepared_xids()]


def run_xa_live(world: World, plants: frozenset[str]) -> list[str]:
    """One seed of ``xa-live``; returns the violations."""
    run = XaRun(world, plants)
    with captured_logs(world, run.loop):
        run.loop.run(run.main())
    world.log(f"network {run.loop.network.trace_hash()}")
    violations = [f"unhandled in the event loop: {error}" for error in run.loop.errors]
    return violations + check_xa(run.record, run.db, MESSAGES)
