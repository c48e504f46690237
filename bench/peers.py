#!/usr/bin/env python3
"""txbroker side by side with RabbitMQ 3.10 and ActiveMQ 5.17, over STOMP, in one run.

Runs the workloads of ``../shared/bench/stompbench.py`` (the same raw-socket
client and the same arguments as ``../shared/bench/run_matrix.py``) against
txbroker and both peer brokers, alternating the order between repetitions,
and prints one table per workload with the median and the ratio of txbroker
to the better peer. Results (one JSON line per run) go to
``bench/results/peers-<time>.jsonl``.

Usage (as root, for the peers)::

    sudo ../shared/bench/install_peers.sh            # once per machine
    .venv/bin/python bench/peers.py --reps 3          # starts and stops everything
    .venv/bin/python bench/peers.py --brokers txbroker --workloads send-receipt --reps 1

The peers are started with ``start_peers.sh --fresh`` (RabbitMQ STOMP on
127.0.0.1:61613, ActiveMQ on :61614) unless they already run, and stopped
with ``stop_peers.sh`` at the end if this script started them. txbroker runs
in a child process of this script (``--serve``: a BrokerServer plus the STOMP
listener, on 127.0.0.1:61615 by default) with a fresh data directory under
``/var/lib`` (the device the peers store on), ``--sync fdatasync``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERBENCH = Path(os.environ.get("PEERBENCH_DIR", ROOT.parent / "shared" / "bench"))
STATE = Path(os.environ.get("PEERBENCH_STATE", "/tmp/peerbench-state"))

N = 20000
#: The workloads of run_matrix.py, with the same arguments.
WORKLOADS: dict[str, list[str]] = {
    "send-receipt": ["send-receipt", "-n", str(N), "-w", "64", "-b", "1024"],
    "tx-send": ["tx-send", "-n", str(N), "-c", "8", "-k", "10", "-b", "1024"],
    "consume-ack": ["consume-ack", "-n", str(N), "--prefetch", "1000", "-b", "1024"],
    "consume-ack-tx": ["consume-ack", "-n", str(N), "--consume-tx", "-k", "10", "--prefetch",
                       "100", "-b", "1024"],
    "roundtrip": ["roundtrip", "-n", "5000", "--rate", "500", "-b", "1024"],
}
WARMUP_N = {"roundtrip": ["-n", "1000"], "default": ["-n", "3000"]}
#: The issue's aims: txbroker / better peer.
AIMS = {"send-receipt": 2.0, "consume-ack": 2.0, "tx-send": 3.0}
#: Latency column of each workload (stompbench JSON key).
LATENCY_KEY = {"send-receipt": "receipt_lat_ms", "tx-send": "commit_lat_ms",
               "roundtrip": "e2e_lat_ms", "consume-ack-tx": "commit_lat_ms"}


# ---------------------------------------------------------------- txbroker child
def serve(data: str, port: int, sync: str, switch_interval: float | None) -> None:
    """``--serve``: run a broker with the STOMP listener until SIGTERM."""
    import asyncio

    if switch_interval:
        sys.setswitchinterval(switch_interval)

    from txbroker.server.app import BrokerServer
    from txbroker.server.config import ServerConfig
    from txbroker.server.stomp import start_stomp_listener

    async def main() -> None:
        server = BrokerServer(ServerConfig(host="127.0.0.1", stomp_port=0, port=0, amqp_port=0,
                                           data=Path(data), sync=sync))
        await server.start()
        listener = await start_stomp_listener(server, "127.0.0.1", port)
        print("ready", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        listener.close()
        await server.stop()

    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


class Txbroker:
    """The txbroker child process."""

    def __init__(self, port: int, sync: str, data_root: str,
                 switch_interval: float | None) -> None:
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="txbroker-peerbench-", dir=data_root)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", self.dir, str(port),
             "--sync", sync, *(["--switch-interval", str(switch_interval)] if switch_interval
                               else [])], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("txbroker did not start")
        self.pidfile = Path(self.dir) / "broker.pid"
        self.pidfile.write_text(str(self.proc.pid))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        subprocess.run(["rm", "-rf", self.dir], check=False)


# ---------------------------------------------------------------- runs
def port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def sys_busy() -> float:
    with open("/proc/stat") as handle:
        values = [int(x) for x in handle.readline().split()[1:]]
    return (values[0] + values[1] + values[2] + values[5] + values[6] + values[7]) / os.sysconf(
        "SC_CLK_TCK")


def wait_quiet(max_wait: float, cores: float) -> dict[str, Any]:
    """Wait (up to ``max_wait`` s) for the 2-core machine to be quiet, as run_matrix does."""
    started = time.time()
    while True:
        before = sys_busy()
        time.sleep(1.0)
        busy = sys_busy() - before
        if busy < cores or time.time() - started > max_wait:
            return {"quiet": busy < cores, "busy_cores": round(busy, 2)}


def run_one(broker: dict[str, Any], workload: str, extra: list[str],
            timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(PEERBENCH / "stompbench.py"), *WORKLOADS[workload], *extra,
           "--port", str(broker["port"]), "--label", broker["name"],
           "--broker-pidfile", str(broker["pidfile"])]
    started = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        line = (done.stdout.strip().splitlines() or [""])[-1]
        try:
            result: dict[str, Any] = json.loads(line)
        except ValueError:
            result = {"ok": False, "error": f"no JSON: rc={done.returncode} {done.stderr[-300:]}"}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"timeout after {timeout} s"}
    result["wall_s"] = round(time.time() - started, 1)
    result["broker"] = broker["name"]
    result["workload_name"] = workload
    return result


def value(result: dict[str, Any]) -> float | None:
    if not result.get("ok"):
        return None
    found = result.get("msgs_per_s", result.get("achieved_rate"))
    return float(found) if found is not None else None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table(results: list[dict[str, Any]], brokers: list[str], workloads: list[str]) -> str:
    """The side-by-side table (markdown)."""
    lines = ["| workload | " + " | ".join(f"{b} msg/s" for b in brokers)
             + " | txbroker / better peer | aim | p50 / p99 ms (" + ", ".join(brokers)
             + ") | broker CPU ms per 1k msg (" + ", ".join(brokers)
             + ") | disk flushes per 1k msg (" + ", ".join(brokers) + ") |",
             "|---" * (len(brokers) + 6) + "|"]
    for workload in workloads:
        runs = {b: [r for r in results if r["broker"] == b and r["workload_name"] == workload
                    and r.get("kind") == "run"] for b in brokers}
        rates = {b: median([v for r in runs[b] if (v := value(r)) is not None]) for b in brokers}
        cells = []
        for b in brokers:
            good = [v for r in runs[b] if (v := value(r)) is not None]
            rate = rates[b]
            spread = f" [{min(good):,.0f}–{max(good):,.0f}]" if len(good) > 1 else ""
            cells.append("failed" if rate is None else f"{rate:,.0f}{spread}")
        peers = [rates[b] for b in brokers if b != "txbroker" and rates[b] is not None]
        ratio = ""
        if rates.get("txbroker") is not None and peers:
            ratio = f"{rates['txbroker'] / max(peers):.2f}×"  # type: ignore[operator]
        aim = f"≥ {AIMS[workload]:g}×" if workload in AIMS else "–"
        latency = []
        cpu = []
        flushes = []
        for b in brokers:
            key = LATENCY_KEY.get(workload)
            lat = [r[key] for r in runs[b] if r.get("ok") and key and r.get(key)]
            latency.append(f"{median([x['p50'] for x in lat]):.1f} / "
                           f"{median([x['p99'] for x in lat]):.1f}" if lat else "–")
            per_k = [1e6 * r["broker_cpu_s"] / r["n"] for r in runs[b]
                     if r.get("ok") and r.get("broker_cpu_s") is not None and r.get("n")]
            cpu.append(f"{median(per_k):.0f}" if per_k else "–")
            flush_k = [1000 * r["disk"]["flushes"] / r["n"] for r in runs[b]
                       if r.get("ok") and (r.get("disk") or {}).get("flushes") is not None]
            flushes.append(f"{median(flush_k):.0f}" if flush_k else "–")
        lines.append(f"| {workload} | " + " | ".join(cells) + f" | {ratio} | {aim} | "
                     + ", ".join(latency) + " | " + ", ".join(cpu) + " | " + ", ".join(flushes)
                     + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", nargs=2, metavar=("DATA", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--sync", default="fdatasync")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval() of the txbroker process (default: "
                             "Python's 5 ms)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--brokers", default="txbroker,rabbitmq,activemq")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--txbroker-port", type=int, default=61615)
    parser.add_argument("--rabbitmq-port", type=int, default=61613)
    parser.add_argument("--activemq-port", type=int, default=61614)
    parser.add_argument("--data-root", default="/var/lib",
                        help="txbroker's data dir is made here (the peers' device)")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--quiet-wait", type=float, default=30)
    parser.add_argument("--quiet-cores", type=float, default=0.3)
    parser.add_argument("--run-timeout", type=float, default=400)
    parser.add_argument("--keep-peers", action="store_true",
                        help="leave the peers running at the end")
    parser.add_argument("--out", default=None)
    parser.add_argument("--table-from", default=None, metavar="JSONL",
                        help="print the table of an earlier run's results and exit")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), args.sync, args.switch_interval)
        return
    brokers = args.brokers.split(",")
    workloads = args.workloads.split(",")
    if args.table_from:
        with open(args.table_from) as handle:
            print(table([json.loads(line) for line in handle], brokers, workloads))
        return
    started_peers = False
    peers = [b for b in brokers if b != "txbroker"]
    if peers and not all(port_open(getattr(args, f"{p}_port")) for p in peers):
        subprocess.run([str(PEERBENCH / "start_peers.sh"), "--fresh", "all"], check=True)
        started_peers = True
    info: dict[str, dict[str, Any]] = {
        "rabbitmq": {"name": "rabbitmq", "port": args.rabbitmq_port,
                     "pidfile": STATE / "run" / "rabbitmq.beam.pid"},
        "activemq": {"name": "activemq", "port": args.activemq_port,
                     "pidfile": STATE / "run" / "activemq.pid"},
    }
    txb = None
    if "txbroker" in brokers:
        txb = Txbroker(args.txbroker_port, args.sync, args.data_root, args.switch_interval)
        info["txbroker"] = {"name": "txbroker", "port": args.txbroker_port,
                            "pidfile": txb.pidfile}
    out_path = Path(args.out or ROOT / "bench" / "results" /
                    f"peers-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    begun = time.time()
    try:
        with open(out_path, "a") as out:
            def emit(record: dict[str, Any]) -> None:
                results.append(record)
                out.write(json.dumps(record) + "\n")
                out.flush()

            if not args.no_warmup:
                for workload in workloads:
                    for name in brokers:
                        extra = WARMUP_N.get(workload, WARMUP_N["default"])
                        record = run_one(info[name], workload, extra, args.run_timeout)
                        record["kind"] = "warmup"
                        emit(record)
            for rep in range(args.reps):
                for index, workload in enumerate(workloads):
                    order = brokers if (rep + index) % 2 == 0 else list(reversed(brokers))
                    for name in order:
                        quiet = wait_quiet(args.quiet_wait, args.quiet_cores)
                        record = run_one(info[name], workload, [], args.run_timeout)
                        record.update(kind="run", rep=rep, pre_quiet=quiet)
                        emit(record)
                        lat = record.get(LATENCY_KEY.get(workload, ""), {}) or {}
                        print(f"[{time.time() - begun:6.0f}s] rep{rep} {workload:<14} "
                              f"{name:<9} ok={record.get('ok')} msgs/s={value(record)} "
                              f"p50={lat.get('p50')} p99={lat.get('p99')} "
                              f"cpu%={record.get('broker_cpu_pct')} "
                              f"{record.get('error') or ''}", flush=True)
    finally:
        if txb is not None:
            txb.stop()
        if started_peers and not args.keep_peers:
            subprocess.run([str(PEERBENCH / "stop_peers.sh"), "all"], check=False)
    print()
    print(f"{args.reps} repetitions, medians [min–max]; N={N} × 1 KiB persistent; "
          f"results in {out_path}")
    print(table(results, brokers, workloads))


if __name__ == "__main__":
    main()
