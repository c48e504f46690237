"""Sans-IO codec of the replication link (``--ha replicated``, docs/ha.md).

Theory of operation
-------------------
A backup connects to the primary's HA port, the two run the handshake of
``protocol/ha_auth.py`` (each proves the HA secret; over TLS when configured),
and then exchange *messages*.
The primary streams its store entries, each numbered by a **log sequence
number** (LSN, 1, 2, 3 … in append order); the backup writes them to its own
store and acknowledges the highest LSN that is durable there. A joining backup
first gets a **dump** — the primary's whole state as store entries, taken when
every entry up to LSN ``at`` was durable — then the entries after ``at``.

Bytes on the wire (the native protocol's framing, ``protocol/native.py``)::

    offset  size  field
    0       4     N, big-endian unsigned: payload length, 1 ≤ N ≤ MAX_FRAME
    4       N     msgpack (use_bin_type) of the array [type, body]

    type         direction          body
    "join"       backup → primary   {"node": str, "version": 1,
                                     "resume": {"epoch": str, "lsn": int}} — resume only
                                    from a backup that kept a whole copy of that epoch,
                                    applied up to ``lsn``
    "welcome"    primary → backup   {"node": str, "epoch": str, "at": int,
                                     "incremental": bool} — a dump of the state at LSN
                                    ``at`` follows; with ``incremental`` true, no dump:
                                    the entries after ``at`` (the backup's resume LSN)
    "refuse"     primary → backup   {"reason": str} — then the primary closes
    "entries"    primary → backup   [[lsn, kind, meta: bin, [body: bin…]]…]
                                    (dump entries have lsn 0)
    "dumped"     primary → backup   {"at": int} — the dump is complete
    "heartbeat"  primary → backup   {"lsn": int} — the newest LSN
    "state"      primary → backup   {"ready": bool} — whether the primary now waits for
                                    this backup's acks (only a ready backup may be
                                    promoted: it has every acknowledged entry)
    "ack"        backup → primary   {"lsn": int} — every entry ≤ lsn is durable
                                    here (after "dumped": 0 until then)
    "vote"       backup → primary   {"lsn": int, "ok": false, "reason": str}
                                    — the backup could not write entry lsn
    "record"     primary → backup   {"record": {"term": int, "version": int,
                                     "primary": str, "ready": [str…]}} — a version of the
                                    ready set to hold (synced) before acknowledging it
                                    (a group of three or more without etcd,
                                    ``core/ha/promotion.py``); the first message after a
                                    join, before the welcome, when records are kept
    "recorded"   backup → primary   {"ok": true, "term": int, "version": int} — held;
                                    {"ok": false, "term": int, "primary": str} — refused:
                                    this backup holds a newer term (then it leaves)
    "standing"   any → peer         {} — before a promotion: what are you? The peer
                 peer → asker       {"node": str, "role": str, "following": str,
                                     "record": {…} | null} — and closes (a "refuse" of a
                                    join carries the same as ``standing``)

A malformed frame raises :class:`~txbroker.errors.ProtocolError`; the peer
closes the link (the backup then joins again, the primary drops the backup).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from txbroker.errors import ProtocolError

__all__ = ["MAX_FRAME", "MESSAGE_TYPES", "LinkMessage", "ReplicationCodec", "encode"]

#: The largest frame of the link: a batch of entries is cut below it.
MAX_FRAME: Final = 64 * 1024 * 1024
#: Every message type, and the one direction each may travel.
MESSAGE_TYPES: Final = frozenset({"join", "welcome", "refuse", "entries", "dumped",
                                  "heartbeat", "state", "ack", "vote", "record",
                                  "recorded", "standing"})
_LENGTH: Final = struct.Struct(">I")
assert _LENGTH.size == 4


@dataclass(frozen=True, slots=True)
class LinkMessage:
    """One message of the link: its ``type`` and ``body`` (see the module docstring)."""

    type: str
    body: Any


def encode(kind: str, body: Any) -> bytes:
    """One framed message."""
    payload = msgpack.packb([kind, body], use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise ValueError(f"a replication frame of {len(payload)} bytes is above {MAX_FRAME}")
    return _LENGTH.pack(len(payload)) + payload


class ReplicationCodec:
    """Bytes in, messages out (one side of one link)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def receive_data(self, data: bytes) -> list[LinkMessage]:
        """Feed bytes; every complete message they finish (ProtocolError on garbage)."""
        buffer = self._buffer
        buffer += data
        found: list[LinkMessage] = []
        start = 0
        while len(buffer) - start >= 4:
            (size,) = _LENGTH.unpack_from(buffer, start)
            if not 1 <= size <= MAX_FRAME:
                raise ProtocolError(f"replication frame length {size} out of range")
            if len(buffer) - start - 4 < size:
                break
            payload = bytes(buffer[start + 4:start + 4 + size])
            start += 4 + size
            try:
                item = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            except (ValueError, msgpack.UnpackException) as exc:
                raise ProtocolError(f"undecodable replication frame: {exc}") from exc
            if (not isinstance(item, list) or len(item) != 2
                    or item[0] not in MESSAGE_TYPES):
                raise ProtocolError(f"not a replication message: {str(item)[:80]}")
            found.append(LinkMessage(item[0], item[1]))
        del buffer[:start]
        return found
