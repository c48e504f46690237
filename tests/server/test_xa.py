"""XA against a real broker process: the wire ops, the clients' XAResource and TPC
names, and prepared branches surviving kill -9 (also while segments are deleted)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import txbroker
from tests.support import STORES, BrokerProcess, store_args
from txbroker.client.xa import TMNOFLAGS, TMSUCCESS, XA_OK
from txbroker.errors import (
    XA_RBROLLBACK,
    XA_RBTIMEOUT,
    XAER_DUPID,
    XAER_NOTA,
    XAER_PROTO,
    XAError,
)
from txbroker.xid import Xid


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """Every case runs on the journal and on the dir store (FDATASYNC,DSYNC; issue 17)."""
    return str(request.param)



def test_tpc_branch_survives_kill9_and_is_committed_by_recovery(tmp_path: Path,
                                                                store: str) -> None:
    proc = BrokerProcess(tmp_path / "data", *store_args(store)).start()
    try:
        with txbroker.connect(proc.url) as conn:
            conn.send("in", b"order-1")
            xid = conn.xid(7, "global-1", "broker")
            conn.tpc_begin(xid)
            msg = conn.receive("in", timeout=5)
            assert msg is not None
            msg.ack()
            conn.send("out", b"shipped-1")
            conn.tpc_prepare()
            proc.kill()  # SIGKILL with the branch prepared
        proc.start()
        with txbroker.connect(proc.url) as conn:
            assert conn.tpc_recover() == [xid]
            assert conn.receive("in", timeout=0.2) is None  # held by the branch
            assert conn.receive("out", timeout=0.2) is None  # not committed yet
            conn.tpc_commit(xid)
            assert conn.tpc_recover() == []
            got = conn.receive("out", timeout=5)
            assert got is not None and got.body == b"shipped-1"
            got.ack(wait=True)
        proc.kill()
        proc.start()
        with txbroker.connect(proc.url) as conn:
            assert conn.tpc_recover() == []
            assert conn.receive("in", timeout=0.2) is None
            assert conn.receive("out", timeout=0.2) is None
    finally:
        proc.kill()


def test_rollback_after_kill9_redelivers(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as conn:
        conn.send("in", b"m")
        xid = conn.xid(0, b"\x01\x02", b"\x03")
        xa = conn.xa_resource()
        xa.start(xid, TMNOFLAGS)
        msg = conn.receive("in", timeout=5)
        assert msg is not None
        msg.ack()
        xa.end(xid, TMSUCCESS)
        assert xa.prepare(xid) == XA_OK
    broker.kill()
    broker.start()
    with txbroker.connect(broker.url) as conn:
        xa = conn.xa_resource()
        assert xa.recover() == [xid]
        xa.rollback(xid)
        got = conn.receive("in", timeout=5)
        assert got is not None and got.body == b"m" and got.redelivered


def test_xa_errors_carry_the_xa_code(broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url) as a, txbroker.connect(broker.url) as b:
        xid = Xid(0, "g", "b")
        a.xa_resource().start(xid)
        with pytest.raises(XAError) as info:
            b.xa_resource().start(xid)
        assert info.value.errcode == XAER_DUPID
        with pytest.raises(XAError) as info:
            a.xa_resource().prepare(xid)
        assert info.value.errcode == XAER_PROTO
        with pytest.raises(XAError) as info:
            b.xa_resource().commit(Xid(0, "nope", "b"))
        assert info.value.errcode == XAER_NOTA and "XAER_NOTA" in str(info.value)
        a.send("t", b"x")
        a.xa_resource().end(xid, TMSUCCESS)
        b.update_queue("t", ingress=False)
        with pytest.raises(XAError) as info:
            a.xa_resource().prepare(xid)
        assert info.value.errcode == XA_RBROLLBACK and info.value.rolled_back
        assert a.xa_resource().get_transaction_timeout() == 180
        a.xa_resource().set_transaction_timeout(30)
        assert a.xa_resource().get_transaction_timeout() == 30


def test_transaction_timeout_is_an_idle_timeout(broker: BrokerProcess) -> None:
    """Seed 002 through a real broker (issue 28 §4): a branch ACTIVE for longer than its
    transaction timeout is not rolled back; once ended, it is rolled back when the
    timeout runs out (XA_RBTIMEOUT on the next request)."""
    with txbroker.connect(broker.url) as conn:
        xa = conn.xa_resource()
        xa.set_transaction_timeout(1)
        xid = Xid(3, "idle", "b")
        xa.start(xid)
        conn.send("idle-out", b"x")
        time.sleep(1.5)  # ACTIVE past its timeout: it stays
        xa.end(xid, TMSUCCESS)
        assert [b["state"] for b in conn.xa_branches()] == ["idle"]
        deadline = time.monotonic() + 10
        while conn.xa_branches():  # the idle timeout (1 s) rolls it back
            assert time.monotonic() < deadline, "the IDLE branch was not rolled back"
            time.sleep(0.05)
        with pytest.raises(XAError) as info:
            xa.prepare(xid)
        assert info.value.errcode == XA_RBTIMEOUT
        assert conn.receive("idle-out", timeout=0.2) is None


def test_one_phase_tpc_commit_and_async_client(broker: BrokerProcess) -> None:
    async def main() -> None:
        async with txbroker.aio.connect(broker.url) as conn:
            await conn.tpc_begin(conn.xid(0, "async", "1"))
            await conn.send("out", b"a")
            await conn.tpc_commit()  # not prepared: one-phase
            got = await conn.receive("out", timeout=5)
            assert got is not None and got.body == b"a"
            await got.ack(wait=True)
            await conn.tpc_begin(conn.xid(0, "async", "2"))
            await conn.send("out", b"never")
            await conn.tpc_rollback()
            assert await conn.receive("out", timeout=0.2) is None

    asyncio.run(main())


def test_prepared_branches_survive_segment_deletion_and_kill9(tmp_path: Path,
                                                              store: str) -> None:
    """Small segments and fast maintenance: old segments are deleted and live bodies
    relocated while branches stay prepared; after kill -9 they are all there. (On the
    dir store, which has no segments: prepared branches survive churn, maintenance and
    kill -9.)"""
    config = tmp_path / "broker.toml"
    config.write_text("[server]\nsegment_size = 65536\nmaintain_interval = 0.1\n")
    proc = BrokerProcess(tmp_path / "data", "--config", str(config), *store_args(store)).start()
    xids = []
    try:
        with txbroker.connect(proc.url) as conn:
            for i in range(20):
                conn.send("in", b"c%d" % i)
            xa = conn.xa_resource()
            for i in range(20):  # each branch consumes one message (no bodies of its own)
                xid = conn.xid(0, f"g{i}", "b")
                xa.start(xid)
                msg = conn.receive("in", timeout=5)
                assert msg is not None
                msg.ack()
                xa.end(xid)
                assert xa.prepare(xid) == XA_OK
                xids.append(xid)
            stop = threading.Event()

            def churn() -> None:
                with txbroker.connect(proc.url) as other:
                    while not stop.is_set():
                        for _ in range(50):
                            other.send("churn", b"x" * 2000)
                        for _ in range(50):
                            m = other.receive("churn", timeout=1)
                            if m is not None:
                                m.ack()

            worker = threading.Thread(target=churn)
            worker.start()
            time.sleep(2.0)
            stop.set()
            worker.join(timeout=30)
        proc.kill()
        proc.start()
        with txbroker.connect(proc.url) as conn:
            assert sorted(conn.tpc_recover()) == sorted(xids)
            assert conn.receive("in", timeout=0.2) is None
            for xid in xids[:10]:
                conn.tpc_commit(xid)
            for xid in xids[10:]:
                conn.tpc_rollback(xid)
            back = set()
            while (m := conn.receive("in", timeout=0.5)) is not None:
                back.add(m.body)
                m.ack(wait=True)
            assert back == {b"c%d" % i for i in range(10, 20)}
    finally:
        proc.kill()


def test_branch_of_a_broken_session_can_be_resumed(broker: BrokerProcess) -> None:
    xid = Xid(0, "reattach", "b")
    first = txbroker.connect(broker.url)
    first.xa_resource().start(xid)
    first.send("out", b"kept")
    first.close()  # the session breaks with the branch active
    with txbroker.connect(broker.url) as second:
        xa = second.xa_resource()
        xa.start(xid, txbroker.client.xa.TMRESUME)
        second.send("out", b"more")
        xa.end(xid)
        xa.commit(xid, one_phase=True)
        got = [second.receive("out", timeout=5) for _ in range(2)]
        assert [m.body for m in got if m is not None] == [b"kept", b"more"]


class CuttableProxy:
    """A TCP proxy to the broker whose connections the test can cut (a network break
    that the broker survives)."""

    def __init__(self, target_port: int) -> None:
        import socket

        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[Any] = []
        self.refusing = False  #: while True, a new connection is closed at once
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: Any, sink: Any) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(2)

    def cut(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(2)
        self.sockets = []

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_client_resumes_its_branch_after_a_network_break(broker: BrokerProcess) -> None:
    proxy = CuttableProxy(broker.port)
    try:
        with txbroker.connect(f"txb://127.0.0.1:{proxy.port}", failover_timeout=10) as conn:
            conn.send("in", b"consumed")
            conn.tpc_begin(conn.xid(0, "resume", "b"))
            msg = conn.receive("in", timeout=5)
            assert msg is not None
            msg.ack(wait=True)
            conn.send("out", b"before")
            session = conn.server_info["session"]
            proxy.cut()
            deadline = time.monotonic() + 10
            while conn.server_info["session"] == session and time.monotonic() < deadline:
                time.sleep(0.02)  # the client notices the break and fails over
            assert conn.server_info["session"] != session
            conn.ping()
            conn.send("out", b"after")  # the branch was resumed: still inside it
            conn.tpc_prepare()
            conn.tpc_commit()
            got = [conn.receive("out", timeout=5) for _ in range(2)]
            assert [m.body for m in got if m is not None] == [b"before", b"after"]
            assert conn.receive("in", timeout=0.2) is None
    finally:
        proxy.close()


def test_a_send_made_while_failing_over_stays_in_its_branch(broker: BrokerProcess) -> None:
    """Issue 25's audit: a pipelined send asked while the connection fails over, then the
    branch's ``end`` at once. The send must reach the broker before the ``end`` and inside
    the resumed branch; sent after it, it would be a plain send, done at once, and the
    rollback below would leave it in the queue."""
    proxy = CuttableProxy(broker.port)

    async def scenario() -> list[bytes]:
        async with txbroker.aio.connect(f"txb://127.0.0.1:{proxy.port}",
                                        failover_timeout=20) as conn:
            xa = conn.xa_resource()
            xid = conn.xid(0, "order", "b")
            await xa.start(xid)
            await conn.send("out", b"before")
            session = conn.server_info["session"]
            proxy.refusing = True
            proxy.cut()
            for _ in range(500):  # the client notices the break and starts failing over
                if conn.epoch is None:
                    break
                await asyncio.sleep(0.01)
            assert conn.epoch is None
            # the broker is reachable again a little later, while both wait for it
            asyncio.get_running_loop().call_later(0.2, setattr, proxy, "refusing", False)
            during = conn.send_nowait("out", b"during")
            await xa.end(xid)  # at once, as a program does (not in a task of its own)
            await during
            assert conn.server_info["session"] != session
            assert await xa.prepare(xid) == XA_OK
            await xa.rollback(xid)
            left = []
            while (msg := await conn.receive("out", timeout=0.3)) is not None:
                left.append(msg.body)
                await msg.ack()
            return left

    try:
        assert asyncio.run(scenario()) == []
    finally:
        proxy.close()


def test_branch_lost_in_a_broker_restart_is_reported_as_rolled_back(
        broker: BrokerProcess) -> None:
    with txbroker.connect(broker.url, failover_timeout=30) as conn:
        conn.tpc_begin(conn.xid(0, "lost", "b"))
        conn.send("out", b"never")
        broker.kill()
        broker.start()  # same port: the client fails over to it; the branch is gone
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                conn.ping()
                break
            except txbroker.TxBrokerError:
                time.sleep(0.1)
        with pytest.raises(XAError) as info:
            conn.tpc_prepare()
        assert info.value.rolled_back
        assert conn.receive("out", timeout=0.2) is None


def test_branch_with_work_in_flight_at_a_network_break_is_not_resumed(
        broker: BrokerProcess) -> None:
    """Issue 25's audit: an ack of the branch was on its way when the connection broke
    (the broker stopped, so it was not answered). Resuming the branch could commit it
    without that ack, and the message would come again: applied twice. The branch is
    lost instead: prepare raises a rollback error."""
    import os
    import signal

    proxy = CuttableProxy(broker.port)
    try:
        with txbroker.connect(f"txb://127.0.0.1:{proxy.port}", failover_timeout=10) as conn:
            conn.send("in", b"consumed")
            conn.tpc_begin(conn.xid(0, "inflight", "b"))
            msg = conn.receive("in", timeout=5)
            assert msg is not None
            session = conn.server_info["session"]
            assert broker.proc is not None
            os.kill(broker.proc.pid, signal.SIGSTOP)
            try:
                msg.ack()  # pipelined: never answered before the break
                proxy.cut()
            finally:
                os.kill(broker.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while conn.server_info["session"] == session and time.monotonic() < deadline:
                time.sleep(0.02)  # the client notices the break and fails over
            assert conn.server_info["session"] != session
            with pytest.raises(XAError) as info:
                conn.tpc_prepare()
            assert info.value.rolled_back and "in flight" in str(info.value)
    finally:
        proxy.close()
