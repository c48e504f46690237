"""AMQP 0-9-1 exchanges, bindings and queue flags: the definitions the AMQP edge
routes by, their equivalence rules, and their stored form.

Theory of operation
-------------------
txbroker's core has queues (and topics with subscription queues); AMQP adds
exchanges that route a published message to the queues bound to them. The
routing itself is a pure function of these definitions (:meth:`Definitions.route`):
a publish to exchange ``X`` with routing key ``K`` and headers ``H`` becomes
one core ``send`` per queue the bindings select, so every queue is an
ordinary txbroker queue (quotas, dead letters, durability, replication,
``txbroker queues`` all apply).

* **default exchange** ``""``: every queue is bound by its own name (spec 3.1.3.1);
  it cannot be bound to, unbound from, declared with another type or deleted.
* **direct**: the binding key equals the routing key.
* **fanout**: every bound queue.
* **topic**: keys are words split by ``.``; in a binding key ``*`` matches one
  word, ``#`` zero or more (:func:`topic_matches`).
* **headers**: the binding's arguments (``x-*`` keys aside) against the message's
  headers; ``x-match`` ``all`` (the default) or ``any`` (:func:`headers_match`).
* the ``amq.*`` exchanges are pre-declared, durable, and cannot be deleted;
  clients may not declare names beginning with ``amq.`` (403, as RabbitMQ).

Equivalence (RabbitMQ's rules): declaring an existing exchange with another type,
durability, auto-delete, internal flag or arguments is 406 PRECONDITION_FAILED;
so is declaring an existing queue with other durable / exclusive / auto-delete
flags or arguments. A passive declare of something that does not exist is 404.

This module holds no I/O: :mod:`txbroker.server.amqp_store` stores
:meth:`Definitions.snapshot` durably and loads it back at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Final

from txbroker.protocol.amqp import ReplyCode

#: Exchange types we route (RabbitMQ's built-in ones; plugins' types are refused).
EXCHANGE_TYPES: Final = ("direct", "fanout", "topic", "headers")
#: The exchanges every vhost has (spec 3.1.3.2; RabbitMQ also pre-declares amq.match).
PREDECLARED: Final = {"amq.direct": "direct", "amq.fanout": "fanout",
                      "amq.topic": "topic", "amq.headers": "headers",
                      "amq.match": "headers"}
#: Names clients may not declare (RabbitMQ: 403 ACCESS_REFUSED).
RESERVED_PREFIX: Final = "amq."
#: The version of :meth:`Definitions.snapshot`'s JSON.
SNAPSHOT_VERSION: Final = 1


class ChannelError(Exception):
    """A refusal that closes the channel (or, ``hard``, the connection) with
    ``reply_code`` and ``text``."""

    def __init__(self, reply_code: ReplyCode, text: str, *, hard: bool = False) -> None:
        super().__init__(text)
        self.reply_code = reply_code
        self.text = text
        self.hard = hard


@dataclass(frozen=True, slots=True)
class Exchange:
    """A declared exchange."""

    name: str
    type: str
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Binding:
    """Queue ``queue`` bound to ``exchange`` with ``key`` and ``arguments``."""

    exchange: str
    queue: str
    key: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def identity(self) -> str:
        """What tells two bindings apart (RabbitMQ: exchange, queue, key, arguments)."""
        return json.dumps([self.exchange, self.queue, self.key, plain(self.arguments)],
                          sort_keys=True)


@dataclass(frozen=True, slots=True)
class QueueFlags:
    """What AMQP says about a queue beyond the core's settings. ``owner``: the
    connection (session id) of an exclusive queue, 0 if none."""

    name: str
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    owner: int = 0


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` zero or more (words split by ".")."""
    return _topic(tuple(pattern.split(".")), tuple(key.split(".")))


@lru_cache(maxsize=4096)
def _topic(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_topic(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _topic(rest, words[1:])


def headers_match(arguments: dict[str, Any], headers: dict[str, Any] | None) -> bool:
    """A headers-exchange binding against a message's headers: ``x-match`` ``all``
    (default: every argument present and equal) or ``any`` (at least one); arguments
    beginning with ``x-`` are not compared."""
    wanted = {k: v for k, v in arguments.items() if not k.startswith("x-")}
    have = headers or {}
    if arguments.get("x-match", "all") == "any":
        return any(k in have and _equal(have[k], v) for k, v in wanted.items())
    return all(k in have and _equal(have[k], v) for k, v in wanted.items())


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bytes):
        a = a.decode("utf-8", "replace")
    if isinstance(b, bytes):
        b = b.decode("utf-8", "replace")
    return bool(a == b)


def plain(value: Any) -> Any:
    """A field-table value as JSON can hold it (bytes as text; timestamps and
    decimals as strings): what the stored definitions hold, and what equivalence
    compares."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


class Definitions:
    """Every exchange, binding and AMQP queue flag of the broker (one per server)."""

    def __init__(self) -> None:
        self.exchanges: dict[str, Exchange] = {
            name: Exchange(name, kind) for name, kind in PREDECLARED.items()}
        #: exchange -> binding identity -> binding
        self.bindings: dict[str, dict[str, Binding]] = {}
        self.queues: dict[str, QueueFlags] = {}

    # ------------------------------------------------------------------ exchanges
    def declare_exchange(self, wanted: Exchange, *, passive: bool) -> bool:
        """Declare (or check) an exchange; True if it is new. ChannelError: 404 for a
        passive declare of none, 403 for a reserved name, 406 for a mismatch or an
        unknown type."""
        if wanted.name == "":
            if passive or wanted.type == "direct":
                return False
            raise ChannelError(ReplyCode.ACCESS_REFUSED,
                               "ACCESS_REFUSED - operation not permitted on the default "
                               "exchange")
        existing = self.exchanges.get(wanted.name)
        if passive:
            if existing is None:
                raise ChannelError(ReplyCode.NOT_FOUND,
                                   f"NOT_FOUND - no exchange '{wanted.name}' in vhost '/'")
            return False
        if existing is None:
            if wanted.name.startswith(RESERVED_PREFIX):
                raise ChannelError(ReplyCode.ACCESS_REFUSED,
                                   f"ACCESS_REFUSED - exchange name '{wanted.name}' contains "
                                   f"reserved prefix '{RESERVED_PREFIX}*'")
            if wanted.type not in EXCHANGE_TYPES:
                raise ChannelError(ReplyCode.COMMAND_INVALID,
                                   f"COMMAND_INVALID - unknown exchange type '{wanted.type}' "
                                   f"(supported: {', '.join(EXCHANGE_TYPES)})", hard=True)
            self.exchanges[wanted.name] = wanted
            return True
        for what, have, want in (("type", existing.type, wanted.type),
                                 ("durable", existing.durable, wanted.durable),
                                 ("auto_delete", existing.auto_delete, wanted.auto_delete),
                                 ("internal", existing.internal, wanted.internal),
                                 ("arguments", plain(existing.arguments),
                                  plain(wanted.arguments))):
            if have != want:
                raise ChannelError(
                    ReplyCode.PRECONDITION_FAILED,
                    f"PRECONDITION_FAILED - inequivalent arg '{what}' for exchange "
                    f"'{wanted.name}' in vhost '/': received {want!r} but current is {have!r}")
        return False

    def exchange(self, name: str) -> Exchange:
        """An existing exchange (the default one included) or 404."""
        if name == "":
            return Exchange("", "direct")
        found = self.exchanges.get(name)
        if found is None:
            raise ChannelError(ReplyCode.NOT_FOUND, f"NOT_FOUND - no exchange '{name}' in "
                               "vhost '/'")
        return found

    def delete_exchange(self, name: str, *, if_unused: bool) -> None:
        """Delete an exchange and its bindings (404 if none; 406 if in use and
        ``if_unused``; 403 for the default and ``amq.*`` ones)."""
        if name == "" or name in PREDECLARED:
            raise ChannelError(ReplyCode.ACCESS_REFUSED,
                               f"ACCESS_REFUSED - operation not permitted on exchange "
                               f"'{name}'")
        self.exchange(name)
        if if_unused and self.bindings.get(name):
            raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                               f"PRECONDITION_FAILED - exchange '{name}' in vhost '/' in use")
        del self.exchanges[name]
        self.bindings.pop(name, None)

    # ------------------------------------------------------------------ bindings
    def bind(self, binding: Binding) -> bool:
        """Add a binding (the exchange must exist; the queue is checked by the
        caller); True if it is new."""
        exchange = self._bindable(binding.exchange)
        if exchange.type == "headers" and \
                binding.arguments.get("x-match", "all") not in ("all", "any"):
            raise ChannelError(ReplyCode.PRECONDITION_FAILED,
                               "PRECONDITION_FAILED - x-match must be 'all' or 'any', not "
                               f"{binding.arguments.get('x-match')!r}")
        table = self.bindings.setdefault(binding.exchange, {})
        identity = binding.identity
        if identity in table:
            return False
        table[identity] = binding
        return True

    def unbind(self, binding: Binding) -> bool:
        """Remove a binding; True if it existed (RabbitMQ: unbinding what is not
        bound is not an error). An auto-delete exchange goes with its last binding."""
        exchange = self._bindable(binding.exchange)
        table = self.bindings.get(binding.exchange, {})
        removed = table.pop(binding.identity, None) is not None
        if removed and not table and exchange.auto_delete:  # its last binding went
            self.exchanges.pop(binding.exchange, None)
            self.bindings.pop(binding.exchange, None)
        return removed

    def _bindable(self, name: str) -> Exchange:
        if name == "":
            raise ChannelError(ReplyCode.ACCESS_REFUSED,
                               "ACCESS_REFUSED - operation not permitted on the default "
                               "exchange")
        return self.exchange(name)

    def drop_queue(self, queue: str) -> list[str]:
        """A queue was deleted: its flags and bindings go; returns the auto-delete
        exchanges left without bindings, which are deleted too."""
        self.queues.pop(queue, None)
        emptied = []
        for exchange, table in self.bindings.items():
            for identity in [i for i, b in table.items() if b.queue == queue]:
                del table[identity]
            found = self.exchanges.get(exchange)
            if not table and found is not None and found.auto_delete:
                emptied.append(exchange)
        for exchange in emptied:
            self.exchanges.pop(exchange, None)
            self.bindings.pop(exchange, None)
        return emptied

    # ------------------------------------------------------------------ routing
    def route(self, exchange_name: str, key: str, headers: dict[str, Any] | None,
              existing: set[str] | dict[str, Any]) -> list[str]:
        """The queues a publish to ``exchange_name`` with ``key`` reaches, in a stable
        order (``existing``: the queue names that exist; the default exchange routes
        to one of them by name)."""
        if exchange_name == "":
            return [key] if key in existing else []
        exchange = self.exchange(exchange_name)
        if exchange.internal:
            raise ChannelError(ReplyCode.ACCESS_REFUSED,
                               f"ACCESS_REFUSED - cannot publish to internal exchange "
                               f"'{exchange_name}' in vhost '/'")
        found: dict[str, None] = {}
        kind = exchange.type
        for binding in self.bindings.get(exchange_name, {}).values():
            if binding.queue in found:
                continue
            if kind == "fanout" or (kind == "direct" and binding.key == key) or \
                    (kind == "topic" and topic_matches(binding.key, key)) or \
                    (kind == "headers" and headers_match(binding.arguments, headers)):
                found[binding.queue] = None
        return [q for q in found if q in existing]

    # ------------------------------------------------------------------ stored form
    def snapshot(self) -> bytes:
        """The durable definitions as JSON (pre-declared exchanges left out)."""
        return json.dumps({
            "version": SNAPSHOT_VERSION,
            "exchanges": [
                {"name": e.name, "type": e.type, "durable": e.durable,
                 "auto_delete": e.auto_delete, "internal": e.internal,
                 "arguments": plain(e.arguments)}
                for e in self.exchanges.values() if e.name not in PREDECLARED],
            "bindings": [
                {"exchange": b.exchange, "queue": b.queue, "key": b.key,
                 "arguments": plain(b.arguments)}
                for table in self.bindings.values() for b in table.values()],
            "queues": [
                {"name": q.name, "durable": q.durable, "exclusive": q.exclusive,
                 "auto_delete": q.auto_delete, "arguments": plain(q.arguments)}
                for q in self.queues.values()],
        }, sort_keys=True).encode()

    @classmethod
    def load(cls, data: bytes) -> Definitions:
        """Definitions from :meth:`snapshot`'s bytes (ValueError if they are not)."""
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("version") != SNAPSHOT_VERSION:
            raise ValueError("not an AMQP definitions snapshot of version "
                             f"{SNAPSHOT_VERSION}")
        found = cls()
        for e in raw["exchanges"]:
            found.exchanges[e["name"]] = Exchange(e["name"], e["type"], e["durable"],
                                                  e["auto_delete"], e["internal"],
                                                  dict(e["arguments"]))
        for b in raw["bindings"]:
            binding = Binding(b["exchange"], b["queue"], b["key"], dict(b["arguments"]))
            found.bindings.setdefault(binding.exchange, {})[binding.identity] = binding
        for q in raw["queues"]:
            found.queues[q["name"]] = QueueFlags(q["name"], q["durable"], q["exclusive"],
                                                 q["auto_delete"], dict(q["arguments"]))
        return found

    def transient(self) -> tuple[list[str], list[str]]:
        """What does not outlive a restart: (queues that are not durable or are
        exclusive, exchanges that are not durable)."""
        queues = [q.name for q in self.queues.values() if not q.durable or q.exclusive]
        exchanges = [e.name for e in self.exchanges.values() if not e.durable]
        return queues, exchanges
