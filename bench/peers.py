#!/usr/bin/env python3
"""txbroker side by side with RabbitMQ 3.10 (and ActiveMQ 5.17), in one run, over STOMP
or AMQP 0-9-1.

``--protocol stomp`` (default) runs the workloads of ``../shared/bench/stompbench.py``
(the same raw-socket client and the same arguments as ``../shared/bench/run_matrix.py``)
against txbroker, RabbitMQ and ActiveMQ. ``--protocol amqp`` runs issue 31's three
workloads with ``bench/amqpbench.py`` (pamqp frames over plain sockets, no client
library) against txbroker and RabbitMQ. txbroker is started as users start it: the
installed console script, ``.venv/bin/txbroker serve``, with its default
configuration. Only the ports differ (STOMP: ``--stomp-port 61615`` because RabbitMQ
holds 61613; AMQP: txbroker's default 5672, RabbitMQ's moved to 5673; the other
listeners off, ``--port 0`` and ``--stomp-port 0`` / ``--amqp-port 0``) and the data
directory is a fresh one under ``--data-root`` (default ``/var/lib``, the peers'
directory; see bench/peers.md).

Every workload warms up each broker once, then repeats ``--reps`` times (default
5), alternating the brokers' order between repetitions. Each run records the
load average before it, and the broker's and the load generator's CPU (the
client is a Python process on the same 2 cores). The summary gives
min / median / max per broker and workload and says where client + broker CPU
fills the machine. One JSON line per run, then the summary lines, go to
``bench/results/peers-<time>.jsonl`` (``amqp-peers-<time>.jsonl``).

Usage (as root, for the peers)::

    sudo ../shared/bench/install_peers.sh                 # once per machine
    .venv/bin/python bench/peers.py                        # everything, 5 repetitions
    .venv/bin/python bench/peers.py --smoke                # txbroker only, tiny counts
    .venv/bin/python bench/peers.py --protocol amqp        # AMQP: txbroker and RabbitMQ
    .venv/bin/python bench/peers.py --protocol amqp --smoke
    .venv/bin/python bench/peers.py --brokers txbroker --workloads send-receipt \\
        --reps 2 --count 2000
    .venv/bin/python bench/peers.py --brokers txbroker,txbroker-before \\
        --txbroker-install txbroker-before=/work/before/.venv/bin/txbroker  # two commits
    .venv/bin/python bench/peers.py --brokers txbroker,txbroker-nosync,rabbitmq \\
        --txbroker-variant 'txbroker-nosync=--sync none' --workloads tx-send  # one setting
    .venv/bin/python bench/peers.py --table-from bench/results/peers-<time>.jsonl

The peers are started with ``start_peers.sh --fresh`` (RabbitMQ STOMP on
127.0.0.1:61613 and AMQP on :5673 — ``RMQ_AMQP_PORT`` —, ActiveMQ on :61614) unless
their ports already answer, and stopped with ``stop_peers.sh`` at the end only if
this script started them.

``--brokers`` also accepts ``txbroker-inprocess`` (STOMP only): the harness's earlier
way of running txbroker (a BrokerServer built in a child of this script, ``--serve``),
kept only to measure the difference (bench/peers.md); it is not the figure to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peers_summary import (
    CORES,
    PEERBENCH,
    PROTOCOLS,
    ROOT,
    Protocol,
    is_txbroker,
    summarize,
    table,
    value,
)

STATE = Path(os.environ.get("PEERBENCH_STATE", "/tmp/peerbench-state"))
TXBROKER = Path(os.environ.get("TXBROKER_BIN", ROOT / ".venv" / "bin" / "txbroker"))

N = 20000
#: Messages per run of the paced workload (STOMP roundtrip, at 500 msg/s).
ROUNDTRIP_N = 5000


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

    def __init__(self, name: str, port: int, data_root: str, inprocess: bool,
                 listeners: list[str], binary: Path = TXBROKER) -> None:
        self.name = name
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="txbroker-peerbench-", dir=data_root)
        data = Path(self.dir) / "data"
        self.log = open(Path(self.dir) / "broker.log", "w")  # noqa: SIM115 - closed in stop()
        if inprocess:
            self.command = [sys.executable, str(Path(__file__).resolve()), "--serve",
                            str(data), str(port)]
        else:
            self.command = [str(binary), "serve", "--data", str(data), "--host", "127.0.0.1",
                            *listeners]
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


def listener_args(protocol: Protocol, port: int) -> list[str]:
    """txbroker's listeners: the protocol's on ``port``, the others off."""
    if protocol.name == "amqp":
        return ["--amqp-port", str(port), "--port", "0", "--stomp-port", "0"]
    return ["--stomp-port", str(port), "--port", "0", "--amqp-port", "0"]


def known_options(binary: Path, listeners: list[str]) -> list[str]:
    """``listeners`` without the options an older install's ``serve`` does not know
    (one from before the AMQP edge has no ``--amqp-port``: nothing to turn off)."""
    help_text = subprocess.run([str(binary), "serve", "--help"], capture_output=True,
                               text=True, check=False).stdout
    pairs = zip(listeners[::2], listeners[1::2], strict=True)
    return [item for option, value in pairs if option in help_text
            for item in (option, value)]


def run_one(protocol: Protocol, broker: dict[str, Any], workload: str, count: int,
            timeout: float, data_root: str) -> dict[str, Any]:
    """One run of the protocol's load generator: its JSON line, and what we add."""
    cmd = [sys.executable, str(protocol.generator), *protocol.workloads[workload],
           "-n", str(count), "--port", str(broker["port"]), "--label", broker["name"],
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


# ---------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    """The command line; ``--smoke`` and the protocol fill in the defaults."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", nargs=2, metavar=("DATA", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="stomp",
                        help="stomp (stompbench.py, default) or amqp (bench/amqpbench.py)")
    parser.add_argument("--reps", type=int, default=None, help="measured runs per broker and "
                        "workload (default 5)")
    parser.add_argument("--brokers", default=None,
                        help="txbroker, rabbitmq, activemq (STOMP only); txbroker-inprocess "
                             "(STOMP only) to compare with the earlier harness")
    parser.add_argument("--workloads", default=None, help="default: all of the protocol's")
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
    parser.add_argument("--txbroker-port", type=int, default=None,
                        help="STOMP 61615 (RabbitMQ holds 61613); AMQP 5672, txbroker's default")
    parser.add_argument("--txbroker-inprocess-port", type=int, default=61618,
                        help="(61616 is ActiveMQ's OpenWire port)")
    parser.add_argument("--rabbitmq-port", type=int, default=61613, help="RabbitMQ's STOMP port")
    parser.add_argument("--rabbitmq-amqp-port", type=int, default=5673,
                        help="RabbitMQ's AMQP port (RMQ_AMQP_PORT when this script starts it)")
    parser.add_argument("--activemq-port", type=int, default=61614)
    parser.add_argument("--txbroker-install", action="append", default=[],
                        metavar="NAME=BIN",
                        help="another txbroker install to run side by side (e.g. "
                             "txbroker-before=/work/before/.venv/bin/txbroker, an older "
                             "commit's install): name NAME in --brokers too (it must start "
                             "with 'txbroker-'), started as 'BIN serve' with the same "
                             "defaults on --txbroker-port + 10 (+1 for each further one); "
                             "repeatable")
    parser.add_argument("--txbroker-variant", action="append", default=[],
                        metavar="NAME=ARGS",
                        help="this install's txbroker again, with more 'serve' arguments "
                             "(e.g. 'txbroker-nosync=--sync none': what the broker would do "
                             "without a flush), side by side: name NAME in --brokers too (it "
                             "must start with 'txbroker-'), on --txbroker-port + 20 (+1 for "
                             "each further one); repeatable")
    parser.add_argument("--data-root", default="/var/lib",
                        help="txbroker's fresh data directory is made here (default /var/lib, "
                             "where the peers store; the same device as the rest of / here)")
    parser.add_argument("--quiet-wait", type=float, default=30,
                        help="wait up to this long before each run for the machine to be quiet")
    parser.add_argument("--quiet-cores", type=float, default=0.3)
    parser.add_argument("--quiet-budget", type=float, default=300,
                        help="stop waiting for quiet once this many seconds were spent waiting "
                             "(bounds a whole run on a busy machine)")
    parser.add_argument("--run-timeout", type=float, default=400)
    parser.add_argument("--keep-peers", action="store_true",
                        help="leave the peers running at the end")
    parser.add_argument("--out", default=None)
    parser.add_argument("--table-from", default=None, metavar="JSONL",
                        help="print the summary of an earlier run's results and exit")
    args = parser.parse_args()
    protocol = PROTOCOLS[args.protocol]
    if args.smoke:
        args.brokers = args.brokers or "txbroker"
        args.count = args.count or 500
        args.reps = args.reps or 2
        args.warmup_count = 200
        args.quiet_wait = 0
    args.brokers = args.brokers or protocol.default_brokers
    args.workloads = args.workloads or ",".join(protocol.workloads)
    args.reps = args.reps or 5
    args.txbroker_port = args.txbroker_port or (5672 if protocol.name == "amqp" else 61615)
    args.installs = {}
    for spec in args.txbroker_install:
        name, _, binary = spec.partition("=")
        if not name.startswith("txbroker-") or not binary or not Path(binary).is_file():
            parser.error(f"--txbroker-install {spec!r}: want NAME=BIN, NAME starting with "
                         "'txbroker-' and BIN an installed txbroker command")
        args.installs[name] = Path(binary)
    args.variants = {}
    for spec in args.txbroker_variant:
        name, _, extra = spec.partition("=")
        if not name.startswith("txbroker-") or not extra.strip() or name in args.installs:
            parser.error(f"--txbroker-variant {spec!r}: want NAME=ARGS, NAME starting with "
                         "'txbroker-' (not an --txbroker-install's) and ARGS 'serve' options")
        args.variants[name] = shlex.split(extra)
    idle = [name for name in [*args.installs, *args.variants]
            if name not in args.brokers.split(",")]
    if idle:  # (it would be installed and never run)
        parser.error(f"--txbroker-install/--txbroker-variant {idle[0]}=…: name {idle[0]} "
                     "in --brokers too")
    unknown = [b for b in args.brokers.split(",")
               if b not in protocol.brokers and b not in args.installs
               and b not in args.variants]
    unknown += [w for w in args.workloads.split(",") if w not in protocol.workloads]
    if unknown:
        parser.error(f"unknown over {protocol.name}: {', '.join(unknown)} (brokers: "
                     f"{', '.join(protocol.brokers)}; workloads: "
                     f"{', '.join(protocol.workloads)})")
    return args


def peer_port(args: argparse.Namespace, peer: str) -> int:
    """The port the load generator talks to ``peer`` on."""
    if peer == "rabbitmq" and args.protocol == "amqp":
        return int(args.rabbitmq_amqp_port)
    return int(getattr(args, f"{peer}_port"))


def start_peers(args: argparse.Namespace, brokers: list[str]) -> list[str]:
    """Start the peers asked for whose port does not answer; return those (to stop)."""
    started = [b for b in brokers if not is_txbroker(b) and not port_open(peer_port(args, b))]
    env = {**os.environ, "RMQ_STOMP_PORT": str(args.rabbitmq_port),
           "RMQ_AMQP_PORT": str(args.rabbitmq_amqp_port),
           "AMQ_STOMP_PORT": str(args.activemq_port)}
    for peer in started:
        subprocess.run([str(PEERBENCH / "start_peers.sh"), "--fresh", peer], check=True, env=env)
        if not port_open(peer_port(args, peer)):
            raise SystemExit(f"{peer} runs but port {peer_port(args, peer)} does not answer: "
                             f"one started with other ports? ({PEERBENCH}/stop_peers.sh {peer})")
    return started


def main() -> None:
    """Start the brokers, run every workload (warm-up, repetitions), print the table."""
    args = parse_args()
    if args.serve:
        serve_inprocess(args.serve[0], int(args.serve[1]))
        return
    protocol = PROTOCOLS[args.protocol]
    brokers = args.brokers.split(",")
    workloads = args.workloads.split(",")
    if args.table_from:
        with open(args.table_from) as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        setup = next((r for r in records if r.get("kind") == "setup"), {})
        protocol = PROTOCOLS[setup.get("protocol", args.protocol)]
        names = [b for b in setup.get("brokers", brokers)
                 if any(r.get("broker") == b for r in records)]
        print(table(summarize(records, names, setup.get("workloads", workloads), protocol),
                    protocol))
        return

    def count_for(workload: str) -> int:
        if args.count:
            return int(args.count)
        return ROUNDTRIP_N if workload in protocol.paced else N

    started_peers = start_peers(args, brokers)
    info: dict[str, dict[str, Any]] = {
        "rabbitmq": {"name": "rabbitmq", "port": peer_port(args, "rabbitmq"),
                     "pidfile": STATE / "run" / "rabbitmq.beam.pid"},
        "activemq": {"name": "activemq", "port": args.activemq_port,
                     "pidfile": STATE / "run" / "activemq.pid"},
    }
    own: list[Txbroker] = []
    prefix = "peers" if protocol.name == "stomp" else f"{protocol.name}-peers"
    out_path = Path(args.out or ROOT / "bench" / "results" /
                    f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    begun = time.time()
    quiet_spent = 0.0
    try:
        for name in [b for b in brokers if is_txbroker(b)]:
            inprocess = name == "txbroker-inprocess"
            port = args.txbroker_inprocess_port if inprocess else args.txbroker_port
            if name in args.installs:
                # +10: ActiveMQ holds 61616 (OpenWire) beside its STOMP port
                port = args.txbroker_port + 10 + list(args.installs).index(name)
            elif name in args.variants:
                port = args.txbroker_port + 20 + list(args.variants).index(name)
            listeners = listener_args(protocol, port)
            if name in args.installs:
                listeners = known_options(args.installs[name], listeners)
            listeners += args.variants.get(name, [])
            txb = Txbroker(name, port, args.data_root, inprocess, listeners,
                           args.installs.get(name, TXBROKER))
            own.append(txb)
            info[name] = {"name": name, "port": port, "pidfile": txb.pidfile,
                          "command": txb.command, "ready": txb.ready_line}
            print(f"{name}: {' '.join(txb.command)}\n  {txb.ready_line}", flush=True)
        with open(out_path, "a") as out:
            def emit(record: dict[str, Any]) -> None:
                results.append(record)
                out.write(json.dumps(record) + "\n")
                out.flush()

            emit({"kind": "setup", "protocol": protocol.name, "brokers": brokers,
                  "workloads": workloads, "reps": args.reps, "count": args.count or N,
                  "cores": CORES, "warmup": 0 if args.no_warmup else args.warmup_count,
                  "ports": {b: info[b]["port"] for b in brokers},
                  "txbroker": {b: {"command": info[b]["command"], "ready": info[b]["ready"]}
                               for b in brokers if is_txbroker(b)},
                  "loadavg": loadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime())})
            for index, workload in enumerate(workloads):
                if not args.no_warmup:
                    warm = args.warmup_count // (3 if workload in protocol.paced else 1)
                    for name in brokers:
                        record = run_one(protocol, info[name], workload, max(warm, 50),
                                         args.run_timeout, args.data_root)
                        record.update(kind="warmup", loadavg=loadavg())
                        emit(record)
                for rep in range(args.reps):
                    order = brokers if (rep + index) % 2 == 0 else list(reversed(brokers))
                    for name in order:
                        wait = min(args.quiet_wait, args.quiet_budget - quiet_spent)
                        quiet = wait_quiet(wait, args.quiet_cores) if wait > 0 else None
                        quiet_spent += quiet["waited_s"] if quiet else 0.0
                        load = loadavg()
                        record = run_one(protocol, info[name], workload, count_for(workload),
                                         args.run_timeout, args.data_root)
                        record.update(kind="run", rep=rep, pre_quiet=quiet, loadavg=load)
                        emit(record)
                        lat = record.get(protocol.latency_keys.get(workload, ""), {}) or {}
                        print(f"[{time.time() - begun:6.0f}s] rep{rep} {workload:<15} "
                              f"{name:<18} ok={record.get('ok')} msgs/s={value(record)} "
                              f"p50={lat.get('p50')} p99={lat.get('p99')} "
                              f"broker%={record.get('broker_cpu_pct')} "
                              f"client%={record.get('client_cpu_pct')} "
                              f"foreign%={record.get('foreign_cpu_pct')} load={load[0]:.2f} "
                              f"{record.get('error') or ''}", flush=True)
            summary = summarize(results, brokers, workloads, protocol)
            for row in summary:
                emit(row)
    finally:
        for txb in own:
            txb.stop()
        if not args.keep_peers:
            for peer in started_peers:
                subprocess.run([str(PEERBENCH / "stop_peers.sh"), peer], check=False)
    print()
    paced = (f" (roundtrip {args.count or ROUNDTRIP_N} at 500 msg/s)"
             if set(workloads) & protocol.paced else "")
    print(f"{protocol.name}: {args.reps} measured runs per broker and workload after "
          f"{'no' if args.no_warmup else 'a'} warm-up, {args.count or N} × 1 KiB persistent"
          f"{paced}, {CORES} cores; results in {out_path}")
    print(table(summary, protocol))


if __name__ == "__main__":
    main()
