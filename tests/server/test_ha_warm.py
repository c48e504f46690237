"""The warm standby (issue 29; ``server/ha/warm.py``): a standby that followed the
journal takes over with a recovery that reads only the suffix the active wrote
since, and nothing acknowledged is lost. Real processes, kill -9."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import txbroker
from tests.ha_support import READY_PREFIX, HaPair

MESSAGES = 3000


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_standby_that_followed_the_journal_takes_over_reading_only_the_suffix(
        tmp_path: Path) -> None:
    with HaPair(tmp_path / "pair", heartbeat_interval=0.5, activation_interval=2.0) as ha:
        a, b = ha.nodes
        with txbroker.connect(ha.url, timeout=15, failover_timeout=60) as conn:
            for number in range(MESSAGES):
                conn.send("warm", f"body {number}".encode() * 10, message_id=f"m{number}")
            appends = conn.stats()["store"]["appends"]
        assert appends >= MESSAGES
        _wait(lambda: (b.status()["warm"] or {}).get("entries", 0) >= appends, 30,
              "the standby to follow every entry the active wrote")
        warm = b.status()["warm"]
        assert warm["following"] and warm["broken"] is None
        ha.kill9(a)
        b.wait_line(READY_PREFIX, timeout=60)
        assert b.log_has("warm standby: ")
        with txbroker.connect(f"txb://{b.address}", timeout=15) as conn:
            store = conn.stats()["store"]
            # the active wrote nothing after the follower's last poll: recovery read
            # no entry, only (at most) the head segment's tail past the last entry
            assert store["recovered_entries"] == 0, store
            assert store["recovered_bytes"] == 0, store
            bodies = []
            while (message := conn.receive("warm", timeout=0)):
                bodies.append(message.body)
                message.ack()
        assert bodies == [f"body {number}".encode() * 10 for number in range(MESSAGES)]
