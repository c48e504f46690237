"""Replicated HA with real processes (issue 14, seed 001): a primary and backups on
their own disks, kill -9, ``txbroker ha promote``, transactions (local, XA, and
``txbroker.tm`` with PostgreSQL) across failovers, the seed's atomicity scenario,
a backup that votes fail, a silent backup, the loss of the whole group.

Every wait is on something observable — a printed line, ``ha status``, a reply —
and bounded (``tests/replicated_support.py``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest

import txbroker
from tests import native_workload as load
from tests.ledger import Ledger, check, join_or_explain, verdict
from tests.replicated_support import BACKUP_PREFIX, Group, LinkProxy, wait_for
from tests.tls_support import ha_link_args
from tests.tm.conftest import orders  # noqa: F401 - the PostgreSQL fixture (postgres: tests/conftest.py)
from txbroker.errors import (
    XA_OK,
    XA_RBROLLBACK,
    IllegalState,
    TransactionRolledBack,
    TxBrokerError,
    XAError,
)
from txbroker.tm import (
    BrokerResource,
    PostgresResource,
    TransactionManager,
    recover,
)
from txbroker.tm.example import dequeue_and_insert, insert_and_send
from txbroker.xid import Xid

#: what a failover may make a worker's step fail with (the step is retried)
RETRY = (TransactionRolledBack, IllegalState, txbroker.ConnectionLost)
#: kill -9 / promote rounds of the load test
ROUNDS = 10
#: The replication link settings a representative subset of the tests runs with: as by
#: default, and with a secret and TLS (issue 29; tests/server/test_ha_link.py has the
#: refusals).
LINKS = pytest.mark.parametrize("link", ["open", "secret+tls"])


def link_args(tmp_path: Path, link: str) -> list[str]:
    return ha_link_args(tmp_path / "link") if link == "secret+tls" else []


def _connect(url: str) -> Any:
    return txbroker.connect(url, timeout=15, failover_timeout=60)


def _guard(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
            fn()

    return run


@contextlib.contextmanager
def group(tmp_path: Path, n: int = 3, *args: str, **kwargs: Any) -> Iterator[Group]:
    g = Group(tmp_path / "group", n, *args, **kwargs)
    with g:
        yield g


def drain(url: str, queue: str) -> list[str]:
    """Bodies left in ``queue`` (acked), in order."""
    return load.drain(_connect, url, queue)


def rows(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as pg:
        return [r[0] for r in pg.execute("SELECT id FROM orders ORDER BY id").fetchall()]


def pg_prepared(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as pg:
        row = pg.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()
        assert row is not None
        return int(row[0])


class Crash(BaseException):
    """The coordinator 'dies' at a step (its connections are then abandoned)."""


# ----------------------------------------------------------------- kill -9 under load
def tx_producer(url: str, name: str, ledger: Ledger, stop: threading.Event,
                count: int) -> None:
    """Local transactions of ``count`` sends to ``plain``; each body names its
    transaction and its size: ``T<name>.<n>.<i>.<count>``."""
    n = 0
    with _connect(url) as conn:
        while not stop.is_set():
            ids = [f"T{name}.{n}.{i}.{count}" for i in range(count)]
            n += 1
            ledger.add("attempted", *ids)
            try:
                with conn.transaction() as tx:
                    for mid in ids:
                        tx.send("plain", mid.encode(), message_id=mid)
            except RETRY:
                continue
            ledger.add("acknowledged", *ids)


def partial_transactions(seen: set[str]) -> dict[str, list[int]]:
    """Transactions of :func:`tx_producer` of which some but not all messages were
    seen: ``{tx: sorted indexes seen}``."""
    parts: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for mid in seen:
        if mid.startswith("T"):
            name, n, i, count = mid[1:].split(".")
            parts.setdefault(f"{name}.{n}", set()).add(int(i))
            sizes[f"{name}.{n}"] = int(count)
    return {tx: sorted(got) for tx, got in parts.items() if len(got) != sizes[tx]}


def first_send(url: str) -> float:
    """Send one message through the failover URL; the monotonic time it was confirmed."""
    with _connect(url) as conn:
        conn.send("probe", b"p")
        return time.monotonic()


def test_kill9_and_promote_ten_times_under_load(tmp_path: Path) -> None:
    """Three brokers; producers (plain and local transactions of 4), a consumer, a
    feeder and a mover through the failover URL; ten times: kill -9 the primary,
    ``ha promote`` a ready backup, restart the killed one (it rejoins and is ready
    before the next kill)."""
    ledger = Ledger()
    promotions: list[float] = []
    promoted: list[str] = []
    with group(tmp_path) as g:
        url = g.url
        stop = threading.Event()
        workers: list[Callable[[], None]] = [
            partial(load.producer, _connect, url, "p0", ledger, stop, 0, RETRY),
            partial(tx_producer, url, "t0", ledger, stop, 4),
            partial(tx_producer, url, "t1", ledger, stop, 3),
            partial(load.feeder, _connect, url, "f0", ledger, stop, RETRY),
            partial(load.consumer, _connect, url, ledger, stop, RETRY),
            partial(load.mover, _connect, url, ledger, stop, RETRY),
        ]
        threads = [threading.Thread(target=_guard(w), daemon=True) for w in workers]
        for t in threads:
            t.start()
        primary = g.primary()
        try:
            for _ in range(ROUNDS):
                g.wait_ready_backups(2, primary=primary)
                before = len(ledger.acknowledged)
                wait_for(lambda: len(ledger.acknowledged) >= before + 100, 60,  # noqa: B023
                         "100 more sends acknowledged by the current primary", g.describe)
                index = g.nodes.index(primary)
                candidates = [g.nodes[(index + k) % 3] for k in (1, 2)]
                killed_at = time.monotonic()
                g.kill9(primary)
                target = next((n for n in candidates if (n.try_status() or {}).get("promotable")),
                              candidates[0])
                g.promote(target)
                promotions.append(first_send(url) - killed_at)
                promoted.append(target.name)
                assert g.primary() is target
                g.restart(primary)
                primary = target
        finally:
            stop.set()
        for t in threads:
            join_or_explain(t, timeout=120)
        g.wait_ready_backups(2, primary=primary)
        assert g.primary() is primary
        plain, txin, txout = (drain(url, q) for q in ("plain", "txin", "txout"))
    seen = set(ledger.received) | set(plain)
    report = verdict(ledger, plain, txin, txout, kills=ROUNDS, promoted="".join(promoted),
                     promotion_max=round(max(promotions), 2),
                     partial_local_tx=len(partial_transactions(seen)))
    print("replicated HA kill -9 report:", report)
    check(report)
    assert partial_transactions(seen) == {}
    assert len(promoted) == ROUNDS and len(set(promoted)) == 3  # every node was primary
    assert sum(1 for m in ledger.acknowledged if m.startswith("T")) > 0


# ----------------------------------------------------------------- XA across a failover
def test_prepared_xa_branches_and_tm_transactions_survive_failover(
        tmp_path: Path, orders: str) -> None:  # noqa: F811 - the fixture
    """Prepared broker branches (the XA API) and a ``txbroker.tm`` transaction
    (broker + PostgreSQL) decided just before the primary dies are completed through
    the promoted backup; open branches of the dead primary are gone."""
    x_send, x_ack, x_open = (Xid(7, name, b"q") for name in (b"send", b"ack", b"open"))
    crash_at = {"step": ""}

    def hook(step: str) -> None:
        if step == crash_at["step"]:
            raise Crash(step)

    log_path = tmp_path / "tm.log"
    with group(tmp_path) as g:
        a = g.primary()
        with _connect(g.url) as conn:
            conn.send("xin", b"in-1", message_id="in-1")
            conn.send("orders", b"o-1", message_id="o-1")
        direct = txbroker.connect(a.url, reconnect=False, timeout=5)
        tm_conn = [txbroker.connect(a.url, reconnect=False, timeout=5) for _ in range(2)]
        pgs = [psycopg.connect(orders) for _ in range(2)]
        try:
            xa = direct.xa_resource()
            xa.start(x_send)
            for i in range(3):
                direct.send("xq", f"x-{i}".encode(), message_id=f"x-{i}")
            xa.end(x_send)
            assert xa.prepare(x_send) == XA_OK
            xa.start(x_ack)
            got = direct.receive("xin", timeout=5)
            assert got is not None and got.body == b"in-1"
            got.ack()
            xa.end(x_ack)
            assert xa.prepare(x_ack) == XA_OK
            xa.start(x_open)  # ended, never prepared: dies with the primary
            direct.send("xq", b"never", message_id="never")
            xa.end(x_open)
            tm = TransactionManager(log_path, hook=hook)
            crash_at["step"] = "after_decision"  # both prepared, commit decided
            with pytest.raises(Crash):
                dequeue_and_insert(tm, tm_conn[0], pgs[0], "orders")
            crash_at["step"] = "between_prepares"  # one prepared, no decision
            with pytest.raises(Crash):
                insert_and_send(tm, tm_conn[1], pgs[1], "shipped", "ship-1", b"parcel")
            tm.close()
            g.kill9(a)
        finally:
            for pg in pgs:
                pg.close()
            for c in (direct, *tm_conn):
                with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
                    c.close()
        assert pg_prepared(orders) == 2  # PostgreSQL votes first ('postgres' < 'txbroker')
        g.promote(g.b)
        tm2 = TransactionManager(log_path)
        with _connect(g.url) as conn, psycopg.connect(orders, autocommit=True) as pg:
            report = recover(tm2.log, [BrokerResource(conn), PostgresResource(pg)])
            assert report.clean, report
            assert len(report.committed) == 2 and len(report.rolled_back) == 1, report
            xa = conn.xa_resource()
            assert set(xa.recover()) == {x_send, x_ack}
            xa.commit(x_send)
            xa.rollback(x_ack)
            assert xa.recover() == []
        tm2.close()
        assert drain(g.url, "xq") == ["x-0", "x-1", "x-2"]
        assert drain(g.url, "xin") == ["in-1"]
        assert drain(g.url, "orders") == []
        assert drain(g.url, "shipped") == []
        g.restart(a)
        g.wait_ready_backups(2, primary=g.b)
    assert rows(orders) == ["o-1"] and pg_prepared(orders) == 0
    assert tm2.log.open_decisions == set()


# ----------------------------------------------------------------- the seed's atomicity
def test_backup_joining_while_prepared_is_promoted_with_whole_branches(tmp_path: Path) -> None:
    """Seed 001, 'Atomicity': a backup joins while a transaction is prepared; the
    transaction commits and the primary dies right after the commit's reply; the
    promoted backup has it whole (and another branch, never committed, still
    prepared, whole)."""
    x_abc, x_def = Xid(9, b"abc", b"q"), Xid(9, b"def", b"q")
    g = Group(tmp_path / "group", 2)
    try:
        a, b = g.nodes
        g.spawn(a)
        a.wait_line(BACKUP_PREFIX)
        g.promote(a, cli=False)
        conn = txbroker.connect(a.url, reconnect=False, timeout=5)
        try:
            xa = conn.xa_resource()
            for xid, bodies in ((x_abc, "ABC"), (x_def, "DEF")):
                xa.start(xid)
                for body in bodies:
                    conn.send("Q", body.encode(), message_id=body)
                xa.end(xid)
                assert xa.prepare(xid) == XA_OK
            g.spawn(b)  # joins now: both branches are prepared on the primary
            b.wait_line(BACKUP_PREFIX)
            g.wait_ready_backups(1, primary=a)
            following = b.status()["following"]
            assert following["state"] == "following" and following["ready"] is True
            xa.commit(x_abc)
            g.kill9(a)  # right after the commit's reply
        finally:
            with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
                conn.close()
        g.promote(b)
        with _connect(g.url) as conn:
            xa = conn.xa_resource()
            assert xa.recover() == [x_def]
            assert drain(g.url, "Q") == ["A", "B", "C"]
            xa.commit(x_def)
            assert xa.recover() == []
        assert drain(g.url, "Q") == ["D", "E", "F"]
    finally:
        g.stop()


# ----------------------------------------------------------------- a backup restarted
class LatencyProducer:
    """Persistent sends to ``queue`` on one thread, each one's (start, latency) kept."""

    def __init__(self, url: str, name: str, ledger: Ledger, queue: str = "plain") -> None:
        self.url, self.name, self.ledger, self.queue = url, name, ledger, queue
        self.stop = threading.Event()
        self.samples: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=_guard(self._run), daemon=True)

    def _run(self) -> None:
        n = 0
        with _connect(self.url) as conn:
            while not self.stop.is_set():
                mid = f"{self.name}-{n}"
                n += 1
                self.ledger.add("attempted", mid)
                started = time.monotonic()
                conn.send(self.queue, mid.encode(), message_id=mid)
                self.samples.append((started, time.monotonic() - started))
                self.ledger.add("acknowledged", mid)

    def __enter__(self) -> LatencyProducer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        join_or_explain(self.thread, 60)

    def max_latency(self, since: float = 0.0) -> float:
        return max((lat for start, lat in self.samples if start + lat >= since), default=0.0)


def wait_acks(ledger: Ledger, more: int, g: Group, timeout: float = 30) -> None:
    before = len(ledger.acknowledged)
    wait_for(lambda: len(ledger.acknowledged) >= before + more, timeout,
             f"{more} more acknowledged sends", g.describe)


@LINKS
def test_backup_killed_and_restarted_under_load_catches_up(tmp_path: Path, link: str) -> None:
    """kill -9 a backup under load and start it again: it resumes the copy on its disk
    (2000 stored messages and what followed) with the entries it missed, becomes ready,
    and is then a complete copy (promoted alone, it holds every acknowledged send); the
    producers never wait for it."""
    timeout = 3.0
    ledger = Ledger()
    with group(tmp_path, 3, *link_args(tmp_path, link), backup_timeout=timeout) as g:
        a, b, c = g.nodes
        with _connect(g.url) as conn:
            for k in range(20):
                with conn.transaction() as tx:
                    for i in range(100):
                        tx.send("bulk", b"x" * 1024, message_id=f"bulk-{k}-{i}")
        with LatencyProducer(g.url, "p0", ledger) as p0, \
                LatencyProducer(g.url, "p1", ledger) as p1:
            wait_acks(ledger, 100, g)
            g.kill9(c)
            wait_acks(ledger, 100, g)
            assert set(g.backup_states(a)) == {"b"}
            g.restart(c)
            g.wait_ready_backups(2, primary=a)
            wait_acks(ledger, 100, g)
        assert g.backup_states(a) == {"b": "ready", "c": "ready"}
        report = g.status_cli()  # txbroker ha status --url a,b,c --json
        assert [report[n.address]["role"] for n in g.nodes] == ["primary", "backup", "backup"]
        assert {x["node"]: x["state"] for x in report[a.address]["replication"]["backups"]} \
            == {"b": "ready", "c": "ready"}
        assert report[c.address]["promotable"] is True
        following = c.status()["following"]
        assert following["state"] == "following" and following["ready"] is True
        assert following["joined_by"] == "suffix"  # the second start: from its disk
        assert c.log_count("replication: copy of a is whole") == 1  # the first start only
        assert c.log_count("replication: kept the copy on disk") == 1
        worst = max(p0.max_latency(), p1.max_latency())
        assert worst < timeout, f"a producer waited {worst:.2f} s"
        # c alone must hold everything: lose a and b, promote c (alone of three it
        # cannot hear a majority: only by force)
        g.kill9(a)
        g.kill9(b)
        assert "only 1 of the 3 nodes answered" in g.promote_fails(c)
        g.promote(c, force=True)
        plain = drain(g.url, "plain")
        bulk = drain(g.url, "bulk")
    assert len(bulk) == 2000
    assert set(plain) == ledger.acknowledged and len(plain) == len(set(plain))


# ----------------------------------------------------------------- a backup that votes fail
def test_backup_voting_fail_rolls_the_prepare_back_and_leaves(tmp_path: Path) -> None:
    """c votes fail on the first XA_PREPARE it is streamed: the prepare fails with
    XA_RBROLLBACK, the branch is gone, c is dropped (it joins again later, fresh)."""
    args = {"c": ["--replica-fault", "vote_fail:11"]}
    x1 = Xid(3, b"first", b"q")
    with group(tmp_path, node_args=args) as g:
        a, _, c = g.nodes
        with _connect(g.url) as conn:
            xa = conn.xa_resource()
            xa.start(x1)
            conn.send("xq", b"one", message_id="one")
            xa.end(x1)
            failed_at = time.time()
            with pytest.raises(XAError) as info:
                xa.prepare(x1)
            assert info.value.errcode == XA_RBROLLBACK
            assert "backup c voted fail" in str(info.value)
            assert xa.recover() == []
            assert conn.queue_info("xq")["depth"] == 0
            backups = {x["node"]: x for x in a.status()["replication"]["backups"]}
            assert backups["b"]["state"] == "ready"
            # c left: absent, or already back through a fresh join (after the failure)
            assert "c" not in backups or backups["c"]["since"] > failed_at, backups
        assert c.log_has("voting fail, leaving")
        assert a.log_has("replication: backup c dropped: it voted fail on entry")
        assert drain(g.url, "xq") == []


def test_the_prepare_after_a_fail_vote_succeeds(tmp_path: Path) -> None:
    """Once the failing backup is back (ready again), the next prepare succeeds."""
    args = {"c": ["--replica-fault", "vote_fail:11"]}
    x1, x2 = Xid(3, b"first", b"q"), Xid(3, b"second", b"q")
    with group(tmp_path, node_args=args) as g:
        with _connect(g.url) as conn:
            xa = conn.xa_resource()
            xa.start(x1)
            conn.send("xq", b"one", message_id="one")
            xa.end(x1)
            with pytest.raises(XAError):
                xa.prepare(x1)
            g.wait_ready_backups(2)
            xa.start(x2)
            conn.send("xq", b"two", message_id="two")
            xa.end(x2)
            assert xa.prepare(x2) == XA_OK
            xa.commit(x2)
        assert drain(g.url, "xq") == ["two"]


# ----------------------------------------------------------------- the whole group lost
def test_whole_group_killed_with_prepared_branches(tmp_path: Path,
                                                   orders: str) -> None:  # noqa: F811
    """kill -9 all three with prepared branches (broker XA, and a txbroker.tm
    transaction decided with PostgreSQL); restart all, promote the old primary;
    recovery completes everything (seed requirement 5)."""
    x_send, x_ack = Xid(5, b"send", b"q"), Xid(5, b"ack", b"q")

    def hook(step: str) -> None:
        if step == "after_decision":
            raise Crash(step)

    log_path = tmp_path / "tm.log"
    with group(tmp_path) as g:
        a = g.primary()
        with _connect(g.url) as conn:
            for i in range(20):
                conn.send("kept", f"k-{i}".encode(), message_id=f"k-{i}")
            conn.send("xin", b"in-1", message_id="in-1")
            conn.send("orders", b"o-9", message_id="o-9")
        direct = txbroker.connect(a.url, reconnect=False, timeout=5)
        tm_conn = txbroker.connect(a.url, reconnect=False, timeout=5)
        pg = psycopg.connect(orders)
        try:
            xa = direct.xa_resource()
            xa.start(x_send)
            direct.send("xq", b"s-1", message_id="s-1")
            direct.send("xq", b"s-2", message_id="s-2")
            xa.end(x_send)
            assert xa.prepare(x_send) == XA_OK
            xa.start(x_ack)
            got = direct.receive("xin", timeout=5)
            assert got is not None
            got.ack()
            xa.end(x_ack)
            assert xa.prepare(x_ack) == XA_OK
            tm = TransactionManager(log_path, hook=hook)
            with pytest.raises(Crash):
                dequeue_and_insert(tm, tm_conn, pg, "orders")
            tm.close()
            for node in g.nodes:  # the primary first
                g.kill9(node)
        finally:
            pg.close()
            for c in (direct, tm_conn):
                with contextlib.suppress(TxBrokerError, OSError, TimeoutError):
                    c.close()
        for node in g.nodes:
            g.spawn(node)
        for node in g.nodes:
            node.wait_line(BACKUP_PREFIX)
        for node in g.nodes:
            wait_for(lambda: (node.try_status() or {}).get("role") == "backup",  # noqa: B023
                     30, f"{node.name} to answer as a backup", g.describe)
        g.promote(a)
        g.wait_ready_backups(2, primary=a)
        tm2 = TransactionManager(log_path)
        with _connect(g.url) as conn, psycopg.connect(orders, autocommit=True) as pgc:
            report = recover(tm2.log, [BrokerResource(conn), PostgresResource(pgc)])
            assert report.clean and len(report.committed) == 2, report
            xa = conn.xa_resource()
            assert set(xa.recover()) == {x_send, x_ack}
            xa.commit(x_send)
            xa.commit(x_ack)
            assert xa.recover() == []
        tm2.close()
        assert drain(g.url, "kept") == [f"k-{i}" for i in range(20)]
        assert drain(g.url, "xq") == ["s-1", "s-2"]
        assert drain(g.url, "xin") == []
        assert drain(g.url, "orders") == []
    assert rows(orders) == ["o-9"] and pg_prepared(orders) == 0


# ----------------------------------------------------------------- a silent backup
def test_stopped_backup_is_dropped_after_backup_timeout(tmp_path: Path) -> None:
    """SIGSTOP a backup: sends wait for it at most about backup_timeout, then it
    leaves the ready set (status says why) and sends go on; SIGCONT: it catches up
    and is ready again."""
    timeout = 2.0
    ledger = Ledger()
    with group(tmp_path, backup_timeout=timeout) as g:
        a, _, c = g.nodes
        with LatencyProducer(g.url, "p0", ledger) as producer:
            wait_acks(ledger, 50, g)
            stopped_at = time.monotonic()
            c.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: g.backup_states(a).get("c") == "catching-up", 3 * timeout,
                         "c to leave the ready set", g.describe)
                backups = {x["node"]: x for x in a.status()["replication"]["backups"]}
                assert backups["b"]["state"] == "ready"
                assert backups["c"]["reason"].startswith("no ack of entry ")
                assert backups["c"]["reason"].endswith("within backup_timeout (2 s)")
                wait_acks(ledger, 100, g, timeout=10)  # sends go on without c
                assert g.backup_states(a) == {"b": "ready", "c": "catching-up"}
            finally:
                c.send_signal(signal.SIGCONT)
            g.wait_ready_backups(2, primary=a)
            wait_acks(ledger, 20, g)
        held = producer.max_latency(since=stopped_at)
        assert timeout * 0.9 <= held < timeout + 1.5, f"held {held:.2f} s"
        assert a.log_has("replication: backup c leaves the ready set")
        assert a.log_has("replication: backup c is ready")
        assert sorted(drain(g.url, "plain")) == sorted(ledger.acknowledged)


# ----------------------------------------------------------------- promotable or not
def test_a_backup_dropped_from_the_ready_set_cannot_be_promoted(tmp_path: Path) -> None:
    """c is SIGSTOPped and dropped from the ready set (told so on its link); five sends
    are acknowledged without it; a dies. c may not be promoted (``ha promote`` says
    why), b may, with every send; c then follows b and is ready."""
    timeout = 1.0
    with group(tmp_path, backup_timeout=timeout) as g:
        a, b, c = g.nodes
        sent = [f"m-{i}" for i in range(5)]
        c.send_signal(signal.SIGSTOP)
        try:
            with txbroker.connect(a.url, reconnect=False, timeout=15) as conn:
                for mid in sent:
                    conn.send("q", mid.encode(), message_id=mid)
            assert g.backup_states(a) == {"b": "ready", "c": "catching-up"}
            g.kill9(a)
        finally:
            c.send_signal(signal.SIGCONT)
        wait_for(lambda: c.log_has("replication: lost the primary a"), 10,
                 "c to notice the end of its link", g.describe)
        assert c.status()["promotable"] is False
        assert "did not count it as ready" in g.promote_fails(c)
        assert b.status()["promotable"] is True
        g.promote(b)
        assert drain(g.url, "q") == sent
        g.wait_ready_backups(1, primary=b)
        assert g.backup_states(b) == {"c": "ready"}


def test_after_a_whole_group_restart_a_stale_backup_is_not_promotable(tmp_path: Path) -> None:
    """c is dropped from the ready set (SIGSTOP); five sends are acknowledged without
    it; the whole group is killed and restarted. c must not be promotable (a is): the
    smaller ready set is on a and b (a majority), and c hears it from them."""
    timeout = 1.0
    with group(tmp_path, backup_timeout=timeout) as g:
        a, _, c = g.nodes
        c.send_signal(signal.SIGSTOP)
        with txbroker.connect(a.url, reconnect=False, timeout=15) as conn:
            for i in range(5):
                conn.send("q", b"m", message_id=f"m-{i}")
        assert g.backup_states(a)["c"] == "catching-up"
        for node in g.nodes:
            g.kill9(node)
        for node in g.nodes:
            g.restart(node)
        for node in g.nodes:
            wait_for(lambda: (node.try_status() or {}).get("role") == "backup",  # noqa: B023
                     30, f"{node.name} to answer as a backup", g.describe)
        # c learns the newer ready set when its search for a primary reaches a or b
        wait_for(lambda: c.status()["promotable"] is False, 10,
                 "c to hear the newer ready set", g.describe)
        assert a.status()["promotable"] is True
        assert "does not hold it" in g.promote_fails(c)
        g.promote(a)
        assert drain(g.url, "q") == ["m"] * 5


# ----------------------------------------------------------------- a backup cut off
@contextlib.contextmanager
def group_with_c_behind_a_proxy(tmp_path: Path, timeout: float, *args: str) -> Iterator[
        tuple[Group, LinkProxy]]:
    """a primary, b and c ready backups; c reaches a's HA port through a proxy."""
    g = Group(tmp_path / "group", 3, *args, backup_timeout=timeout)
    a, _, c = g.nodes
    proxy = LinkProxy(a.ha_port)
    c.peer_override = {"a": f"127.0.0.1:{proxy.port}"}
    try:
        g.start()
        yield g, proxy
    finally:
        g.stop()
        proxy.stop()


def cut_c_off_and_send(g: Group, proxy: LinkProxy, timeout: float) -> list[str]:
    """Silence c's link; five sends, acknowledged once a dropped c (after timeout)."""
    a = g.a
    proxy.blocked.set()
    sent = [f"m-{i}" for i in range(5)]
    with txbroker.connect(a.url, reconnect=False, timeout=15) as conn:
        for mid in sent:
            conn.send("q", mid.encode(), message_id=mid)
    assert g.backup_states(a) == {"b": "ready", "c": "catching-up"}
    with _connect(g.url) as conn:
        assert conn.queue_info("q")["depth"] == 5
    return sent


def test_a_backup_dropped_over_a_silent_link_is_not_promotable(tmp_path: Path) -> None:
    """c's link goes silent; a drops c from the ready set after backup_timeout and
    acknowledges five sends c never got (once b holds the smaller ready set); a dies.
    c must not be promotable (b is): c hears the newer record from b."""
    timeout = 1.0
    with group_with_c_behind_a_proxy(tmp_path, timeout) as (g, proxy):
        a, b, c = g.nodes
        cut_c_off_and_send(g, proxy, timeout)
        g.kill9(a)
        proxy.blocked.clear()
        proxy.sever()  # c's link ends now
        wait_for(lambda: c.log_has("replication: lost the primary a"), 10,
                 "c to notice the end of its link", g.describe)
        assert b.status()["promotable"] is True
        assert "cannot be promoted" in g.promote_fails(c)
        assert c.status()["promotable"] is False, c.status()  # it asked b


def test_a_backup_dropped_over_a_silent_link_is_safe_to_skip(tmp_path: Path) -> None:
    """The same cut-off: promoting b (ready all along) keeps the five sends."""
    timeout = 1.0
    with group_with_c_behind_a_proxy(tmp_path, timeout) as (g, proxy):
        a, b, _ = g.nodes
        sent = cut_c_off_and_send(g, proxy, timeout)
        g.kill9(a)
        proxy.blocked.clear()
        proxy.sever()
        g.promote(b)
        assert drain(g.url, "q") == sent


@LINKS
def test_a_backup_whose_primary_vanished_joins_the_new_primary(tmp_path: Path,
                                                               link: str) -> None:
    """a dies while c's link to it is silent (a machine cut off: no end of stream
    reaches c); b is promoted; c must notice within a bound and follow b."""
    timeout = 1.0
    with group_with_c_behind_a_proxy(tmp_path, timeout, *link_args(tmp_path, link)) as (
            g, proxy):
        a, b, _ = g.nodes
        cut_c_off_and_send(g, proxy, timeout)
        g.kill9(a)
        g.promote(b)
        assert g.wait_ready_backups(1, primary=b, timeout=8 * timeout) == {"c": "ready"}
