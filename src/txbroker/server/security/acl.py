"""Users' permissions per destination pattern, and the audit log (docs/security.md).

Theory of operation
-------------------
The ``[acl]`` table of the config file grants **permissions** — ``send``,
``consume``, ``browse``, ``admin`` — to users (or groups of users) on
**destination patterns**. A pattern is written like Artemis' security-settings
matches and AMQP topic bindings: words separated by ``.``, where a word ``*``
stands for exactly one word and ``#`` for any number of words (none too).
``orders.*`` matches ``orders.eu`` but not ``orders`` or ``orders.eu.late``;
``orders.#`` matches all three. A destination is a queue or topic name; a
topic's subscription queue ``T::S`` is checked as its topic ``T``.

Rules only grant (there are no deny rules): a user may do an action on a
destination when some rule naming the user, or a group the user is in, grants
that permission on a pattern matching the destination. ``consume`` implies
``browse`` (who may take messages may look at them). Actions that name no
destination — XA heuristic outcomes, forget, closing connections — need
``admin`` on the pattern ``#`` (every destination: the broker's operator).

Without an ``[acl]`` table every authenticated user may do everything (the
broker's behaviour before ACLs); with one, whatever no rule grants is refused.

:class:`AccessControl` answers "may this user do that there?" and remembers
each answer (the send path asks once per message: one dict lookup when the
answer is known). :class:`AuditLog` writes one JSON line per event to the
``txbroker.audit`` logger and, when ``audit_log`` is set, to that file. Nothing
here knows about sessions or protocols: ``ops.py`` asks and logs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from txbroker.core.queue_index import SUBSCRIPTION_SEPARATOR

SEND: Final = "send"
CONSUME: Final = "consume"
BROWSE: Final = "browse"
ADMIN: Final = "admin"
#: Every permission a rule may grant.
PERMISSIONS: Final = (SEND, CONSUME, BROWSE, ADMIN)
#: Permissions a granted one implies: who may take messages may look at them.
IMPLIED: Final[dict[str, tuple[str, ...]]] = {CONSUME: (BROWSE,)}
#: The pattern an action naming no destination (XA heuristics, closing a
#: connection) must be granted on: every destination.
BROKER_PATTERN: Final = "#"
#: Answers remembered before the cache starts over: destinations are named by
#: clients (a queue is created on first send), so the cache must not grow forever.
MAX_CACHED_ANSWERS: Final = 65_536
#: The logger every audit event goes to.
AUDIT_LOGGER: Final = "txbroker.audit"
#: The keys of ``[acl]`` and of one ``[[acl.rules]]`` entry.
ACL_KEYS: Final = frozenset({"groups", "rules"})
RULE_KEYS: Final = frozenset({"user", "group", "pattern", "permissions"})

Words = tuple[str, ...]


def parse_pattern(text: object) -> Words:
    """A pattern's words; ValueError naming what is wrong."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"bad pattern {text!r}: a pattern is a non-empty string")
    words = tuple(text.split("."))
    for word in words:
        if not word:
            raise ValueError(f"bad pattern {text!r}: empty word (two dots, or a dot at an end)")
        if word not in ("*", "#") and ("*" in word or "#" in word):
            raise ValueError(f"bad pattern {text!r}: '*' and '#' must be whole words "
                             f"(orders.*, orders.#)")
    return words


def words_match(pattern: Words, words: Words) -> bool:
    """True if a destination's ``words`` match a pattern's: the positions in
    ``words`` reachable after each pattern word, one pass over the pattern."""
    reachable = {0}
    count = len(words)
    for word in pattern:
        if word == "#":
            reachable = set(range(min(reachable), count + 1))
        elif word == "*":
            reachable = {j + 1 for j in reachable if j < count}
        else:
            reachable = {j + 1 for j in reachable if j < count and words[j] == word}
        if not reachable:
            return False
    return count in reachable


def destination_of(name: str) -> str:
    """The destination a queue name is checked as: a subscription queue ``T::S``
    is its topic ``T``."""
    topic, separator, _ = name.partition(SUBSCRIPTION_SEPARATOR)
    return topic if separator else name


@dataclass(frozen=True, slots=True)
class Rule:
    """One grant: ``users`` may do ``permissions`` on destinations matching ``pattern``."""

    users: frozenset[str]
    pattern: str
    words: Words
    permissions: frozenset[str]

    def matches(self, destination: str | None) -> bool:
        """True if the pattern covers ``destination`` (None: the broker itself,
        covered by ``#`` only)."""
        if destination is None:
            return self.pattern == BROKER_PATTERN
        return words_match(self.words, tuple(destination.split(".")))


@dataclass(frozen=True, slots=True)
class AclConfig:
    """The parsed ``[acl]`` table: its rules, groups already expanded to users."""

    rules: tuple[Rule, ...]
    groups: Mapping[str, frozenset[str]]


def parse_acl(data: object, users: Iterable[str]) -> AclConfig:
    """Check and compile the ``[acl]`` table; ValueError with a one-line message."""
    known = set(users)
    if not isinstance(data, dict):
        raise ValueError("[acl] must be a table")
    if not known:
        raise ValueError("[acl] needs [users]: a broker without users is open and has "
                         "no one to grant permissions to")
    unknown = set(data) - ACL_KEYS
    if unknown:
        raise ValueError(f"unknown [acl] keys: {', '.join(sorted(unknown))} "
                         f"(allowed: groups, rules)")
    groups = _parse_groups(data.get("groups", {}), known)
    rules_data = data.get("rules", [])
    if not isinstance(rules_data, list):
        raise ValueError("[acl] rules must be an array of tables ([[acl.rules]])")
    rules = tuple(_parse_rule(number, entry, known, groups)
                  for number, entry in enumerate(rules_data, start=1))
    return AclConfig(rules, groups)


def _parse_groups(data: object, known: set[str]) -> dict[str, frozenset[str]]:
    if not isinstance(data, dict):
        raise ValueError("[acl.groups] must be a table: group = [\"user\", …]")
    groups: dict[str, frozenset[str]] = {}
    for name, members in data.items():
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ValueError(f"[acl.groups] {name}: a group is a list of user names")
        strangers = sorted(set(members) - known)
        if strangers:
            raise ValueError(f"[acl.groups] {name}: unknown user {strangers[0]!r} "
                             f"(not in [users])")
        groups[name] = frozenset(members)
    return groups


def _parse_rule(number: int, entry: object, known: set[str],
                groups: Mapping[str, frozenset[str]]) -> Rule:
    where = f"[[acl.rules]] #{number}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: a rule is a table")
    unknown = set(entry) - RULE_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))} "
                         f"(allowed: user, group, pattern, permissions)")
    if ("user" in entry) == ("group" in entry):
        raise ValueError(f"{where}: name exactly one of user or group")
    if "user" in entry:
        user = entry["user"]
        if user not in known:
            raise ValueError(f"{where}: unknown user {user!r} (not in [users])")
        members = frozenset([user])
    else:
        group = entry["group"]
        if group not in groups:
            raise ValueError(f"{where}: unknown group {group!r} (not in [acl.groups])")
        members = groups[group]
    if "pattern" not in entry:
        raise ValueError(f"{where}: a rule needs a pattern")
    try:
        words = parse_pattern(entry["pattern"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    permissions = entry.get("permissions")
    if not isinstance(permissions, list) or not permissions:
        raise ValueError(f"{where}: permissions must be a non-empty list of "
                         f"{', '.join(PERMISSIONS)}")
    for permission in permissions:
        if permission not in PERMISSIONS:
            raise ValueError(f"{where}: unknown permission {permission!r} "
                             f"(known: {', '.join(PERMISSIONS)})")
    granted = set(permissions)
    for permission in permissions:
        granted.update(IMPLIED.get(permission, ()))
    return Rule(members, entry["pattern"], words, frozenset(granted))


class AccessControl:
    """Answers :meth:`allows` from the rules (everything, with no ``[acl]``)."""

    __slots__ = ("_answers", "_rules_of", "enforcing")

    def __init__(self, config: AclConfig | None) -> None:
        #: False without ``[acl]``: every authenticated user may do everything
        self.enforcing = config is not None
        self._rules_of: dict[str, tuple[Rule, ...]] = {}
        if config is not None:
            for user in {u for rule in config.rules for u in rule.users}:
                self._rules_of[user] = tuple(r for r in config.rules if user in r.users)
        self._answers: dict[tuple[str | None, str, str | None], bool] = {}

    def allows(self, user: str | None, permission: str, destination: str | None) -> bool:
        """True if ``user`` may do ``permission`` on ``destination`` (None: on the
        broker itself). Cached: the send path pays one dict lookup."""
        if not self.enforcing:
            return True
        key = (user, permission, destination)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._decide(user, permission, destination)
            if len(self._answers) >= MAX_CACHED_ANSWERS:
                self._answers.clear()
            self._answers[key] = answer
        return answer

    def _decide(self, user: str | None, permission: str, destination: str | None) -> bool:
        if user is None:
            return False
        target = None if destination is None else destination_of(destination)
        return any(permission in rule.permissions and rule.matches(target)
                   for rule in self._rules_of.get(user, ()))


class AuditLog:
    """Audit events as JSON lines on the ``txbroker.audit`` logger (and in the
    ``audit_log`` file when one is configured)."""

    def __init__(self, path: str = "") -> None:
        self.logger = logging.getLogger(AUDIT_LOGGER)
        self._handler: logging.Handler | None = None
        if path:
            handler = logging.FileHandler(path, encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(handler)
            if self.logger.getEffectiveLevel() > logging.INFO:
                self.logger.setLevel(logging.INFO)  # the file gets every event
            self._handler = handler

    def record(self, **event: Any) -> None:
        """One event: ``time`` (UTC, ISO 8601, ms) first, then ``event``'s fields."""
        if self.logger.isEnabledFor(logging.INFO):
            now = time.time()
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
            line = {"time": f"{stamp}.{int(now * 1000) % 1000:03d}Z", **event}
            self.logger.info("%s", json.dumps(line, ensure_ascii=False))

    def close(self) -> None:
        """Detach and close the file (the broker stops)."""
        if self._handler is not None:
            self.logger.removeHandler(self._handler)
            self._handler.close()
            self._handler = None


__all__ = ["ADMIN", "BROWSE", "CONSUME", "PERMISSIONS", "SEND", "AccessControl", "AclConfig",
           "AuditLog", "Rule", "destination_of", "parse_acl", "parse_pattern", "words_match"]
