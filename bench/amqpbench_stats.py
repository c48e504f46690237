"""What ``bench/amqpbench.py`` measures besides its own rate: latency percentiles and,
over the timed phase, the CPU of the broker, of the load generator and of everything
else on the machine, and the disk's writes and flushes.

The figures and their JSON keys are those of ``../shared/bench/stompbench.py``
(``client_cpu_pct``, ``broker_cpu_pct``, ``foreign_cpu_pct``, ``disk.flushes`` …) so
that ``bench/peers.py`` summarizes both generators with one piece of code. Percent
figures are of one core; CPU is counted in clock ticks (10 ms here), so a run of a
few tens of milliseconds gives coarse CPU figures.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def pct(sorted_values: list[int], q: float) -> int:
    """The ``q`` quantile of ``sorted_values`` (nearest rank, as stompbench)."""
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def lat_stats(ns_values: list[int]) -> dict[str, Any] | None:
    """Nanosecond latencies -> {n, p50, p90, p99, max, mean} in milliseconds."""
    if not ns_values:
        return None
    values = sorted(ns_values)

    def ms(value: float) -> float:
        return round(value / 1e6, 3)

    return {"n": len(values), "p50": ms(pct(values, 0.50)), "p90": ms(pct(values, 0.90)),
            "p99": ms(pct(values, 0.99)), "max": ms(values[-1]),
            "mean": ms(sum(values) / len(values))}


def own_cpu() -> float:
    """This process's CPU seconds (user + system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_pid(pidfile: str) -> int | None:
    """The pid written in ``pidfile``; None (and a warning) if there is none."""
    try:
        with open(pidfile) as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError) as exc:
        print(f"warning: cannot read --broker-pidfile: {exc}", file=sys.stderr)
        return None


def loadavg_1m() -> str:
    """The 1-minute load average, as /proc/loadavg writes it."""
    with open("/proc/loadavg") as handle:
        return handle.read().split()[0]


def find_disk(path: str) -> str | None:
    """The /proc/diskstats name of the block device holding ``path``."""
    try:
        st = os.stat(path)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        with open("/proc/diskstats") as handle:
            for line in handle:
                fields = line.split()
                if int(fields[0]) == major and int(fields[1]) == minor:
                    return fields[2]
    except OSError:
        pass
    return None


def proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) of process ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
        fields = text[text.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError):
        return None


class Sampler:
    """Snapshots taken at the start and end of the timed phase; ``diff`` the figures."""

    def __init__(self, broker_pid: int | None, disk: str | None) -> None:
        self.pid = broker_pid
        self.disk = disk

    def _system(self) -> float:
        """Busy CPU seconds of the whole machine (steal included)."""
        with open("/proc/stat") as handle:
            v = [int(x) for x in handle.readline().split()[1:]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / CLK_TCK

    def _disk(self) -> tuple[int, int, int | None] | None:
        """(writes, sectors written, flushes) of the data disk."""
        if not self.disk:
            return None
        with open("/proc/diskstats") as handle:
            for line in handle:
                p = line.split()
                if p[2] == self.disk:
                    return int(p[7]), int(p[9]), int(p[18]) if len(p) > 18 else None
        return None

    @staticmethod
    def _kthreads() -> float:
        """CPU seconds of kernel threads (children of kthreadd): I/O workers, jbd2 …"""
        total = 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as handle:
                    text = handle.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            if fields[1] == "2" or name == "2":
                total += int(fields[11]) + int(fields[12])
        return total / CLK_TCK

    def snap(self) -> dict[str, Any]:
        """The counters now (own CPU read last, so the /proc scan is not counted)."""
        found = {"kthreads": self._kthreads(), "disk": self._disk(), "busy": self._system(),
                 "broker": proc_cpu(self.pid) if self.pid else None}
        found["client"] = own_cpu()
        found["t"] = time.perf_counter()
        return found

    def end(self) -> dict[str, Any]:
        """The counters at the end (own CPU and time read first)."""
        found: dict[str, Any] = {"t": time.perf_counter(), "client": own_cpu()}
        found.update(busy=self._system(), broker=proc_cpu(self.pid) if self.pid else None,
                     disk=self._disk(), kthreads=self._kthreads())
        return found

    def diff(self, a: dict[str, Any], b: dict[str, Any],
             extra_client_cpu: float = 0.0) -> dict[str, Any]:
        """The figures between snapshots ``a`` and ``b``; ``extra_client_cpu`` is the
        CPU of the generator's worker processes over the same phase."""
        elapsed = b["t"] - a["t"]
        client = b["client"] - a["client"] + extra_client_cpu

        def share(seconds: float) -> float | None:
            return round(100 * seconds / elapsed, 1) if elapsed > 0 else None

        found: dict[str, Any] = {"client_cpu_s": round(client, 3),
                                 "client_cpu_pct": share(client),
                                 "sys_busy_cpu_s": round(b["busy"] - a["busy"], 3)}
        if a["broker"] is not None and b["broker"] is not None:
            broker = b["broker"] - a["broker"]
            kthreads = b["kthreads"] - a["kthreads"]
            foreign = (b["busy"] - a["busy"]) - broker - client - kthreads
            found.update(broker_cpu_s=round(broker, 3), broker_cpu_pct=share(broker),
                         kthreads_cpu_s=round(kthreads, 3), foreign_cpu_s=round(foreign, 3),
                         foreign_cpu_pct=share(foreign))
        if a["disk"] and b["disk"]:
            disk: dict[str, Any] = {"dev": self.disk, "writes": b["disk"][0] - a["disk"][0],
                                    "write_kib": (b["disk"][1] - a["disk"][1]) // 2}
            if a["disk"][2] is not None:
                disk["flushes"] = b["disk"][2] - a["disk"][2]
            found["disk"] = disk
        return found
