"""What every engine attached to a node pool announces: the blocks any of them stored, as KV-aware routers see them.

Any engine attached to the pool can load any block in it, but only the engine that stored a block saw its request,
so only it can describe the block in the engine's own hashes (``BlockDescription``). Each engine that publishes KV
events therefore keeps an announcement log in the namespace's directory, ``announce.<attachment>`` (one writer: the
engine holding that attachment), and reads the others' logs once a step (``NodeIndex.take_events``)::

    share_descriptions (this engine's stores, described) --+            +--> take_events: STORED with descriptions,
    prepare_store's evictions (keys only) -----------------+--> log --->+    REMOVED, for other engines' records,
                                                                             each checked against the index now

A log is a bounded ring of variable-length records (``RING_BYTES``), each with a sequence number, a kind, the key,
for a stored block its encoded description, and a CRC32C. The writer writes a record, then advances the head in
the file's header; before overwriting older records it first advances the tail past them, so a reader that finds a
record's start still at or after the tail after reading it knows the bytes it read were whole. A reader keeps a
cursor per log: one fell behind by more than the ring skips to the oldest record still there and counts the
records lost. Everything read is input written by another process: each length and bound is checked, a damaged
record is refused (counted, logged once per log) and the rest of that log up to its head skipped, since a bad
length leaves no next record to trust. Logs are read and written with ``pread``/``pwrite``, never mapped: a log
truncated under a reader is a short read, never SIGBUS.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from kvoffload.blocks import Medium
from kvoffload.config import ConfigError
from kvoffload.index.base import BlockDescription, EngineHash, EventKind, OffloadEvent
from kvoffload.keys import KEY_BYTES, OffloadKey
from kvoffload.tiers.lower.trust import Access, untrusted
from kvoffload.tiers.node.files import ANNOUNCE_PREFIX
from kvoffload.tiers.node.segment import open_checked

logger = logging.getLogger(__name__)

RING_BYTES = 4 << 20
"""Each engine's ring: about 28,000 records of a 16-token block (133 bytes) or 3,500 of a 256-token one. What a
late joiner can learn is the newest of them, and a reader more than this behind loses records. 4 MiB a log, at most
``_nodeindex.MAX_ATTACH`` logs, is a rounding error beside the pool itself, on the same tmpfs."""
MAX_DESCRIPTION_BYTES = 32 << 10
"""A description longer than this (an offload block of over 8,000 tokens) is not shared (``unshareable``)."""
MAX_RECORDS_PER_STEP = 128
MAX_BYTES_PER_STEP = 256 << 10
"""What one ``take_events`` reads of all logs together, at most: a step never reads megabytes, and a record costs
about 10 us to check and decode, so a step catching up costs at most about 1.3 ms (a late joiner catches up over
several steps)."""
SCAN_S = 1.0
"""How often a reader lists the directory for logs that appeared or were replaced."""

_MAGIC = 0x31676F6C6E6E616B
_VERSION = 1
_STATIC = struct.Struct("<QIIQQ")  # magic, version, attachment, index generation, ring bytes
_POSITIONS = struct.Struct("<QQQQ")  # head, ~head, tail, ~tail: a torn read of either shows as a mismatch
_POSITIONS_AT = 64
_DATA_AT = 128
_RECORD = struct.Struct("<IIQB3x16s")  # length (header included), crc, seq, kind, key
_PAD, _STORED, _REMOVED = 0, 1, 2
_MAX_RECORD = _RECORD.size + MAX_DESCRIPTION_BYTES
_ALL = (1 << 64) - 1


class DescriptionError(ValueError):
    """A description that cannot be encoded, or bytes that are not one."""


# --- BlockDescription <-> bytes ---------------------------------------------------------------------------------

_DESC = struct.Struct("<BHIII")  # flags, hashes, tokens, block size, group
_PARENT, _WIDE_TOKENS, _LORA_ID, _LORA_NAME, _EXTRA = 1, 2, 4, 8, 16
_INT_HASH, _BYTES_HASH = 0, 1
_U64, _I64, _U16, _U32 = struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<H"), struct.Struct("<I")
_EXTRA_DEPTH = 3


def encode(desc: BlockDescription) -> bytes:
    """``desc`` as bytes ``decode`` gives back exactly.

    Raises:
        DescriptionError: a field of a type or size the encoding does not hold (a hash that is not a u64 int or
            bytes of at most 255, a negative token, extra keys that are not str/int/tuple), or lengths that do
            not agree.
    """
    try:
        return _encode(desc)
    except DescriptionError:
        raise
    except (TypeError, ValueError, OverflowError, struct.error, RecursionError) as e:
        raise DescriptionError(f"cannot encode the description: {e}") from e


def _encode(desc: BlockDescription) -> bytes:
    hashes, tokens = tuple(desc.block_hashes), desc.token_ids
    if not isinstance(tokens, tuple | list):
        raise DescriptionError("token_ids is not a tuple")
    _check_shape(len(hashes), len(tokens), desc.block_size, desc.group)
    flags, tail = 0, [_hash(h) for h in hashes]
    if desc.parent_hash is not None:
        flags |= _PARENT
        tail.append(_hash(desc.parent_hash))
    if tokens and min(tokens) < 0:
        raise DescriptionError("a token id is negative")
    try:
        tail.append(struct.pack(f"<{len(tokens)}I", *tokens))
    except struct.error:
        flags |= _WIDE_TOKENS
        tail.append(struct.pack(f"<{len(tokens)}q", *tokens))
    if desc.lora_id is not None:
        flags |= _LORA_ID
        tail.append(_I64.pack(_exact_int(desc.lora_id)))
    if desc.lora_name is not None:
        flags |= _LORA_NAME
        name = desc.lora_name.encode() if type(desc.lora_name) is str else None
        if name is None:
            raise DescriptionError("lora_name is not a str")
        tail += [_U16.pack(len(name)), name]
    if desc.extra_keys is not None:
        flags |= _EXTRA
        extra = desc.extra_keys
        if type(extra) is not tuple or len(extra) != len(hashes) or not all(
                e is None or (type(e) is tuple and _extra_ok(e, tuple, 0)) for e in extra):
            raise DescriptionError("extra_keys is not one tuple (of str/int/tuple) or None per hash")
        text = json.dumps(extra, ensure_ascii=False, separators=(",", ":")).encode()
        tail += [_U32.pack(len(text)), text]
    out = b"".join([_DESC.pack(flags, len(hashes), len(tokens), desc.block_size, desc.group), *tail])
    if len(out) > MAX_DESCRIPTION_BYTES:
        raise DescriptionError(f"the description is {len(out)} bytes, over {MAX_DESCRIPTION_BYTES}")
    return out


def _hash(value: EngineHash) -> bytes:
    if type(value) is bytes and len(value) <= 255:
        return bytes((_BYTES_HASH, len(value))) + value
    if type(value) is int:
        return bytes((_INT_HASH,)) + _U64.pack(value)  # struct refuses what is not a u64
    raise DescriptionError(f"a block hash is a {type(value).__name__} (not a u64 int or bytes of at most 255)")


def _exact_int(value: object) -> int:
    if type(value) is not int:
        raise DescriptionError(f"{value!r} is not an int")
    return value


def _check_shape(hashes: int, tokens: int, block_size: object, group: object) -> None:
    if type(block_size) is not int or type(group) is not int or not (0 < block_size < 1 << 32) \
            or not (0 <= group < 1 << 32):
        raise DescriptionError(f"block size {block_size!r} or group {group!r} out of range")
    if not 0 < hashes < 1 << 16 or tokens not in (0, hashes * block_size):
        raise DescriptionError(f"{tokens} tokens do not fill {hashes} hashes of {block_size} (nor are they none)")


def _extra_ok(value: object, sequence: type, depth: int) -> bool:
    """Whether ``value`` is an extra key the encoding holds exactly: str, int (not bool) of 64 bits, or a
    ``sequence`` (tuple when encoding; list in JSON when decoding) of them, nested at most ``_EXTRA_DEPTH``."""
    if type(value) is str:
        return True
    if type(value) is int:
        return -(1 << 63) <= value < 1 << 63
    return type(value) is sequence and depth < _EXTRA_DEPTH and all(
        _extra_ok(v, sequence, depth + 1) for v in value)  # type: ignore[attr-defined]


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if type(value) is list else value


class _Bytes:
    """A bounded reader of untrusted bytes: every take is checked against what is left."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.buf):
            raise DescriptionError(f"truncated: {n} bytes wanted at {self.at} of {len(self.buf)}")
        self.at += n
        return self.buf[self.at - n:self.at]

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack(self.take(fmt.size))[0]

    def hash(self) -> EngineHash:
        tag = self.take(1)[0]
        if tag == _INT_HASH:
            return int(self.unpack(_U64))
        if tag == _BYTES_HASH:
            return self.take(self.take(1)[0])
        raise DescriptionError(f"unknown hash tag {tag}")


def decode(buf: bytes) -> BlockDescription:
    """The description ``encode`` made of ``buf``, checked as input: types, ranges and lengths hold.

    Raises:
        DescriptionError: ``buf`` is not an encoded description (truncated, trailing bytes, unknown flags,
            lengths that disagree, extra keys of other types).
    """
    try:
        return _decode(_Bytes(bytes(buf)))
    except DescriptionError:
        raise
    except (ValueError, struct.error, RecursionError, TypeError, IndexError) as e:
        raise DescriptionError(f"not a description: {e}") from e


def _decode(data: _Bytes) -> BlockDescription:
    flags, n_hashes, n_tokens, block_size, group = _DESC.unpack(data.take(_DESC.size))
    if flags & ~(_PARENT | _WIDE_TOKENS | _LORA_ID | _LORA_NAME | _EXTRA):
        raise DescriptionError(f"unknown flags {flags:#x}")
    _check_shape(n_hashes, n_tokens, block_size, group)
    hashes = tuple(data.hash() for _ in range(n_hashes))
    parent = data.hash() if flags & _PARENT else None
    wide = flags & _WIDE_TOKENS
    tokens: tuple[int, ...] = struct.unpack(f"<{n_tokens}{'q' if wide else 'I'}", data.take(n_tokens * (8 if wide
                                                                                                          else 4)))
    if wide and tokens and min(tokens) < 0:
        raise DescriptionError("a token id is negative")
    lora_id = int(data.unpack(_I64)) if flags & _LORA_ID else None
    lora_name = data.take(data.unpack(_U16)).decode() if flags & _LORA_NAME else None
    extra = None
    if flags & _EXTRA:
        loaded = json.loads(data.take(data.unpack(_U32)).decode())
        if type(loaded) is not list or len(loaded) != n_hashes or not all(
                e is None or (type(e) is list and _extra_ok(e, list, 0)) for e in loaded):
            raise DescriptionError("extra keys are not one list (of str/int/list) or null per hash")
        extra = tuple(_tuples(loaded))
    if data.at != len(data.buf):
        raise DescriptionError(f"{len(data.buf) - data.at} bytes after the description")
    return BlockDescription(hashes, parent, tokens, block_size, group, lora_id, lora_name, extra)


# --- the logs ---------------------------------------------------------------------------------------------------

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
    length = _RECORD.size + len(payload)
    body = _RECORD.pack(length, 0, seq, kind, key)[8:] + payload
    return _U32.pack(length) + _U32.pack(_crc(_U32.pack(length), body)) + body


def _pad(length: int) -> bytes:
    """A pad's header: ``length`` bytes to the ring's end follow it unread (its check covers the header only)."""
    body = _RECORD.pack(length, 0, 0, _PAD, bytes(KEY_BYTES))[8:]
    return _U32.pack(length) + _U32.pack(_crc(_U32.pack(length), body)) + body


def _positions(head: int, tail: int) -> bytes:
    return _POSITIONS.pack(head, head ^ _ALL, tail, tail ^ _ALL)


def log_name(attachment: int) -> str:
    return f"{ANNOUNCE_PREFIX}{attachment}"


def _attachment_of(name: str, limit: int) -> int | None:
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
            os.posix_fallocate(fd, 0, _DATA_AT + RING_BYTES)  # a full tmpfs fails here, never in a write
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
            size += _RECORD.size + len(record[2])
            if size >= RING_BYTES // 4:
                self._publish(batch)
                batch, size = [], 0
        if batch:
            self._publish(batch)

    def _publish(self, batch: list[tuple[int, bytes, bytes]]) -> None:
        regions: list[list[Any]] = []  # [ring offset, bytes, parts] of each stretch written in one go
        pos = self._head
        for kind, key, payload in batch:
            length = _RECORD.size + len(payload)
            room = RING_BYTES - pos % RING_BYTES
            if room < length:  # records never wrap: the rest of the ring is a pad (or too short to hold one)
                if room >= _RECORD.size:
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
            os.pwrite(self._fd, b"".join(parts), _DATA_AT + offset)
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
        while pos < head and len(out) < max_records and budget - used >= _RECORD.size:
            room = RING_BYTES - pos % RING_BYTES
            if room < _RECORD.size:  # the writer skips a ring's end too short for a record
                pos += room
                continue
            want = min(head - pos, room, budget - used)
            chunk = memoryview(os.pread(self._fd, want, _DATA_AT + pos % RING_BYTES))
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
            if want - at < _RECORD.size:
                if want < span:
                    return pos + at, True  # cut by the budget
                if (pos + span) % RING_BYTES == 0:
                    return pos + at, False  # the ring's end, too short for a record: the caller skips it
                return "a record cut short before the head"
            length, crc, seq, kind, key = _RECORD.unpack_from(chunk, at)
            if kind == _PAD:
                if length != span - at or (pos + span) % RING_BYTES != 0:
                    return f"a pad of {length} bytes"
            elif not _RECORD.size <= length <= min(_MAX_RECORD, span - at):
                return f"a record of {length} bytes"
            whole = _RECORD.size if kind == _PAD else length
            if at + whole > want:
                return pos + at, True
            if _crc(chunk[at:at + 4], chunk[at + 8:at + whole]) != crc:
                return "its check does not match"
            if kind == _PAD:
                return pos + at + length, False
            if kind not in (_STORED, _REMOVED) or (kind == _REMOVED and length != _RECORD.size):
                return f"kind {kind}, {length} bytes"
            if self._seq is not None and seq != self._seq:
                if not (self._behind and seq > self._seq):
                    return f"record {seq} where {self._seq} was next"
                counts.lost += seq - self._seq
            self._seq, self._behind = seq + 1, False
            out.append(Record(pos + at, seq, kind, OffloadKey(bytes(key)), bytes(chunk[at + _RECORD.size:at + length])))
            at += length
        return pos + at, want < span

    def _damaged(self, good: list[Record], head: int, counts: AnnounceCounts, why: str) -> list[Record]:
        """A bad length leaves no next record to trust: the rest up to the head is skipped."""
        self.refuse(counts, why)
        self._cursor, self._seq = head, None
        return good


class Announcements:
    """This engine's announcement log and its readers of the other engines' logs in the namespace's directory.

    Args:
        directory: the namespace's directory (checked and trusted: ``segment.open_directory``).
        attachment: this engine's attachment (its log's name; a log of that name is this engine's own).
        generation: the index's generation: a log written for another set of the pool's files is not read.
        limit: how many attachments the pool has (``_nodeindex.MAX_ATTACH``).
    """

    def __init__(self, directory: Path, attachment: int, generation: int, limit: int) -> None:
        self.counts = AnnounceCounts()
        self._directory, self._attachment, self._generation, self._limit = directory, attachment, generation, limit
        info = os.stat(directory)
        # The directory was made (and checked) with the pool's access: group-writable exactly when shared.
        self._access = Access(info.st_gid if info.st_mode & stat.S_IWGRP else None, tier="node")
        self._writer: LogWriter | None = None
        try:
            self._writer = LogWriter.create(directory, attachment, generation, self._access)
        except (OSError, ConfigError) as e:
            logger.warning("node tier: cannot make this engine's announcement log in %s (%s); the other engines "
                           "do not announce the blocks it stores", directory, e)
        self._readers: dict[str, LogReader] = {}
        self._noted: set[tuple[str, int]] = set()  # logs refused, logged once
        self._scanned = float("-inf")
        self._turn = 0
        self._failed = False

    def share(self, described: Sequence[tuple[OffloadKey, BlockDescription]]) -> None:
        records = []
        for key, desc in described:
            try:
                if len(key) != KEY_BYTES:
                    raise DescriptionError(f"a key of {len(key)} bytes")
                records.append((_STORED, bytes(key), encode(desc)))
            except DescriptionError:
                self.counts.unshareable += 1
        self._write(records)

    def removed(self, keys: Sequence[OffloadKey]) -> None:
        self._write([(_REMOVED, bytes(key), b"") for key in keys])

    def _write(self, records: list[tuple[int, bytes, bytes]]) -> None:
        if self._writer is None or not records:
            return
        try:
            self._writer.append(records)
        except OSError as e:
            logger.warning("node tier: writing the announcement log in %s failed (%s); this engine stops sharing "
                           "what it stores", self._directory, e)
            self._writer.close()
            self._writer = None
            return
        self.counts.shared += len(records)

    def learn(self, held: Callable[[OffloadKey], bool | None], medium: Medium) -> list[OffloadEvent]:
        """Events for the other engines' records published since the last call, each checked against the pool
        now by ``held`` (True: ready; False: not held; None: unknown, skipped)."""
        try:
            return self._learn(held, medium)
        except Exception:  # a bug here must cost announcements, never the engine's step
            if not self._failed:
                self._failed = True
                logger.exception("node tier: reading the announcement logs failed")
            return []

    def _learn(self, held: Callable[[OffloadKey], bool | None], medium: Medium) -> list[OffloadEvent]:
        if time.monotonic() - self._scanned >= SCAN_S:
            self._scan()
        readers = list(self._readers.values())
        if not readers:
            return []
        self._turn = (self._turn + 1) % len(readers)  # a busy log goes first only in its turn
        records_left, bytes_left = MAX_RECORDS_PER_STEP, MAX_BYTES_PER_STEP
        runs: list[tuple[EventKind, list[OffloadKey], list[BlockDescription | None]]] = []
        for reader in readers[self._turn:] + readers[:self._turn]:
            if records_left <= 0 or bytes_left < _RECORD.size:
                break
            try:
                records, used = reader.read(records_left, bytes_left, self.counts)
            except OSError as e:
                reader.refuse(self.counts, str(e))
                continue
            records_left, bytes_left = records_left - len(records), bytes_left - used
            for record in records:
                self._judge(reader, record, held, runs)
        return [OffloadEvent(kind, tuple(keys), medium, tuple(descs)) for kind, keys, descs in runs]

    def _judge(self, reader: LogReader, record: Record, held: Callable[[OffloadKey], bool | None],
               runs: list[tuple[EventKind, list[OffloadKey], list[BlockDescription | None]]]) -> None:
        """Records of different engines are not ordered with each other: each is reported only while it is true."""
        ready = held(record.key)
        desc: BlockDescription | None = None
        if record.kind == _STORED:
            if ready is not True:
                self.counts.untrue += 1
                return
            try:
                desc = decode(record.payload)
            except DescriptionError as e:
                reader.refuse(self.counts, str(e))
                return
            kind = EventKind.STORED
        else:
            if ready is not False:
                self.counts.untrue += 1
                return
            kind = EventKind.REMOVED
        self.counts.learned += 1
        if not runs or runs[-1][0] is not kind:
            runs.append((kind, [], []))
        runs[-1][1].append(record.key)
        runs[-1][2].append(desc)

    def _scan(self) -> None:
        """Open the logs that appeared or were replaced since the last look; close those that went."""
        self._scanned = time.monotonic()
        found: dict[str, int] = {}
        try:
            with os.scandir(self._directory) as entries:
                for entry in entries:
                    number = _attachment_of(entry.name, self._limit)
                    if number is not None and number != self._attachment:
                        found[entry.name] = entry.inode()
        except OSError:
            return  # the directory went: the index leaves the pool at its next reclaim
        for name in [n for n, r in self._readers.items() if found.get(n) != r.inode]:
            self._readers.pop(name).close()
        for name, inode in found.items():
            if name not in self._readers and (name, inode) not in self._noted:
                reader = self._open(name)
                if reader is not None:
                    self._readers[name] = reader

    def _open(self, name: str) -> LogReader | None:
        try:
            fd = os.open(self._directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None  # gone since the listing
        inode = -1
        try:
            info = os.fstat(fd)
            inode = info.st_ino
            problem = untrusted(info, self._access) if stat.S_ISREG(info.st_mode) else "not a regular file"
            if problem is None and info.st_size != _DATA_AT + RING_BYTES:
                problem = f"{info.st_size} bytes"
            raw = os.pread(fd, _STATIC.size, 0) if problem is None else b""
            static = _STATIC.unpack(raw) if len(raw) == _STATIC.size else None
            if problem is None and (static is None or static[:3] != (_MAGIC, _VERSION, _attachment_of(name, 1 << 30))
                                    or static[4] != RING_BYTES):
                problem = "not an announcement log of this version"
        except OSError as e:
            problem, static = str(e), None
        if problem is None and static is not None and static[3] == self._generation:
            return LogReader(fd, name, inode)
        os.close(fd)
        if problem is not None:  # else a log of an older set of the pool's files, left by an engine leaving it
            self._noted.add((name, inode))
            self.counts.refused += 1
            logger.warning("node tier: the announcement log %s is refused: %s", self._directory / name, problem)
        return None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
