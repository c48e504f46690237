"""Pipelined sends coalesced into send_batch requests (client/_coalesce.py), against the
real broker in memory (tests/inmemory.py), whose wire log shows every request as it
arrived."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.inmemory import InMemoryNetwork, Node, run

import txbroker.aio
from txbroker.client._coalesce import MAX_BODY, MAX_MESSAGES
from txbroker.errors import QuotaExceeded

pytestmark = pytest.mark.timeout(30)


def sends(server: Node) -> list[tuple[str, Any]]:
    """The send requests the broker got: (op, dest and the bodies)."""
    out: list[tuple[str, Any]] = []
    for request in [request for _, request in server.log.requests]:
        op, args = request.op, request.args
        if op == "send":
            out.append((op, (args["dest"], [args["body"]])))
        elif op == "send_batch":
            out.append((op, (args["dest"], list(args["bodies"]))))
    return out


def bodies(server: Node, queue: str) -> list[bytes]:
    return server.bodies(queue)


def test_one_loop_turn_becomes_one_batch_per_run_of_a_destination() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            futures = [conn.send_nowait("a", b"a%d" % i) for i in range(10)]
            futures += [conn.send_nowait("b", b"b%d" % i) for i in range(5)]
            futures += [conn.send_nowait("a", b"a%d" % i) for i in range(10, 13)]
            assert await asyncio.gather(*futures) == [None] * 18
            assert sends(server) == [
                ("send_batch", ("a", [b"a%d" % i for i in range(10)])),
                ("send_batch", ("b", [b"b%d" % i for i in range(5)])),
                ("send_batch", ("a", [b"a%d" % i for i in range(10, 13)])),
            ]
            assert bodies(server, "a") == [b"a%d" % i for i in range(13)]
            await conn.send_nowait("c", b"alone")  # a lone message: a plain send
            assert sends(server)[-1] == ("send", ("c", [b"alone"]))

    run(main)


def test_any_other_request_flushes_the_sends_before_it() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            pending = [conn.send_nowait("q", b"%d" % i) for i in range(3)]
            message = await conn.receive("q", timeout=1)  # written after the 3 sends
            assert message is not None and message.body == b"0"
            await asyncio.gather(*pending)
            ops = [op for op in server.log.names() if op in ("send_batch", "receive")]
            assert ops[:2] == ["send_batch", "receive"]
            # a send with options the batch does not carry goes alone, in its place
            futures = [conn.send_nowait("p", b"0"), conn.send_nowait("p", b"1", priority=7),
                       conn.send_nowait("p", b"2"), conn.send_nowait("p", b"3")]
            await asyncio.gather(*futures)
            assert sends(server)[-3:] == [("send", ("p", [b"0"])), ("send", ("p", [b"1"])),
                                          ("send_batch", ("p", [b"2", b"3"]))]

    run(main)


def test_ids_and_headers_travel_per_message() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            futures = [conn.send_nowait("h", b"%d" % i, message_id=f"m{i % 3}",
                                        headers={"n": str(i)} if i % 2 else None)
                       for i in range(5)]
            await asyncio.gather(*futures)
            (args,) = server.log.ops("send_batch")
            assert args["message_ids"] == ["m0", "m1", "m2", "m0", "m1"]
            assert args["headers"] == [None, {"n": "1"}, None, {"n": "3"}, None]
            stored = server.running.broker.queue_browse("h", 10)
            assert [(server.running.body(m), m.message_id, m.headers or {}) for m in stored] == [
                (b"0", "m0", {}), (b"1", "m1", {"n": "1"}), (b"2", "m2", {})]

    run(main)


def test_batches_are_capped_and_big_bodies_go_alone() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            count = 2 * MAX_MESSAGES + 88
            await asyncio.gather(*[conn.send_nowait("cap", b"%d" % i) for i in range(count)])
            sizes = [len(b) for op, (_dest, b) in sends(server) if op == "send_batch"]
            assert sizes == [MAX_MESSAGES, MAX_MESSAGES, 88]
            assert bodies(server, "cap") == [b"%d" % i for i in range(count)]
            big = b"x" * (MAX_BODY + 1)
            await asyncio.gather(conn.send_nowait("big", b"1"), conn.send_nowait("big", big),
                                 conn.send_nowait("big", b"2"))
            assert [op for op, _ in sends(server)[-3:]] == ["send", "send", "send"]

    run(main)


def test_a_refused_batch_fails_every_message_of_it() -> None:
    async def main(net: InMemoryNetwork) -> None:
        server = await net.broker()
        async with txbroker.aio.connect(server.url, transport=net) as conn:
            await conn.declare_queue("full", max_messages=2)
            futures = [conn.send_nowait("full", b"%d" % i) for i in range(3)]
            results = await asyncio.gather(*futures, return_exceptions=True)
            assert [type(r) for r in results] == [QuotaExceeded] * 3
            assert bodies(server, "full") == []
            await conn.send("full", b"ok")  # the connection goes on
            assert bodies(server, "full") == [b"ok"]

    run(main)
