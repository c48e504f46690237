"""Holding a client's input (``SessionSink.hold_input``: a replication dump, a recovery
checkpoint) never un-pauses a client that its own pending requests paused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from txbroker.server.edges.amqp.connection import AmqpServerConnection
from txbroker.server.edges.native.connection import ClientConnection
from txbroker.server.edges.stomp.connection import StompServerConnection


class _Transport:
    def __init__(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


@pytest.mark.parametrize("edge", [ClientConnection, StompServerConnection,
                                  AmqpServerConnection])
@pytest.mark.parametrize("paused_for_pending", [False, True])
def test_a_hold_ends_without_resuming_a_client_paused_for_its_requests(
        edge: Any, paused_for_pending: bool) -> None:
    connection = edge.__new__(edge)  # (the sink alone: no broker behind it)
    transport = _Transport()
    connection.transport = transport
    connection.session = SimpleNamespace(reading_paused=paused_for_pending)
    if paused_for_pending:
        transport.pause_reading()
    connection.hold_input(True)
    assert not transport.reading
    connection.hold_input(False)
    assert transport.reading is not paused_for_pending
