"""What a shared-store takeover waits for (issue 29 §3; docs/ha.md, "How long a takeover
takes"): the mechanisms, not the seconds.

* A standby tries the lock every ``lock_poll_interval`` whatever its link does: when
  the link hangs (a peer that accepts and never answers, as a stopped or partitioned
  active does), a released lock is taken at the next poll, not after the link's
  timeout (``heartbeat_interval``, 30 s here).
* Recovery — which is what a takeover spends its time on — runs with the cyclic GC
  off, and puts it back on afterwards, also when recovery fails.
* A replicated backup that lost its primary polls the etcd key every 50 ms until
  the dead primary's lease expires (``campaign_pause``), instead of every TTL/3,
  and notices the loss however the link ended (a reset as well as an end of stream).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import pytest

from tests.support import free_port
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.ha.etcd_lease import campaign_pause
from txbroker.server.ha.shared_store import HaRole, SharedStoreNode
from txbroker.server.process import gc_paused
from txbroker.server.stores import store_lock_path
from txbroker.storage.store_lock import StoreLock

#: Far longer than the test may take: a standby that waited for its link would fail.
LINK_TIMEOUT = 30.0
DEADLINE = 10.0


async def _until(condition: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_standby_whose_link_hangs_takes_a_released_lock_at_a_poll(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="txbroker.ha")

    async def scenario() -> None:
        accepted: list[asyncio.StreamWriter] = []

        async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)  # accept, never answer: the handshake hangs

        peer = await asyncio.start_server(silent, "127.0.0.1", 0)
        peer_port = peer.sockets[0].getsockname()[1]
        config = ServerConfig(data=tmp_path / "data", port=free_port(), stomp_port=0,
                              amqp_port=0, ha="shared-store", ha_port=free_port(),
                              ha_peer=f"127.0.0.1:{peer_port}",
                              heartbeat_interval=LINK_TIMEOUT,
                              activation_interval=2 * LINK_TIMEOUT)
        holder = StoreLock.try_acquire(store_lock_path(config), "the test, as the active")
        assert holder is not None
        node = SharedStoreNode(config)
        node.lock_poll_interval = 0.05
        run = asyncio.ensure_future(node.run())
        try:
            await _until(lambda: node.role == HaRole.STANDBY and accepted,
                         "the standby to hang in the handshake with its peer")
            assert node.following is None  # no welcome: it is still in the handshake
            holder.release()
            await _until(lambda: node.role in (HaRole.ACTIVATING, HaRole.ACTIVE),
                         "the standby to take the released lock")
            await _until(lambda: node.role == HaRole.ACTIVE, "the takeover to finish")
            assert node.lock is not None and node.lock.held
        finally:
            node.request_stop()
            await asyncio.wait_for(run, DEADLINE)
            for writer in accepted:
                writer.close()
            peer.close()

    asyncio.run(scenario())
    assert "HA: the lock was free at a poll" in caplog.text
    assert "HA: holding the lock" in caplog.text


def test_recovery_runs_with_the_cyclic_gc_off(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    finish = BrokerServer.finish_recovery

    def recording(self: BrokerServer, started: float) -> None:
        seen.append(gc.isenabled())
        finish(self, started)

    monkeypatch.setattr(BrokerServer, "finish_recovery", recording)
    server = BrokerServer(ServerConfig(data=tmp_path / "data", port=0, stomp_port=0,
                                       amqp_port=0))

    async def recover() -> None:
        await server.recover()
        assert server.store is not None
        server.store.close()

    assert gc.isenabled()
    asyncio.run(recover())
    assert seen == [False]
    assert gc.isenabled()


def test_gc_paused_restores_the_gc_as_it_was() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("recovery failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()



# ---------------------------------------------------------------- replicated, etcd
#: (following, key holder, seconds since the primary was lost) -> the campaign's pause,
#: at TTL 3 s; written out by hand, not computed from the constants.
CAMPAIGN_PAUSES = [
    # following a primary: the normal round, TTL/3
    ((True, "b", None), 1.0),
    ((True, "b", 0.1), 1.0),
    # lost the primary b, whose key is still there: poll it every 50 ms
    ((False, "b", 0.0), 0.05),
    ((False, "b", 4.4), 0.05),
    # ... but only for 1.5 TTL: a key held that long is a live primary's
    ((False, "b", 4.5), 1.0),
    # lost nobody (a backup that never followed): the normal round
    ((False, "b", None), 1.0),
    # the key is free (the campaign tries it at once) or ours: the normal round
    ((False, None, 0.1), 1.0),
    ((False, "a", 0.1), 1.0),
]


@pytest.mark.parametrize("case, pause", CAMPAIGN_PAUSES)
def test_campaign_pause(case: tuple[bool, str | None, float | None], pause: float) -> None:
    following, holder, lost_for = case
    assert campaign_pause(3, following=following, holder=holder, node="a",
                          lost_for=lost_for) == pytest.approx(pause)


def test_campaign_pause_has_a_floor() -> None:
    assert campaign_pause(0.3, following=True, holder=None, node="a", lost_for=None) == 0.2


class _Link:
    """What ``ReplicatedNode._follow`` reads of its follower, for one follow() call:
    ``welcomed`` says whether a primary took our join before the link ended."""

    def __init__(self, welcomed: bool) -> None:
        self.welcomed = welcomed
        self.links = 0
        self.server = None
        self.primary = "b"

    async def follow(self, host: str, port: int) -> None:
        if self.welcomed:
            self.links += 1  # as Follower._on_message does at the welcome
            raise ConnectionResetError("the primary's process died")  # a reset, not an EOF
        raise ConnectionRefusedError("nobody listens there")


@pytest.mark.parametrize("welcomed", [True, False])
def test_a_backup_notices_the_loss_of_its_primary_however_the_link_ended(
        tmp_path: Path, welcomed: bool) -> None:
    """The etcd campaign's fast poll starts at the loss of a primary that had welcomed
    us (the link ended by a reset as well as by an end of stream), not at a peer that
    was never reached."""
    from txbroker.server.ha.replicated import ReplicatedNode

    config = ServerConfig(data=tmp_path / "data", port=0, stomp_port=0, amqp_port=0,
                          ha="replicated", ha_port=free_port(),
                          ha_peers=f"127.0.0.1:{free_port()}")

    async def scenario() -> tuple[str, float | None, bool]:
        node = ReplicatedNode(config)
        outcome = await node._follow(_Link(welcomed), "127.0.0.1", 1)  # type: ignore[arg-type]
        return outcome, node._lost_primary_at, node._nudge.is_set()

    outcome, lost_at, woken = asyncio.run(scenario())
    assert outcome == "ended"
    assert (lost_at is not None, woken) == (welcomed, welcomed)
