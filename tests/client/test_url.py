"""Client URL parsing."""

from __future__ import annotations

import pytest

from txbroker.client.url import ClientURL, HostPort, parse_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("txb://127.0.0.1:5445", ClientURL((HostPort("127.0.0.1", 5445),))),
        ("txb://broker", ClientURL((HostPort("broker", 5445),))),
        ("TXB://broker:1/", ClientURL((HostPort("broker", 1),))),
        (
            "txb://a:1,b:2, c",
            ClientURL((HostPort("a", 1), HostPort("b", 2), HostPort("c", 5445))),
        ),
        ("txb://u:p@h:9", ClientURL((HostPort("h", 9),), "u", "p")),
        ("txb://u@h", ClientURL((HostPort("h", 5445),), "u", None)),
        ("txb://u:@h", ClientURL((HostPort("h", 5445),), "u", "")),
        ("txb://u%40x:p%3Aw%2F@h", ClientURL((HostPort("h", 5445),), "u@x", "p:w/")),
        ("txb://u:p@w@h", ClientURL((HostPort("h", 5445),), "u", "p@w")),
        ("txb://[::1]:7,[fe80::2]", ClientURL((HostPort("::1", 7), HostPort("fe80::2", 5445)))),
    ],
)
def test_parse_good_urls(url: str, expected: ClientURL) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("127.0.0.1:5445", "missing scheme"),
        ("http://h:1", "unsupported scheme"),
        ("txb://", "no host"),
        ("txb://u:p@", "no host"),
        ("txb://h:1,,h:2", "empty host"),
        ("txb://h:port", "port must be a number"),
        ("txb://h:0", "out of range"),
        ("txb://h:70000", "out of range"),
        ("txb://h:-1", "port must be a number"),
        ("txb://h:1/queue", "paths, queries"),
        ("txb://h:1?x=1", "paths, queries"),
        ("txb://:1", "missing host"),
        ("txb://::1", "missing host"),
        ("txb://fe80::1:5", "brackets"),
        ("txb://[::1", "unclosed"),
        ("txb://[::1]x", "unexpected"),
        ("txb://[]:1", "empty IPv6"),
        ("txb://:p@h", "empty user"),
        ("txb://h h:1", "invalid host"),
    ],
)
def test_bad_urls_raise_value_error(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="bad txbroker URL") as info:
        parse_url(url)
    assert fragment in str(info.value)


def test_str_masks_the_password() -> None:
    url = parse_url("txb://user:secret@a:1,[::1]:2")
    assert str(url) == "txb://user:***@a:1,[::1]:2"
    assert "secret" not in repr(str(url))
    assert str(parse_url("txb://h")) == "txb://h:5445"


def test_non_str_url() -> None:
    with pytest.raises(TypeError):
        parse_url(b"txb://h")  # type: ignore[arg-type]
