"""The ``txbroker`` command against a real broker process.

Every error is one line on stderr (``error: …``) and a non-zero exit: 1 for an
error, 2 for bad usage, 3 for an incomplete result (``recv`` / ``bench`` got
fewer messages than asked). No traceback, whatever the command.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support import ROOT, BrokerProcess, free_port

XID = "00000000-AA-BB"
BAD_URL_LINE = ("error: bad txbroker URL 'http://x': unsupported scheme 'http' "
                "(expected txb://[user:password@]host[:port][,host[:port]...], or txbs://... "
                "for TLS)")
#: One of each client command, with what it needs besides --url.
CLIENT_COMMANDS = [
    ["send", "q", "x"], ["recv", "q"], ["queues"], ["stat"], ["bench", "--count", "1"],
    ["xa", "list"], ["xa", "commit", XID], ["xa", "rollback", XID], ["xa", "forget", XID],
]


def txb(
    *args: str, input: bytes | None = None, check: bool = True, columns: str | None = "200"
) -> subprocess.CompletedProcess[str]:
    """Run the command; ``columns=None`` leaves the width to rich (80 off a terminal)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TXBROKER_DEBUG")}
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run([sys.executable, "-m", "txbroker.cli", *args], cwd=ROOT, env=env,
                          input=None if input is None else input.decode(), text=True,
                          capture_output=True, check=check, timeout=120)


def assert_fails(result: subprocess.CompletedProcess[str], code: int, line: str) -> None:
    """Exit ``code``, and stderr is exactly ``line`` (no traceback, no wrapping)."""
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert (result.returncode, result.stderr) == (code, line + "\n")


@pytest.fixture
def broker(tmp_path: Path):  # type: ignore[no-untyped-def]
    proc = BrokerProcess(tmp_path / "data").start()
    yield proc
    proc.kill()


@pytest.fixture
def locked_broker(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A broker with a user (alice / pw) and auto_create off."""
    from txbroker.server.security.auth import hash_password

    config = tmp_path / "broker.toml"
    config.write_text("[limits]\nauto_create = false\n\n"
                      f'[users]\nalice = "{hash_password("pw")}"\n')
    proc = BrokerProcess(tmp_path / "data", "--config", str(config)).start()
    yield proc
    proc.kill()


def test_send_recv_queues_stat(broker: BrokerProcess) -> None:
    url = ["--url", broker.url]
    out = txb("send", "orders", "first order", *url).stdout
    assert "sent 1 message(s) to orders" in out
    txb("send", "orders", *url, "--count", "500", "--size", "64")
    txb("send", "orders", *url, "--count", "30", "--tx", "10", "--size", "8")
    table = txb("queues", *url).stdout
    assert "orders" in table and "531" in table
    listed = json.loads(txb("queues", *url, "--json").stdout)
    assert [(q["name"], q["depth"]) for q in listed] == [("orders", 531)]
    got = txb("recv", "orders", *url).stdout
    assert "first order" in got
    txb("recv", "orders", *url, "--count", "10", "--quiet")
    stats = json.loads(txb("stat", *url).stdout)
    assert stats["messages"] == 520 and stats["store"]["syncs"] > 0


def test_send_reads_stdin_and_env_url(broker: BrokerProcess) -> None:
    env_url = broker.url
    os.environ["TXBROKER_URL"] = env_url
    try:
        txb("send", "piped", input=b"from stdin")
        assert "from stdin" in txb("recv", "piped").stdout
    finally:
        del os.environ["TXBROKER_URL"]


def test_bodies_and_names_are_printed_as_they_are(broker: BrokerProcess) -> None:
    """Brackets are not rich markup and long bodies are not wrapped."""
    url = ["--url", broker.url]
    long_body = "y" * 300
    sent = txb("send", "[q]", "[users] [bold]x[/bold]", *url, columns=None).stdout
    assert sent.startswith("sent 1 message(s) to [q] in ")
    txb("send", "[q]", long_body, *url)
    assert "[q]" in txb("queues", *url).stdout
    got = txb("recv", "[q]", "--count", "2", *url, columns=None).stdout
    assert got == f"1 [users] [bold]x[/bold]\n2 {long_body}\n"


def test_recv_times_out_with_exit_code(broker: BrokerProcess) -> None:
    result = txb("recv", "empty", "--url", broker.url, "--timeout", "0.2", check=False)
    assert result.stdout == ""
    assert_fails(result, 3, "error: timed out: received 0 of 1 message(s) "
                            "(none came within 0.2 s)")


def test_recv_partial_result_is_not_success(broker: BrokerProcess) -> None:
    url = ["--url", broker.url]
    txb("send", "part", "m", "--count", "3", *url)
    result = txb("recv", "part", "--count", "5", "--timeout", "0.3", *url, check=False)
    assert result.stdout == "1 m\n2 m\n3 m\n"
    assert_fails(result, 3, "error: timed out: received 3 of 5 message(s) "
                            "(none came within 0.3 s)")
    assert txb("queues", "--json", *url).stdout.count('"depth": 0') == 1  # the 3 were acked
    assert "exit code 3" in " ".join(txb("recv", "--help").stdout.split())


def test_bench_partial_consume_is_not_success(broker: BrokerProcess) -> None:
    url = ["--url", broker.url]
    txb("send", "bq", "m", "--count", "2", *url)
    result = txb("bench", "--queue", "bq", "--phase", "consume", "--count", "5",
                 "--consumers", "1", *url, check=False)
    assert json.loads(result.stdout)["consume"]["received"] == 2
    assert_fails(result, 3, "error: received 2 of 5 message(s)")


def test_bench_prints_json_summary(broker: BrokerProcess, tmp_path: Path) -> None:
    out_file = tmp_path / "bench.json"
    out = txb("bench", "--url", broker.url, "--count", "2000", "--producers", "2",
              "--consumers", "2", "--json", str(out_file)).stdout
    summary = json.loads(out)
    assert json.loads(out_file.read_text()) == summary
    assert summary["consume"]["received"] == 2000
    assert summary["send"]["msgs_per_sync"] > 1  # group commit at work


@pytest.mark.parametrize("command", CLIENT_COMMANDS, ids=" ".join)
def test_bad_url_is_one_line(command: list[str]) -> None:
    assert_fails(txb(*command, "--url", "http://x", check=False, columns=None), 1, BAD_URL_LINE)


@pytest.mark.parametrize("command", CLIENT_COMMANDS, ids=" ".join)
def test_unreachable_broker_is_one_line(command: list[str]) -> None:
    port = free_port()
    result = txb(*command, "--url", f"txb://127.0.0.1:{port}", check=False, columns=None)
    assert_fails(result, 1, f"error: no broker of the list answered: 127.0.0.1:{port}: "
                            "[Errno 111] Connection refused")


def test_broker_refusals_are_one_line(locked_broker: BrokerProcess) -> None:
    good = f"txb://alice:pw@127.0.0.1:{locked_broker.port}"
    wrong = f"txb://alice:nope@127.0.0.1:{locked_broker.port}"
    for command in (["send", "q", "x"], ["queues"], ["xa", "list"]):
        assert_fails(txb(*command, "--url", wrong, check=False), 1,
                     "error: wrong user or password")
    assert_fails(txb("send", "[users]", "x", "--url", good, check=False), 1,
                 "error: no queue '[users]' (auto_create is off)")
    assert_fails(txb("recv", "[users]", "--url", good, check=False), 1,
                 "error: no queue '[users]' (auto_create is off)")
    for command in ("commit", "rollback", "forget"):
        assert_fails(txb("xa", command, XID, "--url", good, check=False), 1,
                     f"error: XAER_NOTA: unknown Xid {XID}")


@pytest.mark.parametrize(("args", "line"), [
    (["send", "q", "x", "--header", "foo"],
     "error: Invalid value for '--header': 'foo' is not KEY=VALUE (see 'txbroker send --help')"),
    (["send", "q", "x", "--size", "-1"],
     "error: Invalid value for '--size': Input should be greater than or equal to 0 "
     "(see 'txbroker send --help')"),
    (["send", "q", "x", "--priority", "10"],
     "error: Invalid value for '--priority': Input should be less than or equal to 9 "
     "(see 'txbroker send --help')"),
    (["send"], "error: Missing argument 'queue'. (see 'txbroker send --help')"),
    (["recv", "q", "--timeout", "-1"],
     "error: Invalid value for '--timeout': Input should be greater than or equal to 0 "
     "(see 'txbroker recv --help')"),
    (["recv", "q", "--count", "0"],
     "error: Invalid value for '--count': Input should be greater than or equal to 1 "
     "(see 'txbroker recv --help')"),
    (["bench", "--phase", "foo"],
     "error: Invalid value for '--phase': Value error, 'foo' is not one of 'send', "
     "'consume', 'both'. (see 'txbroker bench --help')"),
    (["serve", "--log-level", "bogus"],
     "error: Invalid value for '--log-level': Value error, 'bogus' is not one of 'debug', "
     "'info', 'warning', 'error'. (see 'txbroker serve --help')"),
    (["serve", "--port", "abc"],
     "error: Invalid value for '--port': Input should be a valid integer, unable to parse "
     "string as an integer (see 'txbroker serve --help')"),
    (["nosuch"], "error: No such command 'nosuch'. (see 'txbroker --help')"),
    (["xa", "commit"], "error: Missing argument 'xid'. (see 'txbroker xa commit --help')"),
])
def test_usage_errors_are_one_line(args: list[str], line: str) -> None:
    assert_fails(txb(*args, check=False, columns=None), 2, line)


def test_serve_rejects_bad_options(tmp_path: Path) -> None:
    result = txb("serve", "--data", str(tmp_path / "d"), "--sync", "sometimes", check=False)
    assert_fails(result, 1, "error: sync must be one of none, fdatasync, fsync, not 'sometimes'")


def test_serve_config_file_errors_are_one_line(tmp_path: Path) -> None:
    def serve(text: str | None) -> subprocess.CompletedProcess[str]:
        config = tmp_path / "broker.toml"
        if text is None:
            config.unlink(missing_ok=True)
        else:
            config.write_text(text)
        return txb("serve", "--config", str(config), "--data", str(tmp_path / "d"),
                   "--port", "0", "--stomp-port", "0", "--amqp-port", "0", "--log-level", "ERROR",
                   check=False, columns=None)

    config = tmp_path / "broker.toml"
    assert_fails(serve(None), 1, f"error: {config}: No such file or directory")
    assert_fails(serve("[server\n"), 1, f"error: {config}: Expected ']' at the end of a "
                                        "table declaration (at line 1, column 8)")
    assert_fails(serve('[server]\nmax_frame_size = "big"\n'), 1,
                 f"error: {config}: a value has the wrong type "
                 "('<' not supported between instances of 'str' and 'int')")
    assert_fails(serve("server = 5\n"), 1, f"error: {config}: a value has the wrong type "
                                           "('int' object is not iterable)")
    assert_fails(serve("[users]\nbob = 5\n"), 1,
                 "error: [users] values must be password hashes (txbroker passwd)")
    assert_fails(serve("[server]\nspeed = 5\n"), 1,
                 f"error: unknown [server] keys in {config}: speed")


def test_serve_start_failures_are_one_line(broker: BrokerProcess, tmp_path: Path) -> None:
    in_use = txb("serve", "--data", str(tmp_path / "other"), "--port", str(broker.port),
                 "--stomp-port", "0",
                 "--amqp-port", "0", "--log-level", "ERROR", check=False, columns=None)
    assert_fails(in_use, 1, "error: cannot start the broker: error while attempting to bind "
                            f"on address ('127.0.0.1', {broker.port}): address already in use")
    assert broker.proc is not None
    locked = txb("serve", "--data", str(broker.data), "--port", str(free_port()),
                 "--stomp-port", "0",
                 "--amqp-port", "0", "--log-level", "ERROR", check=False, columns=None)
    lock = broker.data / "journal" / "lock"
    assert "Traceback" not in locked.stdout + locked.stderr, locked.stderr
    assert locked.returncode == 1 and locked.stderr.count("\n") == 1, locked.stderr
    assert locked.stderr.startswith(
        f"error: data directory {broker.data} is in use: {lock} is locked by pid "
        f"{broker.proc.pid} on {socket.gethostname()} (store) since "), locked.stderr
    assert locked.stderr.endswith("a data directory cannot be shared, stop that broker first "
                                  "(two brokers share one only as an HA pair: --ha "
                                  "shared-store)\n"), locked.stderr


def test_audit_of_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    nothing = tmp_path / "a-directory-with-a-long-name-so-that-the-line-is-over-80" / "nothing"
    result = txb("audit", "--data", str(nothing), "--out", str(tmp_path / "out"),
                 check=False, columns=None)
    assert_fails(result, 1, f"error: no journal in {nothing}: {nothing / 'journal'} "
                            "is not a directory")


def test_timeouts_and_unexpected_errors_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No broker times out on demand: a stand-in connection raises what the client raises."""
    from txbroker import cli
    from txbroker.cli import common

    class Conn:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def __enter__(self) -> Conn:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def stats(self) -> dict[str, int]:
            raise self.error

    for error, line in [
        (TimeoutError("no reply to 'stats' within 30 s"),
         "error: timed out: no reply to 'stats' within 30 s"),
        (RuntimeError("boom"),
         "error: internal error: RuntimeError: boom (TXBROKER_DEBUG=1 shows the traceback)"),
    ]:
        monkeypatch.setattr(common, "connect", lambda url, tls_ca=None, error=error: Conn(error))
        with pytest.raises(SystemExit) as exited:
            cli.main(["stat"])
        assert exited.value.code == 1
        assert capsys.readouterr().err == line + "\n"


def test_passwd_prints_a_verifiable_hash() -> None:
    from txbroker.server.security.auth import verify_password

    result = subprocess.run([sys.executable, "-m", "txbroker.cli", "passwd", "--password",
                             "pw"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert verify_password("pw", result.stdout.strip())
    assert not verify_password("other", result.stdout.strip())


def test_passwd_reads_stdin_when_it_is_not_a_terminal() -> None:
    from txbroker.server.security.auth import verify_password

    piped = txb("passwd", input=b"pw\n")
    assert (piped.stderr, verify_password("pw", piped.stdout.strip())) == ("", True)
    assert_fails(txb("passwd", input=b"", check=False), 1,
                 "error: no password: give --password, type it at a terminal or pipe one line")
    assert_fails(txb("passwd", "--password", "", check=False), 1,
                 "error: the password is empty")


def _help_texts(command: object, path: list[str]) -> list[tuple[list[str], str]]:
    """(command path, text) of every help string of a click command tree."""
    texts = [(path, getattr(command, "help", None) or "")]
    texts += [(path, getattr(p, "help", None) or "") for p in getattr(command, "params", [])]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        texts += _help_texts(sub, [*path, name])
    return texts


def test_help_keeps_every_bracketed_word() -> None:
    """Rich markup ate ``[users]`` in ``passwd --help``: no help text may lose a word."""
    import typer

    from txbroker.cli import app

    words: dict[tuple[str, ...], set[str]] = {}
    for path, text in _help_texts(typer.main.get_command(app), []):
        words.setdefault(tuple(path), set()).update(re.findall(r"\S*\[\S*", text))
    assert {"[users]", "txb://[user:password@]host[:port],"} <= set().union(
        *words.values())
    for path, expected in words.items():
        shown = "".join(txb(*path, "--help").stdout.split())  # a long word may be wrapped
        assert {w for w in expected if w not in shown} == set(), path
    assert "for the config file's [users] table" in txb("passwd", "--help").stdout


def _listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _overview_status(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/overview", timeout=10) as reply:
        return int(reply.status)


def test_serve_listens_for_http_on_the_flag_or_config_port(tmp_path: Path) -> None:
    port = free_port()
    with BrokerProcess(tmp_path / "flag", "--http-port", str(port)) as flagged:
        assert f", HTTP {port} " in flagged.ready_line
        assert _overview_status(port) == 200
    config = tmp_path / "broker.toml"
    config.write_text(f"[server]\nhttp_port = {port}\n")
    with BrokerProcess(tmp_path / "file", "--config", str(config)) as configured:
        assert _overview_status(port) == 200
        assert f", HTTP {port} " in configured.ready_line
    with BrokerProcess(tmp_path / "default") as default:  # default 0: off
        assert "HTTP" not in default.ready_line
        assert not _listens(port)
    shown = " ".join(txb("serve", "--help").stdout.split())
    assert "--http-port <int> HTTP port: REST API, /api/openapi.json, /metrics" in shown


def test_recv_many_uses_a_window_and_takes_exactly_count(broker: BrokerProcess) -> None:
    """Issue 30: ``recv --count N`` consumes through a prefetch window (not one request a
    message) and never takes more than N: the rest stay in the queue, not redelivered."""
    url = ["--url", broker.url]
    txb("send", "many", "m", "--count", "1300", *url)
    got = txb("recv", "many", "--count", "1000", "--quiet", *url)
    assert got.returncode == 0
    info = json.loads(txb("queues", "--json", *url).stdout)
    assert [(q["name"], q["depth"], q["in_flight"]) for q in info] == [("many", 300, 0)]
    rest = txb("recv", "many", "--count", "300", *url).stdout.splitlines()
    assert len(rest) == 300 and not any("redelivered" in line for line in rest)
