"""The kill -9 child's entries as broker records, for the dir store.

``crash_child.py`` appends entry ``n`` as ``(4, b"n", bodies)`` with 0–2
bodies (``crash_payload.py``): a log store keeps that as it is, but the dir
store reads records. :func:`open_records_store` (the child spec's factory)
returns a thin wrapper that turns entry ``n`` into valid records: its bodies
become messages ``2n + 1`` and ``2n + 2`` of queue :data:`CHILD_QUEUE` with
client message ids ``"n.0"`` and ``"n.1"`` — one ``ADD`` for one body, one
``TX`` for two (so the parent checks that a transaction is all there or not
at all), and an empty ``TX`` (a DUMMY block) for none.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from txbroker.core import records
from txbroker.core.records import Kind
from txbroker.storage.dirstore import DirStore
from txbroker.storage.interface import BodyRef, DurableCallback, StoredEntry

CHILD_QUEUE = "kill"


def records_entry(index: int, bodies: Sequence[bytes]) -> tuple[int, bytes, list[bytes]]:
    """Entry ``index`` of the child as one broker record."""
    msgs = [
        [2 * index + part + 1, CHILD_QUEUE, f"{index}.{part}", None, 4, index, 0, 0, 0]
        for part in range(len(bodies))
    ]
    if len(msgs) == 1:
        return int(Kind.ADD), records.pack(msgs[0]), list(bodies)
    return int(Kind.TX), records.pack([msgs, []]), list(bodies)


class RecordsAdapter:
    """Appends the child's entries to a dir store as broker records."""

    def __init__(self, store: DirStore) -> None:
        self.store = store

    def recover(self) -> Iterator[StoredEntry]:
        return self.store.recover()

    def append(
        self, kind: int, meta: bytes, bodies: Sequence[bytes], on_durable: DurableCallback
    ) -> list[BodyRef]:
        return self.store.append(*records_entry(int(meta), bodies), on_durable)


def open_records_store(**kwargs: Any) -> RecordsAdapter:
    """The child spec's factory: a dir store behind :class:`RecordsAdapter`."""
    return RecordsAdapter(DirStore(**kwargs))
