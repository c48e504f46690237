"""Users and ACLs (issue 16): the pattern language and the rules, pure; then the
permission matrix, the audit log and bad configs on a real broker process with
the native sync client.

Every outcome is exact: the error type and message, what the broker holds
afterwards, and every audit line (its time only checked for its form).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import txbroker
from tests.support import ROOT, BrokerProcess
from txbroker.errors import AuthenticationFailed, ErrorCode, Forbidden, NotFound, XAError
from txbroker.server.security.acl import (
    AccessControl,
    AuditLog,
    destination_of,
    parse_acl,
    parse_pattern,
    words_match,
)
from txbroker.server.security.auth import hash_password

PASSWORD = "pw"
#: One user per permission on ``orders.*``, and an operator with everything on ``#``.
USERS = ("alice", "bob", "carol", "dave", "root")
ACL = """
[acl.groups]
ops = ["root"]

[[acl.rules]]
user = "alice"
pattern = "orders.*"
permissions = ["send"]

[[acl.rules]]
user = "carol"
pattern = "orders.*"
permissions = ["consume"]

[[acl.rules]]
user = "bob"
pattern = "orders.*"
permissions = ["browse"]

[[acl.rules]]
user = "dave"
pattern = "orders.*"
permissions = ["admin"]

[[acl.rules]]
group = "ops"
pattern = "#"
permissions = ["send", "consume", "browse", "admin"]
"""
TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
ADDRESS = re.compile(r"127\.0\.0\.1:\d+")


def users_toml(names: tuple[str, ...] = USERS) -> str:
    """A ``[users]`` table, every user with PASSWORD (one hash: scrypt is slow)."""
    digest = hash_password(PASSWORD)
    return "[users]\n" + "".join(f'{name} = "{digest}"\n' for name in names)


# --------------------------------------------------------------------- patterns, pure
def reference_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """The definition, recursively: ``#`` eats zero or more words, ``*`` one."""
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(reference_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head == "*" or head == words[0]) and reference_match(rest, words[1:])


@pytest.mark.parametrize(("pattern", "destination", "expected"), [
    ("orders", "orders", True),
    ("orders", "orders.eu", False),
    ("orders.*", "orders.eu", True),
    ("orders.*", "orders", False),
    ("orders.*", "orders.eu.late", False),
    ("orders.#", "orders", True),
    ("orders.#", "orders.eu.late", True),
    ("orders.#", "ordersx.eu", False),
    ("#", "anything.at.all", True),
    ("*.eu", "orders.eu", True),
    ("*.eu", "eu", False),
    ("#.late", "orders.eu.late", True),
    ("#.late", "late", True),
    ("orders.#.late", "orders.late", True),
    ("orders.#.late", "orders.eu.x.late", True),
    ("orders.#.late", "orders.eu.early", False),
    ("a.*.#", "a", False),
    ("a.*.#", "a.b", True),
])
def test_pattern_matches(pattern: str, destination: str, expected: bool) -> None:
    assert words_match(parse_pattern(pattern), tuple(destination.split("."))) is expected


WORD = st.sampled_from(["a", "b", "orders", ""])
PATTERN_WORD = st.sampled_from(["a", "b", "orders", "*", "#"])


@given(st.lists(PATTERN_WORD, min_size=1, max_size=6), st.lists(WORD, min_size=1, max_size=7))
def test_pattern_matching_is_the_definition(pattern: list[str], words: list[str]) -> None:
    assert words_match(tuple(pattern), tuple(words)) is reference_match(tuple(pattern),
                                                                       tuple(words))


@given(st.lists(st.sampled_from(["a", "b", "c1", "x-y"]), min_size=1, max_size=6), st.data())
def test_a_name_matches_itself_and_its_wildcards(words: list[str], data: st.DataObject) -> None:
    name = ".".join(words)
    assert words_match(parse_pattern(name), tuple(words))
    index = data.draw(st.integers(0, len(words) - 1))
    starred = [*words[:index], "*", *words[index + 1:]]
    assert words_match(parse_pattern(".".join(starred)), tuple(words))
    hashed = [*words[:index], "#"]
    assert words_match(parse_pattern(".".join(hashed)), tuple(words))
    assert words_match(("#",), tuple(words))


@pytest.mark.parametrize(("pattern", "message"), [
    ("", "bad pattern '': a pattern is a non-empty string"),
    ("orders..eu", "bad pattern 'orders..eu': empty word (two dots, or a dot at an end)"),
    ("orders.", "bad pattern 'orders.': empty word (two dots, or a dot at an end)"),
    ("orders*", "bad pattern 'orders*': '*' and '#' must be whole words (orders.*, orders.#)"),
    ("a.#b", "bad pattern 'a.#b': '*' and '#' must be whole words (orders.*, orders.#)"),
])
def test_bad_patterns(pattern: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_pattern(pattern)
    assert str(caught.value) == message


def test_subscription_queues_are_checked_as_their_topic() -> None:
    assert destination_of("prices::s1") == "prices"
    assert destination_of("prices.eu") == "prices.eu"


# --------------------------------------------------------------------- rules, pure
def control(rules: list[dict[str, Any]], groups: dict[str, list[str]] | None = None
            ) -> AccessControl:
    return AccessControl(parse_acl({"rules": rules, "groups": groups or {}}, USERS))


def test_rules_grant_and_nothing_else() -> None:
    acl = control([{"user": "alice", "pattern": "orders.*", "permissions": ["send"]},
                   {"group": "ops", "pattern": "#", "permissions": ["admin"]},
                   {"user": "carol", "pattern": "prices", "permissions": ["consume"]}],
                  {"ops": ["root", "dave"]})
    assert acl.allows("alice", "send", "orders.eu")
    assert not acl.allows("alice", "send", "orders")
    assert not acl.allows("alice", "consume", "orders.eu")
    assert not acl.allows("bob", "send", "orders.eu")  # no rule at all
    assert not acl.allows(None, "send", "orders.eu")
    assert acl.allows("dave", "admin", "anything")  # by the group
    assert acl.allows("dave", "admin", None)  # "#" covers the broker itself
    assert not acl.allows("alice", "send", None)
    assert acl.allows("carol", "browse", "prices")  # consume implies browse
    assert acl.allows("carol", "consume", "prices::sub-1")  # a subscription queue
    assert not acl.allows("carol", "consume", "prices.eu")
    # the answer is cached: asked twice, the same
    assert acl.allows("alice", "send", "orders.eu")


def test_only_hash_covers_the_broker() -> None:
    acl = control([{"user": "dave", "pattern": "orders.#", "permissions": ["admin"]}])
    assert acl.allows("dave", "admin", "orders.eu")
    assert not acl.allows("dave", "admin", None)


def test_no_acl_allows_everything() -> None:
    acl = AccessControl(None)
    assert not acl.enforcing
    assert acl.allows(None, "admin", None)
    assert acl.allows("anyone", "send", "x")


@pytest.mark.parametrize(("acl", "users", "message"), [
    ({"rules": [{"user": "eve", "pattern": "#", "permissions": ["send"]}]}, USERS,
     "[[acl.rules]] #1: unknown user 'eve' (not in [users])"),
    ({"rules": [{"user": "alice", "pattern": "#", "permissions": ["write"]}]}, USERS,
     "[[acl.rules]] #1: unknown permission 'write' (known: send, consume, browse, admin)"),
    ({"rules": [{"user": "alice", "pattern": "a..b", "permissions": ["send"]}]}, USERS,
     "[[acl.rules]] #1: bad pattern 'a..b': empty word (two dots, or a dot at an end)"),
    ({"rules": [{"user": "alice", "permissions": ["send"]}]}, USERS,
     "[[acl.rules]] #1: a rule needs a pattern"),
    ({"rules": [{"user": "alice", "pattern": "#", "permissions": []}]}, USERS,
     "[[acl.rules]] #1: permissions must be a non-empty list of send, consume, browse, admin"),
    ({"rules": [{"pattern": "#", "permissions": ["send"]}]}, USERS,
     "[[acl.rules]] #1: name exactly one of user or group"),
    ({"rules": [{"group": "ops", "pattern": "#", "permissions": ["send"]}]}, USERS,
     "[[acl.rules]] #1: unknown group 'ops' (not in [acl.groups])"),
    ({"groups": {"ops": ["eve"]}}, USERS,
     "[acl.groups] ops: unknown user 'eve' (not in [users])"),
    ({"rule": []}, USERS, "unknown [acl] keys: rule (allowed: groups, rules)"),
    ({"rules": [{"user": "alice", "pattern": "#", "permissions": ["send"], "deny": True}]},
     USERS, "[[acl.rules]] #1: unknown keys deny (allowed: user, group, pattern, permissions)"),
    ({"rules": []}, (),
     "[acl] needs [users]: a broker without users is open and has no one to grant "
     "permissions to"),
])
def test_bad_acl_config(acl: dict[str, Any], users: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_acl(acl, users)
    assert str(caught.value) == message


def test_bad_config_refused_at_start(tmp_path: Path) -> None:
    """``txbroker serve`` with a bad [acl]: one line on stderr, exit 1, no broker."""
    config = tmp_path / "broker.toml"
    config.write_text(users_toml(("alice",)) + '[[acl.rules]]\nuser = "alice"\n'
                      'pattern = "orders.*"\npermissions = ["send", "write"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(tmp_path / "data"),
         "--config", str(config), "--port", "0", "--stomp-port", "0", "--amqp-port", "0"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr == ("error: [[acl.rules]] #1: unknown permission 'write' "
                           "(known: send, consume, browse, admin)\n")
    assert done.stdout == ""


def test_audit_log_writes_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    try:
        audit.record(user="u", address="a:1", protocol="native", action="admin", op="purge",
                     destination="q", outcome="allowed")
    finally:
        audit.close()
    (line,) = path.read_text().splitlines()
    event = json.loads(line)
    assert TIME.fullmatch(event.pop("time"))
    assert event == {"user": "u", "address": "a:1", "protocol": "native", "action": "admin",
                     "op": "purge", "destination": "q", "outcome": "allowed"}


# --------------------------------------------------------------------- a real broker
class Audit:
    """The broker's audit file, read a test's worth at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def take(self) -> list[dict[str, Any]]:
        """The events written since the last take, without their time; the address
        checked to be a loopback host:port and replaced by ``"ADDR"``."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        new, self.offset = data[self.offset:], len(data)
        events = []
        for line in new.decode().splitlines():
            event = json.loads(line)
            assert TIME.fullmatch(event.pop("time")), line
            assert ADDRESS.fullmatch(event["address"]), line
            event["address"] = "ADDR"
            events.append(event)
        return events


def event(user: str | None, action: str, op: str, destination: str | None, outcome: str,
          protocol: str = "native") -> dict[str, Any]:
    return {"user": user, "address": "ADDR", "protocol": protocol, "action": action, "op": op,
            "destination": destination, "outcome": outcome}


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess,
                                                                          Audit]]:
    base = tmp_path_factory.mktemp("acl")
    audit_path = base / "audit.jsonl"
    config = base / "broker.toml"
    config.write_text(f'[server]\naudit_log = "{audit_path}"\n\n' + users_toml() + ACL)
    with BrokerProcess(base / "data", "--config", str(config)) as proc:
        yield proc, Audit(audit_path)


@pytest.fixture
def audit(acl_broker: tuple[BrokerProcess, Audit]) -> Audit:
    found = acl_broker[1]
    found.take()  # start clean
    return found


def connect(proc: BrokerProcess, user: str) -> txbroker.Connection:
    return txbroker.connect(f"txb://{user}:{PASSWORD}@127.0.0.1:{proc.port}", reconnect=False)


def forbidden(user: str, action: str, where: str, op: str) -> str:
    return f"forbidden: user {user!r} has no {action} permission on {where} ({op})"


def test_send(acl_broker: tuple[BrokerProcess, Audit], audit: Audit) -> None:
    proc = acl_broker[0]
    with connect(proc, "alice") as alice:
        alice.send("orders.send", b"ok")  # allowed, matching
        with pytest.raises(Forbidden) as caught:  # allowed user, pattern does not match
            alice.send("billing.send", b"no")
        assert caught.value.code == ErrorCode.FORBIDDEN
        assert str(caught.value) == forbidden("alice", "send", "'billing.send'", "send")
        alice.ping()  # the connection stays open
    with connect(proc, "carol") as carol, pytest.raises(Forbidden) as caught:
        carol.send("orders.send", b"no")  # matching pattern, no send permission
    assert str(caught.value) == forbidden("carol", "send", "'orders.send'", "send")
    with connect(proc, "root") as root:
        assert root.queue_info("orders.send")["depth"] == 1
        with pytest.raises(NotFound):  # the refused send created nothing
            root.queue_info("billing.send")
    assert audit.take() == [event("alice", "send", "send", "billing.send", "denied"),
                            event("carol", "send", "send", "orders.send", "denied")]


def test_consume(acl_broker: tuple[BrokerProcess, Audit], audit: Audit) -> None:
    proc = acl_broker[0]
    with connect(proc, "root") as root:
        root.send("orders.consume", b"m1")
        root.send("billing.consume", b"m2")
    with connect(proc, "carol") as carol:
        message = carol.receive("orders.consume", timeout=5)
        assert message is not None and message.body == b"m1"
        message.ack()
        with pytest.raises(Forbidden) as caught:
            carol.receive("billing.consume", timeout=0)
        assert str(caught.value) == forbidden("carol", "consume", "'billing.consume'",
                                              "receive")
    with connect(proc, "alice") as alice, pytest.raises(Forbidden) as caught:
        alice.receive("orders.consume", timeout=0)
    assert str(caught.value) == forbidden("alice", "consume", "'orders.consume'", "receive")
    with connect(proc, "root") as root:
        assert root.queue_info("billing.consume")["depth"] == 1
        assert root.queue_info("orders.consume")["depth"] == 0
    assert audit.take() == [
        event("carol", "consume", "receive", "billing.consume", "denied"),
        event("alice", "consume", "receive", "orders.consume", "denied")]


def test_topic_subscription_is_consume_on_the_topic(
        acl_broker: tuple[BrokerProcess, Audit], audit: Audit) -> None:
    proc = acl_broker[0]
    with connect(proc, "root") as root:
        root.declare_topic("orders.prices")
        root.declare_topic("billing.prices")
    with connect(proc, "carol") as carol:
        info = carol.subscribe_topic("orders.prices", "c1")
        assert info["name"] == "orders.prices::c1"
        with pytest.raises(Forbidden) as caught:
            carol.subscribe_topic("billing.prices", "c1")
        assert str(caught.value) == forbidden("carol", "consume", "'billing.prices'",
                                              "topic_subscribe")
    assert audit.take() == [
        event("root", "admin", "declare", "orders.prices", "allowed"),
        event("root", "admin", "declare", "billing.prices", "allowed"),
        event("carol", "consume", "topic_subscribe", "billing.prices", "denied")]


def test_browse(acl_broker: tuple[BrokerProcess, Audit], audit: Audit) -> None:
    """Reading without consuming: the stream ops stream_info / stream_read."""
    proc = acl_broker[0]
    with connect(proc, "root") as root:
        root.send("orders.browse", b"b1")
        root.send("billing.browse", b"b2")
    with connect(proc, "bob") as bob:
        assert bob.stream_info("orders.browse").next == 2
        with pytest.raises(Forbidden) as caught:
            bob.stream_info("billing.browse")
        assert str(caught.value) == forbidden("bob", "browse", "'billing.browse'", "stream_info")
    with connect(proc, "carol") as carol:  # consume implies browse
        assert carol.stream_info("orders.browse").next == 2
    with connect(proc, "alice") as alice, pytest.raises(Forbidden) as caught:
        alice.stream_info("orders.browse")
    assert str(caught.value) == forbidden("alice", "browse", "'orders.browse'", "stream_info")
    with connect(proc, "bob") as bob, pytest.raises(Forbidden) as caught:
        bob.receive("orders.browse", timeout=0)  # browse does not imply consume
    assert str(caught.value) == forbidden("bob", "consume", "'orders.browse'", "receive")
    assert audit.take() == [
        event("bob", "browse", "stream_info", "billing.browse", "denied"),
        event("alice", "browse", "stream_info", "orders.browse", "denied"),
        event("bob", "consume", "receive", "orders.browse", "denied")]


def test_admin(acl_broker: tuple[BrokerProcess, Audit], audit: Audit) -> None:
    proc = acl_broker[0]
    with connect(proc, "root") as root:
        root.send("orders.admin", b"a1")
        root.send("billing.admin", b"a2")
    audit.take()
    with connect(proc, "dave") as dave:
        assert dave.purge_queue("orders.admin") == 1  # allowed, matching
        with pytest.raises(Forbidden) as caught:  # allowed user, not matching
            dave.purge_queue("billing.admin")
        assert str(caught.value) == forbidden("dave", "admin", "'billing.admin'", "purge")
        dave.declare_queue("orders.made", max_deliveries=3)
        with pytest.raises(Forbidden):  # admin on orders.* is not admin of the broker
            dave.xa_heuristic(txbroker.Xid(1, "g", "b"), True)
    with connect(proc, "alice") as alice, pytest.raises(Forbidden) as caught:
        alice.purge_queue("orders.admin")  # matching pattern, no admin permission
    assert str(caught.value) == forbidden("alice", "admin", "'orders.admin'", "purge")
    with connect(proc, "root") as root:
        assert root.queue_info("billing.admin")["depth"] == 1
        assert root.queue_info("orders.made")["settings"]["max_deliveries"] == 3
        with pytest.raises(XAError) as xa:  # past the ACL: the core says the xid is unknown
            root.xa_heuristic(txbroker.Xid(1, "g", "b"), True)
        assert xa.value.errcode == -4
    xid = str(txbroker.Xid(1, "g", "b"))
    assert audit.take() == [
        event("dave", "admin", "purge", "orders.admin", "allowed"),
        event("dave", "admin", "purge", "billing.admin", "denied"),
        event("dave", "admin", "declare", "orders.made", "allowed"),
        event("dave", "admin", "xa_heuristic", xid, "denied"),
        event("alice", "admin", "purge", "orders.admin", "denied"),
        event("root", "admin", "xa_heuristic", xid, "allowed")]


def test_wrong_password(acl_broker: tuple[BrokerProcess, Audit], audit: Audit) -> None:
    proc = acl_broker[0]
    with pytest.raises(AuthenticationFailed) as caught:
        txbroker.connect(f"txb://alice:wrong@127.0.0.1:{proc.port}", reconnect=False)
    assert str(caught.value) == "wrong user or password"
    assert audit.take() == [event("alice", "login", "authenticate", None, "denied")]


def test_without_acl_everyone_may_do_everything(tmp_path: Path) -> None:
    """No [acl]: today's behaviour; admin actions are still audited."""
    audit_path = tmp_path / "audit.jsonl"
    config = tmp_path / "broker.toml"
    config.write_text(f'[server]\naudit_log = "{audit_path}"\n\n' + users_toml(("alice",)))
    with BrokerProcess(tmp_path / "data", "--config", str(config)) as proc, \
            connect(proc, "alice") as alice:
        alice.send("anything", b"x")
        assert alice.purge_queue("anything") == 1
    assert Audit(audit_path).take() == [event("alice", "admin", "purge", "anything", "allowed")]


def test_docs_example(tmp_path: Path) -> None:
    """The [users]/[acl] example of docs/security.md loads and means what it says."""
    from txbroker.server.config import load_config

    text = (ROOT / "docs" / "security.md").read_text()
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    block = block.replace("scrypt$16384$8$1$…", hash_password(PASSWORD))
    path = tmp_path / "broker.toml"
    path.write_text(block)
    config = load_config(path)
    acl = AccessControl(config.acl)
    assert acl.allows("alice", "send", "orders.eu")
    assert not acl.allows("alice", "send", "orders.eu.late")
    assert not acl.allows("alice", "consume", "orders.eu")
    assert acl.allows("alice", "consume", "replies.alice.42")
    assert acl.allows("bob", "consume", "orders.eu.late")
    assert acl.allows("bob", "browse", "orders")
    assert acl.allows("bob", "admin", "orders.eu")
    assert not acl.allows("bob", "admin", None)
    assert not acl.allows("bob", "send", "orders.eu")
    assert acl.allows("ops", "admin", None)
    assert acl.allows("ops", "send", "anything")


# --------------------------------------------------------------------- one decision, in process
def in_process_acl() -> Any:
    import tomllib

    return parse_acl(tomllib.loads(ACL)["acl"], USERS)


def test_a_refusal_is_the_same_decision_on_both_edges(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Native and STOMP get the same code and words from the one check; the
    logger ``txbroker.audit`` gets the events."""
    from tests.server.test_ops import NativePeer, StompPeer, assert_refused, with_server
    from txbroker.protocol.native import Err, Ok

    expected = forbidden("alice", "send", "'billing.x'", "send")
    digest = hash_password(PASSWORD)

    def test(server: Any) -> None:
        native = NativePeer(server)
        native.hello(user="alice", password=PASSWORD)
        assert native.request(2, "send", dest="billing.x", body=b"no") == [
            Err(2, ErrorCode.FORBIDDEN, expected)]
        assert native.request(3, "send", dest="orders.x", body=b"ok", persistent=False) == [
            Ok(3, {"duplicate": False})]
        stomp = StompPeer(server)
        stomp.connect(login="alice", passcode=PASSWORD)
        (error,) = stomp.send("SEND", b"no", destination="/queue/billing.x", receipt="r")
        assert_refused(error, ErrorCode.FORBIDDEN, expected, "r")
        assert stomp.wire.closed
        assert "billing.x" not in server.broker.queues

    caplog.set_level("INFO", logger="txbroker.audit")
    with_server(tmp_path, test, users=dict.fromkeys(USERS, digest), acl=in_process_acl())
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "txbroker.audit"]
    for line in lines:
        assert TIME.fullmatch(line.pop("time"))
        assert line.pop("address").startswith("127.0.0.1:")
    assert lines == [
        {"user": "alice", "protocol": protocol, "action": "send", "op": "send",
         "destination": "billing.x", "outcome": "denied"} for protocol in ("native", "stomp")]


def test_require_admin_is_the_hook_for_broker_actions(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """What the HTTP edge calls: ``require_admin(session, action, resource)``; broker
    actions (closing a connection, XA heuristics) need admin on ``#``."""
    from tests.server.test_ops import NativePeer, with_server

    digest = hash_password(PASSWORD)

    def test(server: Any) -> None:
        sessions = {}
        for user in ("dave", "root"):
            peer = NativePeer(server)
            peer.hello(user=user, password=PASSWORD)
            sessions[user] = peer.connection.session
        ops = server.ops
        ops.require_admin(sessions["root"], "close_connection", "7")
        ops.require_admin(sessions["dave"], "purge", "orders.x")
        with pytest.raises(Forbidden) as caught:
            ops.require_admin(sessions["dave"], "close_connection", "7")
        assert str(caught.value) == forbidden("dave", "admin", "the broker", "close_connection")
        with pytest.raises(Forbidden):
            ops.require_admin(sessions["dave"], "delete", "billing.x")

    caplog.set_level("INFO", logger="txbroker.audit")
    with_server(tmp_path, test, users=dict.fromkeys(USERS, digest), acl=in_process_acl())
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "txbroker.audit"]
    assert [(x["user"], x["op"], x["destination"], x["outcome"]) for x in lines] == [
        ("root", "close_connection", "7", "allowed"),
        ("dave", "purge", "orders.x", "allowed"),
        ("dave", "close_connection", "7", "denied"),
        ("dave", "delete", "billing.x", "denied")]


#: Every native op: the permission it needs (None: nothing more than a login),
#: the audit name of its check, and arguments naming ``billing.x`` (docs/security.md).
XID = "1-67-62"
NATIVE_OPS: dict[str, tuple[str | None, str, dict[str, Any]]] = {
    "send": ("send", "send", {"dest": "billing.x", "body": b"x"}),
    "send_batch": ("send", "send_batch", {"dest": "billing.x", "bodies": [b"x"]}),
    "subscribe": ("consume", "subscribe", {"sub": 1, "queue": "billing.x"}),
    "receive": ("consume", "receive", {"queue": "billing.x", "timeout_ms": 0}),
    "ack_by_id": ("consume", "ack_by_id", {"queue": "billing.x", "id": 1}),
    "topic_subscribe": ("consume", "topic_subscribe", {"topic": "billing.x", "name": "s"}),
    "stream_open": ("consume", "stream_open", {"queue": "billing.x", "name": "r"}),
    "stream_commit": ("consume", "stream_commit", {"queue": "billing.x", "name": "r",
                                                   "end": 1}),
    "stream_info": ("browse", "stream_info", {"queue": "billing.x"}),
    "stream_read": ("browse", "stream_read", {"queue": "billing.x", "start": 0, "end": 1}),
    "queue_declare": ("admin", "declare", {"name": "billing.x"}),
    "queue_update": ("admin", "update", {"name": "billing.x", "max_messages": 5}),
    "queue_purge": ("admin", "purge", {"name": "billing.x"}),
    "queue_delete": ("admin", "delete", {"name": "billing.x"}),
    "xa_heuristic": ("admin", "xa_heuristic", {"xid": XID, "outcome": "commit"}),
    "xa_forget": ("admin", "xa_forget", {"xid": XID}),
    "queue_browse": ("browse", "browse", {"name": "billing.x"}),
    "queue_move": ("admin", "move", {"name": "billing.x", "to": "orders.x"}),
    "conn_list": ("admin", "list_connections", {}),
    "conn_close": ("admin", "close_connection", {"id": 1}),
    "unsubscribe": (None, "", {"sub": 1}),
    "ack": (None, "", {"tags": [1]}),
    "nack": (None, "", {"tags": [1]}),
    "recover": (None, "", {}),
    "tx_begin": (None, "", {}),
    "tx_commit": (None, "", {"tx": 99}),
    "tx_rollback": (None, "", {"tx": 99}),
    "queue_list": (None, "", {}),
    "queue_info": (None, "", {"name": "billing.x"}),
    "ping": (None, "", {}),
    "stats": (None, "", {}),
    "xa_start": (None, "", {"xid": XID}),
    "xa_end": (None, "", {"xid": XID}),
    "xa_prepare": (None, "", {"xid": XID}),
    "xa_commit": (None, "", {"xid": XID}),
    "xa_rollback": (None, "", {"xid": XID}),
    "xa_recover": (None, "", {}),
    "xa_set_timeout": (None, "", {"seconds": 0}),
    "xa_get_timeout": (None, "", {}),
    "xa_list": (None, "", {}),
    "stream_close": (None, "", {"queue": "billing.x", "name": "r"}),
    "sink_status": (None, "", {"sink": "s"}),
    "sink_commit": (None, "", {"sink": "s", "batch": 0, "xids": []}),
    "sink_abort": (None, "", {"sink": "s", "batch": 0}),
    # the router (docs/security.md): permissions on "router.<facility>"
    "rtr_register": ("send", "rtr_register", {"facility": "billing.x"}),
    "rtr_define": ("admin", "router_define", {"facility": "billing.x", "partitions": [
        {"name": "p", "low": 0, "high": 9}]}),
    "rtr_set_partition": ("admin", "router_set_partition",
                          {"facility": "billing.x", "partition": "p", "retry_count": 1}),
    "rtr_retire_shadow": ("admin", "router_retire_shadow",
                          {"facility": "billing.x", "partition": "p"}),
    "rtr_unregister": (None, "", {"controller": 1}),
    "rtr_send": (None, "", {"controller": 1, "tid": "t", "key": 1, "body": b"x"}),
    "rtr_accept": (None, "", {"controller": 1, "tid": "t"}),
    "rtr_reject": (None, "", {"controller": 1, "tid": "t"}),
    "rtr_ack": (None, "", {"controller": 1, "tids": ["t"]}),
    "rtr_outcome": (None, "", {"tid": "t"}),
    "rtr_vote": (None, "", {"controller": 1, "tid": "t", "accept": True}),
    "rtr_done": (None, "", {"controller": 1, "tid": "t"}),
    "rtr_event": (None, "", {"controller": 1, "number": 1}),
    "rtr_show": (None, "", {}),
    "rtr_exceptions": (None, "", {}),
    "rtr_exception_commit": (None, "", {"tid": "t"}),  # unknown tid: NOT_FOUND first
    "rtr_exception_discard": (None, "", {"tid": "t"}),
}


def test_every_native_op_has_its_permission(tmp_path: Path) -> None:
    """A user with no rule at all: each op that needs a permission is FORBIDDEN
    with its words, before anything happens; the others are not."""
    import tomllib

    from tests.server.test_ops import NativePeer, with_server
    from txbroker.protocol.native import Err
    from txbroker.server.edges.native.handlers import HANDLERS

    assert set(NATIVE_OPS) == set(HANDLERS)  # a new op needs its line here
    users = (*USERS, "eve")
    acl = parse_acl(tomllib.loads(ACL)["acl"], users)

    def test(server: Any) -> None:
        eve = NativePeer(server)
        eve.hello(user="eve", password=PASSWORD)
        for rid, (op, (action, name, args)) in enumerate(NATIVE_OPS.items(), start=10):
            answer = eve.request(rid, op, **args)
            refused = [e for e in answer if isinstance(e, Err)
                       and e.code == ErrorCode.FORBIDDEN]
            if action is None:
                assert refused == [], op
                continue
            where = ("the broker" if op.startswith(("xa_", "conn_")) else
                     "'router.billing.x'" if op.startswith("rtr_") else "'billing.x'")
            assert refused == [Err(rid, ErrorCode.FORBIDDEN,
                                   forbidden("eve", action, where, name))], op
        assert "billing.x" not in server.broker.queues  # nothing was made

    with_server(tmp_path, test, users=dict.fromkeys(users, hash_password(PASSWORD)), acl=acl)
