"""One backup attached to the primary's hub (``replication.py``): its link's state
and the frames on their way to it.

Frames go to a backup's socket in order. The hub writes an entry with
:meth:`AttachedBackup.send_entry`: a loop turn's first frame goes at once, the turn's
others are held and go together, in one socket write, when the turn ends
(:meth:`~AttachedBackup.end_turn`, which the hub has the loop call). With 8
connections committing, one socket write per entry per backup was 28 % of a
replicating primary's GIL time (issue 30). A frame outside the table's entries —
a heartbeat, a ready-set record (:meth:`~AttachedBackup.send_now`), a join's welcome
(``joining.py``, after :meth:`~AttachedBackup.flush_out`) — goes after the held ones.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from txbroker.core.ha.backup_link import LinkState
from txbroker.server.ha.clock import monotonic

__all__ = ["AttachedBackup"]


@dataclass(slots=True, eq=False)
class AttachedBackup:
    """One backup connected to this primary."""

    node: str
    address: str
    writer: asyncio.StreamWriter
    state: LinkState = LinkState.JOINING  #: core/ha/backup_link.py
    acked: int = 0
    dump_at: int = 0
    joined: float = field(default_factory=time.time)
    last_ack: float = field(default_factory=monotonic)
    backlog: list[bytes] = field(default_factory=list)  #: frames queued behind the dump
    #: frames held this loop turn (None: nothing written to it this turn yet)
    out: list[bytes] | None = None
    sent_bytes: int = 0
    reason: str = ""
    joined_by: str = ""  #: "dump", or "suffix" (it resumed from its own copy)
    #: the newest LSN answered when entries began to wait for it (_tell_ready)
    ready_mark: int = 0
    told_ready: bool = False

    def info(self, newest: int) -> dict[str, Any]:
        """Its line of ``ha status``."""
        state = self.state.value  # "ready" once told (it holds every answered entry)
        if self.state is LinkState.READY and not self.told_ready:
            state = LinkState.CATCHING_UP.value
        return {"node": self.node, "address": self.address, "state": state,
                "acked": self.acked, "lag_entries": max(0, newest - self.acked),
                "queued_bytes": self.writer.transport.get_write_buffer_size()
                if not self.writer.is_closing() else 0,
                "since": self.joined, "reason": self.reason, "joined_by": self.joined_by}

    def send_entry(self, frame: bytes) -> bool:
        """Write ``frame``: at once if it is the turn's first (True: the caller has
        :meth:`end_turn` called when the turn ends), else held until then."""
        self.sent_bytes += len(frame)
        out = self.out
        if out is None:
            self.writer.write(frame)
            self.out = []
            return True
        out.append(frame)
        return False

    def flush_out(self) -> None:
        """Hand the frames held this turn to the socket, in one write."""
        out = self.out
        if not out:
            return
        self.out = []
        if not self.writer.is_closing():
            self.writer.write(out[0] if len(out) == 1 else b"".join(out))

    def end_turn(self) -> None:
        """The loop turn ended: the held frames go; the next turn's first goes at once."""
        self.flush_out()
        self.out = None

    def send_now(self, frame: bytes) -> None:
        """Write ``frame`` now, after the frames held before it."""
        self.flush_out()
        if not self.writer.is_closing():
            self.writer.write(frame)
