#!/usr/bin/env python3
"""amqpbench.py -- a lean AMQP 0-9-1 load generator: pamqp frames over plain sockets.

The AMQP sibling of ``../shared/bench/stompbench.py``: no client library, the same
code for every broker, made to cost the client as little CPU as it can so that the
figure is the broker's. Frames are built with pamqp (``pamqp.frame.marshal``) once
per run and reused; the three frames that arrive once per message (``basic.ack``
confirms, ``basic.deliver`` and content body frames) are read with ``struct`` at
fixed offsets, every other frame through ``pamqp.frame.unmarshal``
(``--decode pamqp`` sends every frame through pamqp, to see what that costs).
Sockets are non-blocking, several connections per process under one ``selectors``
loop; the replies of one socket read go out in one write.

Workloads (positional argument), 1 KiB persistent messages (``delivery_mode`` 2)
on a fresh durable queue, through the default exchange:

  confirm-publish  ``confirm.select``; N publishes on C connections (default 1), at
                   most W (64) unconfirmed per connection. Confirms may be single or
                   ``multiple`` (RabbitMQ coalesces them). msgs/s and confirm latency.
  tx-publish       C connections (default 8), each ``tx.select`` then: K (10)
                   publishes + ``tx.commit`` in one write, wait for ``commit-ok``,
                   repeat. msgs/s committed and commit latency. ``--procs P`` spreads
                   the connections over P processes (their CPU is summed).
  consume-ack      pre-fills N messages (confirm-publish, untimed), then one consumer,
                   ``basic.qos`` prefetch 1000, ``basic.consume``, and one
                   ``basic.ack`` per message (not ``multiple``: the issue's workload);
                   the timed phase ends with a ``queue.declare`` (passive) round trip
                   after the last ack.

Every run checks the counts: each publish confirmed (no ``nack``), each commit
answered, and the queue deleted at the end holds exactly what was published (N for
the publish workloads, 0 after consume-ack, whose consumer also saw each message
exactly once and none redelivered). It prints one JSON line on stdout with the
keys of stompbench (``msgs_per_s``, ``client_cpu_pct``, ``broker_cpu_pct``,
``foreign_cpu_pct``, ``disk`` …) and exits 0 (ok), 1 (a count is wrong) or 2
(error). Client CPU is the load generator's own (``getrusage``, every worker
process included) over the timed phase; broker CPU is read from /proc for
``--broker-pid`` / ``--broker-pidfile``.

    .venv/bin/python bench/amqpbench.py confirm-publish --port 5672 -n 20000
    .venv/bin/python bench/amqpbench.py tx-publish --port 5673 -n 20000 --procs 2
    .venv/bin/python bench/amqpbench.py consume-ack --smoke     # 500 messages, a check
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import uuid
from collections import deque
from datetime import UTC, datetime
from typing import Any

from amqpbench_stats import Sampler, find_disk, lat_stats, loadavg_1m, own_cpu, read_pid
from amqpbench_wire import (
    BASIC_ACK,
    BASIC_DELIVER,
    BASIC_NACK,
    BODY,
    CHANNEL,
    HEADER,
    METHOD,
    SEQ_LEN,
    TX_COMMIT_OK,
    BrokerError,
    Connection,
    Handler,
    Loop,
    Publisher,
    ack_fields,
    ack_frame,
    body_seq,
    deliver_fields,
    method_ids,
)
from pamqp import commands, frame

VERSION = "1.0"
#: Messages per run: stompbench's default, and --smoke's.
DEFAULT_N, SMOKE_N = 20000, 500


# ---------------------------------------------------------------- workloads
class ConfirmPublisher(Handler):
    """Keeps ``window`` publishes unconfirmed until ``count`` are confirmed (or nacked)."""

    def __init__(self, conn: Connection, publisher: Publisher, count: int, window: int,
                 seq0: int, latencies: list[int] | None) -> None:
        super().__init__(conn)
        self.publisher, self.count, self.window = publisher, count, window
        self.seq0, self.latencies = seq0, latencies
        self.sent = self.confirmed = self.nacked = 0
        self.order: deque[int] = deque()  # delivery tags sent, oldest first
        self.unconfirmed: dict[int, int] = {}  # delivery tag -> sent (ns)
        self.done = count == 0

    def start(self, now: int) -> None:
        self.fill(now)

    def fill(self, now: int) -> None:
        """Publish until ``window`` are unconfirmed or all ``count`` are sent."""
        message, out, pending = self.publisher.message, self.conn.out, self.unconfirmed
        while self.sent < self.count and len(pending) < self.window:
            self.sent += 1
            out += message(self.seq0 + self.sent)
            pending[self.sent] = now
            self.order.append(self.sent)

    def on_frame(self, ftype: int, buf: bytearray, start: int, end: int, now: int) -> None:
        ids = method_ids(buf, start) if ftype == METHOD and not self.conn.decode_all else None
        if ids in (BASIC_ACK, BASIC_NACK):
            tag, multiple = ack_fields(buf, start)
            nack = ids == BASIC_NACK
        else:
            value = self.method(ftype, buf, start, end)
            if value is None:
                return
            if value.name not in ("Basic.Ack", "Basic.Nack"):
                raise BrokerError(f"{self.conn.name}: unexpected {value.name}")
            tag, multiple, nack = value.delivery_tag, value.multiple, value.name == "Basic.Nack"
        self.settle(tag, multiple, nack, now)
        self.fill(now)
        self.done = self.confirmed + self.nacked == self.count

    def settle(self, tag: int, multiple: bool, nack: bool, now: int) -> None:
        """Tag ``tag`` (and, if ``multiple``, every older one) is confirmed or nacked."""
        pending, order, latencies = self.unconfirmed, self.order, self.latencies
        settled = []
        if multiple:
            while order and order[0] <= tag:
                sent_ns = pending.pop(order.popleft(), None)
                if sent_ns is not None:
                    settled.append(sent_ns)
        else:
            sent_ns = pending.pop(tag, None)
            if sent_ns is None:
                raise BrokerError(f"{self.conn.name}: confirm of unknown tag {tag}")
            settled.append(sent_ns)
            while order and order[0] not in pending:
                order.popleft()
        if nack:
            self.nacked += len(settled)
        else:
            self.confirmed += len(settled)
        if latencies is not None:
            latencies.extend(now - sent_ns for sent_ns in settled)


class TxPublisher(Handler):
    """``transactions`` times: ``size`` publishes and ``tx.commit``, one write each."""

    def __init__(self, conn: Connection, publisher: Publisher, transactions: int, size: int,
                 seq0: int, latencies: list[int]) -> None:
        super().__init__(conn)
        self.publisher, self.transactions, self.size = publisher, transactions, size
        self.seq, self.latencies = seq0, latencies
        self.committed = self.began = 0
        self.sent_ns = 0
        self.commit = frame.marshal(commands.Tx.Commit(), CHANNEL)
        self.done = transactions == 0

    def start(self, now: int) -> None:
        if not self.done:
            self.send_tx(now)

    def send_tx(self, now: int) -> None:
        """Queue one transaction: ``size`` publishes and the commit."""
        out, message = self.conn.out, self.publisher.message
        for _ in range(self.size):
            self.seq += 1
            out += message(self.seq)
        out += self.commit
        self.began += 1
        self.sent_ns = now

    def on_frame(self, ftype: int, buf: bytearray, start: int, end: int, now: int) -> None:
        if ftype == METHOD and not self.conn.decode_all and method_ids(buf, start) == TX_COMMIT_OK:
            pass
        else:
            value = self.method(ftype, buf, start, end)
            if value is None:
                return
            if value.name != "Tx.CommitOk":
                raise BrokerError(f"{self.conn.name}: unexpected {value.name}")
        self.committed += 1
        self.latencies.append(now - self.sent_ns)
        if self.began < self.transactions:
            self.send_tx(now)
        else:
            self.done = True


class AckingConsumer(Handler):
    """Consumes ``count`` messages, one ``basic.ack`` each, then a passive declare."""

    def __init__(self, conn: Connection, queue: str, count: int) -> None:
        super().__init__(conn)
        self.queue, self.count = queue, count
        self.received = self.redelivered = self.duplicates = self.unexpected = 0
        self.seen = bytearray(count + 1)
        self.tag = 0

    def start(self, now: int) -> None:
        self.conn.out += frame.marshal(
            commands.Basic.Consume(queue=self.queue, consumer_tag="amqpbench"), CHANNEL)

    def on_frame(self, ftype: int, buf: bytearray, start: int, end: int, now: int) -> None:
        decode_all = self.conn.decode_all
        if ftype == BODY:
            seq = body_seq(buf, start)
            if self.received >= self.count or not 0 < seq <= self.count:
                self.unexpected += 1
                return
            self.received += 1
            if self.seen[seq]:
                self.duplicates += 1
            self.seen[seq] = 1
            self.conn.out += ack_frame(self.tag)
            if self.received == self.count:  # every ack is written: one round trip
                self.conn.out += frame.marshal(
                    commands.Queue.Declare(queue=self.queue, passive=True), CHANNEL)
            return
        if ftype == HEADER:
            return
        if ftype == METHOD and not decode_all and method_ids(buf, start) == BASIC_DELIVER:
            self.tag, redelivered = deliver_fields(buf, start)
        else:
            value = self.method(ftype, buf, start, end)
            if value is None or value.name == "Basic.ConsumeOk":
                return
            if value.name == "Queue.DeclareOk":
                self.done = True
                return
            if value.name != "Basic.Deliver":
                raise BrokerError(f"{self.conn.name}: unexpected {value.name}")
            self.tag, redelivered = value.delivery_tag, value.redelivered
        self.redelivered += redelivered


# ---------------------------------------------------------------- running
class Group:
    """This process's publishing connections, set up (``confirm.select`` or
    ``tx.select``) before the timed phase: ``shares[i]`` messages (confirm-publish) or
    transactions (tx-publish) on connection i, numbered from ``seq0s[i] + 1``."""

    def __init__(self, args: argparse.Namespace, shares: list[int], seq0s: list[int]) -> None:
        self.tx = args.workload == "tx-publish"
        self.tx_size, self.timeout = args.tx_size, args.timeout
        publisher = Publisher(args.queue, args.body)
        self.latencies: list[int] = []
        self.loop = Loop()
        self.handlers: list[Any] = []
        for index, (share, seq0) in enumerate(zip(shares, seq0s, strict=True)):
            conn = Connection(args, f"publisher{seq0}-{index}")
            if self.tx:
                conn.call(commands.Tx.Select(), "Tx.SelectOk")
                handler: Handler = TxPublisher(conn, publisher, share, args.tx_size, seq0,
                                               self.latencies)
            else:
                conn.call(commands.Confirm.Select(), "Confirm.SelectOk")
                handler = ConfirmPublisher(conn, publisher, share, args.window, seq0,
                                           self.latencies)
            self.handlers.append(handler)
            self.loop.add(conn, handler)

    def run(self) -> dict[str, Any]:
        """The timed phase: counts, latencies and this process's CPU (``close`` after)."""
        cpu0 = own_cpu()
        self.loop.run(self.timeout)
        found: dict[str, Any] = {"latencies": self.latencies, "cpu_s": own_cpu() - cpu0}
        if self.tx:
            commits = sum(h.committed for h in self.handlers)
            found.update(messages=commits * self.tx_size, commits=commits, nacked=0)
        else:
            found.update(messages=sum(h.confirmed for h in self.handlers),
                         nacked=sum(h.nacked for h in self.handlers))
        return found

    def close(self) -> None:
        """Close every connection (after the timed phase)."""
        for handler in self.handlers:
            handler.conn.close()

    def run_and_close(self) -> dict[str, Any]:
        """``run``, then ``close`` whatever happened."""
        try:
            return self.run()
        finally:
            self.close()


def worker(args: argparse.Namespace, shares: list[int], seq0s: list[int], ready: Any,
           go: Any, results: Any) -> None:
    """A worker process: set up, say ready, wait for ``go``, run, put the result."""
    try:
        group = Group(args, shares, seq0s)
        ready.put(True)
        go.wait()
        try:
            results.put(group.run())
        finally:
            group.close()
    except Exception as exc:  # reported by the parent
        ready.put(False)
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as possible."""
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def publish_phase(args: argparse.Namespace, sampler: Sampler) -> dict[str, Any]:
    """confirm-publish / tx-publish over ``args.procs`` processes, every connection set
    up before the timed phase, which ends when the last connection is done."""
    tx = args.workload == "tx-publish"
    unit = args.tx_size if tx else 1
    shares = split(args.n // unit, args.connections)
    seq0s = [sum(shares[:i]) * unit for i in range(len(shares))]
    procs = max(1, min(args.procs, args.connections))
    groups = [list(range(args.connections))[p::procs] for p in range(procs)]
    if procs == 1:
        group = Group(args, shares, seq0s)
        before = sampler.snap()
        try:
            parts = [group.run()]
            after = sampler.end()
        finally:
            group.close()
    else:
        context = multiprocessing.get_context("fork")
        ready, go, results = context.Queue(), context.Event(), context.Queue()
        children = [context.Process(target=worker, args=(
            args, [shares[i] for i in g], [seq0s[i] for i in g], ready, go, results))
            for g in groups]
        for child in children:
            child.start()
        try:
            if not all(ready.get(timeout=args.timeout) for _ in children):
                go.set()
                raise BrokerError("; ".join(r["error"] for r in (results.get() for _ in children)
                                            if "error" in r))
            before = sampler.snap()
            go.set()
            parts = [results.get(timeout=args.timeout) for _ in children]
            after = sampler.end()
        finally:
            for child in children:
                child.join(timeout=30)
    errors = [p["error"] for p in parts if "error" in p]
    if errors:
        raise BrokerError("; ".join(errors))
    workers_cpu = sum(p["cpu_s"] for p in parts) if procs > 1 else 0.0
    figures = sampler.diff(before, after, extra_client_cpu=workers_cpu)
    elapsed = after["t"] - before["t"]
    done = sum(p["messages"] for p in parts)
    latencies = [x for p in parts for x in p["latencies"]]
    result: dict[str, Any] = {"elapsed_s": round(elapsed, 3),
                              "msgs_per_s": round(done / elapsed, 1), "client_procs": procs,
                              "connections": args.connections,
                              "worker_cpu_s": [round(p["cpu_s"], 3) for p in parts]}
    if tx:
        commits = sum(p["commits"] for p in parts)
        result.update(tx_size=args.tx_size, commits=commits,
                      commits_per_s=round(commits / elapsed, 1),
                      commit_lat_ms=lat_stats(latencies))
    else:
        result.update(window=args.window, confirm_lat_ms=lat_stats(latencies))
    result.update(figures)
    result["verify"] = {"expected": sum(shares) * unit, "done": done,
                        "nacked": sum(p["nacked"] for p in parts)}
    return result


def consume_phase(args: argparse.Namespace, sampler: Sampler) -> dict[str, Any]:
    """Pre-fill ``n`` messages (untimed, confirmed), then consume them, one ack each."""
    fill_args = argparse.Namespace(**vars(args))
    fill_args.workload = "confirm-publish"
    fills = split(args.n, args.preload_connections)
    filled = Group(fill_args, fills, [sum(fills[:i]) for i in range(len(fills))]).run_and_close()
    conn = Connection(args, "consumer")
    conn.call(commands.Basic.Qos(prefetch_count=args.prefetch), "Basic.QosOk")
    consumer = AckingConsumer(conn, args.queue, args.n)
    loop = Loop()
    loop.add(conn, consumer)
    before = sampler.snap()
    try:
        loop.run(args.timeout)
    finally:
        after = sampler.end()
        conn.close()
    elapsed = after["t"] - before["t"]
    result: dict[str, Any] = {"elapsed_s": round(elapsed, 3),
                              "msgs_per_s": round(consumer.received / elapsed, 1),
                              "client_procs": 1, "connections": 1, "prefetch": args.prefetch,
                              "acks": "one basic.ack per message"}
    result.update(sampler.diff(before, after))
    result["verify"] = {"expected": args.n, "prefilled": filled["messages"],
                        "prefill_nacked": filled["nacked"], "received": consumer.received,
                        "distinct": sum(consumer.seen), "duplicates": consumer.duplicates,
                        "redelivered": consumer.redelivered, "unexpected": consumer.unexpected}
    return result


def run(args: argparse.Namespace, sampler: Sampler) -> dict[str, Any]:
    """Declare the queue, run the workload, delete the queue and check the counts."""
    admin = Connection(args, "admin")
    admin.call(commands.Queue.Declare(queue=args.queue, durable=True), "Queue.DeclareOk")
    try:
        if args.workload == "consume-ack":
            result = consume_phase(args, sampler)
        else:
            result = publish_phase(args, sampler)
        left = admin.call(commands.Queue.Delete(queue=args.queue), "Queue.DeleteOk")
    finally:
        admin.close()
    verify = result["verify"]
    verify["left_in_queue"] = left.message_count
    if args.workload == "consume-ack":  # all n, once each, none left; no nack, no surprise
        wrong = ("prefill_nacked", "duplicates", "redelivered", "unexpected", "left_in_queue")
        ok = (all(verify[key] == args.n for key in ("prefilled", "received", "distinct"))
              and not any(verify[key] for key in wrong))
    else:  # every one confirmed or committed, and in the queue
        ok = (verify["done"] == verify["expected"] == verify["left_in_queue"]
              and not verify["nacked"])
    result.update(n=verify["expected"], ok=ok)
    return result


def main() -> int:
    """Parse the arguments, run once, print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=["confirm-publish", "tx-publish", "consume-ack"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5672)
    ap.add_argument("--user", default="guest")
    ap.add_argument("--password", default="guest")
    ap.add_argument("--vhost", default="/")
    ap.add_argument("--label", default=None, help="broker label copied into the JSON")
    ap.add_argument("-n", "--n", type=int, default=None, help="messages (default 20000)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"a check of the generator, not a figure: -n {SMOKE_N} unless given, "
                         "60 s timeout")
    ap.add_argument("-b", "--body", type=int, default=1024, help="body bytes (>= 12)")
    ap.add_argument("-w", "--window", type=int, default=64,
                    help="unconfirmed publishes per connection (confirm-publish, pre-fill)")
    ap.add_argument("-c", "--connections", type=int, default=None,
                    help="publishing connections (confirm-publish 1, tx-publish 8)")
    ap.add_argument("-k", "--tx-size", type=int, default=10, help="publishes per transaction")
    ap.add_argument("--procs", type=int, default=1,
                    help="client processes the publishing connections are spread over")
    ap.add_argument("--prefetch", type=int, default=1000, help="consume-ack: basic.qos count")
    ap.add_argument("--preload-connections", type=int, default=2,
                    help="consume-ack: connections that pre-fill the queue")
    ap.add_argument("--decode", choices=["fast", "pamqp"], default="fast",
                    help="pamqp: decode every frame with pamqp (costs client CPU)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per phase (s)")
    ap.add_argument("--connect-timeout", type=float, default=10.0)
    ap.add_argument("--broker-pid", type=int, default=None)
    ap.add_argument("--broker-pidfile", default=None)
    ap.add_argument("--disk-path", default="/var/lib",
                    help="account disk I/O of the device holding this path")
    args = ap.parse_args()
    args.n = args.n or (SMOKE_N if args.smoke else DEFAULT_N)
    if args.smoke:
        args.timeout = min(args.timeout, 60.0)
    if args.body < SEQ_LEN + 1:
        ap.error(f"--body must be >= {SEQ_LEN + 1}")
    args.connections = args.connections or (8 if args.workload == "tx-publish" else 1)
    if args.broker_pidfile and not args.broker_pid:
        args.broker_pid = read_pid(args.broker_pidfile)
    args.queue = f"amqpbench.{args.workload}.{time.strftime('%H%M%S')}{uuid.uuid4().hex[:6]}"
    res: dict[str, Any] = {
        "tool": "amqpbench", "v": VERSION, "workload": args.workload, "label": args.label,
        "host": args.host, "port": args.port, "n": args.n, "body": args.body,
        "persistent": True, "decode": args.decode,
        "ts": datetime.now(UTC).isoformat(timespec="seconds"), "ok": False, "error": None,
        "loadavg_start": loadavg_1m()}
    sampler = Sampler(args.broker_pid, find_disk(args.disk_path))
    code = 2
    try:
        res.update(run(args, sampler))
        code = 0 if res["ok"] else 1
        if not res["ok"]:
            res["error"] = "verification failed (see verify)"
    except (BrokerError, OSError, TimeoutError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        res["error"] = "interrupted"
    print(json.dumps(res), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
