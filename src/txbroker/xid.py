"""The Xid value object: one XA transaction branch's identifier.

An Xid is a format id (a 32-bit integer, usually 0 = OSI CCR naming), a global
transaction id (1–64 bytes) and a branch qualifier (1–64 bytes). Its text
form, used in logs, the CLI, errors and on the wire, is the Solace one
(seed 002)::

    <formatId>-<gtrid hex>-<bqual hex>      e.g. 01020304-0123456789ABCDEF-01

each field in upper-case hex, two characters per byte, the format id always
eight digits (its 4 bytes, big-endian; a negative Java int shows as its
two's complement). The longest form is 8 + 1 + 128 + 1 + 128 = 266 characters.
"""

from __future__ import annotations

from dataclasses import dataclass

from txbroker.errors import XAER_INVAL, XAError

#: gtrid and bqual are 1 to 64 bytes (XA's MAXGTRIDSIZE / MAXBQUALSIZE).
MAX_GTRID_SIZE = 64
MAX_BQUAL_SIZE = 64
#: The longest text form (seed 002: "an XID is at most 266 characters long").
MAX_XID_TEXT = 8 + 1 + 2 * MAX_GTRID_SIZE + 1 + 2 * MAX_BQUAL_SIZE


def _as_bytes(value: bytes | str, what: str) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    limit = MAX_GTRID_SIZE if what == "gtrid" else MAX_BQUAL_SIZE
    if not 1 <= len(data) <= limit:
        raise XAError(XAER_INVAL, f"{what} must be 1 to {limit} bytes, not {len(data)}")
    return data


@dataclass(frozen=True, slots=True, order=True)
class Xid:
    """An XA branch id. Build one with ``Xid(format_id, gtrid, bqual)`` (str or bytes
    for gtrid/bqual; str is UTF-8 encoded) or :meth:`parse` of the text form."""

    format_id: int
    gtrid: bytes
    bqual: bytes

    def __init__(self, format_id: int, gtrid: bytes | str, bqual: bytes | str = b"\x00") -> None:
        if isinstance(format_id, bool) or not isinstance(format_id, int):
            raise XAError(XAER_INVAL, "format_id must be an integer")
        if not -(2**31) <= format_id < 2**32:
            raise XAError(XAER_INVAL, "format_id must fit in 4 bytes")
        if format_id >= 2**31:  # the unsigned spelling of a negative Java int
            format_id -= 2**32
        object.__setattr__(self, "format_id", format_id)
        object.__setattr__(self, "gtrid", _as_bytes(gtrid, "gtrid"))
        object.__setattr__(self, "bqual", _as_bytes(bqual, "bqual"))

    @classmethod
    def parse(cls, text: str) -> Xid:
        """Parse ``<formatId>-<gtrid hex>-<bqual hex>`` (XAER_INVAL when malformed)."""
        if not isinstance(text, str) or len(text) > MAX_XID_TEXT:
            raise XAError(XAER_INVAL, "an Xid is a string of at most 266 characters")
        parts = text.split("-")
        if len(parts) != 3 or len(parts[0]) != 8:
            raise XAError(XAER_INVAL, f"malformed Xid {text[:80]!r}: want FFFFFFFF-GTRID-BQUAL")
        try:
            format_id = int(parts[0], 16)
            gtrid = bytes.fromhex(parts[1])
            bqual = bytes.fromhex(parts[2])
        except ValueError:
            raise XAError(XAER_INVAL, f"malformed Xid {text[:80]!r}: fields are hex") from None
        return cls(format_id, gtrid, bqual)

    def __str__(self) -> str:
        return (f"{self.format_id & 0xFFFFFFFF:08X}-{self.gtrid.hex().upper()}-"
                f"{self.bqual.hex().upper()}")

    def __repr__(self) -> str:
        return f"Xid({str(self)!r})"

    # DB-API 2.0 TPC: an xid is also a 3-tuple (format_id, gtrid, bqual)
    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> int | bytes:
        return (self.format_id, self.gtrid, self.bqual)[index]


# -- the Spark sink's branches (docs/spark.md) --------------------------------
#: Format id reserved for the Spark sink's branches ("TXSK"): one branch per
#: (sink, batch, partition, attempt), committed together by ``sink_commit``.
SINK_FORMAT_ID = 0x5458534B
#: A sink id is 1 to 40 characters (the gtrid also holds the batch id).
MAX_SINK_ID = 40


def check_sink_id(sink_id: object) -> str:
    """A valid sink id (XAER_INVAL otherwise): 1–40 characters without NUL."""
    if (not isinstance(sink_id, str) or not 1 <= len(sink_id.encode()) <= MAX_SINK_ID
            or "\x00" in sink_id):
        raise XAError(XAER_INVAL, f"a sink id is 1 to {MAX_SINK_ID} bytes without NUL")
    return sink_id


def sink_xid(sink_id: str, batch_id: int, partition: int, attempt: int, chunk: int = 0) -> Xid:
    """A branch of one Spark task: gtrid ``<sink>\\0<batch>``, bqual
    ``<partition>:<attempt>[:<chunk>]`` (a task writes ``max_sink_branch_messages`` rows
    per branch: chunk 0, 1, 2 …)."""
    check_sink_id(sink_id)
    bqual = f"{int(partition)}:{int(attempt)}" + (f":{int(chunk)}" if chunk else "")
    return Xid(SINK_FORMAT_ID, f"{sink_id}\x00{int(batch_id)}", bqual)


def is_sink_xid(xid: Xid) -> bool:
    """True for a Spark sink branch (see :func:`sink_xid`)."""
    return xid.format_id == SINK_FORMAT_ID


def sink_of(xid: Xid) -> tuple[str, int] | None:
    """``(sink id, batch id)`` of a sink branch, or None for any other Xid."""
    if xid.format_id != SINK_FORMAT_ID:
        return None
    sink, _, batch = xid.gtrid.partition(b"\x00")
    try:
        return sink.decode(), int(batch)
    except (UnicodeDecodeError, ValueError):
        return None


# -- a local transaction's voted commit (docs/replication.md) ------------------
#: Format id reserved for the branch a replicated primary writes for a local
#: transaction's commit ("TXLT"): its ``XA_PREPARE`` is voted by the backups, an
#: ``XA_COMMIT`` or ``XA_ROLLBACK`` follows. Never shown by ``xa recover``/``xa list``,
#: refused in a client's ``xa start``.
LOCAL_TX_FORMAT_ID = 0x54584C54


def local_tx_xid(session_id: int, tx: int | str, now_ms: int) -> Xid:
    """The internal branch of one local transaction's commit (or of a one-phase XA
    commit, ``tx`` = ``xa<n>``): gtrid ``<session>.<tx>``, bqual the commit's time
    (unique within a primary's life)."""
    return Xid(LOCAL_TX_FORMAT_ID, f"{int(session_id)}.{tx}", str(int(now_ms)))


def is_local_tx_xid(xid: Xid) -> bool:
    """True for the internal branch of a local transaction's commit."""
    return xid.format_id == LOCAL_TX_FORMAT_ID
