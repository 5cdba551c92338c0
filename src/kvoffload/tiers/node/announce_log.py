"""The node pool's announcement logs (``announce``): one engine's log, which only it writes, and a reader's
cursor in another engine's. The format: a header (magic, version, attachment, the index's generation, ring size;
then head and tail, each beside its complement) and a ring of variable-length records that never wrap, each with
its length, a CRC32C, a sequence number, a kind and the 16-byte key, and for a stored block its encoded
description (``describe``). A ring's end too short for the next record is a pad (or, under a record header's
size, skipped). Read and written with ``pread``/``pwrite``, never mapped: a log truncated under a reader is a
short read, never SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from kvoffload.keys import KEY_BYTES, OffloadKey
from kvoffload.tiers.lower.trust import Access, untrusted
from kvoffload.tiers.node.describe import MAX_DESCRIPTION_BYTES
from kvoffload.tiers.node.files import ANNOUNCE_PREFIX
from kvoffload.tiers.node.segment import open_checked

logger = logging.getLogger(__name__)

RING_BYTES = 4 << 20
"""Each engine's ring: about 28,000 records of a 16-token block (133 bytes) or 3,500 of a 256-token one. What a
late joiner can learn is the newest of them, and a reader more than this behind loses records. 4 MiB a log, at most
``_nodeindex.MAX_ATTACH`` logs, is a rounding error beside the pool itself, on the same tmpfs."""
_MAGIC = 0x31676F6C6E6E616B
_VERSION = 1
_STATIC = struct.Struct("<QIIQQ")  # magic, version, attachment, index generation, ring bytes
_POSITIONS = struct.Struct("<QQQQ")  # head, ~head, tail, ~tail: a torn read of either shows as a mismatch
_POSITIONS_AT = 64
DATA_AT = 128
RECORD = struct.Struct("<IIQB3x16s")  # length (header included), crc, seq, kind, key
_PAD, STORED, REMOVED = 0, 1, 2
_MAX_RECORD = RECORD.size + MAX_DESCRIPTION_BYTES
_ALL = (1 << 64) - 1
_U32 = struct.Struct("<I")


@dataclass
class AnnounceCounts:
    """What this engine's announcements did since it began to share (``NodeIndex.announcements``)."""

    shared: int = 0
    """Records this engine wrote to its log (stored and removed)."""
    unshareable: int = 0
    """Stored keys not shared: a description the encoding does not hold (or a key of another size)."""
    learned: int = 0
    """Other engines' records reported as events."""
    untrue: int = 0
    """Other engines' records skipped: the pool holds the block no longer (stored) or again (removed), or the
    index could not be asked now."""
    refused: int = 0
    """Damaged records, logs and headers refused."""
    lost: int = 0
    """Records overwritten before this engine read them (it fell more than a ring behind)."""


@dataclass(frozen=True)
class Record:
    start: int
    """Where it starts in the log's stream (bytes ever written before it)."""
    seq: int
    kind: int
    key: OffloadKey
    payload: bytes


def _crc(length: bytes | memoryview, body: bytes | memoryview) -> int:
    """A record's check: its length field and everything after the check itself."""
    return int(crc32c.crc32c(body, crc32c.crc32c(length)))


def _record(seq: int, kind: int, key: bytes, payload: bytes) -> bytes:
    length = RECORD.size + len(payload)
    body = RECORD.pack(length, 0, seq, kind, key)[8:] + payload
    return _U32.pack(length) + _U32.pack(_crc(_U32.pack(length), body)) + body


def _pad(length: int) -> bytes:
    """A pad's header: ``length`` bytes to the ring's end follow it unread (its check covers the header only)."""
    body = RECORD.pack(length, 0, 0, _PAD, bytes(KEY_BYTES))[8:]
    return _U32.pack(length) + _U32.pack(_crc(_U32.pack(length), body)) + body


def _positions(head: int, tail: int) -> bytes:
    return _POSITIONS.pack(head, head ^ _ALL, tail, tail ^ _ALL)


def log_name(attachment: int) -> str:
    return f"{ANNOUNCE_PREFIX}{attachment}"


def attachment_of(name: str, limit: int) -> int | None:
    number = name[len(ANNOUNCE_PREFIX):]
    if not name.startswith(ANNOUNCE_PREFIX) or not number.isdigit() or str(int(number)) != number:
        return None
    return int(number) if int(number) < limit else None


class LogWriter:
    """This engine's log, which only it writes. ``append`` raises ``OSError`` (the caller stops sharing)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._head = self._tail = self._seq = 0
        self._starts: deque[int] = deque()  # where each record still whole in the ring starts, oldest first

    @classmethod
    def create(cls, directory: Path, attachment: int, generation: int, access: Access) -> LogWriter:
        """A new, empty log for ``attachment`` (one an engine that held the attachment before left is replaced:
        its readers see another file). Made beside and renamed into place, so no reader sees it half made.

        Raises:
            ConfigError, OSError: the file cannot be made (untrusted, a full tmpfs).
        """
        path, made = directory / log_name(attachment), directory / f"{log_name(attachment)}.new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(made)
        fd = open_checked(made, access, "node_path")
        try:
            os.posix_fallocate(fd, 0, DATA_AT + RING_BYTES)  # a full tmpfs fails here, never in a write
            os.pwrite(fd, _STATIC.pack(_MAGIC, _VERSION, attachment, generation, RING_BYTES), 0)
            os.pwrite(fd, _positions(0, 0), _POSITIONS_AT)
            os.rename(made, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def append(self, records: Sequence[tuple[int, bytes, bytes]]) -> None:
        """Write ``records`` (kind, key, payload) and publish them, in batches of at most a quarter ring."""
        batch: list[tuple[int, bytes, bytes]] = []
        size = 0
        for record in records:
            batch.append(record)
            size += RECORD.size + len(record[2])
            if size >= RING_BYTES // 4:
                self._publish(batch)
                batch, size = [], 0
        if batch:
            self._publish(batch)

    def _publish(self, batch: list[tuple[int, bytes, bytes]]) -> None:
        regions: list[list[Any]] = []  # [ring offset, bytes, parts] of each stretch written in one go
        pos = self._head
        for kind, key, payload in batch:
            length = RECORD.size + len(payload)
            room = RING_BYTES - pos % RING_BYTES
            if room < length:  # records never wrap: the rest of the ring is a pad (or too short to hold one)
                if room >= RECORD.size:
                    _place(regions, pos, _pad(room))
                pos += room
            _place(regions, pos, _record(self._seq, kind, key, payload))
            self._starts.append(pos)
            self._seq += 1
            pos += length
        floor = pos - RING_BYTES  # a record starting before this has bytes in what the batch overwrites
        while self._starts and self._starts[0] < floor:
            self._starts.popleft()
        tail = self._starts[0] if self._starts else pos
        if tail != self._tail:  # readers learn what goes before it goes
            os.pwrite(self._fd, _positions(self._head, tail), _POSITIONS_AT)
        for offset, _, parts in regions:
            os.pwrite(self._fd, b"".join(parts), DATA_AT + offset)
        os.pwrite(self._fd, _positions(pos, tail), _POSITIONS_AT)
        self._head, self._tail = pos, tail

    def close(self) -> None:
        os.close(self._fd)


def _place(regions: list[list[Any]], pos: int, data: bytes) -> None:
    """``data`` to be written at stream position ``pos``: joined to the stretch before when it follows it."""
    offset = pos % RING_BYTES
    if regions and regions[-1][0] + regions[-1][1] == offset:
        regions[-1][1] += len(data)
        regions[-1][2].append(data)
    else:
        regions.append([offset, len(data), [data]])


class LogReader:
    """This engine's cursor in another engine's log."""

    def __init__(self, fd: int, name: str, inode: int) -> None:
        self._fd, self.name, self.inode = fd, name, inode
        self._cursor: int | None = None  # None: start at the tail, the oldest record still there
        self._seq: int | None = None  # the next record's sequence number; None: not known
        self._behind = False  # the cursor jumped to the tail: a gap in the sequence is records lost
        self._warned = False

    def close(self) -> None:
        os.close(self._fd)

    def refuse(self, counts: AnnounceCounts, why: str) -> None:
        counts.refused += 1
        if not self._warned:
            self._warned = True
            logger.warning("node tier: refused a damaged record in the announcement log %s (%s); its engine's "
                           "blocks may go unannounced by this one (counted, logged once a log)", self.name, why)

    def _read_positions(self, counts: AnnounceCounts) -> tuple[int, int] | None:
        raw = os.pread(self._fd, _POSITIONS.size, _POSITIONS_AT)
        if len(raw) != _POSITIONS.size:
            self.refuse(counts, "truncated")
            return None
        head, not_head, tail, not_tail = _POSITIONS.unpack(raw)
        if head ^ not_head != _ALL or tail ^ not_tail != _ALL:
            return None  # torn by a write in progress (or damaged): asked again next step
        if tail > head or head - tail > RING_BYTES:
            self.refuse(counts, f"head {head}, tail {tail}")
            return None
        return head, tail

    def read(self, max_records: int, max_bytes: int, counts: AnnounceCounts) -> tuple[list[Record], int]:
        """The records published since the last read (at most ``max_records``, ``max_bytes`` read), and the
        bytes read. Raises ``OSError`` only from the file itself."""
        positions = self._read_positions(counts)
        if positions is None or positions[0] == self._cursor:
            return [], 0  # the common case: one read of 32 bytes
        head, tail = positions
        if self._cursor is None or self._cursor > head:
            if self._cursor is not None:
                self.refuse(counts, "its head went back")
            self._cursor, self._seq = tail, None
        elif self._cursor < tail:
            self._cursor, self._behind = tail, True
        start, seq = self._cursor, self._seq
        records, used = self._scan(head, max_records, max_bytes, counts)
        after = self._read_positions(counts)
        if records and (after is None or after[1] > start):  # overwritten while read: read again from the tail
            self._cursor, self._seq, self._behind = (after[1] if after else start), seq, after is not None
            return [], used
        return records, used

    def _scan(self, head: int, max_records: int, budget: int, counts: AnnounceCounts) -> tuple[list[Record], int]:
        out: list[Record] = []
        pos, used = self._cursor, 0
        assert pos is not None
        while pos < head and len(out) < max_records and budget - used >= RECORD.size:
            room = RING_BYTES - pos % RING_BYTES
            if room < RECORD.size:  # the writer skips a ring's end too short for a record
                pos += room
                continue
            want = min(head - pos, room, budget - used)
            chunk = memoryview(os.pread(self._fd, want, DATA_AT + pos % RING_BYTES))
            used += len(chunk)
            if len(chunk) != want:
                return self._damaged(out, head, counts, "truncated"), used
            parsed = self._parse(chunk, pos, min(room, head - pos), max_records, out, counts)
            if isinstance(parsed, str):
                return self._damaged(out, head, counts, parsed), used
            pos, cut = parsed
            if cut:  # inside a record (the rest next step), or enough records
                break
        self._cursor = pos
        return out, used

    def _parse(self, chunk: memoryview, pos: int, span: int, most: int, out: list[Record],
               counts: AnnounceCounts) -> tuple[int, bool] | str:
        """The records of ``chunk``, read at stream position ``pos`` from a ``span`` of whole records (to the
        ring's end or the head), into ``out`` (``most`` there at most). Where the next record starts, and whether
        the chunk was left before its end (cut by the budget, or ``most`` reached); or why it is damaged."""
        at, want = 0, len(chunk)
        while at < want:
            if len(out) >= most:
                return pos + at, True
            if want - at < RECORD.size:
                if want < span:
                    return pos + at, True  # cut by the budget
                if (pos + span) % RING_BYTES == 0:
                    return pos + at, False  # the ring's end, too short for a record: the caller skips it
                return "a record cut short before the head"
            length, crc, seq, kind, key = RECORD.unpack_from(chunk, at)
            if kind == _PAD:
                if length != span - at or (pos + span) % RING_BYTES != 0:
                    return f"a pad of {length} bytes"
            elif not RECORD.size <= length <= min(_MAX_RECORD, span - at):
                return f"a record of {length} bytes"
            whole = RECORD.size if kind == _PAD else length
            if at + whole > want:
                return pos + at, True
            if _crc(chunk[at:at + 4], chunk[at + 8:at + whole]) != crc:
                return "its check does not match"
            if kind == _PAD:
                return pos + at + length, False
            if kind not in (STORED, REMOVED) or (kind == REMOVED and length != RECORD.size):
                return f"kind {kind}, {length} bytes"
            if self._seq is not None and seq != self._seq:
                if not (self._behind and seq > self._seq):
                    return f"record {seq} where {self._seq} was next"
                counts.lost += seq - self._seq
            self._seq, self._behind = seq + 1, False
            out.append(Record(pos + at, seq, kind, OffloadKey(bytes(key)), bytes(chunk[at + RECORD.size:at + length])))
            at += length
        return pos + at, want < span

    def _damaged(self, good: list[Record], head: int, counts: AnnounceCounts, why: str) -> list[Record]:
        """A bad length leaves no next record to trust: the rest up to the head is skipped."""
        self.refuse(counts, why)
        self._cursor, self._seq = head, None
        return good


def open_log(path: Path, access: Access, generation: int) -> LogReader | tuple[str] | None:
    """A reader of the log at ``path``; None when it went, or is a log of another set of the pool's files (left by
    an engine leaving it); else why it is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        return None if e.errno == errno.ENOENT else (str(e),)
    inode, static = -1, None
    try:
        info = os.fstat(fd)
        inode = info.st_ino
        problem = untrusted(info, access) if stat.S_ISREG(info.st_mode) else "not a regular file"
        if problem is None and info.st_size != DATA_AT + RING_BYTES:
            problem = f"{info.st_size} bytes"
        raw = os.pread(fd, _STATIC.size, 0) if problem is None else b""
        static = _STATIC.unpack(raw) if len(raw) == _STATIC.size else None
        if problem is None and (static is None or static[:3] != (_MAGIC, _VERSION, attachment_of(path.name, 1 << 30))
                                or static[4] != RING_BYTES):
            problem = "not an announcement log of this version"
    except OSError as e:
        problem = str(e)
    if problem is None and static is not None and static[3] == generation:
        return LogReader(fd, path.name, inode)
    os.close(fd)
    return None if problem is None else (problem,)
