"""Scheduler side of the disk tier: the index of which block files exist, bounded by the byte budget.

The index is a ``HostTierManager`` over ``capacity_bytes // file size`` logical slots (medium DISK, specs
that name files by key), so pins, in-flight stores, doomed keys and the eviction policy work exactly as on the
host tier. This class adds what is particular to files:

- start-up: the index is rebuilt from the file names in rank 0's directory (no payload is read; temporary
  files left by a crash are removed). Files beyond the capacity are deleted.
- sharing: on an index miss, a file another engine wrote under the same namespace is adopted.
- removal: a key that leaves the index (evicted, failed load, failed store, reset) has its file removed from
  every rank's directory right away, so the directory never holds more than the budget of indexed blocks.
  (Each engine sharing a directory bounds what it indexes; the directory holds at most the sum.)

Only rank 0's directory is indexed: a block whose file is missing on another rank is a failed load there, and
the connector turns it into a recompute. Unlinking is metadata work, not bytes: the scheduler half never reads
or writes a payload.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from kvoffload.config import ConfigError, DiskTierConfig, EvictionPolicy
from kvoffload.disk_format import (
    block_path,
    make_directories,
    rank_directories,
    scan_directory,
)
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.manager.base import (
    EventKind,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    ResidencyManager,
    TierUsage,
)
from kvoffload.manager.host import HostTierManager
from kvoffload.specs import BlockSpec, DiskBlocks, Medium

logger = logging.getLogger(__name__)


def disk_blocks(keys: Sequence[OffloadKey], slots: Sequence[int]) -> DiskBlocks:
    """The disk tier's spec: files named by key, one group (the logical slots stay in the index)."""
    return DiskBlocks(keys=tuple(keys), group_sizes=(len(keys),))


class DiskTierManager(ResidencyManager):
    """Index of the disk tier's block files.

    Args:
        capacity_blocks: how many block files the budget allows.
        policy: eviction policy among ready, unpinned files.
        directories: every rank's directory, rank 0 (the indexed one) first.
    Raises:
        ValueError: ``capacity_blocks`` is not positive or ``directories`` is empty.
    """

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy, directories: Sequence[Path]) -> None:
        if not directories:
            raise ValueError("DiskTierManager needs at least rank 0's directory")
        self._index = HostTierManager(capacity_blocks, policy, Medium.DISK, disk_blocks)
        self._directories = tuple(directories)
        self._events: list[OffloadEvent] = []
        self.rebuild_seconds = 0.0

    @classmethod
    def create(cls, config: DiskTierConfig, namespace: Namespace, file_bytes: int) -> DiskTierManager:
        """The scheduler's disk index, rebuilt from what is already on disk.

        Raises:
            ConfigError: ``disk_bytes`` is below one block file, or ``disk_path`` cannot be used.
        """
        capacity = config.capacity_bytes // file_bytes
        if capacity < 1:
            raise ConfigError(f"disk_bytes={config.capacity_bytes} is below one block file "
                              f"({file_bytes} bytes)")
        directories = rank_directories(config.path, namespace)
        try:
            make_directories(directories[0])
        except OSError as e:
            raise ConfigError(f"disk_path={str(config.path)!r} cannot hold the disk tier: {e}") from e
        if not os.access(directories[0], os.R_OK | os.W_OK | os.X_OK):
            raise ConfigError(f"disk_path={str(config.path)!r} is not readable and writable by this user")
        manager = cls(capacity, config.policy, directories)
        manager.rebuild()
        return manager

    @property
    def capacity(self) -> int:
        return self._index.capacity

    def rebuild(self) -> int:
        """Index the block files found in rank 0's directory; return how many were indexed."""
        found = scan_directory(self._directories[0])
        kept = found.keys[:self.capacity]
        self._remove_files(found.keys[self.capacity:])  # The budget shrank since they were written.
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

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = self._index.prepare_store(keys)
        self._collect()
        return out

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._index.complete_store(keys, success)
        if not success:
            self._remove_files(keys)  # Ranks that did write their file must not keep an unindexed block.
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
        """Index ``key`` if another engine wrote its file (one stat; only on the first miss of a lookup)."""
        if not os.path.exists(block_path(self._directories[0], key)):
            return False
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

    def _remove_files(self, keys: Sequence[OffloadKey]) -> None:
        failed = 0
        for directory in self._directories:
            for key in keys:
                try:
                    os.unlink(block_path(directory, key))
                except FileNotFoundError:
                    pass
                except OSError:
                    failed += 1
        if failed:
            logger.warning("disk tier: could not remove %d block files", failed)
