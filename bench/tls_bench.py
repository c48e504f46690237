#!/usr/bin/env python3
"""The cost of TLS on send-with-receipt throughput (issue 16, "Figures"), in one run.

Usage: ``PYTHONPATH=src .venv/bin/python bench/tls_bench.py [--count 20000] [--runs 3]``
(``--help`` for every setting). Results go to ``bench/results/tls-<timestamp>.json``
and a summary to stdout.

Theory of operation
-------------------
One ``txbroker serve`` process (fdatasync, the default) listens on a plaintext
and a TLS port for the native protocol and for STOMP, with a certificate of a
CA made for the run by ``openssl`` (EC P-256, as in the tests). The same load
runs against the plaintext port and the TLS port of the same broker, alternating,
``--runs`` times each; the figure is the median per mode and the ratio of the
medians (TLS / plaintext), with the median of the ratios of each plaintext run
and the TLS run right after it (less sensitive to other work coming and going
on the machine). Loads, each on a fresh queue:

* ``native_pipelined``: ``txbroker bench --phase send`` (4 producers, 256
  sends in flight each, 1 KiB bodies): every send's reply means durable — the
  native protocol's receipt;
* ``native_one_by_one``: one sync client, one send at a time (the latency-bound
  case: a TLS record each way per message);
* ``stomp_receipts``: one STOMP 1.2 connection (raw socket, TLS through
  ``ssl.SSLContext.wrap_socket``), persistent SENDs with a ``receipt`` header,
  up to 256 receipts outstanding.

The machine's load average is recorded before and after (two cores shared with
other work: the ratio is what to read, not the absolute rates). The broker's
CPU time per message (user + system, from ``/proc``) is recorded for each run
too: other work on the machine slows the rates down but hardly changes what
one message costs the broker, so that ratio is the steadier figure of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.tls_support import make_pki  # noqa: E402

import txbroker  # noqa: E402
from txbroker.bench import run_bench  # noqa: E402

#: STOMP receipts a producer waits for at most at a time (as the native window).
STOMP_WINDOW = 256


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_broker(data: Path, pki: Any, ports: dict[str, int]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "txbroker.cli", "serve", "--data", str(data),
           "--port", str(ports["native"]), "--stomp-port", str(ports["stomp"]), "--amqp-port", "0",
           "--tls-port", str(ports["native_tls"]), "--stomp-tls-port", str(ports["stomp_tls"]),
           "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
           "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("txbroker ready"):
        proc.kill()
        raise RuntimeError(f"broker did not start: {line!r}")
    return proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def native_pipelined(url: str, opts: dict[str, Any], count: int, size: int) -> float:
    summary = run_bench(url, queue=f"pipe-{time.monotonic_ns()}", count=count, size=size,
                        phase="send", connect_options=opts)
    return float(summary["send"]["msg_per_s"])


def native_one_by_one(url: str, opts: dict[str, Any], count: int, size: int) -> float:
    body = b"x" * size
    queue = f"one-{time.monotonic_ns()}"
    with txbroker.connect(url, **opts) as conn:
        started = time.perf_counter()
        for _ in range(count):
            conn.send(queue, body)
        elapsed = time.perf_counter() - started
        conn.purge_queue(queue)
    return count / elapsed


def _stomp_socket(port: int, context: ssl.SSLContext | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return context.wrap_socket(sock, server_hostname="localhost") if context else sock


def stomp_receipts(port: int, context: ssl.SSLContext | None, count: int, size: int) -> float:
    sock = _stomp_socket(port, context)
    buffer = b""

    def frames() -> int:
        """Read once; return how many RECEIPT frames arrived."""
        nonlocal buffer
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("broker closed the STOMP connection")
        buffer += data
        *done, buffer = buffer.split(b"\x00")
        for frame in done:
            if frame.lstrip(b"\n").startswith(b"ERROR"):
                raise RuntimeError(frame.decode(errors="replace"))
        return sum(1 for frame in done if frame.lstrip(b"\n").startswith(b"RECEIPT"))

    sock.sendall(b"CONNECT\naccept-version:1.2\nhost:localhost\n\n\x00")
    while b"CONNECTED" not in buffer:
        buffer += sock.recv(65536)
    buffer = buffer.split(b"\x00", 1)[1]
    destination = f"/queue/stomp-{time.monotonic_ns()}".encode()
    body = b"x" * size
    sent = received = 0
    started = time.perf_counter()
    while received < count:
        batch = []
        while sent < count and sent - received < STOMP_WINDOW:
            batch.append(b"SEND\ndestination:" + destination + b"\npersistent:true\nreceipt:"
                         + str(sent).encode() + b"\ncontent-length:" + str(size).encode()
                         + b"\n\n" + body + b"\x00")
            sent += 1
        if batch:
            sock.sendall(b"".join(batch))
        received += frames()
    elapsed = time.perf_counter() - started
    sock.close()
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000,
                        help="messages per pipelined / STOMP run")
    parser.add_argument("--one-by-one", type=int, default=2_000,
                        help="messages per one-at-a-time run")
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (median)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tls-bench-") as tmp:
        pki = make_pki(Path(tmp) / "pki")
        ports = {name: free_port() for name in ("native", "native_tls", "stomp", "stomp_tls")}
        proc = start_broker(Path(tmp) / "data", pki, ports)
        try:
            context = ssl.create_default_context(cafile=str(pki.ca))
            tls_opts = {"tls_ca": str(pki.ca)}
            plain_url = f"txb://127.0.0.1:{ports['native']}"
            tls_url = f"txbs://127.0.0.1:{ports['native_tls']}"
            loads: dict[str, dict[str, Callable[[], float]]] = {
                "native_pipelined": {
                    "plain": lambda: native_pipelined(plain_url, {}, args.count, args.size),
                    "tls": lambda: native_pipelined(tls_url, tls_opts, args.count, args.size),
                },
                "native_one_by_one": {
                    "plain": lambda: native_one_by_one(plain_url, {}, args.one_by_one,
                                                       args.size),
                    "tls": lambda: native_one_by_one(tls_url, tls_opts, args.one_by_one,
                                                     args.size),
                },
                "stomp_receipts": {
                    "plain": lambda: stomp_receipts(ports["stomp"], None, args.count,
                                                    args.size),
                    "tls": lambda: stomp_receipts(ports["stomp_tls"], context, args.count,
                                                  args.size),
                },
            }
            results: dict[str, Any] = {}
            counts = {"native_pipelined": args.count, "native_one_by_one": args.one_by_one,
                      "stomp_receipts": args.count}
            for name, modes in loads.items():
                rates: dict[str, list[float]] = {"plain": [], "tls": []}
                cpu: dict[str, list[float]] = {"plain": [], "tls": []}
                for _ in range(args.runs):
                    for mode in ("plain", "tls"):  # alternate: drift hits both alike
                        before = cpu_seconds(proc.pid)
                        rates[mode].append(round(modes[mode]()))
                        used = cpu_seconds(proc.pid) - before
                        cpu[mode].append(round(used / counts[name] * 1e6, 1))
                plain, tls = statistics.median(rates["plain"]), statistics.median(rates["tls"])
                paired = statistics.median(t / p for t, p in zip(rates["tls"], rates["plain"],
                                                                 strict=True))
                results[name] = {"plain_msg_per_s": rates["plain"], "tls_msg_per_s": rates["tls"],
                                 "plain_median": plain, "tls_median": tls,
                                 "tls_over_plain": round(tls / plain, 3),
                                 "median_of_paired_ratios": round(paired, 3),
                                 "broker_cpu_us_per_msg_plain": cpu["plain"],
                                 "broker_cpu_us_per_msg_tls": cpu["tls"],
                                 "broker_cpu_tls_over_plain": round(
                                     statistics.median(cpu["tls"])
                                     / statistics.median(cpu["plain"]), 3)}
                print(f"{name:18} plaintext {plain:8.0f} msg/s   TLS {tls:8.0f} msg/s   "
                      f"TLS/plaintext {tls / plain:.2f} (paired runs: {paired:.2f}); broker CPU "
                      f"per message {statistics.median(cpu['plain']):.0f} -> "
                      f"{statistics.median(cpu['tls']):.0f} us", flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {"count": args.count, "one_by_one": args.one_by_one, "size": args.size,
                     "runs": args.runs, "sync": "fdatasync", "stomp_window": STOMP_WINDOW,
                     "native_pipelined": "txbroker bench --phase send: 4 producers, window 256",
                     "certificate": "EC P-256, TLS 1.3 (the default of both sides)"},
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(), "python": sys.version.split()[0],
                    "openssl": ssl.OPENSSL_VERSION},
        "results": results,
    }
    out = args.out or ROOT / "bench" / "results" / f"tls-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
