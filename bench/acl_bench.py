#!/usr/bin/env python3
"""The cost of ACL checks on the send path (issue 16), in one run.

Persistent sends answered once durable (the native protocol's receipt), from
``txbroker bench --phase send``, against a broker with users and no ``[acl]``
(everything allowed, no check) and the same broker with an ``[acl]`` of 50
rules where the bench user may send on ``bench.#``: ``--reps`` runs of each,
alternating, each on a fresh broker process; the medians and their ratio,
for the rate and for the broker's CPU time per message (user + system, from
``/proc/<pid>/stat``: less sensitive than the rate to other load on a shared
machine). Also the cost of one cached check (``AccessControl.allows``) in this
process. The machine's load average is recorded before and after.

Usage: ``.venv/bin/python bench/acl_bench.py [--count 50000] [--sync none]``.
``--sync none`` (the default) takes the disk out, so that the broker's CPU —
where a check costs — is what limits the rate. Results go to
``bench/results/acl-<timestamp>.json`` and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import BrokerProcess  # noqa: E402

from txbroker.server.security.acl import AccessControl, parse_acl  # noqa: E402
from txbroker.server.security.auth import hash_password  # noqa: E402

PASSWORD = "bench"
#: Other users' rules, so that the bench user's answer is not the only rule.
OTHER_RULES = 49


def config_text(with_acl: bool) -> str:
    """``[users]`` (the bench user and others) and, ``with_acl``, an ``[acl]``."""
    digest = hash_password(PASSWORD)
    users = ["bench"] + [f"user{i}" for i in range(OTHER_RULES)]
    text = "[users]\n" + "".join(f'{u} = "{digest}"\n' for u in users)
    if with_acl:
        for i in range(OTHER_RULES):
            text += (f'[[acl.rules]]\nuser = "user{i}"\npattern = "app{i}.*"\n'
                     'permissions = ["send", "consume"]\n')
        text += ('[[acl.rules]]\nuser = "bench"\npattern = "bench.#"\n'
                 'permissions = ["send", "consume"]\n')
    return text


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(tmp: Path, name: str, with_acl: bool, args: argparse.Namespace) -> dict[str, Any]:
    config = tmp / f"{name}.toml"
    config.write_text(config_text(with_acl))
    proc = BrokerProcess(tmp / name, "--config", str(config), "--sync", args.sync).start()
    assert proc.proc is not None
    try:
        cpu_before = cpu_seconds(proc.proc.pid)
        out = subprocess.run(
            [sys.executable, "-m", "txbroker.cli", "bench", "--url",
             f"txb://bench:{PASSWORD}@127.0.0.1:{proc.port}", "--queue", "bench.q",
             "--phase", "send", "--count", str(args.count), "--size", str(args.size),
             "--producers", str(args.producers)],
            check=True, capture_output=True, text=True, cwd=ROOT).stdout
        cpu = cpu_seconds(proc.proc.pid) - cpu_before
    finally:
        proc.stop()
    send: dict[str, Any] = json.loads(out)["send"]
    send["broker_cpu_us_per_msg"] = round(cpu / args.count * 1e6, 2)
    return send


def check_cost_ns() -> float:
    """One cached ``allows`` answer, in ns (the send path's extra work)."""
    acl = AccessControl(parse_acl({"rules": [
        {"user": "bench", "pattern": "bench.#", "permissions": ["send"]}]}, ["bench"]))
    acl.allows("bench", "send", "bench.q")
    number = 1_000_000
    seconds = min(timeit.repeat(lambda: acl.allows("bench", "send", "bench.q"),
                                number=number, repeat=3))
    return round(seconds / number * 1e9, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sync", default="none")
    args = parser.parse_args()
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                              "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="txb-acl-bench-") as tmp:
        for rep in range(args.reps):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                result = one_run(Path(tmp), f"{mode}{rep}", mode == "on", args)
                runs[mode].append(result)
                print(f"rep {rep} acl {mode}: {result['msg_per_s']} msg/s, broker "
                      f"{result['broker_cpu_us_per_msg']} us CPU/msg", flush=True)
    medians = {mode: statistics.median(r["msg_per_s"] for r in found)
               for mode, found in runs.items()}
    cpu = {mode: statistics.median(r["broker_cpu_us_per_msg"] for r in found)
           for mode, found in runs.items()}
    report.update({
        "runs": runs,
        "median_msg_per_s": medians,
        "ratio_on_over_off": round(medians["on"] / medians["off"], 3),
        "median_broker_cpu_us_per_msg": cpu,
        "cpu_ratio_on_over_off": round(cpu["on"] / cpu["off"], 3),
        "cached_check_ns": check_cost_ns(),
        "loadavg_after": os.getloadavg(),
    })
    out = ROOT / "bench" / "results" / f"acl-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in (
        "median_msg_per_s", "ratio_on_over_off", "median_broker_cpu_us_per_msg",
        "cpu_ratio_on_over_off", "cached_check_ns", "loadavg_before", "loadavg_after")}))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
