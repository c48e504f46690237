"""The sync client's one loop thread per process (``_portal.SHARED_LOOP``, issue 30),
pipelined calls handed to it without waiting (``Connection.run_async_pipelined``), and
the TM's sync broker participant built on them — against real brokers in memory."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
from tests.client.test_sync_client import ServerThread

from txbroker.client._portal import SHARED_LOOP
from txbroker.client.xa import TMSUCCESS
from txbroker.errors import XAER_DUPID, XAER_NOTA, XAError
from txbroker.tm import BrokerParticipant
from txbroker.xid import Xid

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def servers() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.stop()


def client_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "txbroker-client")


def test_connections_share_one_loop_thread_until_the_last_closes(servers: ServerThread) -> None:
    server = servers.server()
    before = client_threads()  # 0, or 1 if a connection of another test was left open
    assert before <= 1
    a = servers.connect(f"txb://{server.address}")
    b = servers.connect(f"txb://{server.address}")
    assert client_threads() == 1
    a.send("q", b"1")
    msg = b.receive("q", timeout=1)
    assert msg is not None and msg.body == b"1"
    msg.ack(wait=True)
    a.close()
    assert client_threads() == 1  # b still runs on it
    b.ping()
    b.close()
    assert client_threads() == before  # the last one stopped it
    with servers.connect(f"txb://{server.address}") as c:  # a new one starts again
        assert client_threads() == 1
        c.ping()
    assert client_threads() == before


def test_a_forked_child_starts_its_own_loop_thread(servers: ServerThread) -> None:
    server = servers.server()
    with servers.connect(f"txb://{server.address}"):
        parent = SHARED_LOOP.acquire()
        SHARED_LOOP.release(parent)  # (the connection still holds it)
        pid = os.fork()
        if pid == 0:  # the child: the parent's loop thread does not exist here
            code = 1
            try:
                portal = SHARED_LOOP.acquire()

                async def answer() -> int:
                    return 42

                if portal is not parent and portal.call(answer()) == 42:
                    code = 0
                SHARED_LOOP.release(portal)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert SHARED_LOOP.acquire() is parent
        SHARED_LOOP.release(parent)


def test_a_pipelined_call_runs_in_order_and_its_error_comes_with_the_next_call(
        servers: ServerThread) -> None:
    server = servers.server()
    xid = Xid(1, "g-1", "b")
    with servers.connect(f"txb://{server.address}") as conn, \
            servers.connect(f"txb://{server.address}") as other:
        xa = conn.async_connection.xa_resource()
        conn.run_async_pipelined(xa.start(xid, wait=False))
        conn.send("q", b"in the branch")  # after the start: staged in the branch
        assert other.receive("q", timeout=0.2) is None
        conn.xa_resource().end(xid, TMSUCCESS)
        conn.xa_resource().commit(xid, one_phase=True)
        got = other.receive("q", timeout=1)
        assert got is not None and got.body == b"in the branch"
        got.ack(wait=True)
        # the same Xid again from the other connection: refused, by the next call
        other_xa = other.async_connection.xa_resource()
        conn.run_async_pipelined(xa.start(xid, wait=False))
        other.run_async_pipelined(other_xa.start(xid, wait=False))
        other.ping()  # sent before the refusal came back: its reply follows the refusal
        with pytest.raises(XAError) as refused:
            other.ping()  # so the call after it raises it
        assert refused.value.errcode == XAER_DUPID
        other.ping()  # raised once
        conn.xa_resource().end(xid, TMSUCCESS)
        conn.xa_resource().rollback(xid)


def test_the_sync_broker_participant(servers: ServerThread) -> None:
    server = servers.server()
    with servers.connect(f"txb://{server.address}") as conn, \
            servers.connect(f"txb://{server.address}") as other:
        conn.send("in", b"order")
        broker = BrokerParticipant(conn)
        xid = Xid(1, "g-2", "txbroker")
        broker.begin(xid)
        msg = conn.receive("in", timeout=1)
        assert msg is not None
        msg.ack()  # staged in the branch
        conn.send("out", b"shipped")
        assert broker.vote(xid) is False  # prepared, not read-only
        assert [x for x in conn.tpc_recover() if x == xid] == [xid]
        assert other.receive("out", timeout=0.2) is None
        assert broker.finish(xid, True) is True
        got = other.receive("out", timeout=1)
        assert got is not None and got.body == b"shipped"
        assert other.receive("in", timeout=0.2) is None  # consumed by the branch
        assert broker.finish(xid, True) is True  # already complete (XAER_NOTA): done
        # a refused begin is raised by the next call on the connection
        other_broker = BrokerParticipant(other)
        dup = Xid(1, "g-3", "txbroker")
        broker.begin(dup)
        conn.ping()
        other_broker.begin(dup)
        other.ping()  # (sent before the refusal came back)
        with pytest.raises(XAError) as refused:
            other.receive("in", timeout=0)
        assert refused.value.errcode == XAER_DUPID
        broker.abort(dup)  # rolled back
        with pytest.raises(XAError) as gone:
            conn.xa_resource().rollback(dup)
        assert gone.value.errcode == XAER_NOTA
