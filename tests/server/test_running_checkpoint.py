"""The running broker's recovery checkpoints (``server/recovery.py``, docs/storage.md):
one after the start whatever, then one only when the log grew; a start after a crash
reads the last one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from tests.support import free_port
from txbroker import aio
from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig


async def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_an_idle_broker_writes_one_checkpoint_and_a_busy_one_the_next(tmp_path: Path) -> None:
    config = ServerConfig(data=tmp_path / "data", port=free_port(), stomp_port=0,
                          amqp_port=0, recovery_checkpoint=True, checkpoint_interval=0.02)
    checkpoint = tmp_path / "data" / "journal" / "checkpoint"

    async def run() -> None:
        server = BrokerServer(config)
        await server.start()
        try:
            await _until(lambda: server.stats()["checkpoints"]["written"] >= 1)
            assert checkpoint.exists()  # (one after the start, though nothing was appended)
            await asyncio.sleep(0.3)  # 15 intervals with nothing appended
            assert server.stats()["checkpoints"]["written"] == 1
            async with aio.connect(f"txb://127.0.0.1:{config.port}") as conn:
                for number in range(20):
                    await conn.send("q", b"body %d" % number)
            await _until(lambda: server.stats()["checkpoints"]["written"] >= 2)
            await asyncio.sleep(0.3)
            assert server.stats()["checkpoints"]["written"] == 2
            stats = server.stats()
            assert stats["checkpoints"]["last_bytes"] > 0
            assert stats["checkpoints"]["last_pause_seconds"] >= 0
            assert server.store is not None
            server.store.close()  # (as a kill leaves it: no checkpoint at the close)
        finally:
            server.store = None
            await server.stop()
        again = BrokerServer(config)
        await again.start()
        try:
            store = again.stats()["store"]
            assert store["recovered_from_checkpoint"] and store["recovered_entries"] == 1
            assert again.broker.queues["q"].messages == 20
        finally:
            await again.stop()

    asyncio.run(run())
