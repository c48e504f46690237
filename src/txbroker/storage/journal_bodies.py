"""Reading the journal's bodies back: the LRU body cache and ``pread``.

Theory of operation
-------------------
A body ref packs segment, offset and length
(:mod:`~txbroker.storage.journal_format`), so a body is found without an
index. :class:`BodyReader` serves :meth:`~BodyReader.read_body` from the LRU
cache (``body_cache_bytes``: :meth:`~BodyReader.remember` puts each appended
body there, a body bigger than the whole cache excepted) or with one
``pread`` of the segment, through one read-only descriptor per segment opened
on first use. A body the writer thread has not written yet is taken from the
writer's pending queue or its batch in flight.

:meth:`~BodyReader.read_bodies` serves a stream reader's page: every run of
refs that lie back to back in one segment is read with one ``pread`` and
handed over packed, and the cache is neither searched nor filled.

The store tells the reader which segments exist (``segments``, the store's
own segment table, only read here), when a body died
(:meth:`~BodyReader.forget`) and when a segment was deleted
(:meth:`~BodyReader.close_segment`). Threading: the broker's thread only,
like the store's reads.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Container, Sequence
from itertools import compress, repeat
from operator import add, and_, ne, rshift
from pathlib import Path

from txbroker.storage.interface import BodyRef, PackedBodies
from txbroker.storage.journal_format import (
    REF_LENGTH_BITS,
    REF_OFFSET_BITS,
    segment_name,
    unpack_ref,
)
from txbroker.storage.journal_writer import EntryItem, GroupCommitWriter
from txbroker.storage.writer_thread import PendingQueue

#: The body length packed in the low bits of a ref.
REF_LENGTH_MASK = (1 << REF_LENGTH_BITS) - 1
_REF_OFFSET_MASK = (1 << REF_OFFSET_BITS) - 1


class BodyReader:
    """Stored bodies by ref: an LRU cache bounded to ``cache_limit`` bytes, then ``pread``.

    ``segments`` answers whether a segment still exists; ``queue`` is the
    writer's pending queue, and :attr:`writer` is set once the writer runs.
    """

    def __init__(
        self,
        journal_dir: Path,
        segments: Container[int],
        queue: PendingQueue,
        cache_limit: int,
    ) -> None:
        self.journal_dir = journal_dir
        #: the bound of the cache, in body bytes (0: no cache)
        self.cache_limit = cache_limit
        #: body bytes in the cache now
        self.cache_bytes = 0
        #: the writer thread (None until recovery is done): its batch in flight
        #: holds bodies that are not in the queue any more nor written yet
        self.writer: GroupCommitWriter | None = None
        self._segments = segments
        self._queue = queue
        self._cache: OrderedDict[BodyRef, bytes] = OrderedDict()
        self._read_fds: dict[int, int] = {}

    def remember(self, refs: Sequence[BodyRef], bodies: Sequence[bytes]) -> None:
        """Cache the bodies of an entry just appended (call only if ``cache_limit``)."""
        limit = self.cache_limit
        cache = self._cache
        for ref, body_data in zip(refs, bodies, strict=True):
            if len(body_data) <= limit:  # a huge body would flush everything else
                cache[ref] = body_data
                self.cache_bytes += len(body_data)
        if self.cache_bytes > limit:
            self._evict()

    def read_bodies(self, refs: Sequence[BodyRef]) -> PackedBodies:
        """Many bodies, packed: each run of refs that lie back to back in one segment
        (the sends of one record) is read with one ``pread`` and handed over as
        read, without cutting it into objects; the cache is neither searched nor
        filled (a stream reader's scan would only push the hot bodies out). The
        caller bounds the total (a ``stream_read`` page)."""
        # A ref is segment << 72 | offset << 32 | length, so ``ref >> 32`` is the
        # body's position (segment and offset) and a run goes on where the next
        # body's position is this one's position + length. The runs are found
        # with C-level maps: no Python work per body.
        count = len(refs)
        lengths = list(map(and_, refs, repeat(REF_LENGTH_MASK, count)))
        starts = list(map(rshift, refs, repeat(REF_LENGTH_BITS, count)))
        ends = list(map(add, starts, lengths))
        breaks = list(compress(range(1, count), map(ne, ends, starts[1:])))
        parts: list[bytes] = []
        for low, high in zip([0, *breaks], [*breaks, count], strict=True):
            if high <= low:
                continue
            position, size = starts[low], ends[high - 1] - starts[low]
            segment = position >> REF_OFFSET_BITS
            data = None
            if segment in self._segments:
                data = self._pread(segment, position & _REF_OFFSET_MASK, size)
            if data is None:  # not on disk as expected: the careful way, body by body
                parts.extend(self.read_body(ref) for ref in refs[low:high])
            else:
                parts.append(data)
        return PackedBodies(b"".join(parts), lengths)

    def read_body(self, ref: BodyRef) -> bytes:
        """A stored body, from the cache or with one ``pread``.

        Raises ``KeyError`` if the ref's segment was deleted or never existed.
        """
        cached = self._cache.get(ref)
        if cached is not None:
            self._cache.move_to_end(ref)
            return cached
        segment, offset, length = unpack_ref(ref)
        if segment not in self._segments:
            raise KeyError(f"body ref {ref:#x}: segment {segment} does not exist (any more)")
        if not length:
            return b""
        body = self._pread(segment, offset, length)
        if body is None:  # not written yet: the writer still holds it
            body = self._unwritten_body(ref) or self._pread(segment, offset, length)
        if body is None:
            raise KeyError(f"body ref {ref:#x}: segment {segment} ends before offset {offset}")
        self._cache_put(ref, body)
        return body

    def forget(self, ref: BodyRef) -> None:
        """Drop a dead body from the cache (if it is there)."""
        cached = self._cache.pop(ref, None)
        if cached is not None:
            self.cache_bytes -= len(cached)

    def close_segment(self, segment: int) -> None:
        """Close the read descriptor of a segment that is being deleted."""
        fd = self._read_fds.pop(segment, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every read descriptor and empty the cache."""
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()
        self._cache.clear()
        self.cache_bytes = 0

    def _pread(self, segment: int, offset: int, length: int) -> bytes | None:
        fd = self._read_fds.get(segment)
        if fd is None:
            try:
                fd = os.open(self.journal_dir / segment_name(segment), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            self._read_fds[segment] = fd
        body = os.pread(fd, length, offset)
        return body if len(body) == length else None

    def _unwritten_body(self, ref: BodyRef) -> bytes | None:
        """The body of a queued or in-flight entry (the cache may have dropped it)."""
        with self._queue.lock:
            in_flight = self.writer.in_flight if self.writer is not None else []
            for item in (*in_flight, *self._queue.items):
                if isinstance(item, EntryItem) and ref in item.refs:
                    return bytes(item.bodies[item.refs.index(ref)])
        return None

    def _cache_put(self, ref: BodyRef, body: bytes) -> None:
        if len(body) <= self.cache_limit and ref not in self._cache:
            self._cache[ref] = body
            self.cache_bytes += len(body)
            if self.cache_bytes > self.cache_limit:
                self._evict()

    def _evict(self) -> None:
        """Drop least recently used bodies until the cache fits its bound."""
        while self.cache_bytes > self.cache_limit:
            _, evicted = self._cache.popitem(last=False)
            self.cache_bytes -= len(evicted)
