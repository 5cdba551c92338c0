"""What the other engines on this directory stored: their slot files' tables, read on a thread of its own.

The scheduler step never reads a file. ``ForeignTables`` re-reads the tables of the other engines' slot files in
rank 0's directory every ``interval_s`` (those written since their last read: a file's modification time says) and
soon after a miss (``poke``), and publishes a map from key to
``location`` that ``find`` answers from memory. Only the entries that changed since the last read are parsed, so a
quiet directory costs a table read and a compare. A found block is only a hint: its read checks the block's own
header (fingerprint, key, checksum), so an entry that was reused, damaged or planted is a miss. A location whose
load failed is forgotten (the same key at the same place is not tried again; a bounded memory).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.paths import engine_of, slot_file_path
from kvoffload.tiers.disk.slot_file import (
    ENTRY_BYTES,
    PAGE,
    SlotFileError,
    decode_file_header,
    location,
    open_regular,
    table_names,
)
from kvoffload.tiers.lower.block_format import BlockFormat, CorruptBlockError

logger = logging.getLogger(__name__)

CHUNK = 128 * ENTRY_BYTES
"""Entries compared at once with the last read: a chunk that did not change is not parsed."""
INTERVAL_S = 0.25
"""Between reads: a file nobody wrote since costs a stat; one written is read again (its changed chunks parsed)."""
POKE_MIN_S = 0.05
QUIET_NS = 200_000_000
"""A file last written this long before a read is skipped until written again (see ``_read``)."""
FORGOTTEN_MAX = 65536


@dataclass
class _Table:
    """The last read of one file's table: its identity, bytes and names by slot."""

    identity: tuple[int, int, int]
    raw: bytes = b""
    written: tuple[int, int, int, int] = (0, 0, 0, 0)
    """(device, inode, size, modification time) when the table was last read."""
    names: dict[int, OffloadKey] = field(default_factory=dict)


class ForeignTables:
    """The other engines' blocks in ``rank_dir`` (not ``own_engine``'s), by key.

    Args:
        rank_dir: rank 0's directory (the scheduler indexes rank 0; other ranks hold the same slots).
        own_engine: this engine's number (its own file is its index's business).
        fmt: how names map to keys (a sealed tier's names are keyed permutations).
        interval_s: seconds between reads when nobody pokes.
    """

    def __init__(self, rank_dir: Path, own_engine: int, fmt: BlockFormat, interval_s: float = INTERVAL_S) -> None:
        self._dir, self._own, self._fmt, self._interval_s = rank_dir, own_engine, fmt, interval_s
        self._tables: dict[int, _Table] = {}
        self._found: dict[OffloadKey, int] = {}
        self._forgotten: OrderedDict[tuple[OffloadKey, int], None] = OrderedDict()
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.reads = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-disk-tables", daemon=True)
        self._thread.start()

    def find(self, key: OffloadKey) -> int | None:
        """The location of ``key`` in another engine's file, as last read (memory only)."""
        return self._found.get(key)

    def poke(self) -> None:
        """A lookup missed: read the tables again soon (at most every ``POKE_MIN_S``)."""
        self._wake.set()

    def forget(self, key: OffloadKey, place: int) -> None:
        """A load of ``key`` at ``place`` failed: never answer that pair again (the oldest of ``FORGOTTEN_MAX`` go)."""
        with self._lock:
            self._forgotten[(key, place)] = None
            while len(self._forgotten) > FORGOTTEN_MAX:
                self._forgotten.popitem(last=False)
            if self._found.get(key) == place:
                found = dict(self._found)
                del found[key]
                self._found = found

    def refresh(self) -> None:
        """Read every other engine's table now (the thread calls it; tests and start-up may too: one read at a
        time, so that an older read never publishes after a newer one)."""
        with self._reading:
            self._refresh()

    def _refresh(self) -> None:
        seen = {}
        for engine in self._engines():
            table = self._read(engine, self._tables.get(engine))
            if table is not None:
                seen[engine] = table
        found: dict[OffloadKey, int] = {}
        with self._lock:
            for engine, table in seen.items():
                for slot, key in table.names.items():
                    place = location(engine, slot)
                    if (key, place) not in self._forgotten:
                        found[key] = place
            self._tables, self._found = seen, found
            self.reads += 1

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bug here must not end the reads for the engine's life
                logger.exception("disk tier: reading the other engines' tables failed")
            self._wake.wait(self._interval_s)
            self._wake.clear()
            self._stop.wait(POKE_MIN_S)

    def _engines(self) -> list[int]:
        try:
            with os.scandir(self._dir) as entries:
                found = [engine_of(e.name) for e in entries if e.is_file(follow_symlinks=False)]
        except OSError:
            return []
        return [e for e in found if e is not None and e != self._own]

    def _read(self, engine: int, last: _Table | None) -> _Table | None:
        """The table of ``engine``'s file, parsing only what changed since ``last``; None when it is not one."""
        path = slot_file_path(self._dir, engine)
        try:
            seen = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        if last is not None and last.written == (seen.st_dev, seen.st_ino, seen.st_size, seen.st_mtime_ns):
            return last  # nothing written since the last read: no table to read (an idle engine costs a stat)
        try:
            fd = open_regular(path)
        except (OSError, CorruptBlockError):
            return None
        try:
            info = os.fstat(fd)
            layout = decode_file_header(os.pread(fd, PAGE, 0))
            raw = os.pread(fd, layout.capacity * ENTRY_BYTES, layout.table_offset)
        except (OSError, SlotFileError) as e:
            logger.debug("disk tier: not reading %s: %s", path, e)
            return None
        finally:
            os.close(fd)
        identity = (info.st_dev, info.st_ino, layout.capacity)
        if last is None or last.identity != identity:
            last = _Table(identity)
        # The stat from before the read, trusted only for a file quiet for a while: a modification time is as coarse
        # as the kernel's clock tick, so a write just after this read could leave it as it is.
        quiet = time.time_ns() - seen.st_mtime_ns > QUIET_NS
        last.written = (seen.st_dev, seen.st_ino, seen.st_size, seen.st_mtime_ns) if quiet else (0, 0, 0, 0)
        return self._update(last, raw)

    def _update(self, table: _Table, raw: bytes) -> _Table:
        names = table.names
        old, new = memoryview(table.raw), memoryview(raw)  # slices of views compare without copies
        for start in range(0, len(raw), CHUNK):
            chunk = new[start:start + CHUNK]
            if old[start:start + CHUNK] == chunk:
                continue
            first = start // ENTRY_BYTES
            for slot in range(first, first + len(chunk) // ENTRY_BYTES):
                names.pop(slot, None)
            for slot, name in table_names(chunk, first):
                names[slot] = self._fmt.key_of(name)
        table.raw = raw
        return table
