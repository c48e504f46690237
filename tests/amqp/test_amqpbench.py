"""bench/amqpbench.py, the AMQP load generator of bench/peers.py, against a real
``txbroker serve``: every workload's smoke mode ends with exact counts (every
publish confirmed, every commit answered, every message consumed once and acked),
and its hand-read frames agree with pamqp's reading of the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from tests.amqp.support import AmqpBroker
from tests.support import ROOT, free_port

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import amqpbench as generator  # noqa: E402 - bench/ is not a package
import amqpbench_wire as wire  # noqa: E402

SMOKE_N = 500  # amqpbench.SMOKE_N


def amqpbench(broker: AmqpBroker, *args: str) -> dict[str, Any]:
    """One run of the generator; its JSON line (the exit code must agree with "ok")."""
    assert broker.proc is not None
    done = subprocess.run(
        [sys.executable, str(BENCH / "amqpbench.py"), *args, "--smoke",
         "--port", str(broker.amqp_port), "--broker-pid", str(broker.proc.pid)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # 0: ok; 1: a count is wrong; 2: an error (no figure)
    expected = 0 if result["ok"] else 1 if "verify" in result else 2
    assert done.returncode == expected, (done.returncode, result, done.stderr)
    return result


@pytest.mark.parametrize("extra", [[], ["--decode", "pamqp"]], ids=["fast", "pamqp"])
def test_confirm_publish_confirms_every_publish(amqp_broker: AmqpBroker,
                                                extra: list[str]) -> None:
    result = amqpbench(amqp_broker, "confirm-publish", *extra)
    assert result["error"] is None
    assert result["verify"] == {"expected": SMOKE_N, "done": SMOKE_N, "nacked": 0,
                                "left_in_queue": SMOKE_N}
    assert result["confirm_lat_ms"]["n"] == SMOKE_N
    assert result["ok"] is True and result["n"] == SMOKE_N and result["window"] == 64
    assert {"client_cpu_s", "broker_cpu_s", "foreign_cpu_pct"} <= set(result)


@pytest.mark.parametrize("procs", [1, 2])
def test_tx_publish_commits_every_transaction(amqp_broker: AmqpBroker, procs: int) -> None:
    result = amqpbench(amqp_broker, "tx-publish", "--procs", str(procs))
    assert result["error"] is None
    assert result["verify"] == {"expected": SMOKE_N, "done": SMOKE_N, "nacked": 0,
                                "left_in_queue": SMOKE_N}
    assert result["commits"] == SMOKE_N // 10
    assert result["commit_lat_ms"]["n"] == SMOKE_N // 10
    assert result["connections"] == 8 and result["client_procs"] == procs
    assert len(result["worker_cpu_s"]) == procs


@pytest.mark.parametrize("extra", [[], ["--decode", "pamqp"]], ids=["fast", "pamqp"])
def test_consume_ack_takes_every_message_once(amqp_broker: AmqpBroker,
                                              extra: list[str]) -> None:
    result = amqpbench(amqp_broker, "consume-ack", *extra)
    assert result["error"] is None
    assert result["verify"] == {
        "expected": SMOKE_N, "prefilled": SMOKE_N, "prefill_nacked": 0, "received": SMOKE_N,
        "distinct": SMOKE_N, "duplicates": 0, "redelivered": 0, "unexpected": 0,
        "left_in_queue": 0}
    assert result["ok"] is True and result["prefetch"] == 1000


def test_a_refused_connection_is_an_error_not_a_figure(amqp_broker: AmqpBroker) -> None:
    result = amqpbench(amqp_broker, "confirm-publish", "--vhost", "elsewhere")
    assert result["ok"] is False
    assert "msgs_per_s" not in result and "verify" not in result
    assert result["error"].startswith("BrokerError: admin: Connection.Close 530")


# ---------------------------------------------------------------- the hand-read frames
def payload(data: bytes) -> tuple[bytearray, int, int, int]:
    """(buffer, type, payload start, payload end) of the one frame in ``data``."""
    buf = bytearray(data)
    frames, used = wire.split_frames(buf)
    assert used == len(data) and len(frames) == 1
    ftype, start, end = frames[0]
    return buf, ftype, start, end


@pytest.mark.parametrize("tag, multiple", [(1, False), (2**40 + 7, True)])
def test_ack_fields_read_what_pamqp_wrote(tag: int, multiple: bool) -> None:
    for method in (commands.Basic.Ack(tag, multiple), commands.Basic.Nack(tag, multiple)):
        buf, ftype, start, end = payload(frame.marshal(method, 1))
        assert ftype == wire.METHOD
        assert wire.method_ids(buf, start) == (wire.BASIC_ACK if method.name == "Basic.Ack"
                                               else wire.BASIC_NACK)
        assert wire.ack_fields(buf, start) == (tag, multiple)
        decoded = wire.slow_method(buf, start, end)
        assert (decoded.delivery_tag, decoded.multiple) == (tag, multiple)


@pytest.mark.parametrize("consumer_tag, redelivered", [("", False), ("ctag-" + "x" * 200, True)])
def test_deliver_fields_read_what_pamqp_wrote(consumer_tag: str, redelivered: bool) -> None:
    method = commands.Basic.Deliver(consumer_tag, 123456789, redelivered, "ex", "rk")
    buf, _, start, _ = payload(frame.marshal(method, 1))
    assert wire.method_ids(buf, start) == wire.BASIC_DELIVER
    assert wire.deliver_fields(buf, start) == (123456789, redelivered)


def test_publisher_frames_are_pamqp_frames_and_split_whole_or_in_pieces() -> None:
    publisher = wire.Publisher("q", 1024)
    data = publisher.message(42)
    expected = (frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
                + frame.marshal(header.ContentHeader(
                    0, 1024, commands.Basic.Properties(delivery_mode=2)), 1)
                + frame.marshal(ContentBody(b"%010d;" % 42 + b"x" * 1013), 1))
    assert data == expected
    buf = bytearray(data + frame.marshal(commands.Tx.CommitOk(), 1))
    frames, used = wire.split_frames(buf)
    assert used == len(buf)
    assert [f[0] for f in frames] == [wire.METHOD, wire.HEADER, wire.BODY, wire.METHOD]
    assert wire.body_seq(buf, frames[2][1]) == 42
    assert wire.method_ids(buf, frames[3][1]) == wire.TX_COMMIT_OK
    heads = len(publisher.head)  # the method and header frames
    for cut, whole, used_bytes in ((1, 0, 0), (7, 0, 0), (8, 0, 0), (heads, 2, heads),
                                   (heads + 8, 2, heads), (len(data) - 1, 2, heads)):
        frames, used = wire.split_frames(bytearray(data[:cut]))  # a partial frame waits
        assert (len(frames), used) == (whole, used_bytes), cut
    with pytest.raises(wire.BrokerError):
        wire.split_frames(bytearray(data[:-1] + b"\x00"))
    assert wire.ack_frame(9) == frame.marshal(commands.Basic.Ack(9), 1)


def test_peers_harness_runs_amqpbench_and_summarizes(tmp_path: Path) -> None:
    """``bench/peers.py --protocol amqp --smoke``: its own ``txbroker serve``, every
    workload warmed up and run twice, every run ok, one summary row each."""
    out = tmp_path / "peers.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCH / "peers.py"), "--protocol", "amqp", "--smoke",
         "--txbroker-port", str(free_port()), "--data-root", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["setup"] + ["warmup", "run", "run"] * 3 + ["summary"] * 3
    assert records[0]["protocol"] == "amqp" and records[0]["brokers"] == ["txbroker"]
    assert "--amqp-port" in records[0]["txbroker"]["txbroker"]["command"]
    runs = [r for r in records if r["kind"] in ("warmup", "run")]
    assert all(r["ok"] and r["tool"] == "amqpbench" for r in runs)
    assert [r["n"] for r in runs] == [200, 500, 500] * 3
    summary = [r for r in records if r["kind"] == "summary"]
    assert [r["workload_name"] for r in summary] == ["confirm-publish", "tx-publish",
                                                     "consume-ack"]
    assert all(r["ok_runs"] == r["runs"] == 2 for r in summary)
    assert all(r["client_cpu_pct"] is not None for r in summary)
    assert "| confirm-publish | txbroker |" in done.stdout


# ---------------------------------------------------------------- the handlers, fed bytes
def feed(handler: Any, data: bytes, now: int) -> None:
    """Hand every frame of ``data`` to ``handler`` as the loop does."""
    buf = bytearray(data)
    frames, used = wire.split_frames(buf)
    assert used == len(data)
    for ftype, start, end in frames:
        handler.on_frame(ftype, buf, start, end, now)


@pytest.mark.parametrize("decode_all", [False, True], ids=["fast", "pamqp"])
def test_confirms_single_multiple_out_of_order_and_nacked(decode_all: bool) -> None:
    conn = SimpleNamespace(out=bytearray(), decode_all=decode_all, name="c")
    latencies: list[int] = []
    publisher = wire.Publisher("q", 64)
    handler = generator.ConfirmPublisher(conn, publisher, 6, 4, 100, latencies)  # type: ignore[arg-type]
    handler.start(0)
    assert conn.out == b"".join(publisher.message(seq) for seq in (101, 102, 103, 104))
    conn.out.clear()
    feed(handler, frame.marshal(commands.Basic.Ack(2, True), 1), 10)  # RabbitMQ's way
    assert (handler.confirmed, handler.sent) == (2, 6)
    assert conn.out == publisher.message(105) + publisher.message(106)  # the window refilled
    feed(handler, frame.marshal(commands.Basic.Ack(4), 1), 20)  # overtakes 3
    feed(handler, frame.marshal(commands.Basic.Ack(3), 1), 30)
    assert (handler.confirmed, handler.nacked, handler.done) == (4, 0, False)
    feed(handler, frame.marshal(commands.Basic.Nack(6, True), 1), 40)
    assert (handler.confirmed, handler.nacked, handler.done) == (4, 2, True)
    assert latencies == [10, 10, 20, 30, 30, 30]
    with pytest.raises(wire.BrokerError, match="unknown tag 4"):
        feed(handler, frame.marshal(commands.Basic.Ack(4), 1), 50)
    with pytest.raises(wire.BrokerError, match=r"Channel\.Close 406"):
        feed(handler, frame.marshal(commands.Channel.Close(406, "PRECONDITION_FAILED", 0, 0),
                                    1), 60)


@pytest.mark.parametrize("decode_all", [False, True], ids=["fast", "pamqp"])
def test_consumer_acks_each_delivery_and_counts_what_is_wrong(decode_all: bool) -> None:
    conn = SimpleNamespace(out=bytearray(), decode_all=decode_all, name="c")
    handler = generator.AckingConsumer(conn, "q", 3)  # type: ignore[arg-type]
    publisher = wire.Publisher("q", 64)

    def delivery(tag: int, seq: int, redelivered: bool = False) -> bytes:
        content = frame.marshal(header.ContentHeader(
            0, 64, commands.Basic.Properties(delivery_mode=2)), 1)
        body = publisher.message(seq)[len(publisher.head):]  # the body frame
        return (frame.marshal(commands.Basic.Deliver("amqpbench", tag, redelivered, "", "q"), 1)
                + content + body)

    feed(handler, frame.marshal(commands.Basic.ConsumeOk("amqpbench"), 1)
         + delivery(1, 2) + delivery(2, 2, redelivered=True), 0)
    assert conn.out == wire.ack_frame(1) + wire.ack_frame(2)
    assert (handler.received, handler.duplicates, handler.redelivered) == (2, 1, 1)
    conn.out.clear()
    feed(handler, delivery(3, 1) + delivery(4, 3), 0)  # the fourth is one too many
    assert conn.out == wire.ack_frame(3) + frame.marshal(
        commands.Queue.Declare(queue="q", passive=True), 1)
    assert (handler.received, handler.unexpected, sum(handler.seen), handler.done) == (
        3, 1, 2, False)
    feed(handler, frame.marshal(commands.Queue.DeclareOk("q", 0, 1), 1), 0)
    assert handler.done
