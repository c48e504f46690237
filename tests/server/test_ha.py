"""Shared-store failover with real processes (docs/ha.md): kill -9 under load with
role reversal, a SIGSTOPped active, a blocked HA link, configuration carried over,
and the refusals (a second standby, a peer that is not a txbroker).

Every wait is on something observable — a line a broker prints, a role it
reports, a reply — and bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import txbroker
from tests import native_workload as load
from tests.ha_support import READY_PREFIX, HaNode, HaPair, free_ports
from tests.ledger import Ledger, check, join_or_explain, verdict
from tests.support import ROOT, free_port
from tests.tls_support import ha_link_args
from txbroker.errors import IllegalState, NotFound, Standby, TransactionRolledBack, TxBrokerError

#: Fast settings for tests (the defaults are 3 s and 10 s).
HEARTBEAT = 0.5
ACTIVATION = 2.0


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def pair(tmp_path: Path, *extra: str, peer_of_b: str | None = None) -> Iterator[HaPair]:
    """A active (started first), B standby of it; both stopped at the end."""
    ha = HaPair(tmp_path / "pair", *extra, heartbeat_interval=HEARTBEAT,
                activation_interval=ACTIVATION)
    ha.b.peer_address = peer_of_b
    with ha:
        yield ha


#: The HA link settings a representative subset of the tests runs with: as by default
#: (no secret, no TLS), and with a secret and TLS (issue 29; tests/server/test_ha_link.py
#: has the refusals).
LINKS = pytest.mark.parametrize("link", ["open", "secret+tls"])


def link_args(tmp_path: Path, link: str) -> list[str]:
    return ha_link_args(tmp_path / "link") if link == "secret+tls" else []


def url_of(*nodes: HaNode) -> str:
    return "txb://" + ",".join(n.address for n in nodes)


# ----------------------------------------------------------------- kill -9 under load
def _guard(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
            fn()

    return run


def _connect(url: str) -> Any:
    return txbroker.connect(url, timeout=15, failover_timeout=60)


#: what a failover may make a worker's step fail with (the step is retried)
RETRY = (TransactionRolledBack, IllegalState, txbroker.ConnectionLost)


def test_kill9_alternations_under_load(tmp_path: Path) -> None:
    """Ten kills of whichever broker is active; each time the other takes over and the
    killed one comes back as the standby; clients move by themselves."""
    ledger = Ledger()
    flags: dict[str, list[bool]] = {}
    takeovers: list[float] = []
    with pair(tmp_path) as ha:
        a, b = ha.nodes
        url = url_of(a, b)
        stop = threading.Event()
        workers: list[Callable[[], None]] = [
            partial(load.producer, _connect, url, "p0", ledger, stop, 0, RETRY),
            partial(load.producer, _connect, url, "p1", ledger, stop, 0, RETRY),
            partial(load.producer, _connect, url, "t0", ledger, stop, 5, RETRY),
            partial(load.feeder, _connect, url, "f0", ledger, stop, RETRY),
            partial(load.consumer, _connect, url, ledger, stop, RETRY, flags),
            partial(load.mover, _connect, url, ledger, stop, RETRY),
        ]
        threads = [threading.Thread(target=_guard(w), daemon=True) for w in workers]
        for t in threads:
            t.start()
        active, standby = a, b
        for _ in range(10):
            before = len(ledger.acknowledged)
            wait_until(lambda: len(ledger.acknowledged) >= before + 200, 60,  # noqa: B023
                       "sends acknowledged by the current active")
            killed_at = time.monotonic()
            ha.kill9(active)
            ready = standby.wait_line(READY_PREFIX, timeout=60)
            takeover = time.monotonic() - killed_at
            recovery = float(ready.split(" messages in ")[1].split(" s")[0])
            takeovers.append(takeover)
            # detection by the broken connection: recovery plus a little, and always
            # within the seed's bound of activation interval + recovery
            assert takeover < ACTIVATION + recovery + 5, (takeover, recovery)
            assert standby.status()["role"] == "active"
            assert ha.restart(active).role == "standby"
            wait_until(lambda: active.status()["following"]  # noqa: B023
                       == f"127.0.0.1:{standby.ha_port}", 30,  # noqa: B023
                       "the restarted broker to follow the new active")
            active, standby = standby, active
        stop.set()
        for t in threads:
            join_or_explain(t, timeout=120)
        plain, txin, txout = (load.drain(_connect, url, q) for q in ("plain", "txin", "txout"))
    # a message delivered again (after a failover, or an ack refused by one) is
    # flagged redelivered every later time: the delivered mark (docs/ha.md)
    again = [seen for seen in flags.values() if len(seen) > 1]
    report = verdict(ledger, plain, txin, txout, kills=10,
                     takeover_max=round(max(takeovers), 2), redeliveries=len(again),
                     redeliveries_unflagged=sum(1 for seen in again if not all(seen[1:])))
    print("HA kill -9 report:", report)
    check(report)
    assert report["redeliveries_unflagged"] == 0


# ----------------------------------------------------------------- no split brain
def test_a_stopped_active_keeps_the_store(tmp_path: Path) -> None:
    with pair(tmp_path) as ha:
        a, b = ha.nodes
        with txbroker.connect(url_of(a, b), timeout=10) as conn:
            conn.send("q", b"before", message_id="m1")
        holder = a.status()["lock_holder"]
        a.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: b.log_has("no heartbeat from the active"), 30,
                       "the standby to notice the silence")
            # three activation intervals of alternating: never active, lock unchanged
            deadline = time.monotonic() + 3 * ACTIVATION
            while time.monotonic() < deadline:
                status = b.status()
                assert status["role"] == "standby" and status["lock_holder"] == holder
                time.sleep(0.1)
            # a new client waits for the stopped active, then is refused by the standby
            with pytest.raises(txbroker.ConnectionLost,
                               match="is the standby of a shared-store pair"):
                txbroker.connect(url_of(a, b), timeout=1, reconnect=False)
        finally:
            a.send_signal(signal.SIGCONT)
        with txbroker.connect(url_of(a, b), timeout=10) as conn:
            conn.send("q", b"after", message_id="m2")
            assert conn.queue_info("q")["depth"] == 2
        wait_until(lambda: b.status()["following"] == f"127.0.0.1:{a.ha_port}"
                   and b.status()["last_heartbeat_age"] < ACTIVATION, 30,
                   "the standby to follow the active again")
        assert a.status()["role"] == "active" and b.status()["role"] == "standby"
        assert not any(line.startswith(READY_PREFIX) for line in b.lines())


class Proxy:
    """A TCP proxy on the HA link that can stop forwarding (heartbeat loss without a
    dead process)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.blocked = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._writers: list[asyncio.StreamWriter] = []
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._on_client, "127.0.0.1",
                                                          self.port))
        self._ready.set()
        self.loop.run_forever()

    async def _on_client(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        if self.blocked.is_set():  # accept and say nothing, like a black hole
            self._writers.append(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            while self.blocked.is_set():  # swallow: the bytes never arrive
                await asyncio.sleep(0.05)
                data = b""
            if data:
                writer.write(data)
        writer.close()

    def stop(self) -> None:
        def close() -> None:
            for writer in self._writers:
                writer.close()
            self.loop.stop()

        self.loop.call_soon_threadsafe(close)


@LINKS
def test_heartbeat_loss_without_a_dead_process(tmp_path: Path, link: str) -> None:
    """The standby reaches the active through a proxy that then drops everything: it
    waits the activation interval, fails to get the lock, alternates, and never
    becomes a second active; when the link heals it is the standby again."""
    ha = HaPair(tmp_path / "pair", *link_args(tmp_path, link), heartbeat_interval=HEARTBEAT,
                activation_interval=ACTIVATION)
    a, b = ha.nodes
    proxy = Proxy(a.ha_port)
    b.peer_address = f"127.0.0.1:{proxy.port}"
    try:
        ha.start()
        wait_until(lambda: b.status()["following"] is not None, 30, "the standby to follow")
        proxy.blocked.set()
        blocked_at = time.monotonic()
        wait_until(lambda: b.log_has("no heartbeat from the active"), 30,
                   "the standby to notice the silence")
        assert time.monotonic() - blocked_at >= ACTIVATION - HEARTBEAT
        with txbroker.connect(url_of(a, b), timeout=10) as conn:
            deadline = time.monotonic() + 3 * ACTIVATION
            sent = 0
            while time.monotonic() < deadline:  # the active serves all along
                conn.send("q", b"x")
                sent += 1
                assert b.status()["role"] == "standby"
                time.sleep(0.05)
            assert conn.queue_info("q")["depth"] == sent
        assert b.log_has("no answer to the HA handshake")  # it kept alternating
        proxy.blocked.clear()
        wait_until(lambda: b.status()["last_heartbeat_age"] is not None
                   and b.status()["last_heartbeat_age"] < ACTIVATION
                   and b.status()["following"] is not None, 30,
                   "the standby to follow again")
        assert not any(line.startswith(READY_PREFIX) for line in b.lines())
    finally:
        ha.stop()
        proxy.stop()


# ----------------------------------------------------------------- what carries over
def test_admin_changes_and_the_config_file_carry_over(tmp_path: Path) -> None:
    config = tmp_path / "pair.toml"
    config.write_text("[limits]\nmax_message_size = 100000\n")
    with pair(tmp_path, "--config", str(config)) as ha:
        a, b = ha.nodes
        with txbroker.connect(url_of(a, b), timeout=10) as conn:
            assert conn.server_info["max_message_size"] == 100000
            conn.declare_queue("orders")
            conn.update_queue("orders", max_deliveries=2)
            conn.send("orders", b"one", message_id="o1")
        # an operator edits the shared config file: the standby reads it when it takes over
        config.write_text("[limits]\nmax_message_size = 200000\n")
        ha.kill9(a)
        b.wait_line(READY_PREFIX)
        with txbroker.connect(url_of(a, b), timeout=10) as conn:
            assert conn.server_info["max_message_size"] == 200000
            info = conn.queue_info("orders")
            assert (info["settings"]["max_deliveries"], info["depth"]) == (2, 1)


# ----------------------------------------------------------------- refusals
def test_standby_refuses_clients_and_a_third_broker(tmp_path: Path) -> None:
    with pair(tmp_path) as ha:
        a, b = ha.nodes
        with pytest.raises(txbroker.ConnectionLost, match="is the standby of a shared-store"):
            txbroker.connect(url_of(b), timeout=5)
        with txbroker.connect(url_of(b, a), timeout=5) as conn:  # moves past the standby
            assert conn.host == a.address
        third = HaNode("c", ha.root, free_ports(3))
        third.spawn(a, ha.args)
        assert third.proc is not None and third.proc.wait(timeout=30) == 1
        log = third.log_path.read_text()
        assert "error: the HA peer refused this broker: the active 127.0.0.1:" in log
        assert "already has a standby" in log
        assert a.status()["role"] == "active" and b.status()["role"] == "standby"
        assert b.status()["following"] == f"127.0.0.1:{a.ha_port}"


def test_a_peer_that_is_not_a_txbroker(tmp_path: Path) -> None:
    """B's peer answers HTTP: B says so in its log, stays standby (A holds the lock), and
    A is unharmed; A's own HA port refuses bytes that are not the link."""
    server = _http_like_server()
    try:
        with pair(tmp_path, peer_of_b=f"127.0.0.1:{server.getsockname()[1]}") as ha:
            a, b = ha.nodes
            wait_until(lambda: b.log_has("is not a txbroker HA port"), 30,
                       "the standby to name the problem")
            assert b.status()["role"] == "standby"
            import socket

            with socket.create_connection(("127.0.0.1", a.ha_port), timeout=5) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert sock.recv(100) == b""  # closed without an answer
            wait_until(lambda: a.log_has("on the HA port: the peer is not a txbroker"), 30,
                       "the active to log the stray client")
            with txbroker.connect(url_of(a, b), timeout=5) as conn:
                conn.send("q", b"still fine")
    finally:
        server.close()


def _http_like_server() -> Any:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def serve() -> None:
        while True:
            try:
                client, _ = sock.accept()
            except OSError:
                return
            with contextlib.suppress(OSError):
                client.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            client.close()

    threading.Thread(target=serve, daemon=True).start()
    return sock


def test_standby_error_is_a_distinct_error() -> None:
    assert issubclass(Standby, TxBrokerError) and Standby.retriable


def test_ha_status_command(tmp_path: Path) -> None:
    with pair(tmp_path) as ha:
        a, b = ha.nodes
        dead = free_port()
        url = f"txb://{a.address},{b.address},127.0.0.1:{dead}"
        result = subprocess.run([sys.executable, "-m", "txbroker.cli", "ha", "status", "--url",
                                 url, "--json"], capture_output=True, text=True, timeout=60,
                                cwd=ROOT)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report[a.address]["role"] == "active"
        assert report[a.address]["standby"] == f"127.0.0.1:{b.ha_port}"
        assert report[b.address]["role"] == "standby"
        assert report[b.address]["following"] == f"127.0.0.1:{a.ha_port}"
        assert report[a.address]["lock_holder"] == report[b.address]["lock_holder"]
        assert a.proc is not None
        assert report[a.address]["lock_holder"].startswith(f"pid {a.proc.pid} on ")
        assert "Connection refused" in report[f"127.0.0.1:{dead}"]["error"]
        text = subprocess.run([sys.executable, "-m", "txbroker.cli", "ha", "status", "--url",
                               f"txb://{b.address}"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert text.returncode == 0 and text.stdout.startswith(f"{b.address}  standby since ")
        stat = subprocess.run([sys.executable, "-m", "txbroker.cli", "stat", "--url",
                               f"txb://{b.address},{a.address}"], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
        assert json.loads(stat.stdout)["ha"]["role"] == "active"  # moved past the standby
        a.stop()
        b.wait_line(READY_PREFIX)  # a clean stop hands over too
        none = subprocess.run([sys.executable, "-m", "txbroker.cli", "ha", "status", "--url",
                               f"txb://127.0.0.1:{dead}"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert none.returncode == 1
        assert none.stderr == "error: no broker of the list answered\n"


@LINKS
def test_transactions_xa_and_topics_across_a_takeover(tmp_path: Path, link: str) -> None:
    """Seed 004 through a real pair: an open local transaction rolls back and what it
    received comes back flagged; a prepared XA branch is completed through the new
    active; a durable topic subscription keeps its messages and goes on."""
    from txbroker.core.xa import TMSUCCESS
    from txbroker.xid import Xid

    moves: list[tuple[str, str]] = []
    with pair(tmp_path, *link_args(tmp_path, link)) as ha:
        a, b = ha.nodes
        url = url_of(a, b)
        with txbroker.connect(url, timeout=10, failover_timeout=60,
                              on_failover=lambda old, new: moves.append((old, new))) as conn:
            conn.declare_topic("prices")
            conn.subscribe_topic("prices", "risk")
            conn.send("prices", b"p1")
            conn.send("orders", b"o1")
            conn.send("orders", b"o2")
            xid = Xid(1, "ha", "b1")
            xa = conn.xa_resource()
            xa.start(xid)
            taken = conn.receive("orders", timeout=5)
            assert taken is not None and taken.body == b"o1"
            taken.ack()
            conn.send("shipped", b"o1")
            xa.end(xid, TMSUCCESS)
            xa.prepare(xid)
            tx = conn.transaction()
            got = tx.receive("orders", timeout=5)
            assert got is not None and got.body == b"o2"
            tx.send("shipped", b"o2")
            ha.kill9(a)
            b.wait_line(READY_PREFIX)
            with pytest.raises(TransactionRolledBack):
                tx.commit()
            assert xa.recover() == [xid]  # the prepared branch is in the shared store
            assert moves == [(a.address, b.address)]  # recover() ran on the new active
            xa.commit(xid)
            again = conn.receive("orders", timeout=5)
            assert again is not None and (again.body, again.redelivered) == (b"o2", True)
            again.ack(wait=True)
            conn.send("prices", b"p2")
            prices = [conn.receive("prices::risk", timeout=5) for _ in range(2)]
            assert [m.body for m in prices if m is not None] == [b"p1", b"p2"]
            shipped = conn.receive("shipped", timeout=5)
            assert shipped is not None and shipped.body == b"o1"
            assert conn.receive("shipped", timeout=0.2) is None  # o2's send rolled back
            assert conn.queue_info("orders")["depth"] == 0


def test_acks_after_a_takeover_fail_only_for_another_receiver(tmp_path: Path) -> None:
    """Seed 004 (issue 28 §5): after a failover an ack raises IllegalState only when the
    message "has already been sent to another queue receiver"; "this cannot occur if
    there is only one receiver". The ack names the message by its id: one taken by a
    receive and one pushed to a subscription (restored after the failover) are acked
    and never come back; one meanwhile received by another connection is refused."""
    with pair(tmp_path) as ha:
        a, b = ha.nodes
        url = url_of(a, b)
        with txbroker.connect(url, timeout=10, failover_timeout=60) as conn, \
                txbroker.connect(url, timeout=10, failover_timeout=60) as other:
            for queue, body in (("acks", b"r1"), ("acks", b"r2"), ("subs", b"s1"),
                                ("shared", b"x1")):
                conn.send(queue, body)
            taken = conn.receive("acks", timeout=5)
            shared = conn.receive("shared", timeout=5)
            sub = conn.subscribe("subs", prefetch=1)
            pushed = sub.get(timeout=5)
            assert taken is not None and taken.body == b"r1"
            assert shared is not None and pushed is not None and pushed.body == b"s1"
            ha.kill9(a)
            b.wait_line(READY_PREFIX)
            taken.ack(wait=True)  # one receiver: accepted
            pushed.ack(wait=True)
            elsewhere = other.receive("shared", timeout=10)
            assert elsewhere is not None and (elsewhere.body, elsewhere.redelivered) == (
                b"x1", True)
            with pytest.raises(IllegalState, match="another receiver"):
                shared.ack(wait=True)
            elsewhere.ack(wait=True)
            second = conn.receive("acks", timeout=5)
            assert second is not None and second.body == b"r2"  # r1 is not redelivered
            second.ack(wait=True)
            assert sub.get(timeout=0.5) is None  # s1 neither
            for queue in ("acks", "subs", "shared"):
                info = conn.queue_info(queue)
                assert (queue, info["messages"]) == (queue, 0)


def test_a_non_durable_topic_subscriber_carries_on_after_a_takeover(tmp_path: Path) -> None:
    """Seed 004: "All topic subscribers continue normal operation after a failover." A
    non-durable subscription is not in the store: the client makes it again on the new
    active before it subscribes again; naming ``topic::name`` never creates a plain
    queue."""
    with pair(tmp_path) as ha:
        a, b = ha.nodes
        with txbroker.connect(url_of(a, b), timeout=10, failover_timeout=60) as conn:
            conn.declare_topic("news")
            name = conn.subscribe_topic("news", "mine", durable=False)["name"]
            sub = conn.subscribe(name, prefetch=10)
            conn.send("news", b"n1")
            got = sub.get(timeout=5)
            assert got is not None and got.body == b"n1"
            got.ack(wait=True)
            ha.kill9(a)
            b.wait_line(READY_PREFIX)
            conn.send("news", b"n2")  # sent once the subscription is back
            got = sub.get(timeout=10)
            assert got is not None and got.body == b"n2"
            got.ack(wait=True)
            info = conn.queue_info(name)
            assert (info["topic"], info["durable"]) == ("news", False)
            assert conn.queue_info("news")["subscriptions"] == [name]
            with pytest.raises(NotFound):
                conn.receive("news::nobody", timeout=0)
            assert "news::nobody" not in {q["name"] for q in conn.queues()}


def test_a_pair_on_the_directory_store(tmp_path: Path) -> None:
    """The dir store's lock (DIR/lock) is the HA lock just as the journal's is."""
    with pair(tmp_path, "--store", "dir", "--dir-flags", "FDATASYNC,DSYNC") as ha:
        a, b = ha.nodes
        assert a.status()["lock_file"] == str(ha.data / "lock")
        with txbroker.connect(ha.url, timeout=10, failover_timeout=60) as conn:
            conn.send("q", b"kept", message_id="k1")
            ha.kill9(a)
            b.wait_line(READY_PREFIX)
            got = conn.receive("q", timeout=10)
            assert got is not None and got.body == b"kept"
            got.ack(wait=True)
        assert ha.restart(a).role == "standby"
