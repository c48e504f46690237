"""What ``bench/peers.py`` runs for each protocol, and its summary of the runs.

``PROTOCOLS`` names, per protocol, the load generator (one process per run that
prints one JSON line), its workloads with their arguments, the latency figure of
each, the issue's aims and the brokers that speak it. Both generators —
``../shared/bench/stompbench.py`` (STOMP) and ``bench/amqpbench.py`` (AMQP 0-9-1) —
report the same keys (``msgs_per_s``, ``client_cpu_pct``, ``broker_cpu_pct``,
``foreign_cpu_pct``, ``broker_cpu_s``, ``n``, ``disk.flushes``, latency dicts with
``p50`` / ``p99``), so one summary and one table serve both.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERBENCH = Path(os.environ.get("PEERBENCH_DIR", ROOT.parent / "shared" / "bench"))

#: Client + broker CPU at or above this share of all cores: the machine is full, so
#: the figure is (also) the load generator's, not only the broker's.
FULL_SHARE = 0.85
CORES = os.cpu_count() or 1
#: Median foreign CPU (% of one core: processes other than broker and client) at or
#: above which the summary says the machine was shared during the runs.
FOREIGN_PCT = 25.0


@dataclass(frozen=True)
class Protocol:
    """One protocol's load generator, workloads, aims and brokers."""

    name: str
    #: The load generator script (run with this interpreter).
    generator: Path
    #: Workload name -> the generator's arguments (``-n`` is added per run).
    workloads: dict[str, list[str]]
    #: Workload -> the JSON key of its latency percentiles.
    latency_keys: dict[str, str]
    #: Workload -> the issue's aim, txbroker / the better peer (medians of one run).
    aims: dict[str, float]
    #: The brokers run by default, and every broker that speaks the protocol.
    default_brokers: str
    brokers: tuple[str, ...]
    #: Workloads whose default count is ``small_count`` (paced ones).
    paced: frozenset[str] = frozenset()


PROTOCOLS = {
    # The workloads of ../shared/bench/run_matrix.py, with the same arguments; issue 30's
    # aims.
    "stomp": Protocol(
        name="stomp", generator=PEERBENCH / "stompbench.py",
        workloads={
            "send-receipt": ["send-receipt", "-w", "64", "-b", "1024"],
            "tx-send": ["tx-send", "-c", "8", "-k", "10", "-b", "1024"],
            "consume-ack": ["consume-ack", "--prefetch", "1000", "-b", "1024"],
            "consume-ack-tx": ["consume-ack", "--consume-tx", "-k", "10", "--prefetch", "100",
                               "-b", "1024"],
            "roundtrip": ["roundtrip", "--rate", "500", "-b", "1024"],
        },
        latency_keys={"send-receipt": "receipt_lat_ms", "tx-send": "commit_lat_ms",
                      "roundtrip": "e2e_lat_ms", "consume-ack-tx": "commit_lat_ms"},
        aims={"send-receipt": 4.0, "tx-send": 3.0, "consume-ack": 6.0},
        default_brokers="txbroker,rabbitmq,activemq",
        brokers=("txbroker", "txbroker-inprocess", "rabbitmq", "activemq"),
        paced=frozenset({"roundtrip"})),
    # Issue 31's three workloads (1 KiB persistent; confirms window 64, 8 x tx of 10,
    # prefetch 1000 with one ack per message) and its aim, >= 2x RabbitMQ on each.
    # ActiveMQ 5.17 speaks AMQP 1.0, not 0-9-1: RabbitMQ is the only peer.
    "amqp": Protocol(
        name="amqp", generator=ROOT / "bench" / "amqpbench.py",
        workloads={
            "confirm-publish": ["confirm-publish", "-w", "64", "-b", "1024"],
            "tx-publish": ["tx-publish", "-c", "8", "-k", "10", "-b", "1024"],
            "consume-ack": ["consume-ack", "--prefetch", "1000", "-b", "1024"],
        },
        latency_keys={"confirm-publish": "confirm_lat_ms", "tx-publish": "commit_lat_ms"},
        aims={"confirm-publish": 2.0, "tx-publish": 2.0, "consume-ack": 2.0},
        default_brokers="txbroker,rabbitmq", brokers=("txbroker", "rabbitmq")),
}


def value(result: dict[str, Any]) -> float | None:
    """A run's rate (msg/s), None for a failed run."""
    if not result.get("ok"):
        return None
    found = result.get("msgs_per_s", result.get("achieved_rate"))
    return float(found) if found is not None else None


def median(values: list[float]) -> float | None:
    """The median, None of nothing."""
    return statistics.median(values) if values else None


def is_txbroker(name: str) -> bool:
    """txbroker's rows (and txbroker-inprocess) are compared with the peers'."""
    return name.startswith("txbroker")


# ---------------------------------------------------------------- summary
def summarize(results: list[dict[str, Any]], brokers: list[str], workloads: list[str],
              protocol: Protocol) -> list[dict[str, Any]]:
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

            lat_key = protocol.latency_keys.get(workload)
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
    """A figure with thousands separators, "–" for none."""
    return "–" if number is None else f"{number:,.{digits}f}"


def table(summary: list[dict[str, Any]], protocol: Protocol) -> str:
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
            aim = protocol.aims.get(row["workload_name"])
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
