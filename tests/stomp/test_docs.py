"""The Python examples of docs/stomp.md run against a test broker."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.stomp.support import StompBroker
from tests.support import ROOT

DOC = ROOT / "docs" / "stomp.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_doc_example_runs(stomp_broker: StompBroker, index: int) -> None:
    env = {**os.environ, "TXBROKER_STOMP_PORT": str(stomp_broker.stomp_port)}
    done = subprocess.run([sys.executable, "-c", EXAMPLES[index]], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=45)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_doc_has_examples() -> None:
    assert len(EXAMPLES) >= 3
