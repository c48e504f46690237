"""Byte format, file names and sync flags of the directory store (``DirStore``).

Theory of operation
-------------------
The directory store keeps **one file per command block**, after Enduro/X's
``libndrxxaqdisk`` (seed 003). A data directory looks like this::

    DIR/lock                       flock()ed while a store has DIR open (holder's pid inside)
    DIR/metadata                   the committed METADATA block (queue definitions, ...)
    DIR/active/<tid>-<seq>         blocks being written: transaction not yet prepared
    DIR/active/<GTRID>-<seq>       blocks of an XA branch being prepared
    DIR/prepared/<tid>-<seq>       blocks of prepared (local) transactions
    DIR/prepared/<GTRID>-<seq>     blocks of prepared XA branches (until commit or rollback)
    DIR/committed/<message id>     one NEW block per stored message, named by message id
    DIR/quarantine/<dir>.<name>    foreign, torn or damaged files moved aside at start
    DIR/spare/<n>                  removed files kept for their inodes (no meaning)

``<tid>`` is the store transaction id in 16 lowercase hex digits, ``<seq>``
the block's sequence number in its transaction in (at least) 3 decimal digits
(``000000000000002a-000``); a message file name is the message id in 20
decimal digits (``00000000000000000042``), so names sort in id order.

An XA branch's blocks are named after the seed's "global transaction id":
``<GTRID>`` is the Xid's gtrid in *uppercase* hex (as in the Xid's text form,
``<formatId>-<GTRID>-<BQUAL>``; 2 to 128 digits) and ``<seq>`` numbers the
blocks of every branch with that gtrid on this broker (two branches of one
global transaction, different bquals, take consecutive ranges). The format
id and the bqual are kept in the branch's first block (a DUMMY whose info
is the whole Xid, see below); each block's header carries the store
transaction id of the branch's prepare, which groups a branch's blocks.

All integers are little-endian and unsigned; ``CRC32C`` is the Castagnoli CRC
(``google_crc32c``), as in the journal. Every file the store writes —
command block, message file, metadata — is one *block*::

    offset    size  field
    0         8     magic            b"TXBDBLK\\n"
    8         1     format version   1
    9         1     block type       1 NEW, 2 UPDATE, 3 DELETE, 4 DUMMY, 5 METADATA,
                                     6 RESOLVE
    10        2     flags            bit 0 LOCAL: a local transaction (commit decided
                                     once every block is prepared); bit 1 XA: a block
                                     of an XA branch (stays prepared until resolved);
                                     other bits 0
    12        4     sequence number  the block's place in its transaction (0, 1, ...)
    16        4     block count      blocks in the transaction
    20        8     transaction id   the ``<tid>`` of the file name
    28        8     message id       the message the block is about (0: DUMMY, METADATA)
    36        4     info length      h
    40        8     body length      b
    48        h     info             one msgpack value (see below)
    48 + h    b     body             the message body (NEW only; empty otherwise)
    48 + h + b 4    CRC32C           of bytes 0 .. 47 + h + b (the whole block but itself)

so a block file is exactly ``52 + h + b`` bytes long, which recovery checks.
The info of each block type:

* ``NEW`` — the ``msg`` tuple of ``records.py`` (id, queue, message id,
  headers, priority, timestamp, expiry, deliver-at, delivery count); the body
  follows. A committed message file is the NEW block renamed (or rewritten
  by an update, keeping its transaction id and sequence number, which give
  the message's place in commit order). Once the message was moved to
  another queue (dead-lettered), the info is the pair ``[msg, queue now]``:
  ``msg`` keeps the queue it was sent to, whose duplicate-id window holds its
  client id — or nil there once that queue was deleted;
* ``UPDATE`` — a map ``{position in msg: new value}`` (a redelivery count and
  delay; a move sets expiry and deliver-at to 0 and key -1, "queue now"):
  "updated header information to replace in the message file";
* ``DELETE`` — empty: the message id in the header names the message to remove;
* ``DUMMY`` — empty: marks a read-only transaction (nothing to change);
* ``METADATA`` — the ``SNAPSHOT`` map of ``records.py`` (``next_id``,
  ``queues``, ``dups``, ``sinks``); committing it renames it to ``DIR/metadata``.

XA branch blocks (flag XA; ``docs/dirstore.md`` has the lifecycle):

* the branch's first block is a ``DUMMY`` whose info is ``[xid, [discard
  id…], created_ms, prepared_ms, state]`` (``dirstore_blocks.BranchHeader``;
  ``xid`` the Xid text form; ``state`` ``"prepared"``, or ``"heuristic-commit"``
  / ``"heuristic-rollback"`` once an operator completed the branch, when it is
  the branch's only block); a read-only branch is this block alone, the seed's
  dummy;
* ``NEW`` — a message the branch sends: info the ``msg`` tuple (its seq is
  0 until commit), body the message body;
* ``DELETE`` — a message the branch consumed: info its delivery count.

``RESOLVE`` (in a local transaction) completes a prepared branch: info
``[outcome, xid, GTRID, first seq, block count, branch tid, [[id, seq]…],
[discard id…]]`` (``dirstore_blocks.ResolveInfo``) with ``outcome`` one of
``"commit"``, ``"rollback"``, ``"heuristic-commit"``, ``"heuristic-rollback"``,
``"forget"``; committing it applies the outcome to the branch's blocks (see
``dirstore_writer.py``).

Sync flags (the seed's ``NDRX_XA_FLAGS``): ``FSYNC`` or ``FDATASYNC`` make the
store sync each block file's contents before it is renamed; ``DSYNC`` makes it
fsync each directory after the creates/renames/unlinks of a step. Without
flags (the seed's default) data is only handed to the OS: it survives a
killed process, not a power loss.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import google_crc32c

from txbroker.storage.journal_format import CRC32C_RESIDUE

BLOCK_MAGIC: Final = b"TXBDBLK\n"
FORMAT_VERSION: Final = 1
#: magic, version, type, flags, sequence, count, transaction id, message id,
#: info length, body length.
BLOCK_HEADER: Final = struct.Struct("<8sBBHIIQQIQ")
_CRC: Final = struct.Struct("<I")
assert BLOCK_HEADER.size == 48, BLOCK_HEADER.size
#: Bytes of a block with empty info and body (header + CRC trailer).
BLOCK_OVERHEAD: Final = BLOCK_HEADER.size + _CRC.size

#: Flag bit: the block belongs to a local (one-phase) transaction.
FLAG_LOCAL: Final = 1
#: Flag bit: the block belongs to an XA branch (named by its gtrid).
FLAG_XA: Final = 2
#: Field limits: u32 sequence, count and info length; u64 ids and body length.
MAX_SEQUENCE: Final = 2**32 - 1
MAX_INFO: Final = 2**32 - 1
MAX_ID: Final = 2**64 - 1

#: Subdirectories of the data directory.
ACTIVE: Final = "active"
PREPARED: Final = "prepared"
COMMITTED: Final = "committed"
QUARANTINE: Final = "quarantine"
#: Spare files: the inodes of removed blocks and message files, kept to be written
#: again as new blocks (``dirstore_writer.py``, "Spare files").
SPARE: Final = "spare"
#: The committed metadata block, and the lock file, in the data directory.
METADATA_FILE: Final = "metadata"
LOCK_FILE: Final = "lock"
#: Suffix of a message file being rewritten by an update (renamed over the original).
REWRITE_SUFFIX: Final = ".tmp"

#: Hex digits of a transaction id in a block file name (u64).
TID_DIGITS: Final = 16
#: Minimum digits of the sequence suffix: the seed's "-NNN".
SEQ_DIGITS: Final = 3
#: Decimal digits of a message id in a message file name (u64 fits in 20).
MESSAGE_ID_DIGITS: Final = 20

_BLOCK_NAME: Final = re.compile(rf"([0-9a-f]{{{TID_DIGITS}}})-([0-9]{{{SEQ_DIGITS},10}})")
_BRANCH_BLOCK_NAME: Final = re.compile(rf"((?:[0-9A-F]{{2}}){{1,64}})-([0-9]{{{SEQ_DIGITS},10}})")
_MESSAGE_NAME: Final = re.compile(rf"[0-9]{{{MESSAGE_ID_DIGITS}}}")


class BlockType(IntEnum):
    """What a command block asks for (the seed's four kinds, plus metadata)."""

    NEW = 1  #: a new message with its body
    UPDATE = 2  #: new header fields for a stored message
    DELETE = 3  #: remove a stored message (after dequeue)
    DUMMY = 4  #: a read-only transaction: nothing to change
    METADATA = 5  #: replace DIR/metadata
    RESOLVE = 6  #: complete a prepared XA branch (commit, rollback, heuristic, forget)


@dataclass(frozen=True, slots=True)
class Block:
    """A decoded block file (``info`` and ``body`` are copies of the file's bytes)."""

    type: BlockType
    flags: int
    sequence: int
    count: int
    tid: int
    message_id: int
    info: bytes
    body: bytes


def block_name(tid: int, sequence: int) -> str:
    """The file name of a command block: ``<tid hex>-<seq>``."""
    return f"{tid:0{TID_DIGITS}x}-{sequence:0{SEQ_DIGITS}d}"


def parse_block_name(name: str) -> tuple[int, int] | None:
    """``(tid, sequence)`` of a command block file name, or None if it is not one."""
    match = _BLOCK_NAME.fullmatch(name)
    if match is None:
        return None
    return int(match[1], 16), int(match[2])


def branch_block_name(gtrid_hex: str, sequence: int) -> str:
    """The file name of an XA branch's block: ``<GTRID>-<seq>`` (uppercase hex)."""
    return f"{gtrid_hex}-{sequence:0{SEQ_DIGITS}d}"


def parse_branch_block_name(name: str) -> tuple[str, int] | None:
    """``(GTRID hex, seq)`` of an XA branch block's file name, or None if it is not
    one. (A name of 16 decimal digits parses as both kinds: the block's flags tell.)"""
    match = _BRANCH_BLOCK_NAME.fullmatch(name)
    if match is None:
        return None
    return match[1], int(match[2])


def message_name(message_id: int) -> str:
    """The file name of a committed message: its id in 20 decimal digits."""
    return f"{message_id:0{MESSAGE_ID_DIGITS}d}"


def parse_message_name(name: str) -> int | None:
    """The message id of a committed message file name, or None."""
    return int(name) if _MESSAGE_NAME.fullmatch(name) else None


def encode_block(
    block_type: BlockType,
    *,
    sequence: int,
    count: int,
    tid: int,
    message_id: int,
    info: bytes,
    body: bytes = b"",
    flags: int = FLAG_LOCAL,
) -> list[bytes]:
    """The bytes of a block as parts for one ``writev``: header, info, body, CRC."""
    if len(info) > MAX_INFO or not 0 <= sequence < count <= MAX_SEQUENCE + 1:
        raise ValueError(f"block too large or malformed (info {len(info)}, {sequence}/{count})")
    header = BLOCK_HEADER.pack(
        BLOCK_MAGIC, FORMAT_VERSION, block_type, flags, sequence, count, tid, message_id,
        len(info), len(body),
    )
    crc = google_crc32c.value(header + info)
    if body:
        crc = google_crc32c.extend(crc, body if type(body) is bytes else bytes(body))
    return [header, info, body, _CRC.pack(crc)] if body else [header, info, _CRC.pack(crc)]


def decode_block(data: bytes) -> Block | str:
    """The block in ``data`` (a whole file), or a reason why it is not a valid block."""
    if len(data) < BLOCK_OVERHEAD:
        return f"too short for a block ({len(data)} bytes)"
    (magic, version, block_type, flags, sequence, count, tid, message_id, info_length,
     body_length) = BLOCK_HEADER.unpack_from(data)
    if magic != BLOCK_MAGIC:
        return "bad magic (not a txbroker block)"
    if version != FORMAT_VERSION:
        return f"unknown format version {version}"
    expected = BLOCK_OVERHEAD + info_length + body_length
    if len(data) != expected:
        return f"length {len(data)} but the header says {expected} (torn or padded)"
    if google_crc32c.value(data) != CRC32C_RESIDUE:
        return "CRC mismatch"
    try:
        kind = BlockType(block_type)
    except ValueError:
        return f"unknown block type {block_type}"
    if not sequence < count:
        return f"sequence {sequence} outside a transaction of {count} blocks"
    info_end = BLOCK_HEADER.size + info_length
    return Block(
        kind, flags, sequence, count, tid, message_id,
        data[BLOCK_HEADER.size : info_end], data[info_end : info_end + body_length],
    )


def block_size(info_length: int, body_length: int) -> int:
    """Bytes of a block file with that much info and body."""
    return BLOCK_OVERHEAD + info_length + body_length


# -- sync flags ----------------------------------------------------------------------

#: Flag names as in the seed's ``NDRX_XA_FLAGS``.
FSYNC: Final = "FSYNC"
FDATASYNC: Final = "FDATASYNC"
DSYNC: Final = "DSYNC"
_SEPARATORS: Final = re.compile(r"[,;|\s]+")


@dataclass(frozen=True, slots=True)
class SyncFlags:
    """Parsed sync flags: how block files and directories are pushed to the disk."""

    file_sync: str  #: "" (flush to the OS only), FSYNC or FDATASYNC
    dir_sync: bool  #: DSYNC: fsync directories after creates, renames and unlinks

    def __str__(self) -> str:
        return ",".join(f for f in (self.file_sync, DSYNC if self.dir_sync else "") if f)


def parse_flags(text: str) -> SyncFlags:
    """Parse ``"FSYNC"``, ``"FDATASYNC,DSYNC"``, ``"FSYNC;DSYNC"`` (the seed's
    separator), or ``""`` (the default: flush to the OS only). Case-insensitive."""
    names = [name.upper() for name in _SEPARATORS.split(text.strip()) if name]
    unknown = sorted(set(names) - {FSYNC, FDATASYNC, DSYNC})
    if unknown:
        raise ValueError(
            f"unknown dir store sync flag(s) {', '.join(unknown)}; "
            f"expected FSYNC or FDATASYNC, and/or DSYNC"
        )
    if FSYNC in names and FDATASYNC in names:
        raise ValueError("FSYNC and FDATASYNC exclude each other: give one of them")
    file_sync = FSYNC if FSYNC in names else FDATASYNC if FDATASYNC in names else ""
    return SyncFlags(file_sync, DSYNC in names)


#: ``--sync`` modes of the server and the dir store flags that give the same promise.
FLAGS_FOR_SYNC_MODE: Final = {
    "none": "",
    "fdatasync": f"{FDATASYNC},{DSYNC}",
    "fsync": f"{FSYNC},{DSYNC}",
}
