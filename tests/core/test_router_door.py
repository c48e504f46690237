"""The broker core's front is the router's only door (issue 26 §3): router commands
go through ``Broker.rtr``; the core itself refuses the router's journal queue
(``$router``) to clients and router messages above ``max_message_size`` — the same
errors the operation layer and the native edge give, which answer first (and audit)
but are no longer the only guard. No I/O (tests/core/harness.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.core.harness import Harness
from txbroker.core import LATER, Limits
from txbroker.core.router.commands import (
    Accept,
    Collected,
    Define,
    Done,
    Outcome,
    Register,
    Send,
    Show,
    Vote,
)
from txbroker.core.router.log import ROUTER_QUEUE
from txbroker.errors import BadRequest, Forbidden

BANK = [{"name": "A", "low": 0, "high": 999}, {"name": "B", "low": 1000, "high": 1999}]


def refusal(destination: str, op: str) -> str:
    """What the operation layer has always answered (server/ops/operations.py)."""
    return (f"forbidden: {destination!r} is the transaction router's journal; clients may "
            f"not use destinations beginning with '$router' ({op})")


def rtr(h: Harness, sid: int, rid: int, command: Any) -> Any:
    result = h.call("rtr", sid, rid, command, h.now)
    return h.replies.get((sid, rid), LATER) if result is LATER else result


def bank(h: Harness) -> tuple[int, int, int]:
    """BANK defined; a client (session 1) and a server of A (session 2)."""
    for sid in (1, 2, 9):
        h.session(sid)
    assert rtr(h, 9, 1, Define("BANK", BANK))["name"] == "BANK"
    client = rtr(h, 1, 2, Register("BANK"))["controller"]
    server = rtr(h, 2, 3, Register("BANK", server=True, partition="A"))["controller"]
    return client, server, h.broker.queues[ROUTER_QUEUE].messages


def test_a_transfer_through_the_door() -> None:
    h = Harness()
    client, server, _ = bank(h)
    assert rtr(h, 1, 10, Send(client, "t1", 5, b"leg", accept=True)) == {"partition": "A"}
    assert rtr(h, 2, 11, Vote(server, "t1", True)) == {}
    assert [(s, b["type"]) for s, b in h.pushes] == [(2, "MSG1"), (2, "ACCEPTED"),
                                                     (1, "ACCEPTED")]
    assert rtr(h, 2, 12, Done(server, "t1")) == {}
    assert rtr(h, 1, 13, Collected(client, ["t1"])) == {}
    assert rtr(h, 9, 14, Show())["facilities"][0]["transactions"] == {
        "SENDING": 0, "VREQ": 0, "COMMITTING": 0, "ABORTING": 0}
    assert h.broker.router_stats()["committed"] == 1
    assert rtr(h, 1, 15, Outcome("t1"))["state"] == "UNKNOWN"  # forgotten: presumed


@pytest.mark.parametrize("name", [ROUTER_QUEUE, "$router.x", "$routers"])
def test_the_core_refuses_the_routers_journal_to_clients(name: str) -> None:
    h = Harness()
    bank(h)
    journal = h.broker.queues[ROUTER_QUEUE].messages
    broker, now = h.broker, h.now
    attempts = [
        ("send", lambda: broker.send(1, 20, name, b"x", now)),
        ("send_batch", lambda: broker.send_batch(1, 21, name, [b"x"], now)),
        ("subscribe", lambda: broker.subscribe(1, 1, name, now)),
        ("receive", lambda: broker.receive(1, 22, name, now, 0)),
        ("stream_open", lambda: broker.stream_open(1, name, "reader")),
        ("declare", lambda: broker.queue_declare(1, 23, name, now)),
        ("topic_subscribe", lambda: broker.topic_subscribe(1, 24, name, "s", now)),
        ("update", lambda: broker.queue_update(1, 25, name, {}, now)),
        ("delete", lambda: broker.queue_delete(1, 26, name, now)),
        ("purge", lambda: broker.queue_purge(1, 27, name, now)),
        ("browse", lambda: broker.queue_browse(name, 10)),
        ("move", lambda: broker.queue_move(1, 28, name, "elsewhere", 10, now)),
        ("move", lambda: broker.queue_move(1, 29, "elsewhere", name, 10, now)),
    ]
    for op, attempt in attempts:
        with pytest.raises(Forbidden) as refused:
            attempt()
        assert refused.value.message == refusal(name, op), op
    h.run()
    assert h.pushes == [] and h.deliveries == [] and not h.pending
    assert h.broker.queues[ROUTER_QUEUE].messages == journal  # untouched
    assert "elsewhere" not in h.broker.queues and name not in h.broker.topics
    assert h.broker.queue_info(ROUTER_QUEUE)["depth"] == journal  # reading info is allowed


def test_the_core_refuses_an_oversized_router_message() -> None:
    h = Harness(limits=Limits(max_message_size=8))
    client, _server, journal = bank(h)
    with pytest.raises(BadRequest) as refused:
        rtr(h, 1, 30, Send(client, "big", 5, b"123456789", accept=True))
    assert refused.value.message == "a router message of 9 bytes is above max_message_size (8)"
    with pytest.raises(BadRequest):  # before anything else: even with no such controller
        rtr(h, 1, 31, Send(999, "big", 5, b"123456789"))
    assert h.pushes == [] and h.broker.router_holds() == []
    assert h.broker.queues[ROUTER_QUEUE].messages == journal
    assert rtr(h, 1, 32, Send(client, "small", 5, b"12345678")) == {"partition": "A"}
    assert rtr(h, 1, 33, Accept(client, "small")) == {}
    assert [b["type"] for _, b in h.pushes] == ["MSG1"]
