"""A tiny edge for core tests: runs effects with an in-memory log, no I/O.

``Harness.sync()`` makes everything appended durable (group commit in one go);
``Harness.crash()`` forgets what was not synced and replays the log into a
fresh Broker, exactly as a restart would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from txbroker.core import LATER, Broker, Limits
from txbroker.core.effects import Cancelled, Continue, Deliver, Fail, Persist, Release, Reply
from txbroker.storage.interface import StoredEntry


@dataclass
class Delivery:
    session: int
    sub: int
    rid: int
    tag: int
    message_id: int
    queue: str
    body: bytes
    redelivered: bool
    delivery_count: int
    headers: dict[str, str] | None


@dataclass
class Harness:
    limits: Limits = field(default_factory=Limits)
    auto_sync: bool = True
    now: int = 1_000_000
    auto_continue: bool = True

    def __post_init__(self) -> None:
        self.broker = Broker(self.limits)
        self.log: list[tuple[int, bytes, list[int]]] = []  # durable entries
        self.pending: list[tuple[Persist, list[int]]] = []
        self.bodies: dict[int, bytes] = {}
        self.released: set[int] = set()
        self.next_ref = 1
        self.replies: dict[tuple[int, int], Any] = {}
        self.errors: dict[tuple[int, int], Exception] = {}
        self.deliveries: list[Delivery] = []
        self.cancelled: list[tuple[int, int]] = []
        self.continues: list[Continue] = []
        self.broker.body_size_of = lambda ref: len(self.bodies[ref])

    # -- running effects ----------------------------------------------------
    def run(self) -> None:
        """Carry out the effects; with ``auto_continue``, run long work (``Continue``)
        to its end as later loop turns would."""
        self._run_effects()
        while self.auto_continue and self.continues:
            self.continues.pop(0).step(self.now)
            self._run_effects()

    def next_turn(self) -> bool:
        """Run one pending ``Continue`` step (a later loop turn); False if none."""
        if not self.continues:
            return False
        self.continues.pop(0).step(self.now)
        self._run_effects()
        return True

    def _run_effects(self) -> None:
        for effect in self.broker.take_effects():
            if isinstance(effect, Persist):
                refs = []
                for body in effect.bodies:
                    ref = self.next_ref
                    self.next_ref += 1
                    self.bodies[ref] = body
                    refs.append(ref)
                if effect.on_refs is not None:
                    effect.on_refs(refs)
                self.pending.append((effect, refs))
            elif isinstance(effect, Reply):
                self.replies[(effect.session, effect.rid)] = effect.result
            elif isinstance(effect, Fail):
                self.errors[(effect.session, effect.rid)] = effect.error
            elif isinstance(effect, Deliver):
                m = effect.message
                body = m.body if m.body is not None else self.bodies[m.ref]  # type: ignore[index]
                d = Delivery(effect.session, effect.sub, effect.rid, effect.tag, m.id, m.queue,
                             body, effect.redelivered, m.delivery_count, m.headers)
                self.deliveries.append(d)
                if effect.rid:
                    self.replies[(effect.session, effect.rid)] = d
            elif isinstance(effect, Release):
                assert effect.ref not in self.released, f"double release of {effect.ref}"
                self.released.add(effect.ref)
            elif isinstance(effect, Cancelled):
                self.cancelled.append((effect.session, effect.sub))
            elif isinstance(effect, Continue):
                self.continues.append(effect)
        if self.auto_sync and self.pending:
            self.sync()

    def sync(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            for effect, refs in batch:
                self.log.append((effect.kind, effect.meta, refs))
            self.broker.set_now(self.now)
            for effect, _ in batch:
                effect.on_durable(None)
            self.run_effects_only()

    def run_effects_only(self) -> None:
        auto, self.auto_sync = self.auto_sync, False
        try:
            self.run()
        finally:
            self.auto_sync = auto

    def fail_pending(self, error: Exception) -> None:
        batch, self.pending = self.pending, []
        for effect, _ in batch:
            effect.on_durable(error)
        self.run_effects_only()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.broker, method)(*args, **kwargs)
        self.run()
        return result

    # -- convenience ----------------------------------------------------------
    def session(self, sid: int = 1) -> int:
        self.broker.open_session(sid)
        return sid

    def send(self, sid: int, rid: int, dest: str, body: bytes, **kw: Any) -> Any:
        result = self.call("send", sid, rid, dest, body, self.now, **kw)
        if result is LATER:
            return self.replies.get((sid, rid), LATER)
        return result

    def receive(self, sid: int, rid: int, queue: str, timeout: int | None = 0) -> Any:
        result = self.call("receive", sid, rid, queue, self.now, timeout)
        if result is LATER:
            return self.replies.get((sid, rid), LATER)
        return result

    def receive_marked(self, sid: int, rid: int, queue: str) -> Any:
        """``receive`` for tests without ``auto_sync``: a delivery the queue's delivered
        mark holds back (core/queue_index.py) goes out after one sync — which also
        makes whatever else is pending durable, so call it with nothing pending."""
        result = self.receive(sid, rid, queue)
        if result is LATER and (sid, rid) not in self.replies and self.pending:
            self.sync()
            result = self.replies.get((sid, rid), LATER)
        return result

    def tick(self, ms: int) -> None:
        self.now += ms
        self.call("tick", self.now)

    def crash(self) -> Harness:
        """A restart: only synced entries survive; replay them into a new broker."""
        fresh = Harness(self.limits, self.auto_sync, self.now)
        fresh.bodies = dict(self.bodies)
        fresh.next_ref = self.next_ref
        fresh.log = list(self.log)
        for kind, meta, refs in self.log:
            fresh.broker.replay(StoredEntry(kind, meta, tuple(refs)))
        fresh.broker.finish_recovery(self.now)
        fresh.released = set()
        fresh.run()
        return fresh

    def live_bodies(self) -> set[int]:
        return {m.ref for m in self.broker.messages.values() if m.ref is not None}
