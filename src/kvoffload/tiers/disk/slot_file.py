"""The disk tier's slot file: one preallocated file per engine and rank, a table of names, then fixed-size slots.

An engine's scheduler gives each block a slot of its ``SlotIndex``; the block's bytes live at that slot of the
engine's file, in the block format of ``tiers.lower.block_format`` (header and payload, or the sealed block), and
the slot's 32-byte entry in the table names the key that is there. A store writes the block, then its entry; a read
is one positioned read of the slot, verified as a block file was (the header names the fingerprint and the key).
So a crash between the two writes, a torn write or a slot reused since an entry was read is a miss, never a wrong
block. docs/disk-format.md is this module's twin: change both together.

Layout (``Layout``): a 4 KiB file header (``encode_file_header``), the table (``capacity`` entries), zeros up to
the next 4 KiB, then ``capacity`` slots of ``stride`` bytes. ``open_regular`` is how both halves open a slot file.
No torch.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import zlib
from dataclasses import dataclass

from kvoffload.keys import KEY_BYTES
from kvoffload.tiers.lower.block_format import CorruptBlockError
from kvoffload.tiers.lower.trust import FILE_MODE

FILE_MAGIC = b"KVOFFSLT"
# O_NONBLOCK: opening a FIFO would wait for a writer forever; on a regular file it changes nothing.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
SLOT_FORMAT_VERSION = 3
"""Version 1 and 2 were one file per block (plain and sealed); a directory of those is not read (``tree``)."""
PAGE = 4096
ENTRY_BYTES = 32
_FILE_HEADER = struct.Struct("<8sHHIQQQ")
"""magic, version, header size, stride, capacity, table offset, data offset; a crc32 of these follows."""
_ENTRY = struct.Struct(f"<{KEY_BYTES}sQ")
"""the name (a key, or its keyed permutation in a sealed tier), the slot; a crc32 of these follows."""
EMPTY_ENTRY = bytes(ENTRY_BYTES)
_ZERO_PAGE = bytes(PAGE)
MAX_STRIDE = 1 << 31
MAX_CAPACITY = 1 << 32


class NotABlockFileError(CorruptBlockError):
    """A slot file's path names a symbolic link, directory, FIFO or device: never read or written."""


class SlotFileError(CorruptBlockError):
    """A slot file's header is not one this version writes (damaged, foreign, another layout)."""


@dataclass(frozen=True)
class Layout:
    """Where a slot file keeps what: ``capacity`` slots of ``stride`` bytes, after the table of their entries."""

    stride: int
    capacity: int

    def __post_init__(self) -> None:
        if not 0 < self.stride <= MAX_STRIDE or not 0 < self.capacity <= MAX_CAPACITY:
            raise SlotFileError(f"slot file layout out of range: stride {self.stride}, capacity {self.capacity}")

    @classmethod
    def for_budget(cls, budget_bytes: int, stride: int) -> Layout | None:
        """The largest layout of ``stride``-byte slots whose file fits in ``budget_bytes`` (None: not one slot)."""
        # An upper bound (the table is never padded below it), stepped down to the largest that fits.
        capacity = min(MAX_CAPACITY, max(0, (budget_bytes - PAGE) // (stride + ENTRY_BYTES)))
        while capacity > 0 and cls(stride, capacity).file_bytes > budget_bytes:
            capacity -= 1
        return cls(stride, capacity) if capacity > 0 else None

    @property
    def table_offset(self) -> int:
        return PAGE

    @property
    def data_offset(self) -> int:
        return _round_up(PAGE + self.capacity * ENTRY_BYTES, PAGE)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.capacity * self.stride

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.stride

    def entry_offset(self, slot: int) -> int:
        return PAGE + slot * ENTRY_BYTES


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def open_regular(path: str, create: bool = False, mode: int = FILE_MODE) -> int:
    """A read-write descriptor of the regular file ``path`` (read-only where writing is refused), created with
    ``mode`` when ``create``; never blocks on it, never follows a link. Both halves open slot files through it.

    Raises:
        NotABlockFileError: ``path`` is a symbolic link, or not a regular file.
        OSError: it cannot be opened.
    """
    flags = _OPEN_FLAGS | (os.O_CREAT if create else 0)
    try:
        try:
            fd = os.open(path, os.O_RDWR | flags, mode)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            fd = os.open(path, os.O_RDONLY | flags & ~os.O_CREAT)  # another engine's file, or a read-only mount
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotABlockFileError(f"{path}: a symbolic link, not a slot file") from None
        raise
    try:
        info = os.fstat(fd)  # of what was opened: nothing can be swapped in between
        if not stat.S_ISREG(info.st_mode):
            raise NotABlockFileError(f"{path}: not a regular file (mode {info.st_mode:o})")
        if create and stat.S_IMODE(info.st_mode) != mode and info.st_uid == os.geteuid():
            os.fchmod(fd, mode)  # the umask cut the group's bits
    except BaseException:
        os.close(fd)
        raise
    return fd


def encode_file_header(layout: Layout) -> bytes:
    """The file's first page."""
    body = _FILE_HEADER.pack(FILE_MAGIC, SLOT_FORMAT_VERSION, PAGE, layout.stride, layout.capacity,
                             layout.table_offset, layout.data_offset)
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(PAGE, b"\0")


def decode_file_header(raw: bytes | memoryview) -> Layout:
    """The layout a file header states, once everything in it checks.

    Raises:
        SlotFileError: short, damaged, another version, or offsets that are not this version's.
    """
    size = _FILE_HEADER.size
    if len(raw) < size + 4:
        raise SlotFileError(f"slot file header is {len(raw)} bytes, not {PAGE}")
    body = bytes(raw[:size])
    (crc,) = struct.unpack_from("<I", raw, size)
    if zlib.crc32(body) != crc:
        raise SlotFileError("slot file header checksum mismatch")
    magic, version, header_bytes, stride, capacity, table_offset, data_offset = _FILE_HEADER.unpack(body)
    if magic != FILE_MAGIC or version != SLOT_FORMAT_VERSION or header_bytes != PAGE:
        raise SlotFileError(f"not a version {SLOT_FORMAT_VERSION} slot file (magic {magic!r}, version {version})")
    layout = Layout(stride, capacity)
    if (table_offset, data_offset) != (layout.table_offset, layout.data_offset):
        raise SlotFileError("slot file offsets do not follow from its stride and capacity")
    return layout


def encode_entry(name: bytes, slot: int) -> bytes:
    """The table entry saying that ``slot`` holds the block named ``name`` (its crc binds it to the slot)."""
    body = _ENTRY.pack(name, slot)
    return body + struct.pack("<I", zlib.crc32(body)) + bytes(ENTRY_BYTES - _ENTRY.size - 4)


def entry_name(raw: bytes | memoryview, slot: int) -> bytes | None:
    """The name an entry read from ``slot``'s place gives, or None (empty, damaged, or another slot's)."""
    if raw == EMPTY_ENTRY or len(raw) != ENTRY_BYTES:
        return None
    body = bytes(raw[:_ENTRY.size])
    name, where = _ENTRY.unpack(body)
    (crc,) = struct.unpack_from("<I", raw, _ENTRY.size)
    return name if where == slot and zlib.crc32(body) == crc else None


def table_names(table: bytes | memoryview, first_slot: int = 0) -> list[tuple[int, bytes]]:
    """(slot, name) of every valid entry of ``table`` (entries from ``first_slot`` on, in slot order)."""
    view = memoryview(table)
    out = []
    per_page = PAGE // ENTRY_BYTES
    for page in range(0, len(view) // ENTRY_BYTES, per_page):
        chunk = view[page * ENTRY_BYTES:(page + per_page) * ENTRY_BYTES]
        if chunk == _ZERO_PAGE[:len(chunk)]:
            continue  # a page of empty slots: one compare instead of 128 steps
        for i in range(page, page + len(chunk) // ENTRY_BYTES):
            raw = view[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES]
            if raw == EMPTY_ENTRY:
                continue
            name = entry_name(raw, first_slot + i)
            if name is not None:
                out.append((first_slot + i, name))
    return out


def location(engine: int, slot: int) -> int:
    """A block's place as the disk tier's specs carry it (``TierBlocks.slots``): engine ``engine``'s file, ``slot``."""
    return engine * MAX_CAPACITY + slot


def split_location(place: int) -> tuple[int, int]:
    """(engine, slot) of a ``location``."""
    return divmod(place, MAX_CAPACITY)
