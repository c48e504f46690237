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
#: say: must equal ``txbroker.core.queues.DEFAULT_DUP_WINDOW`` (a test checks;
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


@dataclass(slots=True)
class BranchPrepare:
    """An ``XA_PREPARE``: the whole content of a branch being prepared."""

    xid: str  #: the Xid's text form
    sends: list[tuple[list[Any], bytes, bytes]]  #: msg, info, body
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

    adds: list[tuple[list[Any], bytes, bytes]] = field(default_factory=list)  #: msg, info, body
    deletes: list[int] = field(default_factory=list)
    updates: list[tuple[int, dict[int, Any], str | None]] = field(default_factory=list)
    move_target: str | None = None  #: a MOVE's target queue (replay creates it)
    put: dict[str, Any] | None = None  #: a queue or topic definition
    delete_queue: str | None = None
    snapshot: dict[str, Any] | None = None
    prepare: BranchPrepare | None = None  #: an XA branch to prepare
    resolves: list[BranchResolve] = field(default_factory=list)  #: XA branches to complete
    sink: tuple[str, int] | None = None  #: a SINK_COMMIT's sink and last batch id


def _xid(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("an XA record names its branch by the Xid's text form")
    Xid.parse(value)  # XAError when malformed (decode_operation makes it a ValueError)
    return value


def _pairs(value: Any) -> list[list[int]]:
    if not isinstance(value, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair)
            for pair in value):
        raise ValueError("expected a list of [int, int] pairs")
    return value


def _decode_xa(kind: int, value: Any, bodies: list[bytes], op: Operation) -> None:
    """The XA kinds (records.py 11–16) of :func:`decode_operation`."""
    if kind == Kind.XA_PREPARE:
        xid, msgs, consumed, discards, created = value[:5]
        prepared = value[5] if len(value) > 5 else created
        if not isinstance(msgs, list) or len(msgs) != len(bodies):
            raise ValueError("an XA_PREPARE has one body per message sent")
        if type(created) is not int or type(prepared) is not int:
            raise ValueError("an XA_PREPARE's times are ints")
        op.prepare = BranchPrepare(
            _xid(xid), [(_msg(msg), records.pack(msg), body)
                        for msg, body in zip(msgs, bodies, strict=True)],
            [(pair[0], pair[1]) for pair in _pairs(consumed)], _ids(discards), created, prepared)
        return
    if bodies:
        raise ValueError(f"record kind {kind} carries no bodies")
    if kind == Kind.XA_COMMIT:
        op.resolves.append(BranchResolve(_xid(value[0]), COMMIT,
                                         _pairs(value[2]) if len(value) > 2 else [],
                                         _ids(value[1])))
    elif kind == Kind.XA_ROLLBACK:
        op.resolves.append(BranchResolve(_xid(value if isinstance(value, str) else value[0]),
                                         ROLLBACK))
    elif kind == Kind.XA_HEURISTIC:
        outcome = value[1]
        if outcome not in ("commit", "rollback"):
            raise ValueError("an XA_HEURISTIC's outcome is commit or rollback")
        commit = outcome == "commit"
        op.resolves.append(BranchResolve(
            _xid(value[0]), HEURISTIC_COMMIT if commit else HEURISTIC_ROLLBACK,
            _pairs(value[3]) if commit and len(value) > 3 else [],
            _ids(value[2]) if commit else []))
    elif kind == Kind.XA_FORGET:
        op.resolves.append(BranchResolve(_xid(value), FORGET))
    elif kind == Kind.SINK_COMMIT:
        sink, last, entries, rollbacks = value[:4]
        if not isinstance(sink, str) or type(last) is not int:
            raise ValueError("a SINK_COMMIT names its sink and last batch id")
        for entry in entries:
            op.resolves.append(BranchResolve(_xid(entry[0]), COMMIT, _pairs(entry[1]),
                                             _ids(entry[2]) if len(entry) > 2 else []))
        for xid in rollbacks:
            op.resolves.append(BranchResolve(_xid(xid), ROLLBACK))
        op.sink = (sink, last)


def _ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ValueError("expected a list of message ids")
    return value


def _msg(value: Any) -> list[Any]:
    if (not isinstance(value, list) or len(value) < records.MSG_FIELDS
            or type(value[records.MSG_ID]) is not int or value[records.MSG_ID] <= 0
            or not isinstance(value[records.MSG_QUEUE], str)
            or not isinstance(value[records.MSG_MESSAGE_ID], str | None)):
        raise ValueError("malformed msg tuple")
    return value


def _definition(value: Any) -> dict[str, Any]:
    if (not isinstance(value, dict) or not isinstance(value.get("name"), str)
            or value.get("kind") not in ("queue", "topic")):
        raise ValueError("malformed queue definition")
    return value


def decode_operation(kind: int, meta: bytes, bodies: list[bytes]) -> Operation:
    """The operation an entry asks for; ``ValueError`` if the store cannot take it."""
    try:
        value = records.unpack(meta)
    except Exception as exc:
        raise ValueError(f"undecodable meta of record kind {kind}: {exc}") from exc
    op = Operation()
    try:
        if kind == Kind.ADD:
            if len(bodies) != 1:
                raise ValueError(f"an ADD has exactly one body, not {len(bodies)}")
            op.adds.append((_msg(value), meta, bodies[0]))
            return op
        if kind == Kind.TX:
            msgs, acks = value[0], value[1]  # (a local transaction adds committed_ms)
            if not isinstance(msgs, list) or len(msgs) != len(bodies):
                raise ValueError("a TX has one body per message")
            op.adds = [(_msg(msg), records.pack(msg), body)
                       for msg, body in zip(msgs, bodies, strict=True)]
            op.deletes = _ids(acks)
            return op
        if Kind.XA_PREPARE <= kind <= Kind.SINK_COMMIT:
            _decode_xa(kind, value, bodies, op)
            return op
        if bodies:
            raise ValueError(f"record kind {kind} carries no bodies")
        if kind == Kind.ACK:
            op.deletes = _ids(value)
        elif kind == Kind.DROP:
            op.deletes = _ids(value[0])
        elif kind == Kind.MOVE:
            ids, target = value[0], value[1]
            if not isinstance(target, str):
                raise ValueError("a MOVE names its target queue")
            moved = _ids(ids)
            seqs = value[3] if len(value) > 3 else [0] * len(moved)
            if len(seqs) != len(moved) or not all(type(v) is int for v in seqs):
                raise ValueError("a MOVE's seqs are one int per message")
            op.updates = [(message_id, {PATCH_MOVED_TO: target, records.MSG_EXPIRES: 0,
                                        records.MSG_DELIVER_AT: 0, records.MSG_SEQ: seq}, target)
                          for message_id, seq in zip(moved, seqs, strict=True)]
            op.move_target = target
        elif kind == Kind.UPDATE:
            message_id, delivery_count, deliver_at = value
            if not all(type(v) is int for v in value):
                raise ValueError("an UPDATE is [id, delivery_count, deliver_at_ms]")
            op.updates = [(message_id, dict(zip(_UPDATE_FIELDS, (delivery_count, deliver_at),
                                                strict=True)), None)]
        elif kind == Kind.QUEUE_PUT:
            op.put = _definition(value)
        elif kind == Kind.QUEUE_DELETE:
            if not isinstance(value, str):
                raise ValueError("a QUEUE_DELETE names a queue")
            op.delete_queue = value
        elif kind == Kind.SNAPSHOT:
            if (not isinstance(value, dict) or type(value.get("next_id")) is not int
                    or not isinstance(value.get("queues"), dict)):
                raise ValueError("malformed snapshot")
            for definition in value["queues"].values():
                _definition(definition)
            op.snapshot = value
        elif kind in (Kind.RELOCATE, Kind.RELOCATE_MANY):
            raise ValueError("the dir store never asks for relocation (RELOCATE)")
        else:
            raise ValueError(f"the dir store does not know record kind {kind}")
    except (TypeError, IndexError, KeyError, XAError) as exc:
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
        meta: dict[str, Any] = {
            "next_id": self.next_id,
            "queues": self.definitions,
            "dups": {name: list(ids) for name, ids in self.dups.items() if ids},
        }
        if self.sinks:
            meta["sinks"] = self.sinks
        return records.pack(meta)

    def set_sink(self, sink: str, last: int) -> None:
        """A sink committed batch ``last`` (batch ids only grow, as in replay)."""
        self.sinks[sink] = max(self.sinks.get(sink, -1), last)

    def apply_snapshot(self, meta: dict[str, Any]) -> list[str]:
        """Replace the state by a snapshot; return the queues it deleted."""
        self.next_id = max(self.next_id, int(meta["next_id"]))
        definitions: dict[str, Any] = meta["queues"]
        gone = [name for name in self.definitions if name not in definitions]
        deleted = [name for name in gone if self.delete(name)]  # (all of them were known)
        for definition in definitions.values():
            self.put(definition)
        for sink, last in (meta.get("sinks") or {}).items():
            self.set_sink(sink, int(last))
        for name, ids in (meta.get("dups") or {}).items():
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
