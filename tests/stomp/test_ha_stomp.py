"""Shared-store failover seen by real STOMP clients: stomp.py 9 and stompman 3.16.

A pair of brokers on one data directory (:class:`tests.ha_support.HaPair`, A
active, B standby) and clients that know both STOMP addresses. Under load —
two producers of persistent SENDs with receipts, a producer of STOMP
transactions (BEGIN, 3 SENDs, COMMIT), a consumer with ``client-individual``
ACKs — the active is killed with SIGKILL three times, roles alternating: kill
A, B takes over, restart A (it becomes the standby: its line is awaited), kill
B, restart B, kill A. The clients find the new active by themselves (the
standby's STOMP port does not listen, so a client walking its host list is
refused there and moves on), and each round waits until they make progress
again. Before each kill a transaction is left open (BEGIN and SENDs
acknowledged by a receipt on its last SEND); after the takeover its COMMIT
must not commit.

At the end every queue is drained and the ledger (``tests/ledger.py``) must
say: every SEND whose RECEIPT arrived was received; nothing received that was
never sent; every delivery after the first of a message carries
``redelivered:true`` (the header txbroker sets on a redelivery,
``docs/stomp.md``); nothing whose ACK was confirmed came back; a transaction
open across a failover left no message; every confirmed COMMIT's messages are
all there; no transaction is partly visible.

How the clients confirm things:

* stomp.py: receipts on SEND, ACK, SUBSCRIBE and COMMIT. stomp.py uses its host
  list only while connecting (shared/NOTES.md); after a lost connection the
  worker thread calls ``connect()`` again (stomp.py's own loop then walks A, B,
  A, … with backoff) and resubscribes.
* stompman: it reconnects, walks its server list and resubscribes by itself.
  Its ``ack()`` and its transactions' COMMIT take no receipt, so an ACK or a
  COMMIT counts as confirmed when a persistent SEND with a receipt (to a
  queue nobody counts) sent after it on the *same* connection got its receipt:
  the broker handles a connection's frames in order and that receipt comes
  once everything before it is durable (``tests/support.durability_barrier``).
  "The same connection" is read from stompman's reconnection counter
  (``Client._connection_manager._reconnection_count`` and the frame's
  ``_received_at_reconnection_count``: private names of stompman 3.16).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue as queues
import socket
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
import stomp
import stompman
from stomp.exception import ConnectFailedException, StompException

import txbroker
from tests.ha_support import HaPair
from tests.ledger import Ledger, join_or_explain
from tests.stomp.support import StompClient

pytestmark = pytest.mark.timeout(120)  # a hang guard: each test takes 5-30 s

PLAIN = "/queue/ha-plain"
#: stompman's confirmation SENDs go here; nothing counts this queue.
BARRIER = "/queue/ha-barrier"
#: Kills per test; the roles alternate (A, B, A).
KILLS = 3
#: Messages in each transaction.
TX_SIZE = 3
#: What "the clients carry on" means, between two kills: this many more
#: receipted SENDs, confirmed consumer ACKs and confirmed COMMITs.
PROGRESS = {"sends": 20, "acks": 10, "commits": 2}
#: Seconds for that progress (a takeover is about 0.05 s here; stompman waits
#: its 1 s retry interval once or twice).
PROGRESS_TIMEOUT = 20.0
#: Seconds from the kill to the survivor's "ready" line.
TAKEOVER_TIMEOUT = 15.0
#: Seconds to wait for one receipt before a connection is given up as broken.
RECEIPT_TIMEOUT = 5.0
#: Seconds a client may take to be connected again (to either broker).
RECONNECT_TIMEOUT = 20.0
#: Consumer prefetch (messages in flight at a kill get redelivered).
PREFETCH = "10"
#: Seconds the drain waits for its next message (the broker counted them).
DRAIN_TIMEOUT = 10.0
#: Poll period of the waits on shared state (s).
POLL = 0.02


# --------------------------------------------------------------------------- bookkeeping
@dataclass
class Book:
    """The ledger of one test plus what the failover checks need (thread-safe
    through the ledger's lock)."""

    ledger: Ledger = field(default_factory=Ledger)
    #: message id -> the ``redelivered`` flag of each of its deliveries, in order
    flags: dict[str, list[bool]] = field(default_factory=dict)
    transactions: list[list[str]] = field(default_factory=list)  # every one tried
    committed: set[str] = field(default_factory=set)  # ids of confirmed COMMITs
    open_across: set[str] = field(default_factory=set)  # staged in a tx open at a kill
    commit_after_failover: list[str] = field(default_factory=list)  # what that COMMIT got
    worker_errors: list[str] = field(default_factory=list)  # unexpected: fail the test
    events: Counter[str] = field(default_factory=Counter)  # client-side retries, for the report
    reconnections: dict[str, int] = field(default_factory=dict)  # client name -> count

    def delivered(self, mid: str, redelivered: bool) -> None:
        """A MESSAGE with this id reached a client."""
        with self.ledger.lock:
            self.flags.setdefault(mid, []).append(redelivered)
        self.ledger.delivered(mid)

    def note(self, event: str) -> None:
        """Count a client-side event (a lost receipt, a reconnection …)."""
        with self.ledger.lock:
            self.events[event] += 1

    def problem(self, text: str) -> None:
        """Something a worker did not expect: the test fails with it."""
        with self.ledger.lock:
            self.worker_errors.append(text)

    def begin_transaction(self, ids: list[str]) -> None:
        with self.ledger.lock:
            self.ledger.attempted.update(ids)
            self.transactions.append(ids)

    def commit_confirmed(self, ids: list[str]) -> None:
        with self.ledger.lock:
            self.committed.update(ids)
            self.ledger.acknowledged.update(ids)

    def progress(self) -> dict[str, int]:
        with self.ledger.lock:
            return {"sends": len(self.ledger.acknowledged),
                    "acks": len(self.ledger.ack_confirmed),
                    "commits": len(self.committed) // TX_SIZE}


def guarded(book: Book, name: str, fn: Callable[[], None]) -> Callable[[], None]:
    """A worker thread's body: an exception is a problem of the test, not a hang."""

    def run() -> None:
        try:
            fn()
        except BaseException:  # reported by the test
            book.problem(f"{name} died:\n{traceback.format_exc()}")

    return run


def wait_progress(book: Book, pair: HaPair, what: str) -> float:
    """Wait until the clients made PROGRESS from now; returns the seconds it took."""
    start, began = book.progress(), time.monotonic()
    deadline = began + PROGRESS_TIMEOUT
    while True:
        now = book.progress()
        if all(now[key] - start[key] >= need for key, need in PROGRESS.items()):
            return time.monotonic() - began
        if book.worker_errors:
            raise AssertionError("a client worker failed:\n" + "\n".join(book.worker_errors))
        if time.monotonic() > deadline:
            raise AssertionError(f"no progress {what} in {PROGRESS_TIMEOUT} s: {start} -> "
                                 f"{now}, client events {dict(book.events)}\n{pair.describe()}")
        time.sleep(POLL)


# --------------------------------------------------------------------------- the kills
class Holder(Protocol):
    """A client that keeps a transaction open across each kill."""

    def stage(self, round_no: int) -> None:
        """BEGIN, SENDs; return once the broker has them (not committed)."""

    def after_failover(self, round_no: int) -> str:
        """COMMIT the staged transaction through the new active; what happened."""


def refuses(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (a standby's STOMP port)."""
    with socket.socket() as sock:
        sock.settimeout(2)
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def failover_rounds(pair: HaPair, book: Book, holder: Holder) -> list[dict[str, Any]]:
    """KILLS rounds of: open transaction, kill -9 the active, takeover, the clients
    carry on, the killed one restarted as the standby. Returns the timings."""
    rounds: list[dict[str, Any]] = []
    wait_progress(book, pair, "before the first kill")
    for round_no in range(KILLS):
        holder.stage(round_no)
        victim = pair.active()
        assert refuses(pair.standby().stomp_port), "a standby's STOMP port listens"
        killed_at = time.monotonic()
        pair.kill9(victim)
        survivor = pair.active(timeout=TAKEOVER_TIMEOUT)
        takeover = time.monotonic() - killed_at
        assert survivor is pair.peer(victim)
        book.commit_after_failover.append(holder.after_failover(round_no))
        wait_progress(book, pair, f"after kill {round_no + 1} ({victim.name})")
        carry_on = time.monotonic() - killed_at
        started = time.monotonic()
        pair.restart(victim)
        assert victim.role == "standby", f"the restarted {victim.name} is {victim.role}"
        rounds.append({"killed": victim.name, "takeover_s": round(takeover, 3),
                       "clients_carried_on_s": round(carry_on, 3),
                       "restart_to_standby_s": round(time.monotonic() - started, 3)})
    assert [r["killed"] for r in rounds] == ["a", "b", "a"][:KILLS], rounds
    wait_progress(book, pair, "after the last restart")
    return rounds


# --------------------------------------------------------------------------- the end
def drain(pair: HaPair, book: Book) -> int:
    """Once the workers are gone, receive (and ACK) everything left in PLAIN through
    the active; returns how many. The count comes from the broker, so no wait for
    "nothing more arrives"."""
    active = pair.active()
    with txbroker.connect(f"txb://{active.address}") as native:
        deadline = time.monotonic() + RECONNECT_TIMEOUT
        name = PLAIN.removeprefix("/queue/")
        while (info := native.queue_info(name))["consumers"] or info["in_flight"]:
            assert time.monotonic() < deadline, f"consumers still attached: {info}"
            time.sleep(POLL)
        left = int(info["messages"])
        with StompClient(active.stomp_port) as client:
            client.connect()
            client.call("SUBSCRIBE", {"destination": PLAIN, "id": "drain",
                                      "ack": "client-individual", "prefetch-count": "1000"})
            for got in range(left):
                try:
                    frame = client.messages(1, timeout=DRAIN_TIMEOUT)[0]
                except TimeoutError:
                    raise AssertionError(
                        f"the drain got {got} of the {left} messages the broker counted "
                        f"({info}); now: {native.queue_info(name)}\n{pair.describe()}") from None
                book.delivered(frame.body.decode(), frame.headers.get("redelivered") == "true")
                client.send("ACK", {"id": frame.headers["ack"]})
            client.call("DISCONNECT")  # its receipt: every ACK before it is durable
        assert native.queue_info(name)["messages"] == 0
    return left


def verdict(book: Book, drained: int, **extra: Any) -> dict[str, Any]:
    """Counts of every kind of failure (each must be 0), with a few ids as examples."""
    ledger = book.ledger
    delivered = set(book.flags)
    unflagged = sorted(mid for mid, flags in book.flags.items() if not all(flags[1:]))
    partial = [ids for ids in book.transactions if 0 < len(delivered & set(ids)) < len(ids)]
    failures: dict[str, list[Any]] = {
        "lost": sorted(ledger.acknowledged - delivered),
        "unexpected": sorted(delivered - ledger.attempted),
        "unflagged_duplicates": unflagged,
        "acked_came_back": sorted(ledger.came_back),
        "open_transaction_visible": sorted(book.open_across & delivered),
        "committed_missing": sorted(book.committed - delivered),
        "partial_transactions": partial,
        "worker_errors": book.worker_errors,
    }
    return {
        **extra,
        "acknowledged_sends": len(ledger.acknowledged),
        "committed_transactions": len(book.committed) // TX_SIZE,
        "consumer_acks_confirmed": len(ledger.ack_confirmed),
        "deliveries": sum(len(flags) for flags in book.flags.values()),
        "redelivered": sum(sum(flags) for flags in book.flags.values()),
        "drained": drained,
        "open_across_failover": len(book.open_across),
        "commit_after_failover": book.commit_after_failover,
        "client_events": dict(book.events),
        "reconnections": dict(book.reconnections),
        **{key: len(value) for key, value in failures.items()},
        "examples": {key: value[:5] for key, value in failures.items() if value},
    }


def check(report: dict[str, Any]) -> None:
    """Enough happened, and nothing went wrong."""
    assert report["acknowledged_sends"] > 0 and report["consumer_acks_confirmed"] > 0, report
    assert report["committed_transactions"] > 0 and report["redelivered"] > 0, report
    assert report["open_across_failover"] == KILLS * TX_SIZE, report
    for key in ("lost", "unexpected", "unflagged_duplicates", "acked_came_back",
                "open_transaction_visible", "committed_missing", "partial_transactions",
                "worker_errors"):
        assert report[key] == 0, f"{key}: {report}"


# --------------------------------------------------------------------------- stomp.py
class PyClient(stomp.ConnectionListener):  # type: ignore[misc]
    """One stomp.py connection over the pair's host list, driven by one thread.

    :meth:`connect` waits for the previous I/O thread to end, then calls
    stomp.py's ``connect()``, whose loop walks the host list (a refused address
    is skipped at once). MESSAGE frames are queued with the *generation* of the
    connection they came on: a message of a dead connection must not be acked on
    the next one, since its ``ack`` id is a delivery tag of the old connection —
    on the new one the same number may name another message."""

    def __init__(self, hosts: list[tuple[str, int]],
                 on_message: Callable[[Any], None] | None = None) -> None:
        self.conn = stomp.Connection12(hosts, reconnect_attempts_max=200,
                                       reconnect_sleep_initial=0.05,
                                       reconnect_sleep_increase=0.5, reconnect_sleep_max=0.4,
                                       timeout=RECEIPT_TIMEOUT, auto_decode=False)
        self.conn.set_listener("ha", self)
        self.on_message_hook = on_message
        self.generation = 0
        self.messages: queues.Queue[tuple[int, Any]] = queues.Queue()
        self.errors: list[dict[str, str]] = []
        self._waiters: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._loop_done = threading.Event()
        self._loop_done.set()

    # -- stomp.py's I/O thread -------------------------------------------------
    def on_connected(self, frame: Any) -> None:
        self._connected.set()

    def on_message(self, frame: Any) -> None:
        if self.on_message_hook is not None:
            self.on_message_hook(frame)
        self.messages.put((self.generation, frame))

    def on_receipt(self, frame: Any) -> None:
        self._settle(frame.headers.get("receipt-id"), True)

    def on_error(self, frame: Any) -> None:
        self.errors.append(dict(frame.headers))
        self._settle(frame.headers.get("receipt-id"), False)

    def on_disconnected(self) -> None:
        self._fail_all()

    def on_receiver_loop_completed(self, frame: Any) -> None:
        self._fail_all()
        self._loop_done.set()

    def _settle(self, receipt: str | None, ok: bool) -> None:
        with self._lock:
            slot = self._waiters.get(receipt or "")
            if slot is not None and slot[1] is None:
                slot[1] = ok
                slot[0].set()

    def _fail_all(self) -> None:
        with self._lock:
            for slot in self._waiters.values():
                if slot[1] is None:
                    slot[1] = False
                    slot[0].set()

    # -- the owner thread --------------------------------------------------------
    @property
    def up(self) -> bool:
        """Connected, and the connection's I/O thread still runs."""
        return self._connected.is_set() and not self._loop_done.is_set()

    def connect(self) -> None:
        """(Re)connect to whichever broker accepts, within RECONNECT_TIMEOUT."""
        deadline = time.monotonic() + RECONNECT_TIMEOUT
        while True:
            self.drop()
            self.generation += 1
            self._loop_done.clear()
            try:
                self.conn.connect(wait=False)
            except ConnectFailedException:
                self._loop_done.set()  # no I/O thread was started
            except (StompException, OSError):
                pass  # the I/O thread ends by itself
            else:
                while not self._connected.wait(POLL) and not self._loop_done.is_set() \
                        and time.monotonic() < deadline:
                    pass
                if self.up:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"stomp.py did not reconnect in {RECONNECT_TIMEOUT} s")

    def drop(self) -> None:
        """Close the connection (if any) and wait for its I/O thread to end."""
        if not self._loop_done.is_set():
            with contextlib.suppress(Exception):
                self.conn.transport.disconnect_socket()
            assert self._loop_done.wait(RECONNECT_TIMEOUT), "stomp.py's I/O thread hangs"
        self._connected.clear()

    def call(self, send: Callable[[str], None], timeout: float = RECEIPT_TIMEOUT) -> bool:
        """``send(receipt_id)`` a frame; True once its RECEIPT came, False on an ERROR,
        a lost connection or a timeout."""
        receipt = uuid.uuid4().hex
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            self._waiters[receipt] = slot
        try:
            send(receipt)
            slot[0].wait(timeout)
        except (StompException, OSError):
            pass
        finally:
            with self._lock:
                self._waiters.pop(receipt, None)
        return slot[1] is True


def py_run(book: Book, name: str, client: PyClient, stop: threading.Event,
           step: Callable[[], bool], setup: Callable[[], bool] = lambda: True) -> None:
    """A worker's loop: (re)connect and ``setup()`` when needed, ``step()`` until
    stopped; a False step means the connection is given up and made again."""
    try:
        while not stop.is_set():
            if not client.up:
                client.connect()
                if not setup():
                    client.drop()
                    continue
                book.reconnections[name] = book.reconnections.get(name, -1) + 1
            if not step():
                book.note(f"{name} gave a connection up")
                client.drop()
    finally:
        client.drop()
        for error in client.errors:
            book.problem(f"{name} got an ERROR frame: {error}")


def py_producer(hosts: list[tuple[str, int]], name: str, book: Book,
                stop: threading.Event) -> None:
    client = PyClient(hosts)
    count = iter(range(10**9))

    def step() -> bool:
        mid = f"{name}-{next(count)}"
        book.ledger.add("attempted", mid)
        ok = client.call(lambda r: client.conn.send(
            PLAIN, mid.encode(), headers={"persistent": "true", "receipt": r}))
        if ok:
            book.ledger.add("acknowledged", mid)
        return ok

    py_run(book, name, client, stop, step)


def py_tx_producer(hosts: list[tuple[str, int]], name: str, book: Book,
                   stop: threading.Event) -> None:
    client = PyClient(hosts)
    count = iter(range(10**9))

    def step() -> bool:
        n = next(count)
        tx, ids = f"tx-{n}", [f"{name}-{n}.{i}" for i in range(TX_SIZE)]
        book.begin_transaction(ids)
        try:
            client.conn.begin(transaction=tx)
            for mid in ids:
                client.conn.send(PLAIN, mid.encode(),
                                 headers={"persistent": "true", "transaction": tx})
        except (StompException, OSError):
            return False
        ok = client.call(lambda r: client.conn.commit(tx, headers={"receipt": r}))
        if ok:
            book.commit_confirmed(ids)
        return ok

    py_run(book, name, client, stop, step)


def py_consumer(hosts: list[tuple[str, int]], name: str, book: Book,
                stop: threading.Event) -> None:
    client = PyClient(hosts, on_message=lambda frame: book.delivered(
        frame.body.decode(), frame.headers.get("redelivered") == "true"))

    def setup() -> bool:
        return client.call(lambda r: client.conn.subscribe(
            PLAIN, id="c", ack="client-individual",
            headers={"prefetch-count": PREFETCH, "receipt": r}))

    def step() -> bool:
        try:
            generation, frame = client.messages.get(timeout=POLL)
        except queues.Empty:
            return True
        if generation != client.generation:
            book.note(f"{name}: a message of a dead connection left unacked")
            return True
        ok = client.call(lambda r: client.conn.ack(frame.headers["ack"], receipt=r))
        if ok:
            book.ledger.add("ack_confirmed", frame.body.decode())
        return ok

    py_run(book, name, client, stop, step, setup)


class PyHolder:
    """stomp.py: BEGIN + SENDs before the kill, COMMIT (with a receipt) after it."""

    def __init__(self, hosts: list[tuple[str, int]], book: Book) -> None:
        self.client = PyClient(hosts)
        self.book = book
        self.tx = ""

    def stage(self, round_no: int) -> None:
        client = self.client
        if not client.up:
            client.connect()
        self.tx = f"open-{round_no}"
        ids = [f"py-open{round_no}.{i}" for i in range(TX_SIZE)]
        self.book.begin_transaction(ids)
        self.book.open_across.update(ids)
        client.conn.begin(transaction=self.tx)
        for mid in ids[:-1]:
            client.conn.send(PLAIN, mid.encode(),
                             headers={"persistent": "true", "transaction": self.tx})
        assert client.call(lambda r: client.conn.send(
            PLAIN, ids[-1].encode(),
            headers={"persistent": "true", "transaction": self.tx, "receipt": r})), \
            "the open transaction's SENDs got no receipt"

    def after_failover(self, round_no: int) -> str:
        client = self.client
        assert client._loop_done.wait(RECONNECT_TIMEOUT), "stomp.py did not see the kill"
        client.connect()
        errors = len(client.errors)
        committed = client.call(lambda r: client.conn.commit(self.tx, headers={"receipt": r}))
        assert not committed, "a COMMIT after the failover got a RECEIPT"
        client.drop()
        return " / ".join(e.get("message", "?") for e in client.errors[errors:]) or "no ERROR"

    def close(self) -> None:
        self.client.drop()


def test_stomppy_host_list_across_kill9_failovers(tmp_path: Path) -> None:
    """stomp.py 9 with [A, B]: three kill -9 failovers under load, the ledger clean."""
    book = Book()
    began = time.monotonic()
    with HaPair(tmp_path / "pair") as pair:
        hosts = pair.stomp_hosts
        stop = threading.Event()
        workers = {"py-p0": py_producer, "py-p1": py_producer, "py-t": py_tx_producer,
                   "py-c": py_consumer}
        threads = [threading.Thread(target=guarded(book, name, functools.partial(
            fn, hosts, name, book, stop)), name=name, daemon=True)
            for name, fn in workers.items()]
        holder = PyHolder(hosts, book)
        for thread in threads:
            thread.start()
        try:
            rounds = failover_rounds(pair, book, holder)
        finally:
            stop.set()
            for thread in threads:
                join_or_explain(thread, timeout=30)
            holder.close()
        drained = drain(pair, book)
    report = verdict(book, drained, rounds=rounds, seconds=round(time.monotonic() - began, 1))
    print("stomp.py across failovers:", report)
    check(report)
    assert all(e.startswith("unknown transaction") for e in book.commit_after_failover), report
    assert all(n >= KILLS for n in book.reconnections.values()), book.reconnections


# --------------------------------------------------------------------------- stompman
def stompman_client(hosts: list[tuple[str, int]], book: Book, name: str) -> stompman.Client:
    """A stompman client over the pair's addresses; ERROR frames are noted by name."""

    def on_error(frame: stompman.ErrorFrame) -> None:
        book.note(f"{name} ERROR: {frame.headers.get('message', '?')[:40]}")
        if name not in ("sm-t", "sm-h"):  # where stompman's transaction replay is expected
            book.problem(f"{name} got an ERROR frame: {frame.headers}")

    servers = [stompman.ConnectionParameters(host=host, port=port, login="", passcode="")
               for host, port in hosts]
    return stompman.Client(servers, connect_retry_attempts=15, connect_retry_interval=1,
                           connect_timeout=2, keep_alive_on_connection_failure=True,
                           heartbeat=stompman.Heartbeat(1000, 1000), on_error_frame=on_error)


def epoch(client: stompman.Client) -> int:
    """stompman's count of lost connections (private in stompman 3.16)."""
    return int(client._connection_manager._reconnection_count)


async def barrier(client: stompman.Client) -> None:
    """A persistent SEND with a receipt (to BARRIER)."""
    await client.send(b"barrier", BARRIER, headers={"persistent": "true"},
                      receipt_timeout=RECEIPT_TIMEOUT)


async def barrier_until_ok(client: stompman.Client, book: Book, name: str) -> None:
    """Retry :func:`barrier` until one succeeds (the client is connected again)."""
    deadline = time.monotonic() + RECONNECT_TIMEOUT
    while True:
        try:
            return await barrier(client)
        except Exception as exc:  # stompman raises several kinds
            book.note(f"{name}: {type(exc).__name__}")
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(POLL)


async def sm_producer(client: stompman.Client, name: str, book: Book,
                      stop: asyncio.Event) -> None:
    for n in range(10**9):
        if stop.is_set():
            return
        mid = f"{name}-{n}"
        book.ledger.add("attempted", mid)
        try:
            await client.send(mid.encode(), PLAIN, headers={"persistent": "true"},
                              receipt_timeout=RECEIPT_TIMEOUT)
        except Exception as exc:
            book.note(f"{name}: {type(exc).__name__}")
            await asyncio.sleep(POLL)  # pace the retries while it reconnects
            continue
        book.ledger.add("acknowledged", mid)


async def sm_tx_producer(client: stompman.Client, name: str, book: Book,
                         stop: asyncio.Event) -> None:
    for n in range(10**9):
        if stop.is_set():
            return
        ids = [f"{name}-{n}.{i}" for i in range(TX_SIZE)]
        book.begin_transaction(ids)
        began = epoch(client)
        try:
            async with client.begin() as tx:
                for mid in ids:
                    await tx.send(mid.encode(), PLAIN, headers={"persistent": "true"})
            await barrier(client)
        except Exception as exc:
            book.note(f"{name}: {type(exc).__name__}")
            await asyncio.sleep(POLL)
            continue
        if epoch(client) == began:  # BEGIN … COMMIT and the barrier on one connection
            book.commit_confirmed(ids)
        else:
            book.note(f"{name}: outcome unknown (reconnected)")


async def sm_consumer(client: stompman.Client, name: str, book: Book,
                      stop: asyncio.Event) -> None:
    async def handle(frame: Any) -> None:
        mid = frame.body.decode()
        book.delivered(mid, frame.headers.get("redelivered") == "true")
        if stop.is_set():
            return  # left unacked: it comes back to the drain
        received_on = frame._received_at_reconnection_count  # stompman 3.16, private
        await frame.ack()  # dropped by stompman if the connection changed meanwhile
        try:
            await barrier(client)
        except Exception as exc:
            book.note(f"{name} barrier: {type(exc).__name__}")
            return
        if epoch(client) == received_on:
            book.ledger.add("ack_confirmed", mid)

    subscription = await client.subscribe_with_manual_ack(
        PLAIN, handle, headers={"prefetch-count": PREFETCH})
    await stop.wait()
    await subscription.unsubscribe()


class StompmanLoad:
    """The stompman clients of one test, on an event loop in a thread of its own;
    the test's thread drives the holder through :meth:`call`."""

    def __init__(self, hosts: list[tuple[str, int]], book: Book) -> None:
        self.hosts = hosts
        self.book = book
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stompman",
                                       daemon=True)
        self.ready = threading.Event()
        self.stop_event = asyncio.Event()
        self.holder_client: stompman.Client | None = None
        self.main: Any = None

    def start(self) -> None:
        self.thread.start()
        self.main = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        while not self.ready.wait(POLL):
            if self.main.done():
                self.main.result()  # raises what went wrong
        assert self.holder_client is not None

    async def _run(self) -> None:
        book, hosts, stop = self.book, self.hosts, self.stop_event
        names = ("sm-p0", "sm-p1", "sm-t", "sm-c", "sm-h")
        async with contextlib.AsyncExitStack() as stack:
            clients = {name: await stack.enter_async_context(stompman_client(hosts, book, name))
                       for name in names}
            self.holder_client = clients["sm-h"]
            tasks = [sm_producer(clients["sm-p0"], "sm-p0", book, stop),
                     sm_producer(clients["sm-p1"], "sm-p1", book, stop),
                     sm_tx_producer(clients["sm-t"], "sm-t", book, stop),
                     sm_consumer(clients["sm-c"], "sm-c", book, stop)]
            self.ready.set()
            await asyncio.gather(*(self._guard(name, task) for name, task in
                                   zip(names, tasks, strict=False)))
            for name, client in clients.items():
                book.reconnections[name] = epoch(client)

    async def _guard(self, name: str, task: Coroutine[Any, Any, None]) -> None:
        try:
            await task
        except BaseException:
            self.book.problem(f"{name} died:\n{traceback.format_exc()}")

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Stop the workers, close the clients (bounded), stop the loop."""
        try:
            self.loop.call_soon_threadsafe(self.stop_event.set)
            if self.main is not None:
                self.main.result(timeout=40)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


class StompmanHolder:
    """stompman: ``async with client.begin()`` left open across the kill, then ended
    (its COMMIT) through the new active."""

    def __init__(self, load: StompmanLoad, book: Book) -> None:
        self.load = load
        self.book = book
        self.transaction: Any = None

    @property
    def client(self) -> stompman.Client:
        assert self.load.holder_client is not None
        return self.load.holder_client

    def stage(self, round_no: int) -> None:
        self.load.call(self._stage(round_no))

    async def _stage(self, round_no: int) -> None:
        await barrier_until_ok(self.client, self.book, "sm-h")
        ids = [f"sm-open{round_no}.{i}" for i in range(TX_SIZE)]
        self.book.begin_transaction(ids)
        self.book.open_across.update(ids)
        began = epoch(self.client)
        self.transaction = self.client.begin()
        tx = await self.transaction.__aenter__()
        for mid in ids:
            await tx.send(mid.encode(), PLAIN, headers={"persistent": "true"})
        await barrier(self.client)  # the broker has BEGIN and the SENDs
        assert epoch(self.client) == began, "the holder reconnected while staging"

    def after_failover(self, round_no: int) -> str:
        return str(self.load.call(self._after_failover()))

    async def _after_failover(self) -> str:
        # stompman reconnects by itself; on reconnecting it replays the open
        # transaction's SENDs and a COMMIT (3.16: without a BEGIN)
        await barrier_until_ok(self.client, self.book, "sm-h")
        try:
            await self.transaction.__aexit__(None, None, None)  # the COMMIT
            outcome = "COMMIT written"
        except Exception as exc:  # stompman 3.16 raises KeyError here
            outcome = f"the end of the transaction raised {type(exc).__name__}"
        await barrier_until_ok(self.client, self.book, "sm-h")
        return outcome


def test_stompman_server_list_across_kill9_failovers(tmp_path: Path) -> None:
    """stompman with [A, B]: three kill -9 failovers under load, the ledger clean."""
    book = Book()
    began = time.monotonic()
    with HaPair(tmp_path / "pair") as pair:
        load = StompmanLoad(pair.stomp_hosts, book)
        load.start()
        try:
            rounds = failover_rounds(pair, book, StompmanHolder(load, book))
        finally:
            load.stop()
        drained = drain(pair, book)
    report = verdict(book, drained, rounds=rounds, seconds=round(time.monotonic() - began, 1))
    print("stompman across failovers:", report)
    check(report)
    assert all(n >= KILLS for n in book.reconnections.values()), book.reconnections



def test_stompman_topic_subscriber_carries_on_across_a_takeover(tmp_path: Path) -> None:
    """Seed 004: "All topic subscribers continue normal operation after a failover."
    stompman subscribes to ``/topic/news`` (non-durable) and, after a kill -9, sends
    its SUBSCRIBE again on the new active, which makes a new subscription: messages
    published from then on reach it, and no plain queue appears in the topic's place
    (issue 28 §5)."""
    with HaPair(tmp_path / "pair") as pair:
        got: list[bytes] = []
        book = Book()

        async def main() -> None:
            async def handle(frame: Any) -> None:
                got.append(frame.body)

            async with stompman_client(pair.stomp_hosts, book, "sm-topic") as client:
                subscription = await client.subscribe(
                    "/topic/news", handle, ack="auto",
                    on_suppressed_exception=lambda exc, _: book.problem(repr(exc)))
                await barrier(client)  # the SUBSCRIBE was handled
                async with txbroker.aio.connect(pair.url, timeout=10,
                                                failover_timeout=60) as conn:
                    await conn.send("news", b"before")
                    await wait_for(lambda: got == [b"before"], "the first message")
                    before = epoch(client)
                    pair.kill9(pair.active())
                    pair.active(TAKEOVER_TIMEOUT)
                    await barrier_until_ok(client, book, "sm-topic")
                    assert epoch(client) > before  # stompman reconnected
                    # stompman re-sends its SUBSCRIBE after it reconnected: publish until
                    # one arrives (earlier ones had no subscription to go to)
                    n = 0
                    deadline = time.monotonic() + RECONNECT_TIMEOUT
                    while not any(body.startswith(b"after") for body in got):
                        assert time.monotonic() < deadline, f"nothing after the takeover: {got}"
                        await conn.send("news", b"after-%d" % n)
                        n += 1
                        await asyncio.sleep(0.1)
                    subscriptions = (await conn.queue_info("news"))["subscriptions"]
                    assert len(subscriptions) == 1 and subscriptions[0].startswith("news::")
                    assert {q["name"] for q in await conn.queues()
                            if q.get("topic") is None and "::" in q["name"]} == set()
                await subscription.unsubscribe()

        async def wait_for(condition: Any, what: str) -> None:
            deadline = time.monotonic() + RECEIPT_TIMEOUT
            while not condition():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(POLL)

        asyncio.run(asyncio.wait_for(main(), 90))
        assert not book.worker_errors, book.worker_errors
