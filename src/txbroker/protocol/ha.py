"""The HA link between the two brokers of a shared-store pair: a sans-IO codec.

Wire format
-----------
One JSON object per line (UTF-8, ``\\n``-terminated, at most
:data:`MAX_LINE` bytes). Every object carries ``"txbroker_ha": 1`` (the link's
version) and a ``"type"``:

====================  =========  ===============================================
type                  sent by    fields
====================  =========  ===============================================
``standby``           standby    ``node`` (its HA address), ``lock`` (the line it
                                 reads in the shared lock file)
``welcome``           active     ``node``, ``lock`` (the line it wrote),
                                 ``heartbeat_interval``
``refused``           either     ``reason``, ``retry`` (false: a permanent refusal,
                                 e.g. a second standby)
``heartbeat``         active     ``seq``
``heartbeat_ack``     standby    ``seq``
====================  =========  ===============================================

The connection first runs the handshake of ``protocol/ha_auth.py`` (the peers
prove the HA secret; over TLS when configured); then a standby says ``standby``;
a broker that is active answers ``welcome`` (then heartbeats) or ``refused``; a
broker that is not active answers ``refused`` with ``retry`` true. Anything else — bytes that are
not a line of JSON, an object without the version — means the peer is not a
txbroker HA port: :class:`~txbroker.errors.ProtocolError` with what it sent.

No socket, loop or clock here (``server/ha/shared_store.py`` is the I/O).
"""

from __future__ import annotations

import json
from typing import Any, Final

from txbroker.errors import ProtocolError

__all__ = ["HA_VERSION", "MAX_LINE", "HaDecoder", "encode"]

#: The version every object carries.
HA_VERSION: Final = 1
#: The longest line either side accepts (the link's objects are a few hundred bytes).
MAX_LINE: Final = 16 * 1024
#: The types a peer may send.
TYPES: Final = frozenset({"standby", "welcome", "refused", "heartbeat", "heartbeat_ack"})


def encode(kind: str, **fields: Any) -> bytes:
    """One line: ``{"txbroker_ha": 1, "type": kind, **fields}``."""
    if kind not in TYPES:
        raise ValueError(f"unknown HA message type {kind!r}")
    return json.dumps({"txbroker_ha": HA_VERSION, "type": kind, **fields},
                      separators=(",", ":")).encode() + b"\n"


class HaDecoder:
    """Bytes in, messages out: :meth:`feed` returns the complete messages received."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add ``data``; return the messages it completes. Raises
        :class:`ProtocolError` on anything that is not the HA link."""
        self._buffer += data
        messages: list[dict[str, Any]] = []
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > MAX_LINE:
                    raise ProtocolError(self._not_ha(bytes(self._buffer[:60])))
                return messages
            line = bytes(self._buffer[:end])
            del self._buffer[:end + 1]
            messages.append(self._decode(line))

    @staticmethod
    def _not_ha(sample: bytes) -> str:
        return f"the peer is not a txbroker HA port (it sent {sample[:60]!r})"

    def _decode(self, line: bytes) -> dict[str, Any]:
        try:
            message = json.loads(line)
        except ValueError:
            raise ProtocolError(self._not_ha(line)) from None
        if not isinstance(message, dict) or "txbroker_ha" not in message:
            raise ProtocolError(self._not_ha(line))
        version = message["txbroker_ha"]
        if version != HA_VERSION:
            raise ProtocolError(f"the peer speaks HA link version {version!r}; this broker "
                                f"speaks {HA_VERSION}")
        if message.get("type") not in TYPES:
            raise ProtocolError(f"unknown HA message type {message.get('type')!r}")
        return message
