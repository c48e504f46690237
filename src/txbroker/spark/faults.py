"""Fault points for crash tests of the Spark connectors (off unless asked for).

The connectors call :func:`point` at the steps where a crash matters (see
docs/spark.md). A test sets ``TXBROKER_SPARK_FAULTS`` to a JSON file
``{"<point>": {"batch": n, "action": "raise" | "kill"}}``; Spark passes the
environment on to its Python workers, so the file reaches the process where
the step runs. Each fault fires once: firing creates ``<file>.<point>.fired``.
``kill`` SIGKILLs the process group of the session leader (a test starts the
driver in a new session) and its own — the driver, its JVM and its workers —
as a machine crash would.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

ENV = "TXBROKER_SPARK_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault point."""


def point(name: str, batch: int | None = None) -> None:
    """Fire the fault planned for ``name`` (and this batch), once; else do nothing."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        plan = json.loads(Path(path).read_text()).get(name)
    except (OSError, ValueError):
        return
    if not plan or (plan.get("batch") is not None and plan["batch"] != batch):
        return
    marker = Path(f"{path}.{name}.fired")
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return
    if plan.get("action") == "kill":
        # Spark starts some Python processes in process groups of their own: kill the
        # group of the session leader (the driver the test started with a new session,
        # and its JVM), then our own
        os.killpg(os.getsid(0), signal.SIGKILL)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    raise InjectedFault(f"injected fault at {name} (batch {batch})")
