"""Scheduler side of the disk tier: the index of which block files exist, bounded by the byte budget.

The index is a ``SlotIndex`` over ``capacity_bytes // file size`` logical slots (medium DISK, specs
that name files by key), so pins, in-flight stores, doomed keys and the eviction policy work exactly as on the
host tier. This class adds what is particular to files:

- start-up: the directory tree is created and checked (``tiers.disk.tree.open_tree``: a directory another user could
  write is a ``ConfigError``), then the index is rebuilt from the file names in rank 0's directory (no payload
  is read; temporary files left by a crash are removed).
- sharing: on an index miss, a regular file another engine wrote under the same namespace is adopted. A key
  whose load failed is remembered as bad, with the identity of its file, and is not adopted again until that
  file is replaced: a file that can be neither loaded nor removed is a miss, not a promotion every step.
- removal: a key that leaves the index (evicted, failed load, failed store, reset) has its file removed from
  every rank's directory right away. A removal that fails is counted (``removal_errors``) and logged once.
- budget: an engine's index holds at most its own budget, and it deletes only the files it drops from its own
  index. Files beyond the budget at start-up are deleted only by an engine that starts alone on the directory
  (``tiers.disk.tree.WorldLock``): while other engines run there, they may be theirs. docs/operations.md explains
  the rule.

Only rank 0's directory is indexed: a block whose file is missing on another rank is a failed load there, and
the connector turns it into a recompute. Unlinking is metadata work, not bytes: the scheduler half never reads
or writes a payload.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from kvoffload.blocks import BlockSpec, Medium, TierBlocks
from kvoffload.config import ConfigError, DiskTierConfig, EvictionPolicy
from kvoffload.index.base import (
    BlockIndex,
    EventKind,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    TierUsage,
)
from kvoffload.index.policies.base import Policy
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tenants import PolicyOf, no_tenants
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.disk.paths import block_path, rank_directories
from kvoffload.tiers.disk.tree import Access, Tree, WorldLock, open_tree, scan
from kvoffload.tiers.lower.block_format import BlockFormat

logger = logging.getLogger(__name__)

BAD_KEYS_MAX = 65536
"""Bad files remembered at most, oldest forgotten first: a flood of them costs bounded memory."""

FileIdentity = tuple[int, int, int, int]
"""(device, inode, size, mtime in ns) of a file: another file written at the same path has another one."""


def identity(info: os.stat_result) -> FileIdentity:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def disk_blocks(keys: Sequence[OffloadKey], slots: Sequence[int]) -> TierBlocks:
    """The disk tier's spec: files named by key, one group (the logical slots stay in the index)."""
    return TierBlocks(Medium.DISK, keys=tuple(keys), group_sizes=(len(keys),))


class DiskIndex(BlockIndex):
    """Index of the disk tier's block files.

    Args:
        capacity_blocks: how many block files the budget allows.
        policy: eviction policy among ready, unpinned files.
        directories: every rank's directory, rank 0 (the indexed one) first.
        tree: rank 0's checked tree (its skipped fan-out directories); by default, all of them are used.
    Raises:
        ValueError: ``capacity_blocks`` is not positive or ``directories`` is empty.
    """

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy | Policy, directories: Sequence[Path],
                 tree: Tree | None = None) -> None:
        if not directories:
            raise ValueError("DiskIndex needs at least rank 0's directory")
        self._index = SlotIndex(capacity_blocks, policy, Medium.DISK, disk_blocks)
        self._directories = tuple(directories)
        self._tree = tree or Tree(self._directories[0])
        self._events: list[OffloadEvent] = []
        self._bad: dict[OffloadKey, FileIdentity] = {}
        self._fan_outs: dict[tuple[int, str], bool] = {}  # other ranks': real directory? (checked on first use)
        self._lock: WorldLock | None = None
        self.removal_errors = 0
        self.rebuild_seconds = 0.0

    @classmethod
    def create(cls, config: DiskTierConfig, namespace: Namespace, file_bytes: int,
               policy: PolicyOf = no_tenants) -> DiskIndex:
        """The scheduler's disk index, rebuilt from what is already on disk.

        Raises:
            ConfigError: ``disk_bytes`` is below one block file, or ``disk_path`` cannot be used or could be
                written by another user (docs/security.md).
        """
        capacity = config.capacity_bytes // file_bytes
        if capacity < 1:
            raise ConfigError(f"disk_bytes={config.capacity_bytes} is below one block file "
                              f"({file_bytes} bytes)")
        fmt = BlockFormat.of(config.secret)
        directories = rank_directories(config.path, namespace, fmt)
        access = Access(config.shared_group)
        tree = open_tree(config.path, directories[0], access, fmt)
        if not os.access(directories[0], os.R_OK | os.W_OK | os.X_OK):
            raise ConfigError(f"disk_path={str(config.path)!r} is not readable and writable by this user")
        index = cls(capacity, policy(config.policy, capacity, "disk"), directories, tree)
        try:
            index._lock = WorldLock(directories[0].parent, access)
        except OSError as e:
            raise ConfigError(f"disk_path={str(config.path)!r} cannot hold the disk tier: {e}") from e
        index.rebuild(trim=index._lock.alone)
        index._lock.share()
        return index

    @property
    def capacity(self) -> int:
        return self._index.capacity

    @property
    def medium(self) -> Medium:
        return Medium.DISK

    def rebuild(self, trim: bool = True) -> int:
        """Index the block files found in rank 0's directory; return how many were indexed.

        Args:
            trim: delete the files beyond the budget (only when no other engine runs on the directory).
        """
        found = scan(self._tree)
        kept, beyond = found.keys[:self.capacity], found.keys[self.capacity:]
        if trim:
            self._remove_files(beyond)  # Leftovers of engines that stopped, or of a larger budget.
        elif beyond:
            logger.info("disk tier: leaving %d block files beyond this engine's budget to the engines sharing %s",
                        len(beyond), self._directories[0])
        out = self._index.prepare_store(kept)
        assert out is not None  # An empty index has room for ``capacity`` keys.
        self._index.complete_store(out.keys_to_store)
        self._index.take_events()  # Already on disk before this engine started: nothing new to announce.
        self.rebuild_seconds = found.seconds
        logger.info("disk tier: indexed %d blocks in %s (%.3f s), capacity %d", len(kept),
                    self._directories[0], found.seconds, self.capacity)
        return len(kept)

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        hits = 0
        while True:
            result = self._index.lookup(keys[hits:] if hits else keys)
            hits += result.hits
            if result.pending or hits == len(keys) or not self._adopt(keys[hits]):
                return LookupResult(hits, result.pending)
            hits += 1

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        return self._index.prepare_load(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._index.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._index.complete_load(keys, success)
        self._collect()
        if not success:
            self._remember_bad(keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = self._index.prepare_store(keys)
        self._collect()
        return out

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._index.complete_store(keys, success)
        if not success:
            self._remove_files(keys)  # Ranks that did write their file must not keep an unindexed block.
        elif self._bad:
            for key in keys:
                self._bad.pop(key, None)  # this engine wrote it again
        self._collect()

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        self._index.reset()
        self._collect()

    def check_integrity(self) -> None:
        self._index.check_integrity()

    def usage(self) -> list[TierUsage]:
        return self._index.usage()

    def _adopt(self, key: OffloadKey) -> bool:
        """Index ``key`` if another engine wrote its file (one lstat; only on the first miss of a lookup).

        Only a regular file counts, in a real fan-out directory, and not a file whose load already failed.
        """
        if not self._tree.usable(key):
            return False
        try:
            info = os.lstat(block_path(self._directories[0], key, self._tree.fmt))
        except OSError:
            return False
        if not stat.S_ISREG(info.st_mode):
            return False
        if self._bad and key in self._bad:
            if self._bad[key] == identity(info):
                return False
            del self._bad[key]  # replaced since its load failed: worth another try
        out = self._index.prepare_store([key])
        if out is None or not out.keys_to_store:
            self._collect()
            return False
        self._index.complete_store(out.keys_to_store)
        self._collect()
        return True

    def _collect(self) -> None:
        """Forward the index's events; a key that left the index loses its files."""
        for event in self._index.take_events():
            if event.kind is EventKind.REMOVED:
                self._remove_files(event.keys)
            self._events.append(event)

    def _remember_bad(self, keys: Sequence[OffloadKey]) -> None:
        """Remember the files of ``keys`` that are still there after their failed load (they were not removed)."""
        for key in keys:
            try:
                self._bad[key] = identity(os.lstat(block_path(self._directories[0], key, self._tree.fmt)))
            except OSError:
                continue  # removed, by the worker or by ``_collect``: nothing left to re-adopt
        for key in list(itertools.islice(self._bad, max(0, len(self._bad) - BAD_KEYS_MAX))):
            del self._bad[key]

    def _remove_files(self, keys: Sequence[OffloadKey]) -> None:
        failed: list[tuple[str, OSError]] = []
        for rank, directory in enumerate(self._directories):
            for key in keys:
                if not self._fan_out_usable(rank, key):
                    continue
                path = block_path(directory, key, self._tree.fmt)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    failed.append((path, e))
        if failed:
            self._note_removal_errors(failed)

    def _fan_out_usable(self, rank: int, key: OffloadKey) -> bool:
        """Whether ``key``'s fan-out directory of ``rank`` is a real one (a symbolic link is never followed)."""
        if rank == 0:
            return self._tree.usable(key)
        name = key[:1].hex()
        usable = self._fan_outs.get((rank, name))
        if usable is None:
            try:
                usable = stat.S_ISDIR(os.lstat(self._directories[rank] / name).st_mode)
            except OSError:
                return True  # not there (yet): nothing to remove, and nothing followed
            self._fan_outs[(rank, name)] = usable
        return usable

    def _note_removal_errors(self, failed: list[tuple[str, OSError]]) -> None:
        first = self.removal_errors == 0
        self.removal_errors += len(failed)
        path, error = failed[0]
        # Once: on a read-only file system every eviction fails again, and each one is no news.
        log = logger.warning if first else logger.debug
        log("disk tier: cannot remove %d block files (first %s: %s); %d so far%s", len(failed), path, error,
            self.removal_errors, ", later failures are logged at debug level" if first else "")
