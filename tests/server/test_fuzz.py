"""Hypothesis throws bytes and odd requests at a live broker.

Every test checks what the broker answers, not only that it survives:

* ``test_random_frames``: bytes before ``hello`` (frames of any length, msgpack
  of any shape, requests of every op). A reference reading of docs/protocol.md
  ("Frames") predicts each reply exactly: ``NOT_AUTHENTICATED`` (17) for a
  request, ``BAD_REQUEST`` (5) for a ``hello`` of another version, and for a
  broken frame an ``ERR`` with rid 0 and ``PROTOCOL`` (2) or
  ``FRAME_TOO_LARGE`` (3), then the close. A connection that broke no rule
  stays open: a ``hello`` and a ``ping`` on it then succeed.
* ``test_malformed_requests``: requests of every op (every ``xa_*``,
  ``stream_*``, ``sink_*``, ``send_batch`` …) with exactly one argument missing
  or of the wrong type get exactly ``BAD_REQUEST`` (5), or for XA requests
  ``XAER_INVAL`` (2000 − 5 = 1995); an unknown op gets ``UNKNOWN_OP`` (4); a
  second ``hello`` ``BAD_REQUEST``. With rid 0 the same code comes as an
  ``error`` push. The connection stays usable and stored data is untouched.
* ``test_random_requests``: any op with arguments drawn from real names and
  random values. Whatever happens, the broker answers every request once
  (``receive`` may wait), with a result or a documented error code — never
  ``INTERNAL`` or a protocol error — and the connection stays usable.

``test_stored_data_intact_after_fuzzing`` then checks the reference queue.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import txbroker
from tests.support import ROOT, BrokerProcess, RawClient
from txbroker.errors import ErrorCode

OK, ERR, PUSH = 1, 2, 3
BAD_REQUEST, UNKNOWN_OP, NOT_AUTHENTICATED = 5, 4, 17
PROTOCOL, FRAME_TOO_LARGE = 2, 3
XAER_INVAL_WIRE = 2000 - 5

#: Every op of docs/protocol.md's table (test_the_fuzzed_ops_are_the_documented_ops).
ALL_OPS = [
    "hello", "ping", "send", "subscribe", "unsubscribe", "receive", "ack", "ack_by_id", "nack",
    "tx_begin", "tx_commit", "tx_rollback", "queue_declare", "queue_update", "queue_delete",
    "queue_purge", "queue_list", "queue_info", "topic_subscribe", "stats",
    "xa_start", "xa_end", "xa_prepare", "xa_commit", "xa_rollback", "xa_recover",
    "xa_forget", "xa_heuristic", "xa_set_timeout", "xa_get_timeout", "xa_list",
    "send_batch", "stream_open", "stream_info", "stream_read", "stream_commit",
    "stream_close", "sink_status", "sink_commit", "sink_abort", "recover",
    "queue_browse", "queue_move", "conn_list", "conn_close",
    "rtr_register", "rtr_unregister", "rtr_send", "rtr_accept", "rtr_reject", "rtr_ack",
    "rtr_outcome", "rtr_vote", "rtr_done", "rtr_event", "rtr_define", "rtr_show",
    "rtr_set_partition", "rtr_retire_shadow", "rtr_exceptions", "rtr_exception_commit",
    "rtr_exception_discard",
]

PRECIOUS = "precious"  #: stored before the fuzzing; no request may name it
QUEUE = "fz-args"  #: exists; test_malformed_requests' valid queue arguments name it
TOPIC = "fz-args-topic"
RESERVED = {PRECIOUS, QUEUE, TOPIC}
XID = "00000000-0102-03"  #: a well-formed Xid text

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=20)
    | st.binary(max_size=64) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12,
)


@dataclass
class Live:
    """The broker under fuzz and the frame limit its hello announced."""

    port: int
    url: str
    max_frame_size: int


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    proc = BrokerProcess(Path(tmp_path_factory.mktemp("fuzz")) / "data").start()
    try:
        with txbroker.connect(proc.url) as conn:
            conn.declare_queue(PRECIOUS)
            for i in range(20):
                conn.send(PRECIOUS, b"keep-%d" % i)
            conn.declare_queue(QUEUE)
            conn.declare_topic(TOPIC)
            max_frame_size = int(conn.server_info["max_frame_size"])
        yield Live(proc.port, proc.url, max_frame_size)
    finally:
        proc.kill()


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return len(payload).to_bytes(4, "big") + payload


def read_frame(raw: RawClient, timeout: float = 10.0) -> list[Any] | None:
    """The next frame, or None once the broker closed the connection."""
    raw.sock.settimeout(timeout)
    try:
        return raw.read_frame()
    except ConnectionResetError:
        return None


def shape(reply: list[Any]) -> tuple[Any, ...]:
    """What a test predicts of a reply: (OK, rid) / (ERR, rid, code) / (PUSH, event, code)."""
    kind, rid, name, body = reply
    if kind == OK:
        return (OK, rid)
    if kind == ERR:
        return (ERR, rid, body["code"])
    return (PUSH, name, body.get("code"))


def refusal(rid: int, code: int) -> tuple[Any, ...]:
    """The reply a refused request gets: an ERR for its rid, or an ``error`` push for rid 0."""
    return (ERR, rid, code) if rid else (PUSH, "error", code)


def assert_usable(raw: RawClient, rid: int = 2**40) -> None:
    """A valid request on this connection still gets its answer."""
    raw.request(rid, "ping", {})
    reply = read_frame(raw)
    assert reply is not None, "the broker closed a connection that broke no rule"
    assert shape(reply) == (OK, rid), reply


def assert_precious_intact(raw: RawClient, rid: int = 2**40 + 1) -> None:
    reply = raw.call(rid, "queue_info", name=PRECIOUS)
    assert reply[0] == OK and (reply[3]["depth"], reply[3]["in_flight"]) == (20, 0), reply


# --------------------------------------------------------------------- frames before hello
def expected_before_hello(data: bytes, max_frame: int) -> tuple[list[tuple[Any, ...]], str, int]:
    """docs/protocol.md "Frames", read independently of the broker's codec: the replies
    to ``data`` sent before ``hello``, how the connection ends ("closed" after a broken
    frame, "open", or "partial": waiting for the rest of a frame) and how many bytes
    the broker reads before it closes (the rest is not sent, so that the close is
    clean)."""
    replies: list[tuple[Any, ...]] = []
    pos = 0
    while len(data) - pos >= 4:
        length = int.from_bytes(data[pos:pos + 4], "big")
        if length > max_frame:
            return [*replies, (ERR, 0, FRAME_TOO_LARGE)], "closed", pos + 4
        if length == 0:
            return [*replies, (ERR, 0, PROTOCOL)], "closed", pos + 4
        end = pos + 4 + length
        if end > len(data):
            return replies, "partial", len(data)
        try:
            obj = msgpack.unpackb(data[pos + 4:end], raw=False)
        except Exception:
            return [*replies, (ERR, 0, PROTOCOL)], "closed", end
        if not (type(obj) is list and len(obj) == 4 and obj[0] == 0 and type(obj[0]) is int
                and type(obj[1]) is int and obj[1] >= 0 and type(obj[2]) is str
                and type(obj[3]) is dict):
            return [*replies, (ERR, 0, PROTOCOL)], "closed", end
        _, rid, op, args = obj
        if op == "hello":
            # docs: another version gets BAD_REQUEST (true and 1.0 are not the int 1)
            version = args.get("version", 1)
            assume(type(version) is not int or version != 1)  # this one would log in
            replies.append(refusal(rid, BAD_REQUEST))
        else:
            replies.append(refusal(rid, NOT_AUTHENTICATED))
        pos = end
    return replies, ("partial" if pos < len(data) else "open"), len(data)


rids = st.integers(0, 2**64 - 1)
not_hello = st.sampled_from([op for op in ALL_OPS if op != "hello"] + ["nonsense", ""])
bad_versions = values.filter(lambda v: type(v) is not int or v != 1)  # True, 1.0: refused
arg_maps = st.dictionaries(st.text(max_size=10), values, max_size=4)
requests = st.tuples(st.just(0), rids, not_hello, arg_maps).map(list)


def replaced(request: list[Any], index: int, value: Any) -> bytes:
    """A request frame with element ``index`` of its array replaced by ``value``."""
    return frame([*request[:index], value, *request[index + 1:]])


def wrong_element(index: int, wrong: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.builds(replaced, requests, st.just(index), wrong)


#: What a client may send before hello without breaking the protocol.
valid_pieces = st.one_of(
    requests.map(frame),
    st.builds(lambda rid, v, args: frame([0, rid, "hello", {**args, "version": v}]),
              rids, bad_versions, arg_maps),
)
#: A frame that breaks the protocol, or bytes that do not make a whole frame.
breaking_pieces = st.one_of(
    wrong_element(0, st.integers(-3, 6).filter(bool) | values.filter(lambda v: v != 0)),
    wrong_element(1, st.integers(-2**63, -1) | values.filter(lambda v: type(v) is not int)),
    wrong_element(2, values.filter(lambda v: type(v) is not str)),
    wrong_element(3, values.filter(lambda v: type(v) is not dict)),
    st.builds(lambda request, extra: frame([*request, *extra]),  # not 4 elements
              requests, st.lists(values, min_size=1, max_size=2)),
    st.builds(lambda request, size: frame(request[:size]), requests, st.integers(0, 3)),
    st.builds(frame, values),  # any msgpack value
    st.binary(min_size=1, max_size=40).map(lambda b: len(b).to_bytes(4, "big") + b),
    st.just(b"\x00\x00\x00\x00"),  # length 0
    st.integers(2**23 + 1, 2**32 - 1).map(lambda n: n.to_bytes(4, "big")),  # too large
    st.binary(min_size=1, max_size=12),  # unframed bytes
    st.binary(min_size=1, max_size=40).map(  # a frame cut short
        lambda b: (len(b) + 5).to_bytes(4, "big") + b),
)
traffic = st.builds(lambda good, bad: [*good, *([bad] if bad is not None else [])],
                    st.lists(valid_pieces, max_size=4), st.none() | breaking_pieces)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(chunks=traffic, split=st.integers(1, 64))
def test_random_frames(live: Live, chunks: list[bytes], split: int) -> None:
    data = b"".join(chunks)
    expected, end, read = expected_before_hello(data, live.max_frame_size)
    raw = RawClient(live.port)
    try:
        sent = data[:read]
        for start in range(0, len(sent), split):
            raw.send_raw(sent[start:start + split])
        got = []
        for _ in expected:
            reply = read_frame(raw)
            assert reply is not None, f"closed after {got}, expected {expected}"
            got.append(shape(reply))
        assert got == expected
        if end == "closed":
            assert read_frame(raw) is None, "nothing may follow the ERR of a broken frame"
        elif end == "partial":  # waiting for the rest of a frame: no reply, not closed
            with pytest.raises(TimeoutError):
                read_frame(raw, timeout=0.2)
        else:  # the connection is still usable: hello, then requests
            reply = raw.call(2**40 + 2, "hello", version=1)
            assert reply[0] == OK and reply[3]["server"] == "txbroker", reply
            assert_usable(raw)
    finally:
        raw.close()
    check = RawClient(live.port)  # the broker serves others as before
    try:
        assert check.call(1, "hello", version=1)[0] == OK
        assert_precious_intact(check)
    finally:
        check.close()


# --------------------------------------------------------------------- malformed requests
# op -> (required args, optional args); each arg -> (kind, a valid value). Kinds follow
# docs/protocol.md: "int" is an integer (not a boolean), "map" a msgpack map, "headers"
# a map of strings to strings, "tags" a non-empty list of delivery tags, "xid" an Xid's
# text form, "outcome" "commit" or "rollback", "setting" a queue setting's value.
REQUESTS: dict[str, tuple[dict[str, tuple[str, Any]], dict[str, tuple[str, Any]]]] = {
    "send": ({"dest": ("str", QUEUE), "body": ("bytes", b"x")},
             {"headers": ("headers", {"k": "v"}), "message_id": ("str", "m"),
              "persistent": ("bool", True), "priority": ("int", 4), "ttl_ms": ("int", 0),
              "delay_ms": ("int", 0), "tx": ("int", 1)}),
    "subscribe": ({"queue": ("str", QUEUE), "sub": ("int", 1)},
                  {"prefetch": ("int", 10), "ack": ("str", "client")}),
    "unsubscribe": ({"sub": ("int", 1)}, {}),
    "receive": ({"queue": ("str", QUEUE)}, {"timeout_ms": ("int", 0)}),
    "ack": ({"tags": ("tags", [1])}, {"tx": ("int", 1)}),
    "ack_by_id": ({"queue": ("str", QUEUE), "id": ("int", 2**40)}, {"tx": ("int", 1)}),
    "nack": ({"tags": ("tags", [1])}, {"requeue": ("bool", True), "tx": ("int", 1)}),
    "tx_commit": ({"tx": ("int", 1)}, {}),
    "tx_rollback": ({"tx": ("int", 1)}, {}),
    "queue_declare": ({"name": ("str", QUEUE)},
                      {"kind": ("str", "queue"), "settings": ("settings", {}),
                       "max_messages": ("setting_int", 0), "ingress": ("setting_bool", True),
                       "dead_letter_queue": ("setting_str", "")}),
    "queue_update": ({"name": ("str", QUEUE)},
                     {"settings": ("settings", {}), "max_bytes": ("setting_int", 0),
                      "egress": ("setting_bool", True), "expiry_queue": ("setting_str", "")}),
    "queue_delete": ({"name": ("str", QUEUE)}, {}),
    "queue_purge": ({"name": ("str", QUEUE)}, {}),
    "queue_info": ({"name": ("str", QUEUE)}, {}),
    "queue_browse": ({"name": ("str", QUEUE)}, {"limit": ("int", 10)}),
    "queue_move": ({"name": ("str", QUEUE)}, {"to": ("str", "fz-move-to"), "limit": ("int", 1)}),
    "conn_close": ({"id": ("int", 2**40)}, {}),  # no such connection: nobody is closed
    "topic_subscribe": ({"topic": ("str", TOPIC), "name": ("str", "sub")},
                        {"durable": ("bool", True), "settings": ("map", {})}),
    "xa_start": ({"xid": ("xid", XID)}, {"flags": ("int", 0)}),
    "xa_end": ({"xid": ("xid", XID)}, {"flags": ("int", 0)}),
    "xa_prepare": ({"xid": ("xid", XID)}, {}),
    "xa_commit": ({"xid": ("xid", XID)}, {"one_phase": ("bool", False)}),
    "xa_rollback": ({"xid": ("xid", XID)}, {}),
    "xa_recover": ({}, {"flags": ("int", 0)}),
    "xa_forget": ({"xid": ("xid", XID)}, {}),
    "xa_heuristic": ({"xid": ("xid", XID), "outcome": ("outcome", "commit")}, {}),
    "xa_set_timeout": ({"seconds": ("int", 30)}, {}),
    "send_batch": ({"dest": ("str", QUEUE), "bodies": ("list", [b"x"])},
                   {"headers": ("list", [None]), "message_ids": ("list", [None]),
                    "persistent": ("bool", True)}),
    "stream_open": ({"queue": ("str", QUEUE), "name": ("str", "r")}, {}),
    "stream_info": ({"queue": ("str", QUEUE)}, {}),
    "stream_read": ({"queue": ("str", QUEUE), "start": ("int", 1), "end": ("int", 2)},
                    {"name": ("str", "r"), "max": ("int", 1), "max_bytes": ("int", 100)}),
    "stream_commit": ({"queue": ("str", QUEUE), "name": ("str", "r"), "end": ("int", 1)}, {}),
    "stream_close": ({"queue": ("str", QUEUE), "name": ("str", "r")}, {}),
    "sink_status": ({"sink": ("str", "fz-sink")}, {}),
    "sink_commit": ({"sink": ("str", "fz-sink"), "batch": ("int", 0), "xids": ("list", [])},
                    {}),
    "sink_abort": ({"sink": ("str", "fz-sink"), "batch": ("int", 0)}, {}),
    # the router's ops (docs/router.md): "fz-fac" is not defined, controller 2**40 is
    # nobody's, so a well-typed request is refused (NOT_FOUND) and changes nothing
    "rtr_register": ({"facility": ("str", "fz-fac")},
                     {"kind": ("str", "client"), "role": ("str", "primary"),
                      "explicit_prepare": ("bool", False)}),
    "rtr_unregister": ({"controller": ("int", 2**40)}, {}),
    "rtr_send": ({"controller": ("int", 2**40), "tid": ("str", "fz-t"), "body": ("bytes", b"x")},
                 {"accept": ("bool", False), "headers": ("headers", {})}),
    "rtr_accept": ({"controller": ("int", 2**40), "tid": ("str", "fz-t")}, {}),
    "rtr_reject": ({"controller": ("int", 2**40), "tid": ("str", "fz-t")},
                   {"reason": ("str", "CLIENT")}),
    "rtr_ack": ({"controller": ("int", 2**40), "tids": ("list", [])}, {}),
    "rtr_outcome": ({"tid": ("str", "fz-t")}, {"controller": ("int", 2**40)}),
    "rtr_vote": ({"controller": ("int", 2**40), "tid": ("str", "fz-t"),
                  "accept": ("bool", True)}, {"reason": ("str", ""), "seen": ("int", 1)}),
    "rtr_done": ({"controller": ("int", 2**40), "tid": ("str", "fz-t")}, {}),
    "rtr_event": ({"controller": ("int", 2**40), "number": ("int", 1)},
                  {"body": ("bytes", b""), "recipient": ("str", "*")}),
    "rtr_define": ({"facility": ("str", "fz-fac"), "partitions": ("list", [])}, {}),
    "rtr_show": ({}, {"facility": ("str", "fz-fac")}),
    "rtr_set_partition": ({"facility": ("str", "fz-fac"), "partition": ("str", "p")},
                          {"retry_count": ("int", 3), "vote_timeout_ms": ("int", 100)}),
    "rtr_retire_shadow": ({"facility": ("str", "fz-fac"), "partition": ("str", "p")}, {}),
    "rtr_exceptions": ({}, {"facility": ("str", "fz-fac")}),
    "rtr_exception_commit": ({"tid": ("str", "fz-t")}, {}),
    "rtr_exception_discard": ({"tid": ("str", "fz-t")}, {}),
}
#: Ops with no argument that could be wrong (they are in test_random_requests).
NO_ARGUMENTS = {"ping", "tx_begin", "queue_list", "stats", "xa_get_timeout", "xa_list",
                "recover", "conn_list"}
#: docs/protocol.md "Queue settings" (counts and limits are >= 0).
SETTINGS = {
    "max_messages": "setting_int", "max_bytes": "setting_int", "max_deliveries": "setting_int",
    "dead_letter_queue": "setting_str", "expiry_queue": "setting_str",
    "default_ttl_ms": "setting_int", "ingress": "setting_bool", "egress": "setting_bool",
    "dup_window": "setting_int", "redelivery_delay_ms": "setting_int",
    "reject_to_sender_on_discard": "setting_bool",
}
XID_TEXT = re.compile(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]*-[0-9A-Fa-f]*")


def conforms(kind: str, value: Any) -> bool:
    """Whether ``value`` is a valid argument of ``kind`` (the types of docs/protocol.md)."""
    if kind in ("int", "setting_int"):
        return type(value) is int and (kind == "int" or value >= 0)
    if kind in ("bool", "setting_bool"):
        return type(value) is bool
    if kind in ("str", "setting_str"):
        return type(value) is str
    if kind == "bytes":
        return type(value) is bytes
    if kind in ("list", "map"):
        return type(value) is (list if kind == "list" else dict)
    if kind == "headers":
        return type(value) is dict and all(type(v) is str for v in value.values())
    if kind == "tags":
        return type(value) is list and bool(value) and all(type(t) is int for t in value)
    if kind == "settings":
        return type(value) is dict and all(
            key in SETTINGS and conforms(SETTINGS[key], v) for key, v in value.items())
    if kind == "xid":
        return type(value) is str and XID_TEXT.fullmatch(value) is not None
    if kind == "outcome":
        return value in ("commit", "rollback")
    raise AssertionError(kind)


def wrong_values(kind: str, optional: bool) -> st.SearchStrategy[Any]:
    """Values that are not a valid ``kind`` (an optional argument is never nil: absent
    and nil mean the same to some ops)."""
    pool = values
    if kind == "xid":
        pool = values | st.text(max_size=30)
    elif kind == "settings":  # a map with an unknown setting or a setting of a wrong type
        pool = values | st.dictionaries(st.sampled_from(sorted(SETTINGS)) | st.text(max_size=8),
                                        values | st.integers(-5, 5), min_size=1, max_size=2)
    elif kind.startswith("setting_"):
        pool = values | st.integers(-5, -1)
    elif kind == "tags":
        pool = values | st.lists(values, min_size=1, max_size=3)
    return pool.filter(lambda v: not conforms(kind, v) and not (optional and v is None))


@st.composite
def malformed_request(draw: st.DrawFn) -> tuple[int, str, dict[str, Any], int]:
    """(rid, op, args, the error code docs/protocol.md gives for them)."""
    rid = draw(st.integers(0, 2**32))
    choice = draw(st.sampled_from([*sorted(REQUESTS), "<unknown op>", "<second hello>"]))
    if choice == "<unknown op>":
        op = draw(st.text(max_size=12).filter(lambda name: name not in ALL_OPS))
        return rid, op, draw(arg_maps), UNKNOWN_OP
    if choice == "<second hello>":
        return rid, "hello", {"version": 1}, BAD_REQUEST
    required, optional = REQUESTS[choice]
    targets = [(name, kind, False) for name, (kind, _) in required.items()]
    targets += [(name, kind, True) for name, (kind, _) in optional.items()]
    name, kind, is_optional = draw(st.sampled_from(targets))
    args = {arg: valid for arg, (_, valid) in required.items()}
    # some optional arguments, valid (a setting given on its own would override the
    # same one inside a broken 'settings' map: those stay out then)
    others = sorted(arg for arg, (other, _) in optional.items()
                    if not (kind == "settings" and other.startswith("setting_")))
    if others:
        chosen = draw(st.sets(st.sampled_from(others), max_size=3))
        args.update({arg: optional[arg][1] for arg in chosen})
    if not is_optional and draw(st.booleans()):
        del args[name]  # a required argument missing
    else:
        args[name] = draw(wrong_values(kind, is_optional))
    code = XAER_INVAL_WIRE if choice.startswith("xa_") else BAD_REQUEST
    return rid, choice, args, code


def test_the_fuzzed_ops_are_the_documented_ops() -> None:
    documented = re.findall(r"^\| `([a-z_]+)` \|", (ROOT / "docs" / "protocol.md").read_text(),
                            re.MULTILINE)
    pushes = {"deliver", "cancelled", "error", "rtr"}
    assert sorted(ALL_OPS) == sorted(set(documented) - pushes)
    assert set(REQUESTS) | NO_ARGUMENTS | {"hello"} == set(ALL_OPS)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(malformed_request(), min_size=1, max_size=6))
def test_malformed_requests(live: Live,
                            batch: list[tuple[int, str, dict[str, Any], int]]) -> None:
    raw = RawClient(live.port)
    try:
        assert raw.call(2**41, "hello", version=1)[0] == OK
        for rid, op, args, _ in batch:
            raw.request(rid, op, args)
        got = []
        for _ in batch:
            reply = read_frame(raw)
            assert reply is not None, f"closed after {got}"
            got.append(shape(reply))
        assert got == [refusal(rid, code) for rid, _, _, code in batch]
        assert_usable(raw)
        assert_precious_intact(raw)
        info = raw.call(2**40 + 3, "queue_info", name=QUEUE)
        assert info[0] == OK and info[3]["depth"] == 0 and info[3]["consumers"] == 0, info
    finally:
        raw.close()


# --------------------------------------------------------------------- any request
NAMES = ["fz-a", "fz-b", "fz-t", "fz-a::s", "s", "", "x" * 300, "fz a"]
names = st.sampled_from(NAMES) | st.text(max_size=12)
arg_values = st.one_of(
    values, names, st.integers(0, 8), st.sampled_from([XID, "00000001-AA-BB", "1-2-3"]),
    st.lists(st.integers(0, 8), max_size=3), st.lists(st.binary(max_size=8), max_size=3),
    st.sampled_from(["commit", "rollback", "client", "auto", "queue", "topic"]),
)
ARG_NAMES = sorted({name for required, optional in REQUESTS.values()
                    for name in [*required, *optional]} | {"seconds", "version", "user"})
random_requests = st.tuples(st.sampled_from([*ALL_OPS, "nonsense"]), st.dictionaries(
    st.sampled_from(ARG_NAMES) | st.text(max_size=6), arg_values, max_size=5))
#: Codes a request may get: documented refusals (not INTERNAL, not the protocol errors,
#: not the ones about the connection, the store or shutdown) and XA codes (2000 + errcode).
REFUSALS = {int(code) for code in ErrorCode} - {
    ErrorCode.INTERNAL, ErrorCode.PROTOCOL, ErrorCode.FRAME_TOO_LARGE,
    ErrorCode.NOT_AUTHENTICATED, ErrorCode.TOO_MANY_CONNECTIONS,
    ErrorCode.AUTHENTICATION_FAILED, ErrorCode.STORAGE_FAILED, ErrorCode.SHUTTING_DOWN}
REFUSALS |= set(range(2000 - 9, 2000 - 2)) | set(range(2005, 2009)) | set(range(2100, 2108))


def keep_off(value: Any) -> Any:
    """The value with names of the reference queues replaced (never touched on purpose)."""
    if isinstance(value, str) and value.split("::")[0] in RESERVED:
        return "fz-a"
    if isinstance(value, list):
        return [keep_off(v) for v in value]
    if isinstance(value, dict):
        return {k: keep_off(v) for k, v in value.items()}
    return value


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(random_requests, min_size=1, max_size=8),
       silent=st.lists(st.booleans(), min_size=8, max_size=8))
def test_random_requests(live: Live, batch: list[tuple[str, dict[str, Any]]],
                         silent: list[bool]) -> None:
    raw = RawClient(live.port)
    try:
        assert raw.call(2**41, "hello", version=1)[0] == OK
        waiting: dict[int, str] = {}
        for index, (op, args) in enumerate(batch):
            rid = 0 if silent[index] else index + 1
            raw.request(rid, op, keep_off(args))
            if rid and op != "receive":  # a receive may wait for a message
                waiting[rid] = op
        ping = 2**40
        raw.request(ping, "ping", {})
        answered: set[int] = set()
        while waiting.keys() - answered or ping not in answered:
            reply = read_frame(raw)
            assert reply is not None, f"closed; unanswered: {waiting.keys() - answered}"
            kind, rid, name, body = reply
            if kind == PUSH:
                assert name in ("deliver", "cancelled", "error"), reply
                if name == "error":
                    assert body["code"] in REFUSALS, reply
                continue
            assert rid not in answered, f"two replies to request {rid}"
            assert rid == ping or 1 <= rid <= len(batch), reply
            answered.add(rid)
            if kind == ERR:
                op = batch[rid - 1][0] if rid != ping else "ping"
                assert body["code"] in REFUSALS, (op, reply)
                assert op != "ping", reply
        assert_precious_intact(raw)
    finally:
        raw.close()


@pytest.mark.parametrize("version", [True, 1.0, "1", 2, None])
def test_hello_of_any_other_version_is_refused(live: Live, version: Any) -> None:
    raw = RawClient(live.port)
    try:
        reply = raw.call(7, "hello", version=version)
        assert (reply[0], reply[3]["code"]) == (ERR, BAD_REQUEST), reply
        assert raw.call(8, "hello", version=1)[0] == OK  # the connection is still usable
    finally:
        raw.close()


def test_stored_data_intact_after_fuzzing(live: Live) -> None:
    with txbroker.connect(live.url) as conn:
        info = conn.queue_info(PRECIOUS)
        assert (info["depth"], info["in_flight"]) == (20, 0)
        page = conn.stream_read(PRECIOUS, 1, 21)  # reads without consuming
        assert list(page.seqs) == list(range(1, 21))
        assert list(page.bodies) == [b"keep-%d" % i for i in range(20)]


def test_a_reset_mid_frame_leaves_the_broker_serving(live: Live) -> None:
    sock = socket.create_connection(("127.0.0.1", live.port))
    sock.sendall(frame([0, 1, "hello", {"version": 1}])[:-3])
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # RST with half a frame sent
    raw = RawClient(live.port)
    try:
        assert raw.call(1, "hello", version=1)[0] == OK
        assert_usable(raw)
    finally:
        raw.close()
