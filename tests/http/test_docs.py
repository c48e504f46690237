"""Every example command of docs/http.md runs against a broker (in order)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.http.conftest import HttpBroker
from tests.support import ROOT

DOC = ROOT / "docs" / "http.md"
#: Placeholders the reader fills in: those lines are not run.
PLACEHOLDERS = ("<XID>", "<ID>", "<TID>")


def doc_commands() -> list[str]:
    """The ``curl`` and ``txbroker`` lines of the page's ``sh`` blocks (continued
    lines joined)."""
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    commands = []
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            command = command.strip()
            if command.startswith(("curl ", "txbroker ")) and not any(
                    p in command for p in PLACEHOLDERS):
                commands.append(command)
    return commands


def test_the_examples_of_docs_http_run(broker: HttpBroker) -> None:
    commands = doc_commands()
    assert len(commands) >= 15
    for command in commands:
        runnable = command.replace(":8161", f":{broker.http_port}").replace(
            ":5445", f":{broker.process.port}")
        if runnable.startswith("curl "):
            runnable = "curl --fail-with-body " + runnable[len("curl "):]
        else:
            runnable = f"{sys.executable} -m txbroker.cli " + runnable[len("txbroker "):]
        done = subprocess.run(runnable, shell=True, capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    moved = broker.http.get("/api/queues/orders").json()
    assert (moved["depth"], moved["dead_lettered"]) == (0, 0)  # purged after the re-drive
