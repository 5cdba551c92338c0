"""The scheduler's side of the slot files: this engine's number, its file in every rank directory, what it held.

At start-up the scheduler takes the lowest engine number whose lock (``<world>/engine-<n>.lock``) no running engine
holds, and keeps it for its life (``EngineNumber``). A restarted engine so takes its own number back when it
starts alone, and finds its blocks in its file. ``prepare_files`` creates that number's slot file in every rank
directory, or keeps it when its header states this engine's layout (then rank 0's table is what it held), or starts
it afresh. ``trim_leftovers`` deletes the other engines' files when this engine starts alone on the directory (no
running engine can be using them). Metadata and tables only: no payload is read here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.disk.paths import MAX_ENGINES, engine_lock_path, engine_of, rank_directories, slot_file_path
from kvoffload.tiers.disk.slot_file import (
    ENTRY_BYTES,
    PAGE,
    Layout,
    SlotFileError,
    decode_file_header,
    encode_file_header,
    open_regular,
    table_names,
)
from kvoffload.tiers.disk.tree import open_tree
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.trust import Access

logger = logging.getLogger(__name__)


class EngineNumber:
    """This engine's number on a world directory, held (``flock``, exclusive) until the process ends or ``close``.

    Raises:
        OSError: no number is free (``MAX_ENGINES`` engines run there), or the lock files cannot be made.
    """

    def __init__(self, world_dir: Path, access: Access) -> None:
        for engine in range(MAX_ENGINES):
            fd = os.open(engine_lock_path(world_dir, engine), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         access.file_mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            except OSError as e:  # no flock on this file system: numbers cannot be held, so none is shared
                os.close(fd)
                raise OSError(f"cannot lock {engine_lock_path(world_dir, engine)}: {e}") from e
            with contextlib.suppress(OSError):  # the umask cut a shared group's bits; only the number we hold
                os.fchmod(fd, access.file_mode)
            self.engine, self._fd = engine, fd
            return
        raise OSError(f"{MAX_ENGINES} engines already run on {world_dir}")

    def close(self) -> None:
        """Let the number go (once: a second call does nothing, never closing a descriptor reused since)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(frozen=True)
class Found:
    """What this engine's rank 0 file held at start-up: (slot, name) of its valid entries."""

    placed: tuple[tuple[int, bytes], ...]
    seconds: float


def prepare_files(directories: Sequence[Path], engine: int, layout: Layout, access: Access) -> Found:
    """Make ``engine``'s slot file of ``layout`` in every directory (rank 0's first), keeping a file that already
    has this layout; return rank 0's entries when it was kept.

    Raises:
        OSError, NotABlockFileError: a file cannot be made (not a regular file at its path, no space, no rights).
    """
    start = time.perf_counter()
    placed: list[tuple[int, bytes]] = []
    for rank, directory in enumerate(directories):
        fd = open_regular(slot_file_path(directory, engine), create=True, mode=access.file_mode)
        try:
            if _keep_or_reset(fd, layout, directory) and rank == 0:
                placed = _read_table(fd, layout)
        finally:
            os.close(fd)
    return Found(tuple(placed), time.perf_counter() - start)


def _keep_or_reset(fd: int, layout: Layout, directory: Path) -> bool:
    """Whether the file at ``fd`` has ``layout`` (kept as it is); if not, it is emptied and given it."""
    size = os.fstat(fd).st_size
    try:
        if decode_file_header(os.pread(fd, PAGE, 0)) == layout and size == layout.file_bytes:
            return True
    except SlotFileError as e:
        if size:
            logger.warning("disk tier: starting a slot file in %s afresh: %s", directory, e)
    else:
        logger.info("disk tier: starting a slot file in %s afresh: its layout (or size) is not this engine's",
                    directory)
    os.ftruncate(fd, 0)  # every old byte goes: no entry of the old layout can name a slot of the new one
    os.ftruncate(fd, layout.file_bytes)
    os.pwrite(fd, encode_file_header(layout), 0)
    return False


def _read_table(fd: int, layout: Layout) -> list[tuple[int, bytes]]:
    table = os.pread(fd, layout.capacity * ENTRY_BYTES, layout.table_offset)
    return table_names(table)


def trim_leftovers(directories: Sequence[Path], engine: int) -> int:
    """Delete the slot files of every other engine number (call only when this engine started alone); return how
    many went."""
    removed = 0
    for directory in directories:
        try:
            with os.scandir(directory) as entries:
                names = [e.name for e in entries if engine_of(e.name) not in (None, engine)]
        except OSError:
            continue
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                try:
                    os.unlink(directory / name)
                    removed += 1
                except OSError as e:
                    logger.warning("disk tier: cannot remove leftover slot file %s: %s", directory / name, e)
    if removed:
        logger.info("disk tier: removed %d slot files of engines that stopped (this engine starts alone)", removed)
    return removed


def clear_entries(directory: Path, engine: int, layout: Layout, slots: Sequence[int]) -> None:
    """Empty the table entries of ``slots`` in ``engine``'s file in ``directory`` (a reset: no engine may find
    those blocks again).

    Raises:
        OSError: the file cannot be opened or written.
    """
    fd = open_regular(slot_file_path(directory, engine))
    try:
        for slot in slots:
            os.pwrite(fd, bytes(ENTRY_BYTES), layout.entry_offset(slot))
    finally:
        os.close(fd)


def prepare_engine(config: DiskTierConfig, namespace: Namespace, file_bytes: int, engine: int = 0) -> Layout:
    """Make ``engine``'s slot files for ``config`` without a scheduler (benches, tests, tools driving a handler
    alone); return their layout.

    Raises:
        ConfigError: ``disk_bytes`` is below one slot. OSError: as ``prepare_files``.
    """
    layout = Layout.for_budget(config.capacity_bytes, file_bytes)
    if layout is None:
        raise ConfigError(f"disk_bytes={config.capacity_bytes} is below one slot of {file_bytes} bytes")
    fmt = BlockFormat.of(config.secret)
    access = Access(config.shared_group)
    directories = rank_directories(config.path, namespace, fmt)
    for directory in directories:
        open_tree(config.path, directory, access, fmt)
    prepare_files(directories, engine, layout, access)
    return layout
