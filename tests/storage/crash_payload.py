"""What the kill -9 test's child appends: entry ``index`` is a pure function of
``index``, so the parent can check every recovered entry byte for byte."""

from __future__ import annotations

import random

#: The kind the child writes (any non-snapshot kind).
CHILD_KIND = 4


def expected_body(index: int) -> tuple[bytes, list[bytes]]:
    """Meta and bodies of entry ``index``: 0–2 bodies of 0–3000 random bytes."""
    rng = random.Random(index)
    bodies = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(rng.choice((0, 1, 1, 1, 2)))]
    return b"%d" % index, bodies
