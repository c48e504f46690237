"""The etcd client, the lease holder's fencing and the promotion rule, against a real
etcd (the session's ``etcd`` fixture, tests/etcd_support.py).

Every test works under its own key prefix; waits are bounded polls of etcd or of
the holder's state, never sleeps used as synchronisation.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from tests.etcd_support import EtcdServer, LinkProxy
from tests.support import free_port
from txbroker.errors import EtcdUnavailable, TxBrokerError
from txbroker.server.ha.etcd import EtcdClient, prefix_end
from txbroker.server.ha.etcd_lease import (
    Candidate,
    LeaseHolder,
    Progress,
    ProgressBoard,
    best_candidate,
    default_margin,
    primary_key,
)

TTL = 2  # etcd's minimum with its default election timeout (1 s)


def run(main: Coroutine[Any, Any, None], limit: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(main, limit))


def prefix() -> str:
    return f"/txbroker-test/{uuid.uuid4().hex[:12]}"


async def until(predicate: Callable[[], Awaitable[bool]], limit: float, what: str,
                every: float = 0.02) -> float:
    """Poll ``predicate`` until true (at most ``limit`` s); the monotonic time it was."""
    deadline = time.monotonic() + limit
    while True:
        if await predicate():
            return time.monotonic()
        assert time.monotonic() < deadline, f"not within {limit} s: {what}"
        await asyncio.sleep(every)


class Lost:
    """An ``on_lost`` callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str]] = []
        self.event = asyncio.Event()

    def __call__(self, reason: str) -> None:
        self.calls.append((time.monotonic(), reason))
        self.event.set()


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_grant_keepalive_and_expiry(etcd: EtcdServer) -> None:
    async def main() -> None:
        async with EtcdClient([etcd.url], timeout=2) as client:
            key = prefix() + "/k"
            sent = time.monotonic()
            lease, granted = await client.grant(TTL)
            assert granted == TTL
            await client.put(key, b"v", lease=lease)
            kv = await client.get(key)
            assert kv is not None and kv.value == b"v" and kv.lease == lease
            assert kv.create_revision == kv.mod_revision > 0
            renewal_sent = time.monotonic()
            assert await client.keepalive(lease) == TTL
            gone = await until(lambda: _absent(client, key), TTL + 3, "the lease expired")
            # etcd cannot expire a lease earlier than TTL after the last renewal was sent
            assert gone - sent >= TTL and gone - renewal_sent >= TTL
            assert await client.keepalive(lease) == 0
            assert await client.keepalive(12345) == 0  # never existed
            await client.revoke(lease)  # already gone: not an error

    run(main())


async def _absent(client: EtcdClient, key: str) -> bool:
    return await client.get(key) is None


def test_keys_prefix_put_delete_if(etcd: EtcdServer) -> None:
    async def main() -> None:
        async with EtcdClient([etcd.url], timeout=2) as client:
            base = prefix()
            for name in ("x/b", "x/a", "y"):
                await client.put(f"{base}/{name}", name)
            found = await client.get_prefix(f"{base}/x/")
            assert [(kv.key, kv.value) for kv in found] == [
                (f"{base}/x/a".encode(), b"x/a"), (f"{base}/x/b".encode(), b"x/b")]
            assert await client.get(f"{base}/none") is None
            assert await client.delete_if(f"{base}/y", "other") is False
            assert (await client.get(f"{base}/y")) is not None
            assert await client.delete_if(f"{base}/y", "y") is True
            assert await client.get(f"{base}/y") is None
            assert await client.delete(f"{base}/x/a") is True
            assert await client.delete(f"{base}/x/a") is False

    run(main())


def test_create_only_while_another_key_is_unchanged(etcd: EtcdServer) -> None:
    """A promotion takes the primary key only while the ready-set record it decided on
    is still the last one (``create(unchanged=…)``: a ``mod_revision`` compare; 0 for a
    key that does not exist)."""
    async def main() -> None:
        base = prefix()
        record, primary = base + "/ready", base + "/primary"
        async with EtcdClient([etcd.url], timeout=2) as client:
            assert await client.create(primary, "a", lease=0, unchanged=(record, 0))
            assert await client.delete(primary)
            await client.put(record, "first")
            first = await client.get(record)
            assert first is not None
            assert not await client.create(primary, "b", lease=0, unchanged=(record, 0))
            await client.put(record, "second")  # another primary's term recorded
            assert not await client.create(primary, "b", lease=0,
                                           unchanged=(record, first.mod_revision))
            assert await client.get(primary) is None  # nothing was written
            second = await client.get(record)
            assert second is not None
            assert await client.create(primary, "c", lease=0,
                                       unchanged=(record, second.mod_revision))
            taken = await client.get(primary)
            assert taken is not None and taken.value == b"c"

    run(main())


def test_create_is_exclusive_under_a_race(etcd: EtcdServer) -> None:
    async def main() -> None:
        async with EtcdClient([etcd.url], timeout=2) as one, \
                EtcdClient([etcd.url], timeout=2) as two:
            for round_ in range(20):
                key = f"{prefix()}/primary"
                (l1, _), (l2, _) = await asyncio.gather(one.grant(TTL), two.grant(TTL))
                won = await asyncio.gather(one.create(key, "one", lease=l1),
                                           two.create(key, "two", lease=l2))
                assert sorted(won) == [False, True], round_
                kv = await one.get(key)
                assert kv is not None
                assert kv.value == (b"one" if won[0] else b"two")
                assert kv.lease == (l1 if won[0] else l2)
                assert await two.create(key, "late", lease=l2) is False
                await one.revoke(l1)
                await two.revoke(l2)

    run(main())


def test_dead_endpoint_is_unavailable_with_its_url() -> None:
    async def main() -> None:
        url = f"http://127.0.0.1:{free_port()}"
        async with EtcdClient([url], timeout=1) as client:
            with pytest.raises(EtcdUnavailable, match="etcd is unavailable") as info:
                await client.get("k")
            assert url in str(info.value)
            assert isinstance(info.value, TxBrokerError)
            holder = LeaseHolder(client, "k", "v", ttl=TTL, on_lost=Lost())
            with pytest.raises(EtcdUnavailable, match=url):
                await holder.acquire()
            assert not holder.held

    run(main())


def test_a_dead_endpoint_is_skipped_for_a_live_one(etcd: EtcdServer) -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with EtcdClient([dead, etcd.url], timeout=1) as client:
            key = prefix() + "/k"
            await client.put(key, "v")
            kv = await client.get(key)
            assert kv is not None and kv.value == b"v"

    run(main())


def test_paused_etcd_holder_stops_before_its_lease_can_expire(etcd: EtcdServer) -> None:
    async def main() -> None:
        key = prefix() + "/primary"
        lost = Lost()
        async with EtcdClient([etcd.url], timeout=0.5) as a, \
                EtcdClient([etcd.url], timeout=1) as b:
            holder = LeaseHolder(a, key, "a", ttl=TTL, on_lost=lost)
            assert await holder.acquire()
            first = holder.last_renewal_sent
            assert holder.margin == default_margin(TTL) and holder.granted_ttl == TTL
            await until(_true(lambda: holder.last_renewal_sent > first), 5, "one renewal")
            etcd.pause()
            try:
                await asyncio.wait_for(lost.event.wait(), TTL + 2)
            finally:
                etcd.resume()
            assert len(lost.calls) == 1 and not holder.held
            assert "no lease renewal" in lost.calls[0][1]
            lost_at = lost.calls[0][0]
            last = holder.last_renewal_sent
            assert lost_at - last >= TTL - holder.margin
            assert lost_at < last + TTL  # before the earliest moment the lease can expire
            other = LeaseHolder(b, key, "b", ttl=TTL, on_lost=Lost())
            taken_at = await until(other.acquire, TTL + 5, "the second holder takes the key",
                                   every=0.05)
            assert lost_at < last + TTL <= taken_at
            assert len(lost.calls) == 1
            await other.release()

    run(main())


def test_a_holder_resumed_past_its_deadline_renews_nothing(etcd: EtcdServer) -> None:
    """A holder stopped (SIGSTOP) past its fencing deadline and resumed fences without
    sending one more renewal: a renewal granted then would keep the fenced holder's key
    for another TTL and delay the takeover (replicated-etcd-live seed 60023: the key
    outlived its fenced holder by 1.4 s). The stop is a jump of the holder's clock."""
    async def main() -> None:
        key = prefix() + "/primary"
        lost = Lost()
        jump = [0.0]
        async with EtcdClient([etcd.url], timeout=1) as a, \
                EtcdClient([etcd.url], timeout=1) as b:
            renewals: list[float] = []
            keepalive = a.keepalive

            async def counted(lease: int) -> float:
                renewals.append(time.monotonic())
                return await keepalive(lease)

            a.keepalive = counted  # type: ignore[method-assign]
            # margin 0.5 s: the renewal task wakes (at 2/3 TTL) before the watch's
            # deadline (at TTL - 0.5 s), as the first overdue timer at a SIGCONT can
            holder = LeaseHolder(a, key, "a", ttl=TTL, on_lost=lost, margin=0.5,
                                 clock=lambda: time.monotonic() + jump[0])
            assert await holder.acquire()
            await until(_true(lambda: len(renewals) == 1), 5, "one renewal")
            await until(_true(lambda: holder.deadline - holder.clock() > TTL / 3), 5,
                        "the renewal granted")
            # "stopped" past every deadline a renewal sent so far can grant, the one
            # still on its way included (a loaded machine sends the next before this)
            stopped_at = time.monotonic()
            jump[0] = max(renewals) + TTL + 0.05 - stopped_at
            await asyncio.wait_for(lost.event.wait(), TTL + 3)
            assert not holder.held
            assert [r for r in renewals if r >= stopped_at] == []  # nothing sent after it
            assert "no lease renewal granted" in lost.calls[0][1]
            other = LeaseHolder(b, key, "b", ttl=TTL, on_lost=Lost())
            taken_at = await until(other.acquire, TTL + 5, "the second holder takes the key",
                                   every=0.05)
            # the key went with the last lease granted before the stop (etcd revokes
            # within its 0.5 s check; 1 s more for a loaded machine)
            assert taken_at < max(renewals) + TTL + 1.5
            await other.release()

    run(main())


def test_partitioned_holder_stops_before_another_takes_the_key(etcd: EtcdServer) -> None:
    """The holder's link to etcd is cut (a black hole); etcd keeps serving the other
    node, whose polling takes the key as soon as etcd expires the lease."""

    async def main() -> None:
        key = prefix() + "/primary"
        lost = Lost()
        link = await LinkProxy(etcd.port).start()
        try:
            async with EtcdClient([link.url], timeout=0.5) as a, \
                    EtcdClient([etcd.url], timeout=1) as b:
                holder = LeaseHolder(a, key, "a", ttl=TTL, on_lost=lost)
                assert await holder.acquire()
                first = holder.last_renewal_sent
                await until(_true(lambda: holder.last_renewal_sent > first), 5, "a renewal")
                link.block()
                other = LeaseHolder(b, key, "b", ttl=TTL, on_lost=Lost())
                attempts: list[float] = []

                async def attempt() -> bool:
                    attempts.append(time.monotonic())
                    return await other.acquire()

                taken_at = await until(attempt, TTL + 5, "the other node takes the key",
                                       every=0.02)
                assert len(lost.calls) == 1, "the holder did not fence itself"
                lost_at, last = lost.calls[0][0], holder.last_renewal_sent
                # it stopped before the winning attempt even started, and before etcd
                # could expire its lease
                assert lost_at < attempts[-1] and lost_at < last + TTL <= taken_at
                assert len(attempts) > 1  # the key was not free while the holder served
                kv = await b.get(key)
                assert kv is not None and kv.value == b"b"
                await other.release()
                await holder.close()
        finally:
            await link.close()

    run(main())


def _true(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return predicate()

    return check


def test_a_renewal_that_says_expired_calls_on_lost(etcd: EtcdServer) -> None:
    async def main() -> None:
        lost = Lost()
        async with EtcdClient([etcd.url], timeout=1) as client:
            holder = LeaseHolder(client, prefix() + "/primary", "a", ttl=TTL, on_lost=lost)
            assert await holder.acquire()
            assert holder.lease_id is not None
            await client.revoke(holder.lease_id)  # e.g. an operator revoked it
            await asyncio.wait_for(lost.event.wait(), TTL)
            assert [reason for _, reason in lost.calls] == ["etcd says the lease has expired"]
            assert not holder.held

    run(main())


def test_release_frees_the_key_at_once(etcd: EtcdServer) -> None:
    async def main() -> None:
        key = prefix() + "/primary"
        lost = Lost()
        async with EtcdClient([etcd.url], timeout=1) as client:
            holder = LeaseHolder(client, key, "a", ttl=TTL, on_lost=lost)
            assert await holder.acquire()
            other = LeaseHolder(client, key, "b", ttl=TTL, on_lost=Lost())
            assert await other.acquire() is False
            await holder.release()
            assert await client.get(key) is None
            assert await other.acquire() is True
            assert lost.calls == [] and not holder.held
            await other.release()

    run(main())


def test_best_candidate_rule() -> None:
    board = [Progress("n1", 10, True), Progress("n2", 12, True), Progress("n3", 15, False)]
    assert best_candidate(board) == "n2"
    assert best_candidate(board, ready_nodes={"n1", "n3"}) == "n1"
    assert best_candidate([*board, Progress("n0", 12, True)]) == "n0"  # tie: smallest name
    assert best_candidate([Progress("n3", 15, False)]) is None
    assert best_candidate([]) is None


def test_progress_board_and_promotion(etcd: EtcdServer) -> None:
    async def main() -> None:
        base = prefix()
        async with EtcdClient([etcd.url], timeout=1) as client:
            n1 = Candidate(client, base, "n1", ttl=TTL, on_lost=Lost())
            n2 = Candidate(client, base, "n2", ttl=TTL, on_lost=Lost())
            n3 = Candidate(client, base, "n3", ttl=TTL, on_lost=Lost())
            await n1.board.publish(10, ready=True)
            await n2.board.publish(12, ready=True)
            await n3.board.publish(15, ready=False)
            board = await n1.board.read()
            assert board == {"n1": Progress("n1", 10, True), "n2": Progress("n2", 12, True),
                             "n3": Progress("n3", 15, False)}
            assert best_candidate(board.values()) == "n2"
            assert await n1.primary() is None
            assert await n3.try_take() is False  # not ready: never
            assert await n1.try_take() is False  # not the best, the key only just free
            assert await n2.try_take() is True
            assert await n1.primary() == "n2"
            assert await n1.try_take() is False
            # the best one steps down and stops publishing; n1 becomes the best
            await n2.holder.release()
            await n2.board.close()
            assert set(await n1.board.read()) == {"n1", "n3"}
            assert await n1.try_take() is True
            assert await n3.primary() == "n1"
            for candidate in (n1, n2, n3):
                await candidate.holder.release()
                await candidate.close()

    run(main())


def test_a_ready_backup_takes_over_when_the_best_does_not(etcd: EtcdServer) -> None:
    async def main() -> None:
        base = prefix()
        async with EtcdClient([etcd.url], timeout=1) as client:
            n1 = Candidate(client, base, "n1", ttl=TTL, on_lost=Lost())
            best = ProgressBoard(client, base, "n2", ttl=TTL)  # alive, but never takes
            await n1.board.publish(10, ready=True)
            await best.publish(12, ready=True)
            first = time.monotonic()
            assert await n1.try_take() is False
            taken = await until(n1.try_take, TTL + 3, "n1 takes the key", every=0.1)
            assert taken - first >= TTL
            assert await n1.primary() == "n1"
            await n1.holder.release()
            await n1.close()
            await best.close()
            assert await client.get(primary_key(base)) is None

    run(main())
