"""A node pool's set of files, bound together: the ``index``, the ``engines`` file and each rank's ``pool.<rank>``
in the namespace's directory (``segment.namespace_directory``); beside them each engine that publishes KV events
keeps ``announce.<attachment>`` (``announce``), which goes with the set.

The index records the set it belongs to: a random generation (its epochs start from it), the inode of the
``engines`` file whose locks say which engines live (``liveness``), and the inode of each rank's pool file once
made. Every process opening the set does so under an exclusive ``flock`` of the directory, and finds either a
consistent set or makes a new one: a file removed (an operator's ``rm``, systemd-logind's RemoveIPC), replaced,
truncated or damaged past repair makes the whole set new, never one new file beside an old one, which would pair
an empty pool with a full index (or an empty index with a full pool) and serve other blocks' bytes. Files are
made new by unlinking and creating, never by formatting a file another engine may still map: an engine running on
the old set keeps a consistent view until it notices (``BoundFiles.problem``, once a ``RECLAIM_S``) and detaches.
A file is never mapped beyond its size (a short file is refused), so mapping one cannot SIGBUS; a file truncated
after it was mapped is contained by ``_mapguard``.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import logging
import mmap
import os
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload import _mapguard, _nodeindex
from kvoffload.config import ConfigError
from kvoffload.tiers.lower.trust import Access
from kvoffload.tiers.node.liveness import ENGINES_NAME
from kvoffload.tiers.node.segment import NodeGeometry, open_checked

logger = logging.getLogger(__name__)

INDEX_NAME = "index"
POOL_PREFIX = "pool."
ANNOUNCE_PREFIX = "announce."
"""Each engine's announcement log (``announce``): part of the set, removed with it."""
MAGIC = 0x313065646F6E766B
_HEADER = struct.Struct("<QII16sQQQQQQ")
"""magic, version, header bytes, namespace fingerprint, slots, slot bytes, table entries, total bytes, generation,
engines file inode."""


@dataclass(frozen=True)
class BoundFiles:
    """What an engine mapped: it watches that the directory still holds these very files."""

    directory: Path
    index_inode: int
    pool_bytes: int

    def problem(self, index: mmap.mmap) -> str | None:
        """None while the directory holds this engine's set; else what changed (a removed, replaced or truncated
        file, or a damaged record): the engine must stop using the pool."""
        try:
            _, engines, pools = _nodeindex.files(index)
        except _nodeindex.Damaged as e:
            return str(e)
        expected: list[tuple[str, int, int | None]] = [(INDEX_NAME, self.index_inode, None),
                                                       (ENGINES_NAME, engines, None)]
        expected += [(f"{POOL_PREFIX}{rank}", inode, self.pool_bytes) for rank, inode in sorted(pools.items())]
        for name, inode, size in expected:
            try:
                info = os.lstat(self.directory / name)
            except FileNotFoundError:
                return f"{self.directory / name} was removed"
            except OSError as e:
                return f"{self.directory / name}: {e}"
            if info.st_ino != inode:
                return f"{self.directory / name} was replaced"
            if size is not None and info.st_size != size:
                return f"{self.directory / name} was truncated to {info.st_size} bytes"
        return None


@contextlib.contextmanager
def set_locked(directory: Path) -> Iterator[None]:
    """The namespace's directory under an exclusive ``flock``: who holds it decides what the set is."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def open_index(directory: Path, geometry: NodeGeometry, access: Access) -> tuple[mmap.mmap, BoundFiles]:
    """The namespace's index, mapped, from a consistent set (made anew when there is none).

    Raises:
        ConfigError: the index holds another version, namespace or geometry (the message says which and what to
            change), or the set cannot be made.
    """
    with set_locked(directory):
        return _open_set(directory, geometry, access)


def open_pool(directory: Path, rank: int, geometry: NodeGeometry,
              access: Access) -> tuple[mmap.mmap, BoundFiles, mmap.mmap]:
    """The index and rank ``rank``'s pool file, mapped from one consistent set (a worker's pool and the index it
    checks its jobs in must be of one generation).

    Raises:
        ConfigError: as ``open_index``, or the pool file cannot be made (a full tmpfs), or ``rank`` is past
            ``_nodeindex.MAX_RANKS``.
    """
    if not 0 <= rank < _nodeindex.MAX_RANKS:
        raise ConfigError(f"host_scope node: rank {rank} is past the {_nodeindex.MAX_RANKS} a node pool holds")
    with set_locked(directory):
        index, bound = _open_set(directory, geometry, access)
        try:
            with _guarded(index):
                return index, bound, _open_pool_file(directory, rank, geometry, access, index)
        except BaseException:
            index.close()
            raise


def _open_set(directory: Path, geometry: NodeGeometry, access: Access) -> tuple[mmap.mmap, BoundFiles]:
    path = directory / INDEX_NAME
    fd, created = _open(path, access)
    try:
        if not created:
            found = _open_existing(fd, path, geometry)
            if isinstance(found, mmap.mmap):
                return found, BoundFiles(directory, os.fstat(fd).st_ino, geometry.pool_bytes)
            logger.warning("node tier: the node pool at %s %s; making a new one (engines on the old one stop "
                           "using it within a second)", directory, found)
            os.close(fd)
            fd = -1
            _unlink_set(directory)
            fd, _ = _open(path, access)
        return _make_set(directory, fd, path, geometry, access), BoundFiles(
            directory, os.fstat(fd).st_ino, geometry.pool_bytes)
    finally:
        if fd >= 0:
            os.close(fd)


def _open(path: Path, access: Access) -> tuple[int, bool]:
    """``path`` opened (``open_checked``), and whether this call created it (the caller holds the set lock)."""
    existed = path.exists()
    return open_checked(path, access, "node_path"), not existed


def _open_existing(fd: int, path: Path, geometry: NodeGeometry) -> mmap.mmap | str:
    """The index mapped when the set is whole; else why not (the caller makes a new set).

    Raises:
        ConfigError: a whole index of another version or configuration (engines with other settings use it).
    """
    size = os.fstat(fd).st_size
    header = os.pread(fd, _HEADER.size, 0) if size >= _HEADER.size else b""
    if not header or _HEADER.unpack(header)[0] != MAGIC:
        return "has an index that was never finished (or was overwritten)"
    fields = _HEADER.unpack(header)
    _, version, _, fingerprint, slots, _, table, total, _, _ = fields
    if version == _nodeindex.VERSION and (fingerprint != geometry.fingerprint or total != size or
                                          table < 2 * slots or _nodeindex.size(slots, table) != size):
        return f"has an index whose header does not match itself or its file ({size} bytes)"
    _check_header(path, fields, size, geometry)
    index = _map(fd, size)
    with _guarded(index):
        problem = _set_problem(path.parent, index, os.fstat(fd).st_ino, geometry)
    if problem is None:
        return index
    index.close()
    return problem


def _set_problem(directory: Path, index: mmap.mmap, inode: int, geometry: NodeGeometry) -> str | None:
    problem = BoundFiles(directory, inode, geometry.pool_bytes).problem(index)
    if problem is not None:
        return f"is not whole: {problem}"
    try:
        engines = os.open(directory / ENGINES_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return f"has no engines file ({e})"
    try:
        fixed = _nodeindex.check(index, engines, -1, True)  # rebuilt from its slots when damaged
    except _nodeindex.Damaged as e:
        return f"is damaged ({e})"
    except _nodeindex.Busy:
        return None  # a live engine holds the lock (frozen, maybe): this engine waits for it when it attaches
    finally:
        os.close(engines)
    if fixed is not None:
        logger.warning("node tier: repaired the node index at %s (%s)", directory, fixed)
    return None


def _unlink_set(directory: Path) -> None:
    for entry in os.scandir(directory):
        if entry.name in (INDEX_NAME, ENGINES_NAME) or entry.name.startswith((POOL_PREFIX, ANNOUNCE_PREFIX)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


def _make_set(directory: Path, fd: int, path: Path, geometry: NodeGeometry, access: Access) -> mmap.mmap:
    """A new set: the pool files, announcement logs and the engines file of an older set go first (a new index
    never pairs with them: engines of an older set may still lock bytes of its engines file), then the index is
    formatted."""
    for entry in os.scandir(directory):
        if entry.name == ENGINES_NAME or entry.name.startswith((POOL_PREFIX, ANNOUNCE_PREFIX)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    engines = open_checked(directory / ENGINES_NAME, access, "node_path")
    try:
        engines_inode = os.fstat(engines).st_ino
    finally:
        os.close(engines)
    _allocate(fd, geometry.index_bytes, path)
    index = _map(fd, geometry.index_bytes)
    generation = int.from_bytes(os.urandom(8), "little") | 1
    with _guarded(index):
        _nodeindex.init(index, geometry.num_slots, geometry.slot_bytes, geometry.table_size, geometry.fingerprint,
                        generation, engines_inode)
    return index


def _open_pool_file(directory: Path, rank: int, geometry: NodeGeometry, access: Access,
                    index: mmap.mmap) -> mmap.mmap:
    path = directory / f"{POOL_PREFIX}{rank}"
    try:
        recorded = _nodeindex.files(index)[2].get(rank, 0)
    except _nodeindex.Damaged as e:  # the index was truncated or overwritten since this engine opened the set
        raise ConfigError(f"node_path: the node index in {directory} was damaged while this engine opened it "
                          f"({e}): start the engine again") from e
    if not recorded:  # none made for this index yet: a file there is an older set's (or half made), never used
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fd = open_checked(path, access, "node_path")
    try:
        info = os.fstat(fd)
        if not recorded:
            _allocate(fd, geometry.pool_bytes, path)
            _nodeindex.bind_pool(index, rank, info.st_ino)
        elif info.st_ino != recorded or info.st_size != geometry.pool_bytes:
            raise ConfigError(f"node_path: {path} changed while this engine opened it (removed, replaced or "
                              f"truncated: {info.st_size} bytes): start the engine again")
        return _map(fd, geometry.pool_bytes, populate=True)
    finally:
        os.close(fd)


def guard(mapping: mmap.mmap, owner: object) -> int | None:
    """``mapping`` guarded against a truncation of its file (``_mapguard``) for as long as ``owner`` lives (the
    guard keeps the mapping open); None when this process guards too many already (then it is unguarded)."""
    guarded = _guard_now(mapping)
    if guarded is not None:
        weakref.finalize(owner, _mapguard.unguard, guarded)
    return guarded


@contextlib.contextmanager
def _guarded(mapping: mmap.mmap) -> Iterator[None]:
    """``mapping`` guarded while the block reads or writes it: opening a set reads the index before any owner holds
    it, and a file truncated meanwhile must read as zeros (a damaged set), never SIGBUS. Unguarded after, so the
    mapping can be closed; the caller guards what it keeps (``guard``)."""
    guarded = _guard_now(mapping)
    try:
        yield
    finally:
        if guarded is not None:
            _mapguard.unguard(guarded)


def _guard_now(mapping: mmap.mmap) -> int | None:
    # faulthandler goes first, so that an engine enabling it later (vLLM's watchdog does) finds it on and leaves
    # the guard's handler in front.
    if not faulthandler.is_enabled():
        faulthandler.enable()
    try:
        return _mapguard.guard(mapping)
    except RuntimeError as e:
        logger.warning("node tier: %s; a truncation of this pool's files kills this process", e)
        return None


def _check_header(path: Path, header: tuple[int, ...], size: int, geometry: NodeGeometry) -> None:
    _, version, _, _, slots, slot_bytes, table, total, _, _ = header
    if version != _nodeindex.VERSION:
        raise ConfigError(f"node_path: {path} is a node index of version {version}; this kvoffload uses version "
                          f"{_nodeindex.VERSION}. Stop the engines using it and remove {path.parent} "
                          f"(kvoffload node remove)")
    if (slots, slot_bytes) != (geometry.num_slots, geometry.slot_bytes):
        raise ConfigError(
            f"host_bytes/host_gib: the node pool at {path.parent} holds {slots} slots of {slot_bytes} bytes, this "
            f"engine asks for {geometry.num_slots} of {geometry.slot_bytes}: every engine sharing a node pool must "
            f"give the same host_bytes and offload_block_tokens")
    if table != geometry.table_size or total != size or size != geometry.index_bytes:
        raise ConfigError(f"node_path: {path} is {size} bytes, not the {geometry.index_bytes} of its header; "
                          f"remove {path.parent}")


def _allocate(fd: int, size: int, path: Path) -> None:
    """``fd`` at ``size`` bytes, every page allocated now: a full tmpfs is an error at start-up, never a SIGBUS in
    the middle of serving."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.ftruncate(fd, 0)
        room = " (the tmpfs is full: lower host_bytes or grow the mount)" if e.errno == errno.ENOSPC else ""
        raise ConfigError(f"node_path: cannot make {path} {size} bytes{room}: {e}") from e


def _map(fd: int, size: int, populate: bool = False) -> mmap.mmap:
    # A pool is mapped in full now (MAP_POPULATE): a fault per page would otherwise land in the first copies.
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
