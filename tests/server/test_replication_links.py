"""The primary's hub drives each backup's link through the table of
``core/ha/backup_link.py``: in memory, no broker, no socket (a fake writer records
the frames, a fake port runs completions at once). What the table says happens to
the link's state, to the frames the backup gets and to the entries waiting for it."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from txbroker.core.ha.backup_link import LinkInput, LinkState
from txbroker.errors import ReplicaVoteFailed
from txbroker.protocol import replication as link
from txbroker.server.ha.attached import AttachedBackup
from txbroker.server.ha.replication import ReplicationHub


class Transport:
    def get_write_buffer_size(self) -> int:
        return 0


class Writer:
    """What the hub uses of an asyncio StreamWriter."""

    def __init__(self) -> None:
        self.frames: list[link.LinkMessage] = []
        self.closed = False
        self.transport = Transport()

    def write(self, data: bytes) -> None:
        self.frames.extend(link.ReplicationCodec().receive_data(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def types(self) -> list[str]:
        return [f.type for f in self.frames]


class Port:
    """The server as the hub sees it: completions run at once."""

    broker: Any = None

    def __init__(self) -> None:
        self.completions = 0

    def complete(self, completions: Any) -> None:
        self.completions += 1
        completions()

    def hold_input(self, held: bool) -> None:
        raise AssertionError("no dump in these tests")

    def after_turn(self, callback: Any) -> None:
        callback()  # no loop: every turn is one call (the frames' order is what counts)


def attach(hub: ReplicationHub, node: str = "b") -> tuple[AttachedBackup, Writer]:
    """A backup resumed at the hub's LSN: catching-up at once (rule 1)."""
    writer = Writer()
    backup = AttachedBackup(node, "test", cast(Any, writer))
    hub.backups[node] = backup
    hub.feed(backup, LinkInput.RESUME)
    return backup, writer


def entry(hub: ReplicationHub, outcomes: list[BaseException | None]) -> int:
    lsn = hub.begin(4, b"meta", [b"body"], outcomes.append)
    hub.local_durable(lsn, None)
    return lsn


def ack(hub: ReplicationHub, backup: AttachedBackup, lsn: int) -> None:
    hub._on_message(backup, link.LinkMessage("ack", {"lsn": lsn}))


def test_an_ack_within_the_lag_makes_a_backup_ready_and_entries_then_wait_for_it() -> None:
    hub = ReplicationHub(cast(Any, Port()), "a", backup_timeout=1.0, catchup_bytes=0)
    backup, writer = attach(hub)
    outcomes: list[BaseException | None] = []
    first = entry(hub, outcomes)
    assert outcomes == [None]  # catching up: nobody waited for it
    ack(hub, backup, first)
    assert backup.state is LinkState.READY and hub.ready_names() == ["b"]
    assert writer.types() == ["entries", "state"] and writer.frames[1].body == {"ready": True}
    second = entry(hub, outcomes)
    assert outcomes == [None] and len(hub.pending) == 1  # waits for b's ack
    ack(hub, backup, second)
    assert outcomes == [None, None] and not hub.pending


def test_a_ready_backup_dropped_without_a_recorder_is_gone_and_releases_the_entries() -> None:
    hub = ReplicationHub(cast(Any, Port()), "a", backup_timeout=1.0, catchup_bytes=0)
    backup, writer = attach(hub)
    outcomes: list[BaseException | None] = []
    ack(hub, backup, entry(hub, outcomes))
    entry(hub, outcomes)
    assert len(outcomes) == 1
    hub.drop(backup, "test")
    assert backup.state is LinkState.DROPPED and writer.closed and "b" not in hub.backups
    assert outcomes == [None, None] and backup.reason == "test"
    hub.drop(backup, "again")  # rule 19: nothing changes
    assert backup.reason == "test"


def test_a_fail_vote_on_a_prepare_fails_it_and_drops_the_backup() -> None:
    hub = ReplicationHub(cast(Any, Port()), "a", backup_timeout=1.0, catchup_bytes=0)
    backup, _ = attach(hub)
    outcomes: list[BaseException | None] = []
    ack(hub, backup, entry(hub, outcomes))
    lsn = hub.begin(11, b"meta", [], outcomes.append)  # an XA_PREPARE
    hub.local_durable(lsn, None)
    hub._on_message(backup, link.LinkMessage("vote", {"lsn": lsn, "reason": "disk"}))
    assert backup.state is LinkState.DROPPED
    assert isinstance(outcomes[1], ReplicaVoteFailed) and "backup b voted fail" in str(
        outcomes[1])


def test_with_a_recorder_a_dropped_backup_is_waited_for_until_the_set_is_recorded() -> None:
    async def scenario() -> None:
        hub = ReplicationHub(cast(Any, Port()), "a", backup_timeout=1.0, catchup_bytes=0)
        recorded: list[list[str]] = []
        release = asyncio.Event()

        async def record(names: list[str]) -> None:
            await release.wait()
            recorded.append(names)

        backup, writer = attach(hub)
        outcomes: list[BaseException | None] = []
        ack(hub, backup, entry(hub, outcomes))
        hub.on_ready_change = record
        entry(hub, outcomes)
        hub.drop(backup, "link closed")
        assert backup.state is LinkState.LEAVING and writer.closed
        assert len(outcomes) == 1  # still waited for: the smaller set is not recorded
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert backup.state is LinkState.DROPPED and outcomes == [None, None]
        assert [] in recorded
        hub.close()

    asyncio.run(scenario())


def test_a_late_backup_whose_link_ends_while_demoting_is_dropped_once_recorded() -> None:
    """Rule 18: before the tables a backup dropped while leaving for lateness stayed
    attached (catching-up, its link open) until it joined again."""
    async def scenario() -> None:
        hub = ReplicationHub(cast(Any, Port()), "a", backup_timeout=1.0, catchup_bytes=0)
        release = asyncio.Event()

        async def record(names: list[str]) -> None:
            await release.wait()

        backup, writer = attach(hub)
        outcomes: list[BaseException | None] = []
        ack(hub, backup, entry(hub, outcomes))
        hub.on_ready_change = record
        hub.feed(backup, LinkInput.LATE, reason="late")
        assert backup.state is LinkState.DEMOTING and not writer.closed
        hub.drop(backup, "link closed")
        assert backup.state is LinkState.LEAVING and writer.closed
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert backup.state is LinkState.DROPPED and "b" not in hub.backups
        hub.close()

    asyncio.run(scenario())


def test_a_late_backup_without_a_recorder_catches_up_unwaited_and_is_told() -> None:
    hub = ReplicationHub(cast(Any, Port()), "a", backup_timeout=1.0, catchup_bytes=0)
    backup, writer = attach(hub)
    outcomes: list[BaseException | None] = []
    ack(hub, backup, entry(hub, outcomes))
    entry(hub, outcomes)
    assert len(outcomes) == 1
    hub.feed(backup, LinkInput.LATE, reason="late")
    assert backup.state is LinkState.CATCHING_UP and backup.reason == "late"
    assert writer.frames[-1].type == "state" and writer.frames[-1].body == {"ready": False}
    assert outcomes == [None, None]  # nobody waits for it any more


class TurnPort(Port):
    """A port whose loop turns the test ends by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.turn_ends: list[Any] = []

    def after_turn(self, callback: Any) -> None:
        self.turn_ends.append(callback)

    def end_turn(self) -> None:
        callbacks, self.turn_ends = self.turn_ends, []
        for callback in callbacks:
            callback()


class CountingWriter(Writer):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        super().write(data)


def test_a_turns_entries_reach_a_backup_in_two_writes_in_order() -> None:
    """The turn's first entry goes at once, the rest together when the turn ends; a
    frame written directly (a heartbeat, a ready-set record) goes after the held ones."""
    port = TurnPort()
    hub = ReplicationHub(cast(Any, port), "a", backup_timeout=1.0, catchup_bytes=0)
    writer = CountingWriter()
    backup = AttachedBackup("b", "test", cast(Any, writer))
    hub.backups["b"] = backup
    hub.feed(backup, LinkInput.RESUME)
    port.end_turn()
    writes = writer.writes
    lsns = [hub.begin(4, b"meta", [b"body %d" % n], lambda error: None) for n in range(5)]
    assert writer.writes == writes + 1  # the first, at once
    assert [f.body[0][0] for f in writer.frames if f.type == "entries"] == lsns[:1]
    port.end_turn()
    assert writer.writes == writes + 2  # the other four in one write
    assert [f.body[0][0] for f in writer.frames if f.type == "entries"] == lsns
    # next turn: two entries, then a heartbeat: the held entry goes before it
    more = [hub.begin(4, b"meta", [b"x"], lambda error: None) for _ in range(2)]
    backup.send_now(link.encode("heartbeat", {}))
    assert writer.types()[-3:] == ["entries", "entries", "heartbeat"]
    assert [f.body[0][0] for f in writer.frames if f.type == "entries"][-2:] == more
    port.end_turn()
    assert writer.types()[-1] == "heartbeat"  # nothing was left to write
