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

import logging
import mmap
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from kvoffload import _nodeindex
from kvoffload.blocks import Medium
from kvoffload.config import ConfigError
from kvoffload.index.base import BlockDescription, EventKind, OffloadEvent
from kvoffload.keys import KEY_BYTES, OffloadKey
from kvoffload.tiers.lower.trust import Access
from kvoffload.tiers.node.announce_log import (
    RECORD,
    REMOVED,
    STORED,
    AnnounceCounts,
    LogReader,
    LogWriter,
    Record,
    attachment_of,
    open_log,
)
from kvoffload.tiers.node.describe import DescriptionError, decode, encode

logger = logging.getLogger(__name__)

Described = Sequence[tuple[OffloadKey, BlockDescription]]
"""What ``share_descriptions`` is given: keys this engine announced as stored, with their descriptions."""

MAX_RECORDS_PER_STEP = 128
MAX_BYTES_PER_STEP = 256 << 10
"""What one ``take_events`` reads of all logs together, at most: a step never reads megabytes, and a record costs
about 10 us to check and decode, so a step catching up costs at most about 1.3 ms (a late joiner catches up over
several steps)."""
SCAN_S = 1.0
"""How often a reader lists the directory for logs that appeared or were replaced."""


class Announcements:
    """This engine's announcement log and its readers of the other engines' logs in the namespace's directory.

    Args:
        directory: the namespace's directory (checked and trusted: ``segment.open_directory``).
        segment, lock_fd, attachment: the shared index, as ``NodeIndex`` calls it: each record read is checked
            against it (a lookup, without the lock); ``attachment`` is this engine's (its log's name).
        generation: the index's generation: a log written for another set of the pool's files is not read.
    """

    def __init__(self, directory: Path, segment: mmap.mmap, lock_fd: int, attachment: int, generation: int) -> None:
        self.counts = AnnounceCounts()
        self._directory, self._attachment, self._generation = directory, attachment, generation
        self._index = (segment, lock_fd, attachment)
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

    @classmethod
    def start(cls, directory: Path, segment: mmap.mmap, lock_fd: int, attachment: int) -> Announcements:
        """This engine's announcements; an index that no longer reads (the engine is about to leave the pool)
        gives generation 0, which no set has: its log is read by no one, and it reads none."""
        try:
            generation = _nodeindex.files(segment)[0]
        except _nodeindex.Damaged:
            generation = 0
        return cls(directory, segment, lock_fd, attachment, generation)

    def _held(self, key: OffloadKey) -> bool | None:
        """Whether ``key`` is ready in the pool now; None when the index cannot tell now (busy, damaged)."""
        try:
            return bool(_nodeindex.lookup(*self._index, key)[0] == 1)
        except (_nodeindex.Busy, _nodeindex.Damaged):
            return None

    def share(self, described: Described) -> None:
        records = []
        for key, desc in described:
            try:
                if len(key) != KEY_BYTES:
                    raise DescriptionError(f"a key of {len(key)} bytes")
                records.append((STORED, bytes(key), encode(desc)))
            except DescriptionError:
                self.counts.unshareable += 1
        self._write(records)

    def removed(self, keys: Sequence[OffloadKey]) -> None:
        self._write([(REMOVED, bytes(key), b"") for key in keys])

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

    def learn(self, medium: Medium, own: Sequence[OffloadEvent] = ()) -> list[OffloadEvent]:
        """Log the blocks this engine's stores evicted (its ``own`` REMOVED events); then events for the other
        engines' records published since the last call, each reported only while the pool says it is true now."""
        for event in own:
            if event.kind is EventKind.REMOVED:
                self.removed(event.keys)
        try:
            return self._learn(medium)
        except Exception:  # a bug here must cost announcements, never the engine's step
            if not self._failed:
                self._failed = True
                logger.exception("node tier: reading the announcement logs failed")
            return []

    def _learn(self, medium: Medium) -> list[OffloadEvent]:
        if time.monotonic() - self._scanned >= SCAN_S:
            self._scan()
        readers = list(self._readers.values())
        if not readers:
            return []
        self._turn = (self._turn + 1) % len(readers)  # a busy log goes first only in its turn
        records_left, bytes_left = MAX_RECORDS_PER_STEP, MAX_BYTES_PER_STEP
        runs: list[tuple[EventKind, list[OffloadKey], list[BlockDescription | None]]] = []
        for reader in readers[self._turn:] + readers[:self._turn]:
            if records_left <= 0 or bytes_left < RECORD.size:
                break
            try:
                records, used = reader.read(records_left, bytes_left, self.counts)
            except OSError as e:
                reader.refuse(self.counts, str(e))
                continue
            records_left, bytes_left = records_left - len(records), bytes_left - used
            for record in records:
                self._judge(reader, record, runs)
        return [OffloadEvent(kind, tuple(keys), medium, tuple(descs)) for kind, keys, descs in runs]

    def _judge(self, reader: LogReader, record: Record,
               runs: list[tuple[EventKind, list[OffloadKey], list[BlockDescription | None]]]) -> None:
        """Records of different engines are not ordered with each other: each is reported only while it is true."""
        ready = self._held(record.key)
        desc: BlockDescription | None = None
        if record.kind == STORED:
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
                    number = attachment_of(entry.name, _nodeindex.MAX_ATTACH)
                    if number is not None and number != self._attachment:
                        found[entry.name] = entry.inode()
        except OSError:
            return  # the directory went: the index leaves the pool at its next reclaim
        for name in [n for n, r in self._readers.items() if found.get(n) != r.inode]:
            self._readers.pop(name).close()
        for name, inode in found.items():
            if name not in self._readers and (name, inode) not in self._noted:
                reader = self._open(name, inode)
                if reader is not None:
                    self._readers[name] = reader

    def _open(self, name: str, inode: int) -> LogReader | None:
        """A reader of log ``name`` (``inode`` as listed): a refused one is logged once and not opened again."""
        opened = open_log(self._directory / name, self._access, self._generation)
        if isinstance(opened, LogReader) or opened is None:
            return opened
        self._noted.add((name, inode))
        self.counts.refused += 1
        logger.warning("node tier: the announcement log %s is refused: %s", self._directory / name, opened[0])
        return None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
