"""The warm standby in one process (``server/ha/warm.py``): the core it followed,
finished by a recovery that resumes after it, holds exactly what a cold
recovery of the same journal holds; a journal changed under it, or another
configuration, gives a cold recovery."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import txbroker.aio as aio
from tests.support import free_port
from txbroker.core.limits import Limits
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.ha.warm import WarmStandby, takeover_server
from txbroker.server.stores import store_lock_path
from txbroker.storage.journal_format import segment_name
from txbroker.storage.store_lock import StoreLock

SEGMENT = 16 * 1024


def _config(data: Path) -> ServerConfig:
    return ServerConfig(data=data, port=free_port(), stomp_port=0, amqp_port=0,
                        segment_size=SEGMENT)


async def _write(config: ServerConfig, warm: WarmStandby) -> None:
    """An active that sends, consumes and moves messages while ``warm`` follows;
    its store is closed at the end (the lock is free)."""
    active = BrokerServer(config)
    await active.recover()
    await active.open_listeners()
    try:
        async with aio.connect(f"txb://127.0.0.1:{config.port}") as conn:
            for number in range(300):
                await conn.send("a" if number % 3 else "b", f"body {number}".encode() * 8,
                                message_id=f"m{number}")
                if number % 50 == 0:
                    warm.step()
            for _ in range(120):
                message = await conn.receive("a", timeout=1)
                assert message is not None
                await message.ack()
            warm.step()
            for number in range(300, 320):  # the suffix: written after the last poll
                await conn.send("b", f"body {number}".encode(), message_id=f"m{number}")
    finally:
        await active.stop()


def _contents(server: BrokerServer) -> dict[str, Any]:
    broker = server.broker
    return {name: (queue.messages, queue.bytes) for name, queue in broker.queues.items()} | {
        "ids": sorted(broker.messages)}


async def _recover(config: ServerConfig, warm: WarmStandby | None) -> BrokerServer:
    lock = StoreLock.try_acquire(store_lock_path(config), "the test")
    assert lock is not None
    server = await takeover_server(warm, config, lock)
    await server.recover()
    return server


def test_the_warm_core_finished_after_the_suffix_equals_a_cold_recovery(
        tmp_path: Path) -> None:
    config = _config(tmp_path / "data")

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
        warm = WarmStandby(config)
        await _write(config, warm)
        probe = copy.deepcopy(warm.follower)  # what is left to read: the suffix
        suffix = 0
        while batch := probe.poll():
            suffix += len(batch)
        taken = await _recover(config, warm)
        assert taken.broker is warm.broker
        assert taken.store is not None
        store = taken.store.stats()
        warm_contents = _contents(taken)
        await taken.stop()
        cold = await _recover(config, None)
        cold_contents = _contents(cold)
        assert cold.store is not None
        full = cold.store.stats()
        await cold.stop()
        return warm_contents, cold_contents, {
            "suffix": suffix, "entries": store.recovered_entries,
            "all_entries": full.recovered_entries,
            "bytes": store.recovered_bytes, "all_bytes": full.recovered_bytes,
            "live": store.live_bodies, "cold_live": full.live_bodies}

    warm_contents, cold_contents, read = asyncio.run(scenario())
    assert warm_contents == cold_contents
    assert warm_contents["a"][0] == 200 - 120 and warm_contents["b"][0] == 100 + 20
    # the suffix only: the 20 sends after the last poll (and whatever the active's
    # compaction wrote after them)
    assert read["entries"] == read["suffix"] >= 20
    assert read["all_entries"] > 320
    assert 0 < read["bytes"] < read["all_bytes"] / 5
    assert read["live"] == read["cold_live"]  # the releases noted while following


def test_a_segment_replaced_under_the_follower_gives_a_cold_recovery(tmp_path: Path) -> None:
    config = _config(tmp_path / "data")

    async def scenario() -> tuple[bool, int, int]:
        warm = WarmStandby(config)
        await _write(config, warm)
        oldest = config.data / "journal" / segment_name(min(warm.follower.segments))
        copy = oldest.with_suffix(".copy")
        copy.write_bytes(oldest.read_bytes())
        os.replace(copy, oldest)
        taken = await _recover(config, warm)
        assert taken.store is not None
        result = (taken.broker is warm.broker, taken.store.stats().recovered_entries,
                  len(taken.broker.messages))
        await taken.stop()
        return result

    reused, entries, messages = asyncio.run(scenario())
    assert not reused and entries > 320 and messages == 320 - 120


def test_other_limits_at_the_takeover_give_a_cold_recovery(tmp_path: Path) -> None:
    config = _config(tmp_path / "data")
    changed = dataclasses.replace(config, limits=dataclasses.replace(
        Limits(), default_prefetch=Limits().default_prefetch + 1))

    async def scenario() -> bool:
        warm = WarmStandby(config)
        await _write(config, warm)
        taken = await _recover(changed, warm)
        reused = taken.broker is warm.broker
        await taken.stop()
        return reused

    assert not asyncio.run(scenario())


def test_compaction_under_the_follower_relocates_and_deletes_and_the_states_agree(
        tmp_path: Path) -> None:
    """The active relocates parked messages forward and deletes the dead segments
    while the standby follows: the follower forgets them with their releases, and
    the warm takeover holds what a cold recovery holds."""
    config = dataclasses.replace(_config(tmp_path / "data"), maintain_interval=0.02)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], int, int]:
        warm = WarmStandby(config)
        active = BrokerServer(config)
        await active.recover()
        await active.open_listeners()
        try:
            async with aio.connect(f"txb://127.0.0.1:{config.port}") as conn:
                for number in range(400):
                    await conn.send("parked" if number % 10 == 0 else "churn",
                                    f"body {number}".encode() * 20, message_id=f"m{number}")
                    if number % 25 == 0:
                        warm.step()
                while (message := await conn.receive("churn", timeout=0)) is not None:
                    await message.ack()
                    warm.step()
                for _ in range(100):  # compaction runs every 20 ms meanwhile
                    await asyncio.sleep(0.02)
                    warm.step()
        finally:
            await active.stop()
        oldest = min(warm.follower.segments)
        taken = await _recover(config, warm)
        assert taken.broker is warm.broker
        warm_contents = _contents(taken)
        assert taken.store is not None
        live = taken.store.stats().live_bodies
        await taken.stop()
        cold = await _recover(config, None)
        cold_contents = _contents(cold)
        assert cold.store is not None
        assert cold.store.stats().live_bodies == live
        await cold.stop()
        return warm_contents, cold_contents, oldest, live

    warm_contents, cold_contents, oldest, live = asyncio.run(scenario())
    assert oldest > 1  # segments were deleted under the follower
    assert warm_contents == cold_contents
    assert warm_contents["parked"][0] == 40 and warm_contents["ids"] and live == 40


def _state(server: BrokerServer) -> dict[str, Any]:
    """What a takeover built, in detail: every queue's counters, every message (in the
    index's log order) and every XA branch."""
    broker = server.broker
    return {
        "queues": {name: (q.messages, q.bytes, q.next_seq, q.delivered_seq, q.ready_count,
                          q.pending, q.pending_bytes, q.expiring)
                   for name, q in broker.queues.items()},
        "messages": [(m.id, m.queue, m.state, m.seq, m.delivery_count, m.size, m.ref)
                     for m in broker.messages.values()],
        "branches": {str(xid): (b.state, sorted(m.id for m in b.work.sends), sorted(b.work.acks))
                     for xid, b in broker.branches.items()}}


def test_a_standby_that_settles_as_it_follows_takes_over_with_a_cold_recoverys_state(
        tmp_path: Path) -> None:
    """Plain messages (no client id: the ones a standby settles ahead of the takeover,
    ``core/replay_settled.py``) parked, consumed and acked, delivered and not acked,
    in a local transaction, consumed and sent by a prepared XA branch, relocated by
    compaction while the standby follows: the warm takeover's state is the cold
    recovery's, message by message."""
    config = dataclasses.replace(_config(tmp_path / "data"), maintain_interval=0.02)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], int, int]:
        warm = WarmStandby(config)
        warm.settle_always = True
        active = BrokerServer(config)
        await active.recover()
        await active.open_listeners()
        try:
            async with aio.connect(f"txb://127.0.0.1:{config.port}") as conn:
                for _ in range(6):
                    await conn.send_batch("parked", [b"p" * 200] * 50)
                    warm.step()
                await conn.send_batch("work", [b"w" * 100] * 100)
                for number in range(45):
                    message = await conn.receive("work", timeout=1)
                    assert message is not None
                    if number < 40:  # 5 stay delivered, unacked
                        await message.ack()
                    if number % 10 == 0:
                        warm.step()
                tx = conn.transaction()
                for _ in range(3):
                    await tx.send("work", b"in tx")
                for _ in range(2):
                    consumed = await tx.receive("parked", timeout=1)
                    assert consumed is not None
                    await tx.ack(consumed)
                await tx.commit()
                warm.step()
                await conn.tpc_begin(conn.xid(0, "warm", "1"))
                for _ in range(2):
                    consumed = await conn.receive("parked", timeout=1)
                    assert consumed is not None
                    await consumed.ack()
                await conn.send("xa-out", b"prepared send")
                await conn.tpc_prepare()
                for _ in range(50):  # compaction runs every 20 ms meanwhile
                    await asyncio.sleep(0.02)
                    warm.step()
                settled = len(warm.broker.replay_part.settled.at)
                await conn.send_batch("parked", [b"late"] * 20)  # the suffix
        finally:
            await active.stop()
        taken = await _recover(config, warm)
        assert taken.broker is warm.broker
        warm_state = _state(taken)
        await taken.stop()
        cold = await _recover(config, None)
        cold_state = _state(cold)
        await cold.stop()
        return warm_state, cold_state, settled, len(cold_state["messages"])

    warm_state, cold_state, settled, messages = asyncio.run(scenario())
    assert warm_state == cold_state
    assert warm_state["queues"]["parked"][0] == 300 - 2 + 20  # (2 held by the branch)
    assert warm_state["queues"]["work"][0] == 100 - 40 + 3
    assert len(warm_state["branches"]) == 1
    assert settled >= 300 - 4  # what the takeover's finish did not walk
    assert messages == 300 - 2 + 20 + 60 + 3
