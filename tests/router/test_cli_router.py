"""``txbroker router …``: what each command sends and prints (a stand-in connection)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from txbroker import cli
from txbroker.cli import common
from txbroker.cli.router_commands import parse_partition

SHOW = {"facilities": [{
    "name": "BANK", "key_type": "int", "clients": 2, "exceptions": 1,
    "transactions": {"SENDING": 1, "VREQ": 0, "COMMITTING": 0, "ABORTING": 0},
    "partitions": [
        {"name": "A", "low": 0, "high": 99, "retry_count": 3, "vote_timeout_ms": 30000,
         "servers": [{"controller": 4, "session": 9, "role": "primary", "site": "primary",
                      "busy_tid": "t1", "explicit_prepare": True},
                     {"controller": 5, "session": 10, "role": "standby", "site": "primary",
                      "busy_tid": None, "explicit_prepare": False}], "shadowed": True},
        {"name": "B", "low": 100, "high": 199, "retry_count": 5, "vote_timeout_ms": 1000,
         "servers": []},
    ]}]}
EXCEPTIONS = [{"tid": "ab12", "facility": "BANK", "partitions": ["A"], "strikes": 4,
               "reason": "SRVDIED", "flagged_ms": 1, "messages": 2}]


class Conn:
    """Records the requests; answers from ``replies`` by op."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def request(self, op: str, args: dict[str, Any]) -> Any:
        self.requests.append((op, args))
        return self.replies.get(op, {})


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> Conn:
    stand_in = Conn({"rtr_show": SHOW, "rtr_exceptions": EXCEPTIONS})
    urls: list[str] = []

    def connect(url: str, tls_ca: str | None = None) -> Conn:
        urls.append(url)
        return stand_in

    monkeypatch.setattr(common, "connect", connect)
    monkeypatch.setenv("COLUMNS", "200")
    return stand_in


def txb(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    out = capsys.readouterr()
    return int(exited.value.code or 0), out.out, out.err


def table_rows(out: str) -> list[list[str]]:
    """The body rows of the rich tables in ``out``, cell by cell."""
    return [[c.strip() for c in line.strip("│").split("│")] for line in out.splitlines()
            if line.startswith("│")]


def header_of(out: str) -> list[str]:
    """The header cells of the (first) table in ``out``."""
    line = next(line for line in out.splitlines() if line.startswith("┃"))
    return [c.strip() for c in line.strip("┃").split("┃")]


def test_parse_partition_ints_and_strings() -> None:
    assert parse_partition("A:0-99") == {"name": "A", "low": 0, "high": 99}
    assert parse_partition("N:-10--1") == {"name": "N", "low": -10, "high": -1}
    assert parse_partition("S:a-m") == {"name": "S", "low": "a", "high": "m"}
    assert parse_partition("S:a-b..x-y") == {"name": "S", "low": "a-b", "high": "x-y"}
    assert parse_partition("M:1-z") == {"name": "M", "low": "1", "high": "z"}


def test_define_sends_the_partitions(conn: Conn, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = txb(capsys, "router", "define", "BANK", "--partition", "A:0-99",
                         "--partition", "B:100-199", "--retry-count", "5", "--vote-timeout",
                         "2000", "--url", "txb://h:1")
    assert (code, err) == (0, "")
    partitions = [{"name": "A", "low": 0, "high": 99, "retry_count": 5, "vote_timeout_ms": 2000},
                  {"name": "B", "low": 100, "high": 199, "retry_count": 5,
                   "vote_timeout_ms": 2000}]
    assert conn.requests == [("rtr_define", {"facility": "BANK", "partitions": partitions})]
    assert out.splitlines()[0] == "facility BANK: 2 partition(s) defined"
    assert table_rows(out) == [["A", "0", "99", "5", "2000"], ["B", "100", "199", "5", "2000"]]


def test_define_bad_partition_is_a_usage_error(conn: Conn,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = txb(capsys, "router", "define", "BANK", "--partition", "A0-99")
    assert code == 2
    assert err.startswith("error: Invalid value: 'A0-99': expected NAME:LOW-HIGH")
    assert conn.requests == []


def test_show_table_and_json(conn: Conn, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = txb(capsys, "router", "show", "BANK")
    assert code == 0
    assert conn.requests == [("rtr_show", {"facility": "BANK"})]
    lines = out.splitlines()
    assert lines[0] == ("facility BANK (int keys): 2 client(s), transactions: SENDING 1, "
                        "VREQ 0, COMMITTING 0, ABORTING 0, exceptions: 1")
    assert table_rows(out) == [
        ["A", "0", "99", "3", "30000", "yes", "4", "primary", "primary", "t1", "explicit"],
        ["", "", "", "", "", "", "5", "standby", "primary", "", "implicit"],
        ["B", "100", "199", "5", "1000", "no", "-", "", "", "", ""],
    ]
    code, out, _ = txb(capsys, "router", "show", "--json")
    assert code == 0 and json.loads(out) == SHOW
    assert conn.requests[-1] == ("rtr_show", {})


def test_set_partition(conn: Conn, capsys: pytest.CaptureFixture[str]) -> None:
    conn.replies["rtr_set_partition"] = {"name": "A", "low": 0, "high": 99, "retry_count": 7,
                                         "vote_timeout_ms": 30000}
    code, out, _ = txb(capsys, "router", "set-partition", "BANK", "A", "--retry-count", "7")
    assert code == 0
    assert conn.requests == [("rtr_set_partition",
                              {"facility": "BANK", "partition": "A", "retry_count": 7})]
    assert table_rows(out) == [["A", "0", "99", "7", "30000"]]
    code, _, err = txb(capsys, "router", "set-partition", "BANK", "A")
    assert code == 2 and "give --retry-count and/or --vote-timeout" in err


def test_retire_shadow(conn: Conn, capsys: pytest.CaptureFixture[str]) -> None:
    conn.replies["rtr_retire_shadow"] = {"facility": "BANK", "partition": "A", "released": 3}
    code, out, _ = txb(capsys, "router", "retire-shadow", "BANK", "A")
    assert code == 0 and conn.requests == [("rtr_retire_shadow",
                                            {"facility": "BANK", "partition": "A"})]
    assert out == ("BANK/A: secondary site retired (3 transaction(s) no longer wait for "
                   "it)\n")


def test_exceptions_list_commit_discard(conn: Conn, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = txb(capsys, "router", "exceptions", "list", "BANK")
    assert code == 0
    assert header_of(out) == ["tid", "facility", "partitions", "strikes", "reason", "messages"]
    assert table_rows(out) == [["ab12", "BANK", "A", "4", "SRVDIED", "2"]]
    code, out, _ = txb(capsys, "router", "exceptions", "list", "--json")
    assert code == 0 and json.loads(out) == EXCEPTIONS
    assert txb(capsys, "router", "exceptions", "commit", "ab12") == (0, "ab12: committed\n", "")
    assert txb(capsys, "router", "exceptions", "discard", "cd34") == (0, "cd34: discarded\n", "")
    assert conn.requests == [("rtr_exceptions", {"facility": "BANK"}), ("rtr_exceptions", {}),
                             ("rtr_exception_commit", {"tid": "ab12"}),
                             ("rtr_exception_discard", {"tid": "cd34"})]
