from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import BrokerProcess


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A real broker process on a free loopback port, killed at the end."""
    proc = BrokerProcess(tmp_path / "data").start()
    try:
        yield proc
    finally:
        proc.kill()
