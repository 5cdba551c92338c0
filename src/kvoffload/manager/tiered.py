"""The host tier over one lower tier behind one ``ResidencyManager`` face: the scheduler half's index.

The lower tier is the disk tier (``DiskTierManager``) or the remote tier (``RemoteTierManager``): anything with
the ``LowerTier`` interface. Host RAM is the hub: a lower tier moves blocks only to and from the host pool.

Only host blocks load to the device. A block found only in the lower tier is promoted first: ``lookup`` reserves
host slots, pins the lower tier's entries, queues a lower -> HOST ``TierTransfer`` and answers ``pending``; the
connector ships it (``take_transfers``) and reports its outcome (``complete_transfer``). A failed promotion
drops the host reservation and the lower tier's entry (a missing or corrupt block is a miss: the engine
recomputes).

Blocks reach the lower tier by one of two write policies:

- write-through (default): every block whose host store completes is written below at once. The host
  entries stay pinned while the write runs, so their slots are not reused under it.
- on-evict: only blocks about to leave the host are written. A block fresh on the host is *dirty*: it stays
  pinned on the host (so the host policy cannot evict it) until it is written. When dirty blocks exceed
  ``capacity - low_water`` host slots, the least recently used dirty blocks are written; once written they
  are unpinned and become ordinary, evictable host blocks. So the host only ever evicts blocks that are
  already below (or whose write failed), and at least ``low_water`` host slots stay evictable for new
  stores. A written block that becomes hot again stays on the host: "on evict" means "ahead of eviction".

Not thread-safe, like every manager: the scheduler half calls it from one thread.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvoffload.config import DiskTierConfig, WritePolicy
from kvoffload.disk_format import BlockFormat, GroupedLayout, entry_bytes_of
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.manager.base import (
    EventKind,
    IntegrityError,
    LoadAdvisor,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    ResidencyManager,
    TierTransfer,
    TierUsage,
)
from kvoffload.manager.disk import DiskTierManager
from kvoffload.manager.host import HostTierManager
from kvoffload.specs import BlockSpec, HostBlocks, Medium


class _Kind(enum.Enum):
    PROMOTE = "promote"
    WRITE = "write"


@dataclass(frozen=True)
class _Transfer:
    kind: _Kind
    keys: tuple[OffloadKey, ...]


class LowerTier(Protocol):
    """The index of a tier under host, as ``TieredManager`` uses it (``DiskTierManager``, ``RemoteTierManager``).

    The methods mean what they mean on ``ResidencyManager``, with the keys of one tier transfer at a time:
    ``lookup`` counts the leading keys a promotion can read now (its ``pending`` is not used); ``prepare_load``
    pins them for a promotion and returns the promotion's source spec (this tier's medium, one entry per key,
    one group); ``prepare_store`` reserves room for a write. Like every manager, none of them raises on a data-path
    failure: an unreachable tier is a miss, or a store refused with None.
    """

    @property
    def medium(self) -> Medium: ...

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult: ...

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec: ...

    def touch(self, keys: Sequence[OffloadKey]) -> None: ...

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None: ...

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None: ...

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None: ...

    def take_events(self) -> list[OffloadEvent]: ...

    def reset(self) -> None: ...

    def check_integrity(self) -> None: ...

    def usage(self) -> list[TierUsage]: ...


Lower = TypeVar("Lower", bound=LowerTier)


class TieredManager(ResidencyManager, Generic[Lower]):
    """The host tier with one lower tier under it.

    Args:
        host: the host tier's index (its capacity is the host pool's slot count).
        lower: the lower tier's index.
        write_policy: when blocks are written to the lower tier.
        low_water: on-evict only: host slots kept evictable (default: an eighth of the host, at least 1).
    Raises:
        ValueError: ``low_water`` is not in [1, host capacity).
    """

    def __init__(self, host: HostTierManager, lower: Lower,
                 write_policy: WritePolicy = WritePolicy.WRITE_THROUGH, low_water: int | None = None) -> None:
        low_water = max(1, host.capacity // 8) if low_water is None else low_water
        if write_policy is WritePolicy.ON_EVICT and not 1 <= low_water < host.capacity:
            raise ValueError(f"TieredManager: low_water {low_water} must be in [1, {host.capacity})")
        self.host = host
        self.lower = lower
        self.write_policy = write_policy
        self._dirty_max = host.capacity - low_water
        self._dirty: dict[OffloadKey, int] = {}  # on-evict: host-pinned, not yet written below; oldest first
        self._transfers: dict[int, _Transfer] = {}
        self._queued: list[TierTransfer] = []
        self._ids = itertools.count()
        self._events: list[OffloadEvent] = []
        self._advisor: LoadAdvisor | None = None

    @classmethod
    def create(cls, config: DiskTierConfig, host: HostTierManager, namespace: Namespace,
               layout: GroupedLayout, factor: int) -> TieredManager[DiskTierManager]:
        """The scheduler's index with a disk tier; the disk index is rebuilt from the files already there.

        Raises:
            ConfigError: ``disk_bytes`` is below one block file, or ``disk_path`` cannot be used.
        """
        size = BlockFormat.of(config.secret).file_bytes(max(entry_bytes_of(layout, factor)))
        return TieredManager(host, DiskTierManager.create(config, namespace, size), config.write_policy)

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        found = self.host.lookup(keys)
        if found.pending or found.hits == len(keys):
            return found
        below = self.lower.lookup(keys[found.hits:])
        if not below.hits or not self._worth_loading(below.hits):
            return LookupResult(found.hits)  # a slow tier's hits are misses: the engine computes them
        # The host hits go along so that the promotion's evictions cannot take them (they are held).
        if self._promote(keys[:found.hits + below.hits]):
            return LookupResult(found.hits, pending=True)
        return LookupResult(found.hits)

    def set_load_cost(self, advisor: LoadAdvisor) -> None:
        self._advisor = advisor

    def _worth_loading(self, blocks: int) -> bool:
        return self._advisor is None or self._advisor.worth_loading(self.lower.medium, blocks)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        return self.host.prepare_load(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.host.touch(keys)
        self.lower.touch(keys)
        dirty = self._dirty
        if dirty:
            for key in keys:
                if key in dirty:
                    dirty[key] = dirty.pop(key)  # most recently used last

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self.host.complete_load(keys, success)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        return self.host.prepare_store(keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        # Earlier host events first, so that only this store's STORED event says what to write.
        self._events += self.host.take_events()
        self.host.complete_store(keys, success)
        stored: list[OffloadKey] = []
        for event in self.host.take_events():
            if event.kind is EventKind.STORED:
                stored.extend(event.keys)
            self._events.append(event)
        if not stored:
            return
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_through(stored)
        else:
            self._mark_dirty(stored)

    def take_transfers(self) -> list[TierTransfer]:
        queued, self._queued = self._queued, []
        return queued

    def complete_transfer(self, transfer_id: int, success: bool) -> None:
        transfer = self._transfers.pop(transfer_id, None)
        if transfer is None:
            raise KeyError(f"unknown tier transfer {transfer_id}")
        if transfer.kind is _Kind.PROMOTE:
            self.host.complete_store(transfer.keys, success)
            self.lower.complete_load(transfer.keys, success)
        else:
            self.lower.complete_store(transfer.keys, success)
            self.host.complete_load(transfer.keys)  # the host copy is intact either way

    def take_events(self) -> list[OffloadEvent]:
        events = self._events + self.host.take_events() + self.lower.take_events()
        self._events = []
        return events

    def reset(self) -> None:
        dropped, self._dirty = list(self._dirty), {}
        self.host.complete_load(dropped, success=False)  # dirty pins go, and their blocks with them
        self.host.reset()
        self.lower.reset()

    def check_integrity(self) -> None:
        """Both tiers' laws, and: a key is in at most one tier transfer, and a dirty key in none."""
        self.host.check_integrity()
        self.lower.check_integrity()
        moving = [k for t in self._transfers.values() for k in t.keys]
        if len(moving) != len(set(moving)):
            raise IntegrityError("tiered: a key is in two tier transfers at once")
        if not self._dirty.keys().isdisjoint(moving):
            raise IntegrityError("tiered: a dirty key is also in a tier transfer")

    def usage(self) -> list[TierUsage]:
        return self.host.usage() + self.lower.usage()

    def _promote(self, keys: Sequence[OffloadKey]) -> bool:
        """Queue a lower -> HOST copy of the keys of ``keys`` not on the host (those are ready below).

        False when the host has no room for them.
        """
        out = self.host.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return False
        assert isinstance(out.store_spec, HostBlocks)
        moving = out.keys_to_store
        self._queue(_Kind.PROMOTE, moving, self.lower.prepare_load(moving), out.store_spec)
        return True

    def _write_through(self, keys: Sequence[OffloadKey]) -> None:
        out = self.lower.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return  # The lower tier is full of pinned or in-flight blocks, or off: these stay host-only.
        moving = out.keys_to_store
        self._queue(_Kind.WRITE, moving, self.host.prepare_load(moving), out.store_spec)

    def _mark_dirty(self, keys: Sequence[OffloadKey]) -> None:
        spec = self.host.prepare_load(keys)  # The dirty pin: not evictable until written below.
        assert isinstance(spec, HostBlocks)
        for key, slot in zip(keys, spec.slots, strict=True):
            self._dirty[key] = slot
        self._flush_dirty()

    def _flush_dirty(self) -> None:
        """Write the least recently used dirty blocks when they crowd the host below its low-water mark."""
        excess = len(self._dirty) - self._dirty_max
        if excess <= 0:
            return
        batch = list(itertools.islice(self._dirty, excess))  # dirty keys being written left ``_dirty``
        out = self.lower.prepare_store(batch)
        if out is None:
            return  # The lower tier has no evictable room now; try again after the next store.
        moving = set(out.keys_to_store)
        held = [k for k in batch if k not in moving]  # already written below: clean without a copy
        for key in held:
            del self._dirty[key]
        self.host.complete_load(held)
        if moving:
            slots = tuple(self._dirty.pop(k) for k in out.keys_to_store)
            spec = HostBlocks(slots, (len(slots),))
            self._queue(_Kind.WRITE, out.keys_to_store, spec, out.store_spec)

    def _queue(self, kind: _Kind, keys: tuple[OffloadKey, ...], src: BlockSpec, dst: BlockSpec) -> None:
        transfer_id = next(self._ids)
        self._transfers[transfer_id] = _Transfer(kind, keys)
        self._queued.append(TierTransfer(transfer_id, src, dst))
