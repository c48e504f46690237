"""The outbox: the effects the core leaves for its edge, and the open record group.

Theory of operation
-------------------
Every part of the core (``core/broker.py`` lists them) writes through one
:class:`Outbox`. It gathers effects in order — records to append, replies,
deliveries, bodies to release — until the edge drains them with
:meth:`Outbox.take` and carries them out.

**Record groups.** Plain persistent sends and acks of one batch of commands
are not written one record each: they wait in the open group
(:attr:`Outbox.group`), and closing the group writes them as ONE record (one
store entry, one checksum, one completion). The group is closed by
:meth:`take`, and before any other record is appended (the log stays in
command order). Closing it is the delivery part's job (it knows how to make
the messages visible): it installs itself as :attr:`Outbox.close_group`.

**Store failure.** Once the store reports a failure, :attr:`failed` holds it
and no part takes another write (:meth:`check_writable`).

**Time.** Durable callbacks carry no time; the edge sets :attr:`now` before
running them (:meth:`set_now`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from txbroker.core.effects import Effect, Fail, Persist, Reply
from txbroker.core.messages import Message
from txbroker.core.records import Record
from txbroker.errors import StorageFailed

#: What a part passes as ``on_durable``: called with ``None`` once durable, else the error.
OnDurable = Callable[[BaseException | None], None]


@dataclass(slots=True, init=False)  # its own __init__: compiled (a generated one is not)
class RecordGroup:
    """The open record group: plain sends and acks waiting to be written as one record."""

    adds: list[Message] = field(default_factory=list)
    acks: list[Message] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)  #: sent when the group is durable

    def __init__(self, adds: list[Message] | None = None, acks: list[Message] | None = None,
                 replies: list[Reply] | None = None) -> None:
        self.adds = [] if adds is None else adds
        self.acks = [] if acks is None else acks
        self.replies = [] if replies is None else replies

    def __bool__(self) -> bool:
        return bool(self.adds or self.acks)


class Outbox:
    """Effects for the edge, the open record group, the store's failure and the time."""

    def __init__(self) -> None:
        self.items: list[Effect] = []
        self.group = RecordGroup()
        self.failed: BaseException | None = None  #: the store failed: no more writes
        self.now = 0  #: the latest time the edge told the core
        #: writes the open group as one record (installed by the delivery part)
        self.close_group: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ effects
    def emit(self, effect: Effect) -> None:
        """Queue one effect for the edge."""
        self.items.append(effect)

    def take(self) -> list[Effect]:
        """Every effect produced since the last call, in order (closes the record group)."""
        if self.group:
            self.close_group()
        items, self.items = self.items, []
        return items

    def write(self, record: Record, on_durable: OnDurable,
              bodies: list[bytes] | None = None,
              on_refs: Callable[[list[int]], None] | None = None) -> None:
        """Append one record (after the open group, to keep the log in command order)."""
        self.check_writable()
        if self.group:
            self.close_group()
        self.items.append(Persist(record.kind, record.encode(), bodies or [], on_durable,
                                  on_refs))

    def reply_later(self, session: int, rid: int, result: Any) -> None:
        """Answer ``rid`` when the open record group is durable."""
        self.group.replies.append(Reply(session, rid, result))

    def reply_when_durable(self, session: int, rid: int, result: Any) -> OnDurable:
        """An ``on_durable`` that answers ``rid`` with ``result`` (or the store's error)."""
        def done(error: BaseException | None) -> None:
            if error is not None:
                self.storage_failed(error)
                self.items.append(Fail(session, rid, StorageFailed(str(error))))
            else:
                self.items.append(Reply(session, rid, result))

        return done

    # ------------------------------------------------------------------ failure, time
    def storage_failed(self, error: BaseException) -> None:
        """Remember the store's first failure: no part takes another write."""
        if self.failed is None:
            self.failed = error

    def ignore_durable(self, error: BaseException | None) -> None:
        """``on_durable`` of a record nobody waits for (its failure still stops writes)."""
        if error is not None:
            self.storage_failed(error)

    def check_writable(self) -> None:
        """Raise StorageFailed once the store has failed."""
        if self.failed is not None:
            raise StorageFailed(f"the store failed, the broker takes no writes: {self.failed}")

    def set_now(self, now: int) -> None:
        """The edge tells the core the time (before running durable callbacks)."""
        self.now = max(self.now, now)


__all__ = ["OnDurable", "Outbox", "RecordGroup"]
