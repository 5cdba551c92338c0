"""The disk tier's slot files as a test sees them from outside the engine: which blocks a file's table names and
where each lies, to count what was stored (per rank, per engine) or to damage a block in place.

``tiers.disk.slot_file`` is the format: a header stating the layout, a table of entries (a name, the slot), then the
slots. A valid entry names a block its engine wrote there; eviction leaves it (the bytes stay loadable) until the
slot is written again, and a failed store or a damaged block empties it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvoffload.tiers.disk.paths import engine_of
from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, PAGE, Layout, decode_file_header, table_names

__all__ = ["StoredBlock", "layout_of", "names", "slot_files", "stored_blocks"]


@dataclass(frozen=True)
class StoredBlock:
    """A block a slot file's table names: its file, slot, name (the key, or its keyed permutation in a sealed
    tier), and the bytes of its slot."""

    path: Path
    slot: int
    name: bytes
    offset: int
    nbytes: int


def slot_files(root: Path) -> list[Path]:
    """Every slot file (``engine-<n>.kvs``, a regular file) under ``root``, sorted."""
    return sorted(p for p in root.rglob("engine-*.kvs")
                  if engine_of(p.name) is not None and p.is_file() and not p.is_symlink())


def layout_of(path: Path) -> Layout:
    """The layout ``path``'s header states.

    Raises:
        SlotFileError: not a slot file of this version. OSError: it cannot be read.
    """
    with open(path, "rb") as f:
        return decode_file_header(f.read(PAGE))


def stored_blocks(path: Path) -> list[StoredBlock]:
    """The blocks ``path``'s table names, in slot order."""
    layout = layout_of(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        table = os.pread(fd, layout.capacity * ENTRY_BYTES, layout.table_offset)
    finally:
        os.close(fd)
    return [StoredBlock(path, slot, name, layout.slot_offset(slot), layout.stride)
            for slot, name in table_names(table)]


def names(path: Path) -> set[bytes]:
    """The names of the blocks ``path``'s table names."""
    return {block.name for block in stored_blocks(path)}
