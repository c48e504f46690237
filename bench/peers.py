#!/usr/bin/env python3
"""txbroker side by side with RabbitMQ 3.10 and ActiveMQ 5.17, over STOMP, in one run.

Runs the workloads of ``../shared/bench/stompbench.py`` (the same raw-socket
client and the same arguments as ``../shared/bench/run_matrix.py``) against
txbroker and the peer brokers. txbroker is started as users start it: the
installed console script, ``.venv/bin/txbroker serve``, with its default
configuration. Only the ports differ (``--stomp-port 61615`` because RabbitMQ
holds 61613, ``--port 0 --amqp-port 0`` so that nothing else is opened) and the
data directory is a fresh one under ``--data-root`` (default ``/var/lib``, the
peers' directory; see bench/peers.md).

Every workload warms up each broker once, then repeats ``--reps`` times (default
5), alternating the brokers' order between repetitions. Each run records the
load average before it, and the broker's and the load generator's CPU (the
stompbench client is a Python process on the same 2 cores). The summary gives
min / median / max per broker and workload and says where client + broker CPU
fills the machine. One JSON line per run, then the summary lines, go to
``bench/results/peers-<time>.jsonl``.

Usage (as root, for the peers)::

    sudo ../shared/bench/install_peers.sh                 # once per machine
    .venv/bin/python bench/peers.py                        # everything, 5 repetitions
    .venv/bin/python bench/peers.py --smoke                # txbroker only, tiny counts
    .venv/bin/python bench/peers.py --brokers txbroker --workloads send-receipt \\
        --reps 2 --count 2000
    .venv/bin/python bench/peers.py --table-from bench/results/peers-<time>.jsonl

The peers are started with ``start_peers.sh --fresh`` (RabbitMQ STOMP on
127.0.0.1:61613, ActiveMQ on :61614) unless their ports already answer, and
stopped with ``stop_peers.sh`` at the end only if this script started them.

``--brokers`` also accepts ``txbroker-inprocess``: the harness's earlier way of
running txbroker (a BrokerServer built in a child of this script, ``--serve``),
kept only to measure the difference (bench/peers.md); it is not the figure to
quote.
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
TXBROKER = Path(os.environ.get("TXBROKER_BIN", ROOT / ".venv" / "bin" / "txbroker"))

N = 20000
ROUNDTRIP_N = 5000
#: The workloads of run_matrix.py, with the same arguments (``-n`` added per run).
WORKLOADS: dict[str, list[str]] = {
    "send-receipt": ["send-receipt", "-w", "64", "-b", "1024"],
    "tx-send": ["tx-send", "-c", "8", "-k", "10", "-b", "1024"],
    "consume-ack": ["consume-ack", "--prefetch", "1000", "-b", "1024"],
    "consume-ack-tx": ["consume-ack", "--consume-tx", "-k", "10", "--prefetch", "100",
                       "-b", "1024"],
    "roundtrip": ["roundtrip", "--rate", "500", "-b", "1024"],
}
#: The issue's aims (issue 30): txbroker / better peer, medians of one run.
AIMS = {"send-receipt": 4.0, "tx-send": 3.0, "consume-ack": 6.0}
#: Latency column of each workload (stompbench JSON key).
LATENCY_KEY = {"send-receipt": "receipt_lat_ms", "tx-send": "commit_lat_ms",
               "roundtrip": "e2e_lat_ms", "consume-ack-tx": "commit_lat_ms"}
#: Client + broker CPU at or above this share of all cores: the machine is full, so
#: the figure is (also) the load generator's, not only the broker's.
FULL_SHARE = 0.85
CORES = os.cpu_count() or 1
#: Median foreign CPU (% of one core: processes other than broker and client) at or
#: above which the summary says the machine was shared during the runs.
FOREIGN_PCT = 25.0


# ---------------------------------------------------------------- txbroker
def serve_inprocess(data: str, port: int) -> None:
    """``--serve``: the harness's earlier txbroker (a BrokerServer built here, no
    ``txbroker.server.app.run``: Python's default GIL switch interval and GC
    thresholds), kept only for the comparison in bench/peers.md."""
    import asyncio

    from txbroker.server.app import BrokerServer
    from txbroker.server.config import ServerConfig
    from txbroker.server.edges.stomp.connection import start_stomp_listener

    async def main() -> None:
        server = BrokerServer(ServerConfig(host="127.0.0.1", stomp_port=0, port=0, amqp_port=0,
                                           data=Path(data), sync="fdatasync"))
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
    """One txbroker process on a fresh data directory: ``txbroker serve`` (default), or
    the in-process ``--serve`` child (``inprocess``)."""

    def __init__(self, name: str, port: int, data_root: str, inprocess: bool) -> None:
        self.name = name
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="txbroker-peerbench-", dir=data_root)
        data = Path(self.dir) / "data"
        self.log = open(Path(self.dir) / "broker.log", "w")  # noqa: SIM115 - closed in stop()
        if inprocess:
            self.command = [sys.executable, str(Path(__file__).resolve()), "--serve",
                            str(data), str(port)]
        else:
            self.command = [str(TXBROKER), "serve", "--data", str(data), "--host", "127.0.0.1",
                            "--stomp-port", str(port), "--port", "0", "--amqp-port", "0"]
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        self.ready_line = self.proc.stdout.readline().strip()
        if not (self.ready_line == "ready" or self.ready_line.startswith("txbroker ready on")):
            self.stop()
            raise RuntimeError(f"{name} did not start: {self.ready_line!r} "
                               f"({' '.join(self.command)})")
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
        self.log.close()
        subprocess.run(["rm", "-rf", self.dir], check=False)


# ---------------------------------------------------------------- runs
def port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def loadavg() -> list[float]:
    with open("/proc/loadavg") as handle:
        return [float(x) for x in handle.read().split()[:3]]


def sys_busy() -> float:
    with open("/proc/stat") as handle:
        values = [int(x) for x in handle.readline().split()[1:]]
    return (values[0] + values[1] + values[2] + values[5] + values[6] + values[7]) / os.sysconf(
        "SC_CLK_TCK")


def wait_quiet(max_wait: float, cores: float) -> dict[str, Any]:
    """Wait (up to ``max_wait`` s) for the machine to be quiet, as run_matrix does."""
    started = time.time()
    while True:
        before = sys_busy()
        time.sleep(1.0)
        busy = sys_busy() - before
        if busy < cores or time.time() - started > max_wait:
            return {"quiet": busy < cores, "busy_cores": round(busy, 2),
                    "waited_s": round(time.time() - started, 1)}


def workload_args(workload: str, count: int) -> list[str]:
    return [*WORKLOADS[workload], "-n", str(count)]


def run_one(broker: dict[str, Any], workload: str, count: int, timeout: float,
            data_root: str) -> dict[str, Any]:
    cmd = [sys.executable, str(PEERBENCH / "stompbench.py"), *workload_args(workload, count),
           "--port", str(broker["port"]), "--label", broker["name"],
           "--broker-pidfile", str(broker["pidfile"]), "--disk-path", data_root]
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


def is_txbroker(name: str) -> bool:
    return name.startswith("txbroker")


# ---------------------------------------------------------------- summary
def summarize(results: list[dict[str, Any]], brokers: list[str],
              workloads: list[str]) -> list[dict[str, Any]]:
    """One record per (workload, broker) over the measured runs, plus the ratio."""
    summary = []
    for workload in workloads:
        rates: dict[str, float | None] = {}
        rows = []
        for b in brokers:
            runs = [r for r in results if r.get("broker") == b
                    and r.get("workload_name") == workload and r.get("kind") == "run"]
            good = [r for r in runs if value(r) is not None]
            vals = [v for r in good if (v := value(r)) is not None]
            rates[b] = median(vals)

            def med(key: str, runs: list[dict[str, Any]] = good) -> float | None:
                found = [float(r[key]) for r in runs if r.get(key) is not None]
                return round(statistics.median(found), 1) if found else None

            lat_key = LATENCY_KEY.get(workload)
            lats = [r[lat_key] for r in good if lat_key and r.get(lat_key)]
            per_k = [1e6 * r["broker_cpu_s"] / r["n"] for r in good
                     if r.get("broker_cpu_s") is not None and r.get("n")]
            flush_k = [1000 * r["disk"]["flushes"] / r["n"] for r in good
                       if (r.get("disk") or {}).get("flushes") is not None and r.get("n")]
            both = [float(r["client_cpu_pct"]) + float(r["broker_cpu_pct"]) for r in good
                    if r.get("client_cpu_pct") is not None
                    and r.get("broker_cpu_pct") is not None]
            both_med = median(both)
            rows.append({
                "kind": "summary", "workload_name": workload, "broker": b,
                "runs": len(runs), "ok_runs": len(good),
                "min": min(vals) if vals else None, "median": rates[b],
                "max": max(vals) if vals else None,
                "client_cpu_pct": med("client_cpu_pct"), "broker_cpu_pct": med("broker_cpu_pct"),
                "foreign_cpu_pct": med("foreign_cpu_pct"),
                "client_plus_broker_cores": round(both_med / 100, 2) if both_med else None,
                "machine_full": bool(both_med and both_med >= FULL_SHARE * 100 * CORES),
                "broker_cpu_ms_per_1k": round(median(per_k), 1) if per_k else None,
                "flushes_per_1k": round(median(flush_k), 1) if flush_k else None,
                "p50_ms": median([x["p50"] for x in lats]),
                "p99_ms": median([x["p99"] for x in lats]),
                "loadavg_1m": [r["loadavg"][0] for r in runs if r.get("loadavg")],
            })
        peers = [rates[b] for b in brokers if not is_txbroker(b) and rates[b] is not None]
        for row in rows:
            if is_txbroker(row["broker"]) and row["median"] is not None and peers:
                row["ratio_to_better_peer"] = round(row["median"] / max(peers), 2)  # type: ignore[type-var]
        summary.extend(rows)
    return summary


def fmt(number: float | None, digits: int = 0) -> str:
    return "–" if number is None else f"{number:,.{digits}f}"


def table(summary: list[dict[str, Any]]) -> str:
    """The summary as markdown: one row per workload and broker."""
    lines = ["| workload | broker | msg/s median | min | max | runs ok | txbroker / better "
             "peer (aim) | client CPU % | broker CPU % | other CPU % | client + broker (cores) | "
             "p50 / p99 ms | broker CPU ms per 1k | flushes per 1k | load avg (1 min) before "
             "each run |",
             "|---" * 15 + "|"]
    notes = []
    for row in summary:
        ratio = ""
        if row.get("ratio_to_better_peer") is not None:
            aim = AIMS.get(row["workload_name"])
            ratio = f"{row['ratio_to_better_peer']:.2f}×" + (f" (≥ {aim:g}×)" if aim else "")
        cores = fmt(row["client_plus_broker_cores"], 2)
        if row["machine_full"]:
            cores += " **full**"
            notes.append(f"{row['workload_name']} / {row['broker']}: client + broker used "
                         f"{row['client_plus_broker_cores']:.2f} of {CORES} cores (client "
                         f"{row['client_cpu_pct']} %, broker {row['broker_cpu_pct']} % of one "
                         "core): the machine, not only the broker, sets this figure.")
        foreign = row.get("foreign_cpu_pct")
        if foreign is not None and foreign >= FOREIGN_PCT:
            notes.append(f"{row['workload_name']} / {row['broker']}: other processes used "
                         f"{foreign:.0f} % of a core (median) during these runs: the broker "
                         "got what the scheduler gave it; compare its CPU per 1k messages, "
                         "not only its rate.")
        latency = (f"{row['p50_ms']:.1f} / {row['p99_ms']:.1f}" if row["p50_ms"] is not None
                   else "–")
        loads = ", ".join(f"{x:.2f}" for x in row["loadavg_1m"])
        lines.append(
            f"| {row['workload_name']} | {row['broker']} | {fmt(row['median'])} | "
            f"{fmt(row['min'])} | {fmt(row['max'])} | {row['ok_runs']}/{row['runs']} | {ratio} | "
            f"{fmt(row['client_cpu_pct'])} | {fmt(row['broker_cpu_pct'])} | "
            f"{fmt(row['foreign_cpu_pct'])} | {cores} | "
            f"{latency} | {fmt(row['broker_cpu_ms_per_1k'])} | {fmt(row['flushes_per_1k'])} | "
            f"{loads} |")
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines)


# ---------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", nargs=2, metavar=("DATA", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=None, help="measured runs per broker and "
                        "workload (default 5)")
    parser.add_argument("--brokers", default=None,
                        help="txbroker, rabbitmq, activemq; txbroker-inprocess only to compare "
                             "with the earlier harness")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--count", type=int, default=None,
                        help=f"messages per run (default {N}; roundtrip {ROUNDTRIP_N})")
    parser.add_argument("--warmup-count", type=int, default=3000,
                        help="messages of each broker's warm-up run per workload (roundtrip: "
                             "a third)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the warm-up (only to measure what it changes)")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check of the harness: txbroker only unless --brokers is "
                             "given, --count 500, --reps 2, warm-up 200, no quiet wait")
    parser.add_argument("--txbroker-port", type=int, default=61615)
    parser.add_argument("--txbroker-inprocess-port", type=int, default=61618,
                        help="(61616 is ActiveMQ's OpenWire port)")
    parser.add_argument("--rabbitmq-port", type=int, default=61613)
    parser.add_argument("--activemq-port", type=int, default=61614)
    parser.add_argument("--data-root", default="/var/lib",
                        help="txbroker's fresh data directory is made here (default /var/lib, "
                             "where the peers store; the same device as the rest of / here)")
    parser.add_argument("--quiet-wait", type=float, default=30,
                        help="wait up to this long before each run for the machine to be quiet")
    parser.add_argument("--quiet-cores", type=float, default=0.3)
    parser.add_argument("--run-timeout", type=float, default=400)
    parser.add_argument("--keep-peers", action="store_true",
                        help="leave the peers running at the end")
    parser.add_argument("--out", default=None)
    parser.add_argument("--table-from", default=None, metavar="JSONL",
                        help="print the summary of an earlier run's results and exit")
    args = parser.parse_args()
    if args.serve:
        serve_inprocess(args.serve[0], int(args.serve[1]))
        return
    if args.smoke:
        args.brokers = args.brokers or "txbroker"
        args.count = args.count or 500
        args.reps = args.reps or 2
        args.warmup_count = 200
        args.quiet_wait = 0
    args.brokers = args.brokers or "txbroker,rabbitmq,activemq"
    args.reps = args.reps or 5
    brokers = args.brokers.split(",")
    workloads = args.workloads.split(",")
    unknown = [b for b in brokers if b not in ("txbroker", "txbroker-inprocess", "rabbitmq",
                                                "activemq")]
    unknown += [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown broker or workload: {', '.join(unknown)}")
    if args.table_from:
        with open(args.table_from) as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        names = [b for b in brokers if any(r.get("broker") == b for r in records)]
        print(table(summarize(records, names, workloads)))
        return

    def count_for(workload: str) -> int:
        if args.count:
            return args.count
        return ROUNDTRIP_N if workload == "roundtrip" else N

    # Start only the peers asked for whose port does not answer; stop only those.
    started_peers = [b for b in brokers if not is_txbroker(b)
                     and not port_open(getattr(args, f"{b}_port"))]
    for peer in started_peers:
        subprocess.run([str(PEERBENCH / "start_peers.sh"), "--fresh", peer], check=True)
    info: dict[str, dict[str, Any]] = {
        "rabbitmq": {"name": "rabbitmq", "port": args.rabbitmq_port,
                     "pidfile": STATE / "run" / "rabbitmq.beam.pid"},
        "activemq": {"name": "activemq", "port": args.activemq_port,
                     "pidfile": STATE / "run" / "activemq.pid"},
    }
    own: list[Txbroker] = []
    out_path = Path(args.out or ROOT / "bench" / "results" /
                    f"peers-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    begun = time.time()
    try:
        for name in [b for b in brokers if is_txbroker(b)]:
            inprocess = name == "txbroker-inprocess"
            port = args.txbroker_inprocess_port if inprocess else args.txbroker_port
            txb = Txbroker(name, port, args.data_root, inprocess)
            own.append(txb)
            info[name] = {"name": name, "port": port, "pidfile": txb.pidfile,
                          "command": txb.command, "ready": txb.ready_line}
            print(f"{name}: {' '.join(txb.command)}\n  {txb.ready_line}", flush=True)
        with open(out_path, "a") as out:
            def emit(record: dict[str, Any]) -> None:
                results.append(record)
                out.write(json.dumps(record) + "\n")
                out.flush()

            emit({"kind": "setup", "brokers": brokers, "workloads": workloads,
                  "reps": args.reps, "count": args.count or N, "cores": CORES,
                  "warmup": 0 if args.no_warmup else args.warmup_count,
                  "txbroker": {b: {"command": info[b]["command"], "ready": info[b]["ready"]}
                               for b in brokers if is_txbroker(b)},
                  "loadavg": loadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime())})
            for index, workload in enumerate(workloads):
                if not args.no_warmup:
                    warm = args.warmup_count // (3 if workload == "roundtrip" else 1)
                    for name in brokers:
                        record = run_one(info[name], workload, max(warm, 50), args.run_timeout,
                                         args.data_root)
                        record.update(kind="warmup", loadavg=loadavg())
                        emit(record)
                for rep in range(args.reps):
                    order = brokers if (rep + index) % 2 == 0 else list(reversed(brokers))
                    for name in order:
                        quiet = (wait_quiet(args.quiet_wait, args.quiet_cores)
                                 if args.quiet_wait > 0 else None)
                        load = loadavg()
                        record = run_one(info[name], workload, count_for(workload),
                                         args.run_timeout, args.data_root)
                        record.update(kind="run", rep=rep, pre_quiet=quiet, loadavg=load)
                        emit(record)
                        lat = record.get(LATENCY_KEY.get(workload, ""), {}) or {}
                        print(f"[{time.time() - begun:6.0f}s] rep{rep} {workload:<14} "
                              f"{name:<18} ok={record.get('ok')} msgs/s={value(record)} "
                              f"p50={lat.get('p50')} p99={lat.get('p99')} "
                              f"broker%={record.get('broker_cpu_pct')} "
                              f"client%={record.get('client_cpu_pct')} "
                              f"foreign%={record.get('foreign_cpu_pct')} load={load[0]:.2f} "
                              f"{record.get('error') or ''}", flush=True)
            summary = summarize(results, brokers, workloads)
            for row in summary:
                emit(row)
    finally:
        for txb in own:
            txb.stop()
        if not args.keep_peers:
            for peer in started_peers:
                subprocess.run([str(PEERBENCH / "stop_peers.sh"), peer], check=False)
    print()
    count = args.count or N
    print(f"{args.reps} measured runs per broker and workload after "
          f"{'no' if args.no_warmup else 'a'} warm-up, {count} × 1 KiB persistent "
          f"(roundtrip {args.count or ROUNDTRIP_N} at 500 msg/s), {CORES} cores; "
          f"results in {out_path}")
    print(table(summary))


if __name__ == "__main__":
    main()
