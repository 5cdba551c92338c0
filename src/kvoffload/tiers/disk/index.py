"""Scheduler side of the disk tier: which blocks this engine's slot file holds, and where the others' are.

The index is a ``SlotIndex`` over the slots of this engine's slot file (``tiers.disk.slot_file``): a key's slot in
the index is its slot in the file, so pins, in-flight stores, doomed keys and the eviction policy work exactly as on
the host tier, and the specs carry (engine, slot) ``location``s. This class adds what is particular to disk:

- start-up: the directory tree is created and checked (``tiers.disk.tree.open_tree``: a directory another user could
  write is a ``ConfigError``); the engine takes its number and its file in every rank directory
  (``tiers.disk.engine_files``), and the index is rebuilt from rank 0's table (no payload is read).
- sharing: a key this index misses is looked for in the other engines' tables, which ``ForeignTables`` reads on a
  thread of its own; a found block loads from the other engine's file without joining this index or its budget. A
  location whose load failed is forgotten.
- budget: an engine's file holds at most its own budget (its size is fixed at start-up). Files of other engine
  numbers are deleted only by an engine that starts alone on the directory (``tiers.disk.tree.WorldLock``).
  docs/operations.md explains the rule.
- eviction frees the slot; the bytes stay (another engine may still load them) until the slot is written again.
  A reset empties the entries of the keys it drops, so that no engine finds them again.

Only rank 0's table is read: a block missing on another rank is a failed load there, and the connector turns it
into a recompute. The step itself never touches a file (the reset aside).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvoffload.blocks import BlockSpec, Medium, TierBlocks
from kvoffload.config import ConfigError, DiskTierConfig, EvictionPolicy
from kvoffload.index.base import (
    BlockIndex,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    TierUsage,
)
from kvoffload.index.policies.base import Policy
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tenants import PolicyOf, no_tenants
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.disk.engine_files import EngineNumber, clear_entries, prepare_files, trim_leftovers
from kvoffload.tiers.disk.foreign import ForeignTables
from kvoffload.tiers.disk.paths import rank_directories
from kvoffload.tiers.disk.slot_file import Layout, location
from kvoffload.tiers.disk.tree import Access, WorldLock, open_tree
from kvoffload.tiers.lower.block_format import BlockFormat, CorruptBlockError

logger = logging.getLogger(__name__)

FOUND_MAX = 65536
"""Other engines' locations a lookup answered, kept for the load that follows it."""


def disk_blocks(keys: Sequence[OffloadKey], slots: Sequence[int], engine: int = 0) -> TierBlocks:
    """The disk tier's spec: one group, each key's (engine, slot) ``location``."""
    return TierBlocks(Medium.DISK, keys=tuple(keys), group_sizes=(len(keys),),
                      slots=tuple(location(engine, s) for s in slots))


class DiskIndex(BlockIndex):
    """Index of the blocks in this engine's slot file, and a way to the other engines'.

    Args:
        capacity_blocks: the slot file's slots (``Layout.capacity``).
        policy: eviction policy among ready, unpinned blocks.
        directories: every rank's directory, rank 0 (the indexed one) first.
        engine: this engine's number (its file in each directory).
        foreign: the other engines' tables (None: this index finds only its own blocks).
        layout: the slot file's layout (a reset empties entries through it; None: it cannot).
    Raises:
        ValueError: ``capacity_blocks`` is not positive or ``directories`` is empty.
    """

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy | Policy, directories: Sequence[Path],
                 engine: int = 0, foreign: ForeignTables | None = None, layout: Layout | None = None) -> None:
        if not directories:
            raise ValueError("DiskIndex needs at least rank 0's directory")
        self._index = SlotIndex(capacity_blocks, policy, Medium.DISK, functools.partial(disk_blocks, engine=engine))
        self._directories = tuple(directories)
        self.engine = engine
        self._layout = layout
        self._foreign = foreign
        self._found: OrderedDict[OffloadKey, int] = OrderedDict()
        self._events: list[OffloadEvent] = []
        self._loading_foreign: Counter[OffloadKey] = Counter()
        self._number: EngineNumber | None = None
        self._lock: WorldLock | None = None
        self.rebuild_seconds = 0.0

    @classmethod
    def create(cls, config: DiskTierConfig, namespace: Namespace, file_bytes: int,
               policy: PolicyOf = no_tenants) -> DiskIndex:
        """The scheduler's disk index, rebuilt from this engine's slot file.

        Raises:
            ConfigError: ``disk_bytes`` is below one slot, or ``disk_path`` cannot be used or could be written by
                another user (docs/security.md).
        """
        layout = Layout.for_budget(config.capacity_bytes, file_bytes)
        if layout is None:
            raise ConfigError(f"disk_bytes={config.capacity_bytes} is below one slot of a slot file "
                              f"({file_bytes} bytes and its table)")
        fmt = BlockFormat.of(config.secret)
        directories = rank_directories(config.path, namespace, fmt)
        access = Access(config.shared_group)
        open_tree(config.path, directories[0], access, fmt)
        if not os.access(directories[0], os.R_OK | os.W_OK | os.X_OK):
            raise ConfigError(f"disk_path={str(config.path)!r} is not readable and writable by this user")
        held: list[WorldLock | EngineNumber] = []  # let go of when the start fails: a retry may take them
        try:
            lock = WorldLock(directories[0].parent, access)
            held.append(lock)
            number = EngineNumber(directories[0].parent, access)
            held.append(number)
            for directory in directories[1:]:
                open_tree(config.path, directory, access, fmt)
            found = prepare_files(directories, number.engine, layout, access)
        except (OSError, ValueError) as e:
            for thing in held:
                thing.close()
            raise ConfigError(f"disk_path={str(config.path)!r} cannot hold the disk tier: {e}") from e
        index = cls(layout.capacity, policy(config.policy, layout.capacity, "disk"), directories, number.engine,
                    layout=layout)
        index._lock, index._number = lock, number
        index.restore([(fmt.key_of(name), slot) for slot, name in found.placed], found.seconds)
        if lock.alone:
            trim_leftovers(directories, number.engine)
        lock.share()
        index._foreign = ForeignTables(directories[0], number.engine, fmt)
        return index

    @property
    def capacity(self) -> int:
        return self._index.capacity

    @property
    def medium(self) -> Medium:
        return Medium.DISK

    def restore(self, placed: Sequence[tuple[OffloadKey, int]], seconds: float = 0.0) -> int:
        """Index the blocks this engine's file held (a key named twice keeps its first slot); return how many."""
        first: dict[OffloadKey, int] = {}
        for key, slot in placed:
            first.setdefault(key, slot)
        self._index.restore(list(first.items()))
        self.rebuild_seconds = seconds
        logger.info("disk tier: engine %d indexed %d blocks of its slot file in %s (%.3f s), capacity %d",
                    self.engine, len(first), self._directories[0], seconds, self.capacity)
        return len(first)

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        hits = 0
        while True:
            result = self._index.lookup(keys[hits:] if hits else keys)
            hits += result.hits
            if result.pending or hits == len(keys):
                return LookupResult(hits, result.pending)
            run = self._foreign_run(keys, hits)
            if not run:
                return LookupResult(hits)
            hits += run

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        found = self._found
        if not found:  # no other engine's block was ever found: the plain index's load, no step per key
            return self._index.prepare_load(keys)
        own = [key for key in keys if key not in found or self._index.slot_of(key) is not None]
        if len(own) == len(keys):
            return self._index.prepare_load(keys)
        spec = self._index.prepare_load(own) if own else None
        places = dict(zip(own, spec.slots, strict=True)) if isinstance(spec, TierBlocks) else {}
        for key in keys:
            if key not in places:
                places[key] = found[key]
                self._loading_foreign[key] += 1
        return TierBlocks(Medium.DISK, keys=tuple(keys), group_sizes=(len(keys),),
                          slots=tuple(places[key] for key in keys))

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._index.touch(keys)  # policies pass over keys they do not hold (other engines' blocks)

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        loading = self._loading_foreign
        if not loading:
            self._index.complete_load(keys, success)
            return
        own = []
        for key in keys:
            if loading[key] > 0:
                self._complete_foreign(key, success)
            else:
                own.append(key)
        if own:
            self._index.complete_load(own, success)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        return self._index.prepare_store(keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._index.complete_store(keys, success)

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events + self._index.take_events(), []
        return events

    def reset(self) -> None:
        before = self._index.placed()
        self._index.reset()
        events = self._index.take_events()
        self._events.extend(events)
        after = self._index.placed()
        dropped = [slot for key, slot in before.items() if key not in after]  # not every pending event's keys
        if dropped and self._layout is not None:
            try:
                for directory in self._directories:
                    clear_entries(directory, self.engine, self._layout, dropped)
            except (OSError, CorruptBlockError) as e:  # CorruptBlockError: a link or FIFO at the file's path
                logger.warning("disk tier: cannot empty the entries of %d reset blocks: %s", len(dropped), e)

    def check_integrity(self) -> None:
        self._index.check_integrity()

    def usage(self) -> list[TierUsage]:
        return self._index.usage()

    def close(self) -> None:
        """Stop reading the other engines' tables, and let go of this engine's number and the world lock."""
        if self._foreign is not None:
            self._foreign.close()
        for held in (self._number, self._lock):
            if held is not None:
                held.close()

    def _foreign_run(self, keys: Sequence[OffloadKey], start: int) -> int:
        """How many keys from ``start`` on other engines' files hold (as last read); a miss asks for a read."""
        foreign = self._foreign
        if foreign is None:
            return 0
        n = 0
        for key in keys[start:]:
            place = foreign.find(key)
            if place is None or self._index.slot_of(key) is not None:
                break
            self._found[key] = place
            self._found.move_to_end(key)
            n += 1
        while len(self._found) > FOUND_MAX:
            self._found.popitem(last=False)
        if start + n < len(keys):
            foreign.poke()
        return n

    def _complete_foreign(self, key: OffloadKey, success: bool) -> None:
        loading = self._loading_foreign
        loading[key] -= 1
        if loading[key] <= 0:
            del loading[key]
        if not success and self._foreign is not None:
            place = self._found.pop(key, None)
            if place is not None:
                self._foreign.forget(key, place)
