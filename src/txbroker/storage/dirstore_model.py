"""How the directory store reads the broker's records: operations and metadata.

Theory of operation
-------------------
A journal keeps entries opaque; the directory store cannot, because it keeps
*state* (one file per stored message), not a log. :func:`decode_operation`
turns one entry (``kind``, ``meta``, ``bodies`` as ``records.py`` defines
them) into an :class:`Operation`: messages to add, messages to delete,
header updates, and metadata changes. It validates everything and changes
nothing, so a malformed entry is refused with ``ValueError`` before the
store's state moves.

:class:`MetadataModel` is the part of the broker's state that is not in
message files — queue and topic definitions, duplicate-id windows, the next
message id — kept exactly as ``core/replay.py`` would rebuild it by
replaying the same records (snapshot replacement, implicit queues, the
insertion-ordered, bounded duplicate-id window). The store writes it as the
METADATA block ``DIR/metadata`` and hands it back as one ``SNAPSHOT`` entry.

XA records become a :class:`BranchPrepare` (``XA_PREPARE``) or
:class:`BranchResolve` outcomes (``XA_COMMIT``, ``XA_ROLLBACK``,
``XA_HEURISTIC``, ``XA_FORGET``, and each branch of a ``SINK_COMMIT``, whose
last batch id goes into the metadata's ``sinks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.errors import XAError
from txbroker.xid import Xid

#: Ids remembered per queue for duplicate detection when a definition does not
#: say: must equal ``txbroker.core.queue_settings.DEFAULT_DUP_WINDOW`` (a test checks;
#: the storage layer does not import the core).
DEFAULT_DUP_WINDOW: Final = 20_000

#: msg positions an UPDATE replaces (as ``core/replay.py`` replays them).
_UPDATE_FIELDS: Final = (records.MSG_DELIVERY_COUNT, records.MSG_DELIVER_AT)
#: Key of an UPDATE patch that is not a msg position: the queue a MOVE sends the
#: message to (``msg`` keeps the queue it was sent to, whose duplicate-id window
#: holds its client id, exactly as a replayed ADD + MOVE would).
PATCH_MOVED_TO: Final = -1


def unpack_message_info(info: bytes) -> tuple[list[Any], str | None]:
    """``(msg, moved-to queue or None)`` of a message file's info: the ``msg``
    tuple, or ``[msg, queue]`` once the message was moved to another queue."""
    value = records.unpack(info)
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
        return value[0], value[1]
    return value, None


def pack_message_info(msg: list[Any], moved_to: str | None) -> bytes:
    """The inverse of :func:`unpack_message_info`."""
    return records.pack(msg if moved_to is None else [msg, moved_to])


def apply_patch(info: bytes, patch: dict[int, Any]) -> bytes:
    """A message file's info with an UPDATE block's patch applied."""
    msg, moved_to = unpack_message_info(info)
    for position, value in patch.items():
        if position == PATCH_MOVED_TO:
            moved_to = value
        elif position < len(msg):
            msg[position] = value
        else:  # a seq for a message written before seqs existed
            msg.extend([0] * (position - len(msg)) + [value])
    return pack_message_info(msg, moved_to)


#: How a RESOLVE block completes a prepared XA branch.
COMMIT: Final = "commit"
ROLLBACK: Final = "rollback"
HEURISTIC_COMMIT: Final = "heuristic-commit"
HEURISTIC_ROLLBACK: Final = "heuristic-rollback"
FORGET: Final = "forget"
#: The state a branch's first block records while it waits for its outcome.
PREPARED_STATE: Final = "prepared"
COMMITTING_OUTCOMES: Final = frozenset({COMMIT, HEURISTIC_COMMIT})
HEURISTIC_OUTCOMES: Final = frozenset({HEURISTIC_COMMIT, HEURISTIC_ROLLBACK})


#: One message an entry adds: its ``msg``, its info (the packed msg) and its body.
Send = tuple[list[Any], bytes, bytes]


@dataclass(slots=True)
class BranchPrepare:
    """An ``XA_PREPARE``: the whole content of a branch being prepared."""

    xid: str  #: the Xid's text form
    sends: list[Send]  #: msg, info, body
    consumed: list[tuple[int, int]]  #: message id, delivery count
    discards: list[int]
    created_ms: int
    prepared_ms: int


@dataclass(slots=True)
class BranchResolve:
    """The outcome of a prepared branch (``XA_COMMIT``, ``XA_ROLLBACK``,
    ``XA_HEURISTIC``, ``XA_FORGET``, or one branch of a ``SINK_COMMIT``)."""

    xid: str
    outcome: str  #: COMMIT, ROLLBACK, HEURISTIC_COMMIT, HEURISTIC_ROLLBACK or FORGET
    seqs: list[list[int]] = field(default_factory=list)  #: [[id, seq]…] of committed sends
    discards: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Operation:
    """What one entry asks of the store (see the module docstring)."""

    adds: list[Send] = field(default_factory=list)  #: msg, info, body
    deletes: list[int] = field(default_factory=list)
    updates: list[tuple[int, dict[int, Any], str | None]] = field(default_factory=list)
    move_target: str | None = None  #: a MOVE's target queue (replay creates it)
    put: dict[str, Any] | None = None  #: a queue or topic definition
    delete_queue: str | None = None
    snapshot: records.Snapshot | None = None
    prepare: BranchPrepare | None = None  #: an XA branch to prepare
    resolves: list[BranchResolve] = field(default_factory=list)  #: XA branches to complete
    sink: tuple[str, int] | None = None  #: a SINK_COMMIT's sink and last batch id


def _xid(value: str) -> str:
    Xid.parse(value)  # XAError when malformed (decode_operation makes it a ValueError)
    return value


def _sends(msgs: list[list[Any]], bodies: list[bytes], what: str) -> list[Send]:
    """Each ``msg`` with its info (the msg packed alone) and its body."""
    if len(msgs) != len(bodies):
        raise ValueError(f"{what} has one body per message sent")
    for msg in msgs:
        if msg[records.MSG_ID] <= 0:
            raise ValueError("a msg's id is positive")
    return [(msg, records.pack(msg), body) for msg, body in zip(msgs, bodies, strict=True)]


def _decode_xa(record: Any, bodies: list[bytes], op: Operation) -> None:
    """The XA kinds (records.py 11–16) of :func:`decode_operation`."""
    if isinstance(record, records.XaPrepare):
        op.prepare = BranchPrepare(
            _xid(record.xid), _sends(record.sends, bodies, "an XA_PREPARE"),
            [(pair[0], pair[1]) for pair in record.consumed], record.discards,
            record.created_ms, record.prepared_or_created)
        return
    if bodies:
        raise ValueError(f"record kind {record.kind} carries no bodies")
    if isinstance(record, records.XaCommit):
        op.resolves.append(BranchResolve(_xid(record.xid), COMMIT, record.seqs or [],
                                         record.discards))
    elif isinstance(record, records.XaRollback):
        op.resolves.append(BranchResolve(_xid(record.xid), ROLLBACK))
    elif isinstance(record, records.XaHeuristic):
        commit = record.commit
        op.resolves.append(BranchResolve(
            _xid(record.xid), HEURISTIC_COMMIT if commit else HEURISTIC_ROLLBACK,
            (record.seqs or []) if commit else [], record.discards if commit else []))
    elif isinstance(record, records.XaForget):
        op.resolves.append(BranchResolve(_xid(record.xid), FORGET))
    elif isinstance(record, records.SinkCommit):
        for branch in record.commits:
            op.resolves.append(BranchResolve(_xid(branch.xid), COMMIT, branch.seqs,
                                             branch.discards or []))
        for xid in record.rollbacks:
            op.resolves.append(BranchResolve(_xid(xid), ROLLBACK))
        op.sink = (record.sink, record.last_batch)


def decode_operation(kind: int, meta: bytes, bodies: list[bytes]) -> Operation:
    """The operation an entry asks for; ``ValueError`` (``MalformedRecord`` for a record
    that does not decode as its kind) if the store cannot take it."""
    if kind in (Kind.RELOCATE, Kind.RELOCATE_MANY):
        raise ValueError("the dir store never asks for relocation (RELOCATE)")
    record = records.decode(kind, meta)
    op = Operation()
    try:
        if isinstance(record, records.Add):
            if len(bodies) != 1:
                raise ValueError(f"an ADD has exactly one body, not {len(bodies)}")
            _sends([record.msg], bodies, "an ADD")  # (checks it)
            op.adds = [(record.msg, meta, bodies[0])]  # its info: the meta as it came
            return op
        if isinstance(record, records.Tx):
            op.adds = _sends(record.adds, bodies, "a TX")
            op.deletes = record.acks
            return op
        if Kind.XA_PREPARE <= kind <= Kind.SINK_COMMIT:
            _decode_xa(record, bodies, op)
            return op
        if bodies:
            raise ValueError(f"record kind {kind} carries no bodies")
        if isinstance(record, (records.Ack, records.Drop)):
            op.deletes = record.ids
        elif isinstance(record, records.Move):
            target = record.queue
            seqs = record.seqs if record.seqs is not None else [0] * len(record.ids)
            op.updates = [(message_id, {PATCH_MOVED_TO: target, records.MSG_EXPIRES: 0,
                                        records.MSG_DELIVER_AT: 0, records.MSG_SEQ: seq}, target)
                          for message_id, seq in zip(record.ids, seqs, strict=True)]
            op.move_target = target
        elif isinstance(record, records.Update):
            op.updates = [(record.id, dict(zip(
                _UPDATE_FIELDS, (record.delivery_count, record.deliver_at_ms), strict=True)),
                None)]
        elif isinstance(record, records.QueuePut):
            op.put = record.definition
        elif isinstance(record, records.QueueDelete):
            op.delete_queue = record.name
        elif isinstance(record, records.Snapshot):
            op.snapshot = record
    except XAError as exc:
        raise ValueError(f"malformed meta of record kind {kind}: {exc}") from exc
    return op


class MetadataModel:
    """The broker's metadata as replay would rebuild it (see the module docstring)."""

    def __init__(self) -> None:
        #: The next message id to hand back (the store keeps it ahead of every id used).
        self.next_id = 1
        self.definitions: dict[str, dict[str, Any]] = {}
        self.dups: dict[str, dict[str, None]] = {}
        #: The Spark sinks' last committed batch ids (SINK_COMMIT).
        self.sinks: dict[str, int] = {}

    def pack(self) -> bytes:
        """The SNAPSHOT meta of this state (the METADATA block's info)."""
        return records.Snapshot(
            self.next_id, self.definitions,
            {name: list(ids) for name, ids in self.dups.items() if ids}, None,
            self.sinks or None).encode()

    def set_sink(self, sink: str, last: int) -> None:
        """A sink committed batch ``last`` (batch ids only grow, as in replay)."""
        self.sinks[sink] = max(self.sinks.get(sink, -1), last)

    def apply_snapshot(self, snapshot: records.Snapshot) -> list[str]:
        """Replace the state by a snapshot; return the queues it deleted."""
        self.next_id = max(self.next_id, snapshot.next_id)
        definitions = snapshot.queues
        gone = [name for name in self.definitions if name not in definitions]
        deleted = [name for name in gone if self.delete(name)]  # (all of them were known)
        for definition in definitions.values():
            self.put(definition)
        for sink, last in (snapshot.sinks or {}).items():
            self.set_sink(sink, last)
        for name, ids in snapshot.dups.items():
            if self.definitions.get(name, {}).get("kind") == "queue":
                for message_id in ids:
                    self.remember(name, message_id)
        return deleted

    def put(self, definition: dict[str, Any]) -> None:
        """Declare or update a queue or topic (QUEUE_PUT)."""
        name = definition["name"]
        old = self.definitions.get(name)
        if definition["kind"] == "topic":
            if old is None or old["kind"] != "topic":
                self.definitions[name] = definition
            return
        if old is not None and old.get("topic") and not definition.get("topic"):
            definition = {**definition, "topic": old["topic"]}  # replay keeps the topic
        self.definitions[name] = definition

    def delete(self, name: str) -> bool:
        """Forget a queue or topic (QUEUE_DELETE); False if it was a topic, True
        otherwise (the messages of a queue of that name go too)."""
        definition = self.definitions.pop(name, None)
        self.dups.pop(name, None)
        return definition is None or definition["kind"] == "queue"

    def ensure_queue(self, name: str) -> bool:
        """A message names ``name``: replay would create it. True if it was new."""
        if name in self.definitions:
            return False
        self.definitions[name] = {"name": name, "kind": "queue", "topic": None, "settings": {}}
        return True

    def remember(self, queue: str, message_id: str) -> None:
        """Add a duplicate id to a queue's window, as ``Queue.remember`` does."""
        settings = self.definitions.get(queue, {}).get("settings") or {}
        window = settings.get("dup_window", DEFAULT_DUP_WINDOW)
        if not window:
            return
        ids = self.dups.setdefault(queue, {})
        ids[message_id] = None
        while len(ids) > window:
            del ids[next(iter(ids))]
