#!/usr/bin/env python3
"""Console figure (issue 16): page load time of the queue list with 10,000 queues,
measured in a real browser.

Usage: ``.venv/bin/python bench/console_bench.py [--queues 10000] [--runs 3]``.
Results go to ``bench/results/console-<timestamp>.json`` and a summary to stdout.

A ``txbroker serve`` process (journal store, fdatasync, uvloop; open broker, no
users) with ``--http-port`` gets ``--queues`` queues with one 100-byte message
each (``http_bench.fill``). Debian's chromium, headless through Selenium and
``/usr/bin/chromedriver``, then loads ``/console/#/queues`` ``--runs`` times,
each time with the browser cache cleared (a cold load: HTML, CSS, the JS
modules and ``GET /api/queues``). The figure is the time from the start of the
navigation to the first full render of the list (the page's
``txbroker:queues-rendered`` performance mark, taken once the first page of
queues — filtered, sorted and paged by the broker, ``GET /api/queues?limit=50``
— is in the DOM), read in the browser with the Performance API; the median is
reported with every run, the fetch time of that page (resource timing) and the
machine's load average.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_bench import http_broker, loadavg, machine, parse_args

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MARK = "txbroker:queues-rendered"
#: Seconds one load may take before the run fails.
LOAD_TIMEOUT = 120

MEASURE = f"""
const mark = performance.getEntriesByName("{MARK}")[0];
if (!mark) return null;
const nav = performance.getEntriesByType("navigation")[0];
const api = performance.getEntriesByType("resource")
  .filter((e) => e.name.includes("/api/queues?"))[0];
return {{rendered_ms: mark.startTime,
         dom_content_loaded_ms: nav ? nav.domContentLoadedEventEnd : null,
         api_queues_fetch_ms: api ? api.responseEnd - api.startTime : null,
         api_queues_bytes: api ? api.transferSize : null,
         rows: document.querySelectorAll("#queue-rows tr").length,
         count_text: document.getElementById("queue-count").textContent}};
"""


def chrome() -> webdriver.Chrome:
    """Headless Debian chromium (nothing downloaded: both paths explicit)."""
    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000", "--lang=en-US"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def load(driver: webdriver.Chrome, url: str) -> dict[str, Any]:
    """One cold load of the queue list; what the browser measured."""
    driver.get("about:blank")
    driver.execute_cdp_cmd("Network.clearBrowserCache", {})
    driver.get(url)
    result: dict[str, Any] = WebDriverWait(driver, LOAD_TIMEOUT, poll_frequency=0.05).until(
        lambda d: d.execute_script(MEASURE), "the queue list was not rendered")
    return result


def main() -> None:
    args = parse_args(__doc__ or "")
    report: dict[str, Any] = {
        "bench": "console", "queues": args.queues, "runs": args.runs,
        "what": "navigation start to the queue list's first render (Performance API "
                "mark), cold browser cache, headless chromium",
        "machine": machine(),
        "broker": {"store": "journal", "sync": "fdatasync", "loop": "uvloop", "users": False},
    }
    driver = None
    with http_broker("txb-console-bench-", args.queues) as (_port, http_port, filled):
        report["fill_seconds"] = filled
        try:
            driver = chrome()
            report["browser"] = {"name": "chromium",
                                 "version": driver.capabilities.get("browserVersion")}
            url = f"http://127.0.0.1:{http_port}/console/#/queues"
            load(driver, url)  # warm-up: the broker's first list, the browser's first start
            runs = []
            for _ in range(args.runs):
                started = time.perf_counter()
                measured = load(driver, url)
                measured["selenium_wall_seconds"] = round(time.perf_counter() - started, 3)
                runs.append(measured)
        finally:
            if driver is not None:
                driver.quit()
    assert all(r["count_text"] == f"{args.queues:,} in all" for r in runs), runs
    rendered = [r["rendered_ms"] for r in runs]
    report["runs_detail"] = runs
    report["rendered_ms"] = {"median": round(statistics.median(rendered), 1),
                             "runs": [round(x, 1) for x in rendered]}
    report["api_queues_fetch_ms_median"] = round(statistics.median(
        r["api_queues_fetch_ms"] for r in runs), 1)
    report["machine"]["load_after"] = loadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"console-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("queues", "rendered_ms",
                                             "api_queues_fetch_ms_median")}
                     | {"load": [report["machine"]["load_before"],
                                 report["machine"]["load_after"]]}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
